"""Fixtures for the tests of examples/pytorch/, whose modules are scripts a user copies, not a
package: their folder goes on the import path here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples" / "pytorch"
sys.path.insert(0, str(EXAMPLES))

import kjv  # noqa: E402  (needs the path above)
from run_config import load_run_config  # noqa: E402


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def corpus(repo: Path) -> kjv.Corpus:
    path = repo / "data" / "kjv.txt"
    if not path.exists():
        pytest.skip(f"{path} is missing: run scripts/bootstrap (it writes the corpus)")
    return kjv.load_corpus(path)


@pytest.fixture(scope="session")
def tiny(repo: Path) -> dict:
    """configs/tiny.toml with an absolute corpus path, so tests run from any folder."""
    config = load_run_config(repo / "configs" / "tiny.toml")
    config["data"]["path"] = str(repo / config["data"]["path"])
    return config
