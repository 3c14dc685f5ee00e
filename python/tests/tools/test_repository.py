"""Where the tools find the repository, and what they say when there is none (a package installed
outside a checkout): every command's --help still works, and a command that needs the repository
names $DILOCO_ROOT instead of failing with a traceback."""
import importlib
import os

import pytest

from decoupled_diloco.tools import repository

COMMANDS = ["run_local", "report", "chaos", "wan_sim", "bench_quality", "bench_wan", "bench_link_cut", "bench_chaos"]
CHECKOUT = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture
def environment(monkeypatch):
    """The repository's environment, cleared; the cached answer is forgotten before and after."""
    monkeypatch.delenv(repository.ROOT_VARIABLE, raising=False)
    monkeypatch.delenv("DILOCO_BIN_DIR", raising=False)
    repository._find_root.cache_clear()
    yield monkeypatch
    repository._find_root.cache_clear()


@pytest.fixture
def installed(environment, tmp_path):
    """The package as a wheel installs it: its sources are not inside a checkout."""
    environment.setattr(repository, "_SOURCE_ROOT", str(tmp_path / "site-packages"))
    return environment


def test_the_checkout_holding_the_sources(environment):
    assert os.path.realpath(repository.root()) == CHECKOUT
    assert repository.default_bin_dir() == os.path.join(repository.root(), "build", "bin")


def test_the_variables_come_first(environment, tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "broker").write_text("")
    environment.setenv(repository.ROOT_VARIABLE, str(tmp_path))
    environment.setenv("DILOCO_BIN_DIR", "/opt/diloco/bin")
    assert repository.root() == str(tmp_path)
    assert repository.default_bin_dir() == "/opt/diloco/bin"


def test_a_variable_that_names_no_repository(environment, tmp_path, capsys):
    environment.setenv(repository.ROOT_VARIABLE, str(tmp_path))
    with pytest.raises(SystemExit) as raised:
        repository.root(exit_status=2)
    assert raised.value.code == 2
    assert f"DILOCO_ROOT={tmp_path} is not a decoupled-diloco repository" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_works_outside_a_repository(installed, command, capsys):
    with pytest.raises(SystemExit) as raised:
        importlib.import_module(f"decoupled_diloco.tools.{command}").main(["--help"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


@pytest.mark.parametrize("command, argv, status", [
    ("run_local", ["configs/tiny.toml"], 1), ("chaos", ["--dry-run"], 2), ("bench_quality", ["--dry-run"], 1),
    ("bench_wan", ["--dry-run"], 1), ("bench_chaos", [], 1)])
def test_a_command_outside_a_repository_names_the_variable(installed, command, argv, status, capsys):
    with pytest.raises(SystemExit) as raised:
        importlib.import_module(f"decoupled_diloco.tools.{command}").main(argv)
    assert raised.value.code == status
    err = capsys.readouterr().err
    assert "this package is not in a decoupled-diloco repository" in err and "set DILOCO_ROOT" in err
    assert "Traceback" not in err
