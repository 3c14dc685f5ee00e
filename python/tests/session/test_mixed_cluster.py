"""The mixed cluster: a C++ learner (diloco-learner) and a Python learner (train.py --model builtin,
the same tensors in PyTorch) train one model through one C++ merger, followed by a C++ evaluator.
Each learner adopts versions that hold the other's deltas, the global model learns, and the run's
logs audit and verify.
"""
from __future__ import annotations

import numpy as np

from decoupled_diloco.safetensors import load_file

STEPS = 200


def adopted_from(learner, merges: dict[tuple[int, int], set[str]], other: str) -> list[tuple[int, int]]:
    """The (fragment, version)s `learner` adopted whose merge took a delta of `other`."""
    return [(a["fragment"], a["version"]) for a in learner.events("adopt")
            if other in merges.get((a["fragment"], a["version"]), set())]


def test_a_cpp_and_a_python_learner_train_one_model(run, merger):
    """A run mixes clients: the Session and diloco-learner share the wire format, the layout and
    the fingerprint, so their deltas merge together and each adopts the other's progress."""
    export = run.folder / "global.safetensors"
    evaluator = run.cpp_learner("eval", "eu", "--eval-only", "--eval-interval", "2", "--export", str(export))
    cpp = run.cpp_learner("eu-0", "eu", "--index", "0", "--learners", "2", "--steps", str(STEPS),
                          "--set", "train.eval_every=0")
    python = run.python_learner("us-0", "us", "--model", "builtin", "--index", "1", "--learners", "2",
                                "--steps", str(STEPS), "--eval-every", "0")
    first, last = run.finish([cpp, python], merger, evaluator)

    assert python.events("start")[0]["client"] == "python" and cpp.events("start")[0]["client"] == "diloco-learner"
    merges = {(m["fragment"], m["version"]): {i["learner"] for i in m["inputs"]} for m in merger.events("merge")}
    assert {"eu-0", "us-0"} <= set().union(*merges.values())
    assert adopted_from(cpp, merges, "us-0"), "the C++ learner adopted no version with the Python learner's deltas"
    assert adopted_from(python, merges, "eu-0"), "the Python learner adopted no version with the C++ learner's deltas"

    assert last["eval_loss"] < first["eval_loss"]
    run.assert_audit_and_verify_pass()
    # What the C++ evaluator holds, from the updates it received, is what the logs rebuild.
    rebuilt, info = run.read_version()
    assert list(info["versions"].values()) == last["versions"]
    exported = load_file(export)
    assert list(exported) == info["tensors"]
    for name, value in rebuilt.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
