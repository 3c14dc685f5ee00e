"""examples/pytorch/train.py --standalone: the plain loop for both models, its metrics.jsonl, its
export, and a clean stop on SIGTERM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from decoupled_diloco.safetensors import load_file, load_metadata


def train_command(repo: Path, *args: str) -> list[str]:
    return [sys.executable, str(repo / "examples" / "pytorch" / "train.py"), "-c", "configs/tiny.toml",
            "--standalone", *args]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", ["builtin", "conv"])
def test_standalone_run(repo: Path, corpus, tmp_path: Path, model: str) -> None:
    result = subprocess.run(
        train_command(repo, "--model", model, "--steps", "10", "--eval-every", "5", "--log-every", "5",
                      "--run-dir", str(tmp_path), "--export", str(tmp_path / "model.safetensors")),
        cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    log = events(tmp_path)
    evals = [e for e in log if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 5, 10]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert log[-1]["event"] == "stop" and log[-1]["reason"] == "budget"
    assert "held-out" in result.stderr
    info = json.loads(load_metadata(tmp_path / "model.safetensors")["info"])
    assert info["model"] == model and info["step"] == 10
    assert load_file(tmp_path / "model.safetensors")


def test_sigterm_stops_cleanly(repo: Path, corpus, tmp_path: Path) -> None:
    process = subprocess.Popen(
        train_command(repo, "--steps", "100000", "--log-every", "1", "--eval-every", "0", "--run-dir", str(tmp_path),
                      "--export", str(tmp_path / "model.safetensors")),
        cwd=repo, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "step 3 " in line:
                break
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, rest
    assert "(signal)" in rest
    stop = events(tmp_path)[-1]
    assert stop["event"] == "stop" and stop["reason"] == "signal" and stop["step"] >= 3
    assert json.loads(load_metadata(tmp_path / "model.safetensors")["info"])["step"] == stop["step"]
