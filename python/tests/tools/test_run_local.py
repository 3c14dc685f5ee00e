"""scripts/run-local's live view, folded from metrics files written here by hand, the run's config
and cluster shape, and the command lines of the processes a cluster starts (C++ and Python
learners). Expected values are worked out by hand in the comments."""
import importlib
import json
import os
import subprocess
import sys
import tomllib
import types

import pytest

from decoupled_diloco.tools import repository, run_local


@pytest.fixture
def view(tmp_path, write_jsonl):
    write_jsonl(str(tmp_path / "learner-0" / "metrics.jsonl"), [
        {"event": "start", "region": "eu"},
        {"event": "step", "step": 10, "t": 10.0, "loss_ema": 3.5, "tokens_per_s": 100.0, "adopted": 1,
         "bytes_sent": 1000, "bytes_received": 2000},
        {"event": "step", "step": 30, "t": 20.0, "loss_ema": 3.0, "tokens_per_s": 120.0, "adopted": 3,
         "bytes_sent": 3000, "bytes_received": 5000},
        {"event": "eval", "eval_loss": 2.9},
    ], torn='{"event": "step", "step": 40')
    write_jsonl(str(tmp_path / "merger-0" / "metrics.jsonl"), [
        {"event": "assigned", "partitions": [0, 1]},
        {"event": "merge", "fragment": 1, "version": 1, "time_us": 5e6, "inputs": [{}, {}], "dropped": []},
        {"event": "merge", "fragment": 1, "version": 2, "time_us": 6e6, "inputs": [{}],
         "dropped": [{"reason": "superseded"}]},
        {"event": "stop_record", "dropped": [{"reason": "too_stale"}, {"reason": "superseded"}]},
    ])
    write_jsonl(str(tmp_path / "eval" / "metrics.jsonl"), [
        {"event": "global_eval", "eval_loss": 2.75, "versions": [0, 2]}])
    v = run_local.View(str(tmp_path), ["learner-0"], ["merger-0"], fragments=2, steps_budget=100)
    v.update()
    return v


def test_view_folds_learner_events(view):
    s = view.learners["learner-0"]
    assert (s["region"], s["step"], s["loss"], s["tok_s"], s["adopted"], s["eval"]) == ("eu", 30, 3.0, 120.0, 3, 2.9)
    assert (view.bytes_sent(), view.bytes_received()) == (3000, 5000)
    assert view.wire_text() == "wire up 0.00 MB, down 0.01 MB"
    # 20 steps in 10 s since its first logged step: 70 steps left take 35 s.
    assert view.eta_seconds() == pytest.approx(35.0)


def test_view_folds_merger_events(view):
    assert (view.versions, view.owner) == ([0, 2], ["merger-0", "merger-0"])
    assert (view.merges, view.merged) == (2, 3)
    # Dropped in merges and in the stop record.
    assert view.dropped == {"superseded": 2, "too_stale": 1}
    assert view.dropped_text() == "dropped 3 (superseded 2, too_stale 1)"
    assert view.global_text() == "global held-out 2.750 at versions [0, 2]"


def test_view_reads_a_torn_line_once_it_is_complete(view, tmp_path):
    with open(tmp_path / "learner-0" / "metrics.jsonl", "a") as f:
        f.write(', "t": 25.0}\n')
    view.update()
    assert view.learners["learner-0"]["step"] == 40


def test_run_config_names_the_run(tmp_path):
    def written(text, overrides=()):
        source, out = tmp_path / "in.toml", tmp_path / "out.toml"
        source.write_text(text)
        run_local.write_run_config(str(source), list(overrides), "demo-1", str(out))
        header, *body = out.read_text().splitlines()
        return header, body

    header, body = written('[run]\nid = "demo"\nseed = 1\n', ["merger.quorum=2"])
    assert header.endswith("as run by scripts/run-local with --set merger.quorum=2")
    assert body == ["[run]", 'id = "demo-1"  # set by scripts/run-local', "seed = 1", "", "[merger]",
                    "quorum = 2  # --set by scripts/run-local"]
    assert written("[run]\nseed = 1\n")[1] == ["[run]", 'id = "demo-1"  # set by scripts/run-local', "seed = 1"]
    assert written("[model]\nlayers = 2\n")[1] == ["[run]", 'id = "demo-1"  # set by scripts/run-local', "",
                                                   "[model]", "layers = 2"]


def test_cluster_shape_command_line_over_config():
    config = {"cluster": {"learners": 3, "regions": ["eu", "us"], "mergers": 1, "speed_factors": [1, 2],
                          "eval_interval": 5}}
    plain = types.SimpleNamespace(learners=None, regions=None, mergers=None, speed_factors=None)
    assert run_local.cluster_shape(config, plain) == (3, ["eu", "us"], 1, [1.0, 2.0], 5.0)
    given = types.SimpleNamespace(learners=4, regions="a,b,c", mergers=2, speed_factors="1,1,1,3")
    assert run_local.cluster_shape(config, given) == (4, ["a", "b", "c"], 2, [1.0, 1.0, 1.0, 3.0], 5.0)


def test_durations_and_sizes():
    assert [run_local.duration(s) for s in (None, 59.9, 61, 3600)] == ["?", "59s", "1m01s", "60m00s"]
    assert run_local.megabytes(1_234_567) == "1.23 MB"


# ---- the cluster's command lines ----------------------------------------------------------------

TINY = os.path.join(repository.root(), "configs", "tiny.toml")


@pytest.fixture
def cluster(tmp_path):
    """A cluster of 3 learners over eu,us (speed factors 1, 1.5, 1), 1 merger, 100 steps each,
    learner-2 in Python unless told otherwise; nothing is started."""
    def make(python_learners=1, python_model="builtin", bin_dir="/opt/diloco/bin", max_seconds=0):
        c = run_local.Cluster(TINY, ["merger.quorum=2"], 3, ["eu", "us"], 1, [1.0, 1.5], 5.0, 100, max_seconds,
                              str(tmp_path / "run"), bin_dir, "tiny-1", 1024, 4, python_learners, python_model)
        c.servers = "127.0.0.1:29392"
        return c
    return make


def learner_args(tmp_path, i, region):
    """What every learner i gets, C++ or Python."""
    return ["-c", TINY, "--set", "merger.quorum=2", "--set", 'run.id="tiny-1"', "--bootstrap", "127.0.0.1:29392",
            "--id", f"learner-{i}", "--index", str(i), "--learners", "3", "--region", region, "--regions", "eu,us",
            "--steps", "100", "--run-dir", str(tmp_path / "run" / f"learner-{i}")]


def test_the_last_learners_run_python_with_the_same_arguments(cluster, tmp_path):
    commands = cluster(python_learners=1).commands()
    assert list(commands) == ["merger-0", "learner-0", "learner-1", "learner-2", "eval"]
    assert commands["learner-0"] == ["/opt/diloco/bin/diloco-learner", *learner_args(tmp_path, 0, "eu"),
                                     "--speed-factor", "1.0"]
    assert commands["learner-1"] == ["/opt/diloco/bin/diloco-learner", *learner_args(tmp_path, 1, "us"),
                                     "--speed-factor", "1.5"]
    assert commands["learner-2"] == [sys.executable, os.path.join(repository.root(), run_local.TRAIN_PY),
                                     "--model", "builtin", *learner_args(tmp_path, 2, "eu"), "--speed-factor", "1.0"]
    # The built-in model: the C++ evaluator measures the run's model.
    assert commands["eval"][0] == "/opt/diloco/bin/diloco-learner"
    assert commands["eval"][-4:] == ["--export", str(tmp_path / "run" / "final_model.safetensors"),
                                     "--run-dir", str(tmp_path / "run" / "eval")]


def test_a_time_budget_reaches_python_learners_too(cluster):
    c = cluster(python_learners=3, max_seconds=60)
    assert all(c.learner_argv(i)[-4:-2] == ["--max-seconds", "60.0"] for i in range(3))
    # A restart (scripts/chaos) gets what is left of it.
    assert c.learner_argv(2, max_seconds=12.34)[-4:-2] == ["--max-seconds", "12.3"]


def test_conv_runs_every_learner_and_the_evaluator_in_python(cluster, tmp_path):
    c = cluster(python_learners=3, python_model="conv")
    train_py = [sys.executable, os.path.join(repository.root(), run_local.TRAIN_PY), "--model", "conv"]
    commands = c.commands()
    assert all(commands[f"learner-{i}"][:4] == train_py for i in range(3))
    assert commands["eval"] == [*train_py, "-c", TINY, "--set", "merger.quorum=2", "--set", 'run.id="tiny-1"',
                                "--bootstrap", "127.0.0.1:29392", "--id", "eval", "--eval-only", "--region", "eu",
                                "--regions", "eu,us", "--eval-interval", "5.0",
                                "--export", str(tmp_path / "run" / "final_model.safetensors"),
                                "--run-dir", str(tmp_path / "run" / "eval")]
    assert commands["merger-0"][0] == "/opt/diloco/bin/diloco-merger"
    assert (c.info["python_learners"], c.info["python_model"]) == (["learner-0", "learner-1", "learner-2"], "conv")


def test_no_python_learner_by_default(cluster):
    c = cluster(python_learners=0)
    assert all(argv[0].startswith("/opt/diloco/bin/") for argv in c.commands().values())
    assert (c.info["python_learners"], c.info["python_model"]) == ([], None)


def test_a_cluster_writes_nothing_until_its_folder_is_created(cluster, tmp_path):
    c = cluster()
    assert not (tmp_path / "run").exists()
    c.create_folder()
    assert 'id = "tiny-1"' in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.parametrize("python_learners, python_model, message", [
    (4, "builtin", "--python-learners 4: the cluster has 3 learner(s) (--python-learners must be between 0 and 3)"),
    (-1, "builtin", "--python-learners must be between 0 and 3"),
    (2, "conv", "--python-model conv needs every learner in Python (--python-learners 3 or --learners 2, "
                "not 2 of 3)"),
    (0, "conv", "--python-model conv needs every learner in Python (--python-learners 3, not 0 of 3)"),
])
def test_impossible_python_learners_are_refused(capsys, python_learners, python_model, message):
    with pytest.raises(SystemExit):
        run_local.check_python_learners(3, python_learners, python_model)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("python_learners, python_model", [(0, "builtin"), (1, "builtin"), (3, "conv")])
def test_possible_python_learners_pass(python_learners, python_model):
    run_local.check_python_learners(3, python_learners, python_model)


def test_a_python_learner_gets_its_speed_factor(cluster, monkeypatch):
    """train.py emulates slower hardware as diloco-learner does, so a cluster's speed factors apply to both."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(os.path.join(repository.root(), "examples", "pytorch"))
    train = importlib.import_module("train")
    c = run_local.Cluster(TINY, [], 3, ["eu", "us"], 1, [1.0, 1.0, 2.5], 5.0, 100, 0, "/tmp/unused", "/opt/bin",
                          "tiny-1", 1024, 4, 1, "builtin")
    assert train.parse_args(c.learner_argv(2)[2:]).speed_factor == 2.5


def test_train_py_reads_a_python_learners_command_line(cluster, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(os.path.join(repository.root(), "examples", "pytorch"))
    train = importlib.import_module("train")
    c = cluster(python_learners=3, python_model="conv", max_seconds=30)
    for argv in (c.learner_argv(1), c.eval_argv()):
        args = train.parse_args(argv[2:])
        assert (args.config, args.set, args.bootstrap, args.model) == (
            TINY, ["merger.quorum=2", 'run.id="tiny-1"'], "127.0.0.1:29392", "conv")
    args = train.parse_args(c.learner_argv(1)[2:])
    assert (args.id, args.index, args.learners, args.region, args.regions, args.steps, args.max_seconds) == (
        "learner-1", 1, 3, "us", ["eu", "us"], 100, 30.0)
    args = train.parse_args(c.eval_argv()[2:])
    assert (args.id, args.eval_only, args.eval_interval) == ("eval", True, 5.0)


def test_diloco_learner_reads_a_cpp_learners_command_line(cluster):
    """Each C++ command line parses in the built binaries (--print-config exits after parsing)."""
    bin_dir = repository.default_bin_dir()
    for tool in ("diloco-learner", "diloco-merger"):
        if not os.access(os.path.join(bin_dir, tool), os.X_OK):
            pytest.skip(f"{tool} is not built in {bin_dir}")
    c = cluster(python_learners=0, bin_dir=bin_dir, max_seconds=30)
    for name, argv in c.commands().items():
        if argv[0].endswith("diloco-learner"):
            r = subprocess.run([*argv, "--print-config"], capture_output=True, text=True)
            assert r.returncode == 0, f"{name}: {r.stderr}"


def test_schedule_by_speed_divides_each_learners_schedule_by_its_speed():
    config = {"cluster": {"schedule_by_speed": True}, "train": {"total_steps": 400, "warmup_steps": 50}}
    # Factors 1, 2, 3 (learner 3 missing: 1): 400/2 = 200, 50/2 = 25; 400/3 = 133.3 -> 133, 50/3 = 16.7 -> 17.
    assert run_local.schedule_overrides(config, [1.0, 2.0, 3.0], 4) == {
        1: ["train.total_steps=200", "train.warmup_steps=25"],
        2: ["train.total_steps=133", "train.warmup_steps=17"]}
    # At least one step, a warm-up no longer than the schedule: 3 / 1000 -> 1 step, warm-up 0.
    tiny = {"cluster": {"schedule_by_speed": True}, "train": {"total_steps": 3, "warmup_steps": 3}}
    assert run_local.schedule_overrides(tiny, [1000.0], 1) == {0: ["train.total_steps=1", "train.warmup_steps=0"]}
    off = {"cluster": {"schedule_by_speed": False}, "train": {"total_steps": 400, "warmup_steps": 50}}
    assert run_local.schedule_overrides(off, [1.0, 2.0], 2) == {}


def test_a_learners_own_schedule_wins_over_the_runs(cluster, tmp_path):
    """The per-learner --set comes after the run's, so the binary reads the learner's value."""
    bin_dir = repository.default_bin_dir()
    if not os.access(os.path.join(bin_dir, "diloco-learner"), os.X_OK):
        pytest.skip(f"diloco-learner is not built in {bin_dir}")
    c = run_local.Cluster(TINY, ["train.total_steps=400"], 2, ["eu", "us"], 1, [1.0, 2.0], 5.0, 100, 0,
                          str(tmp_path / "run"), bin_dir, "tiny-1", 1024, 4, 0, "builtin", None,
                          {1: ["train.total_steps=200", "train.warmup_steps=25"]})
    c.servers = "127.0.0.1:29392"
    printed = []
    for i in range(2):
        r = subprocess.run([*c.learner_argv(i), "--print-config"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        printed.append(json.loads(r.stdout)["train"])
    assert printed[0]["total_steps"] == 400
    assert (printed[1]["total_steps"], printed[1]["warmup_steps"]) == (200, 25)
    assert c.info["learner_overrides"] == {"learner-1": ["train.total_steps=200", "train.warmup_steps=25"]}


def test_run_config_holds_the_overrides(tmp_path, capsys):
    """diloco-replay -c RUN_DIR/config.toml must see the config the processes ran: every --set
    written into its table (a layout override such as model.width changes the fingerprint)."""
    source, out = tmp_path / "in.toml", tmp_path / "out.toml"
    source.write_text('[run]\nid = "demo"  # the run\n\n[model]\n# the width\nwidth = 32\nlayers = 2\n\n'
                      '[train]\nbatch = 8\n')
    overrides = ["model.width=64", "train.lr=0.01", "codec.dtype=\"int8\"", 'run.id="ignored"',
                 "cluster.speed_factors=[1.0, 2.0]"]
    run_local.write_run_config(str(source), overrides, "demo-1", str(out))
    text = out.read_text()
    config = tomllib.loads(text)
    assert config["run"]["id"] == "demo-1"
    assert config["model"] == {"width": 64, "layers": 2}
    assert config["train"] == {"batch": 8, "lr": 0.01}
    assert config["codec"] == {"dtype": "int8"}
    assert config["cluster"] == {"speed_factors": [1.0, 2.0]}
    assert "# the width\nwidth = 64  # --set by scripts/run-local\nlayers = 2" in text
    assert capsys.readouterr().err == ""


def test_run_config_lists_an_override_it_cannot_write(tmp_path, capsys):
    source, out = tmp_path / "in.toml", tmp_path / "out.toml"
    source.write_text("[cluster]\nspeed_factors = [\n  1.0,\n  2.0,\n]\n")
    run_local.write_run_config(str(source), ["cluster.speed_factors=[3.0]"], "demo-1", str(out))
    header, *body = out.read_text().splitlines()
    assert header.endswith("with --set cluster.speed_factors=[3.0]")
    assert tomllib.loads("\n".join(body))["cluster"]["speed_factors"] == [1.0, 2.0]
    assert "could not write cluster.speed_factors=[3.0]" in capsys.readouterr().err
