"""A tensor larger than a fragment: cut into blocks of rows that travel in three fragments, each
cut, merged and adopted on its own schedule, and put back together whole by replay.

The model: embed (90 x 8 = 720 values), w (15 x 16 = 240) and b (8), over tiny's 4 fragments. The
mean fragment is ceil(968 / 4) = 242 values, so embed is cut into ceil(720 / 242) = 3 blocks of 30
rows; LPT then gives fragment 0 embed[0:30] and b, fragment 1 embed[30:60], fragment 2
embed[60:90] and fragment 3 w (core/fragments/partition.h).

By hand, as in test_cuda.py: fragment p is cut at step 10 (p + 1); after 40 steps of "every value
down by 0.01" its delta is 0.01 * 10 (p + 1); one learner's merge moves version 0 by
-1.0 * (1 + 0.5) times it; the learner, adopting with rebase, keeps its 0.01 * (40 - 10 (p + 1))
since the cut. So the rows of embed move by an amount that depends on the block they are in.
"""
from __future__ import annotations

import numpy as np

from decoupled_diloco import safetensors

STEPS = 40
RATE = 0.01
OUTER = 1.0 * (1 + 0.5)
SHAPES = {"embed": (90, 8), "w": (15, 16), "b": (8,)}


def test_a_tensor_cut_over_three_fragments_trains_and_replay_rebuilds_it_whole(run, merger, tmp_path):
    rng = np.random.default_rng(5)
    version_0 = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    model = {name: value.copy() for name, value in version_0.items()}
    session = run.session(list(model.items()), learner_id="eu-0", run_dir=run.folder / "eu-0")
    assert session.fragments == [["embed[0:30]", "b"], ["embed[30:60]"], ["embed[60:90]"], ["w"]]

    for _ in range(STEPS):
        for value in model.values():
            value -= RATE
        session.step(tokens=64)
    assert run.poll_until_version(session, 1) == [1, 1, 1, 1]

    # Where each row of each tensor lives, and so when it was cut.
    rows_of_fragment = {"embed": [(0, 0, 30), (1, 30, 60), (2, 60, 90)], "w": [(3, 0, 15)], "b": [(0, 0, 8)]}
    newest, info = run.read_version()
    assert list(newest) == ["embed", "w", "b"] and info["versions"] == {0: 1, 1: 1, 2: 1, 3: 1}
    for name, blocks in rows_of_fragment.items():
        assert newest[name].shape == SHAPES[name]
        for p, first, last in blocks:
            cut_at = 10 * (p + 1)
            np.testing.assert_allclose(newest[name][first:last], version_0[name][first:last] - OUTER * RATE * cut_at,
                                       rtol=0, atol=1e-4, err_msg=f"{name} rows {first}:{last}: version 1")
            np.testing.assert_allclose(model[name][first:last], newest[name][first:last] - RATE * (STEPS - cut_at),
                                       rtol=0, atol=1e-5, err_msg=f"{name} rows {first}:{last}: after adopting")
    session.close()
    assert merger.stop() == 0
    run.assert_audit_and_verify_pass()

    # diloco-replay rebuild writes the model whole, the same values; one fragment as it holds it.
    whole, one = tmp_path / "whole.safetensors", tmp_path / "fragment1.safetensors"
    assert run.replay("rebuild", "--version", "1", "--out", str(whole)).returncode == 0
    rebuilt = safetensors.load_file(whole)
    assert list(rebuilt) == ["embed", "w", "b"]
    for name in SHAPES:
        np.testing.assert_array_equal(rebuilt[name], newest[name])
    result = run.replay("rebuild", "--version", "1", "--fragment", "1", "--out", str(one))
    assert result.returncode == 0, result.stderr
    piece = safetensors.load_file(one)
    assert list(piece) == ["embed[30:60]"]
    np.testing.assert_array_equal(piece["embed[30:60]"], newest["embed"][30:60])
