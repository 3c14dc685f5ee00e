"""Sessions of some fragments (``fragments=``): two learners in one process, each training two of
the four fragments of the model of test_split_tensor.py (embed cut into blocks of rows over
fragments 0-2, w in fragment 3; core/fragments/partition.h):

    fragment 0: embed[0:30], b    fragment 1: embed[30:60]    fragment 2: embed[60:90]    fragment 3: w

Learner A takes fragments 0 and 1, learner B fragments 2 and 3. Each proposes version 0 of its own
fragments, cuts them, and adopts their merges; the rows and tensors of the other learner's
fragments are never read or written in its model (they keep the values its own loop gave them, bit
for bit). Expected values by hand, as in test_split_tensor.py: fragment p is cut at step 10 (p + 1),
one learner's merge moves version 0 by -1.0 * (1 + 0.5) times the delta, and a rebase keeps the
progress since the cut.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import decoupled_diloco as dd

STEPS = 40
RATE = 0.01
OUTER = 1.0 * (1 + 0.5)
SHAPES = {"embed": (90, 8), "w": (15, 16), "b": (8,)}
# Where the rows of each tensor live: (fragment, first row, last row).
BLOCKS = {"embed": [(0, 0, 30), (1, 30, 60), (2, 60, 90)], "w": [(3, 0, 15)], "b": [(0, 0, 8)]}


def test_two_sessions_of_two_fragments_each_train_the_whole_model(run, merger):
    rng = np.random.default_rng(9)
    version_0 = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    models = {who: {name: value.copy() for name, value in version_0.items()} for who in "ab"}
    takes = {"a": [0, 1], "b": [2, 3]}
    sessions = {who: run.session(list(models[who].items()), learner_id=f"eu-{who}", fragments=takes[who],
                                 run_dir=run.folder / f"eu-{who}") for who in "ab"}
    assert sessions["a"].fragments == [["embed[0:30]", "b"], ["embed[30:60]"], ["embed[60:90]"], ["w"]]
    # Only the model's own loop touches what a session does not train: the same float32 steps.
    untouched = {name: value.copy() for name, value in version_0.items()}
    for _ in range(STEPS):
        for value in untouched.values():
            value -= RATE
        for who in "ab":
            for value in models[who].values():
                value -= RATE
            sessions[who].step(tokens=64)

    deadline = time.monotonic() + 30
    for who in "ab":
        while not all(sessions[who].versions[p] >= 1 for p in takes[who]):
            assert time.monotonic() < deadline, f"learner {who} not at version 1 of its fragments after 30 s"
            sessions[who].poll()
            time.sleep(0.2)
    assert sessions["a"].versions == [1, 1, 0, 0]
    assert sessions["b"].versions == [0, 0, 1, 1]

    newest, info = run.read_version()
    assert info["versions"] == {0: 1, 1: 1, 2: 1, 3: 1}
    for who in "ab":
        model = models[who]
        for name, blocks in BLOCKS.items():
            for p, first, last in blocks:
                rows = slice(first, last)
                if p not in takes[who]:
                    np.testing.assert_array_equal(model[name][rows], untouched[name][rows],
                                                  err_msg=f"learner {who} wrote {name} rows {first}:{last}")
                    continue
                cut_at = 10 * (p + 1)
                np.testing.assert_allclose(newest[name][rows], version_0[name][rows] - OUTER * RATE * cut_at,
                                           rtol=0, atol=1e-4, err_msg=f"{name} rows {first}:{last}: version 1")
                np.testing.assert_allclose(model[name][rows], newest[name][rows] - RATE * (STEPS - cut_at),
                                           rtol=0, atol=1e-5, err_msg=f"learner {who}, {name} rows {first}:{last}")
    for who in "ab":
        sessions[who].close()
    assert merger.stop() == 0
    run.assert_audit_and_verify_pass()


@pytest.mark.parametrize("fragments, message", [
    ([4], "fragment 4 is not in the layout (fragments 0 to 3)"),
    ([1, 1], "fragment 1 is listed twice"),
    ([], "fragments must be a non-empty list"),
    ([True], "fragments must be a non-empty list"),
    (["0"], "fragments must be a non-empty list"),
])
def test_fragments_that_are_not_the_layouts_are_refused_naming_them(run, fragments, message):
    model = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    with pytest.raises(dd.InvalidInputError) as error:
        run.session(list(model.items()), learner_id="eu-0", fragments=fragments)
    assert message in str(error.value)
