"""The Python port of the built-in model (examples/pytorch/builtin_transformer.py) against
diloco-learner: same parameter list, same initialisation, same held-out loss on the same
parameters, and the same 30 training steps (corpus sampling and inner optimizer included).

The binaries come from $DILOCO_BIN_DIR (default build/bin); the test is skipped without them.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import kjv
from builtin_transformer import BuiltinTransformer
from inner_optimizer import InnerOptimizer
from run_config import load_run_config
from train import heldout_loss, next_token_loss

from decoupled_diloco.safetensors import load_file

STEPS = 30
OVERRIDES = [f"train.eval_every={STEPS}"]  # held-out losses at step 0 and at the last step


def read_model_file(path: Path) -> dict[str, np.ndarray]:
    """A model file of diloco-learner --export: safetensors, or the libtorch archive (a zip file
    whose "tensors" attribute holds the parameters by name) of binaries built before it."""
    if path.read_bytes()[:4] == b"PK\x03\x04":
        return {name: t.numpy() for name, t in torch.jit.load(str(path)).tensors.items()}
    return load_file(path)


@pytest.fixture(scope="module")
def cpp_run(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, np.ndarray]]:
    """Held-out losses by step and the exported parameters of a standalone C++ learner."""
    learner = Path(os.environ.get("DILOCO_BIN_DIR", repo / "build" / "bin")) / "diloco-learner"
    if not os.access(learner, os.X_OK):
        pytest.skip(f"{learner} is missing: build the project (scripts/test) or set DILOCO_BIN_DIR")
    out = tmp_path_factory.mktemp("cpp")
    command = [str(learner), "-c", "configs/tiny.toml", "--standalone", "--steps", str(STEPS),
               "--export", str(out / "model.safetensors"), "--run-dir", str(out / "run")]
    for o in OVERRIDES:
        command += ["--set", o]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {e["step"]: e["eval_loss"] for e in events if e["event"] == "eval"}
    assert sorted(evals) == [0, STEPS]
    return evals, read_model_file(out / "model.safetensors")


@pytest.fixture
def setup(repo: Path, corpus: kjv.Corpus) -> tuple[dict, BuiltinTransformer, kjv.BatchStream]:
    config = load_run_config(repo / "configs" / "tiny.toml", OVERRIDES)
    model = BuiltinTransformer.from_config(config, kjv.VOCAB_SIZE)
    heldout = kjv.heldout_batches(corpus, config["data"], config["train"]["batch"], config["model"]["context"])
    return config, model, heldout


def test_same_parameters_initialisation_and_heldout_loss(cpp_run, setup) -> None:
    evals, exported = cpp_run
    config, model, heldout = setup
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == \
           [(n, a.shape) for n, a in exported.items()]
    batches = config["train"]["eval_batches"]
    # Seeded from run.seed, the Python model starts where the C++ one does.
    assert heldout_loss(model, heldout, batches) == pytest.approx(evals[0], abs=1e-5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(exported[name]))
    assert heldout_loss(model, heldout, batches) == pytest.approx(evals[STEPS], abs=1e-5)


def test_same_training_steps(cpp_run, setup, corpus: kjv.Corpus) -> None:
    evals, exported = cpp_run
    config, model, heldout = setup
    t = config["train"]
    batches = kjv.training_batches(corpus, config["data"], kjv.ShardSpec(), t["batch"], config["model"]["context"],
                                   config["run"]["seed"])
    optimizer = InnerOptimizer(model.parameters(), t)
    for step in range(STEPS):
        next_token_loss(model, *batches.next()).backward()
        optimizer.step(step)
        optimizer.zero_grad()
    assert heldout_loss(model, heldout, t["eval_batches"]) == pytest.approx(evals[STEPS], abs=1e-4)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), exported[name], atol=1e-4, err_msg=name)
