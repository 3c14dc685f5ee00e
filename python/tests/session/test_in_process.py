"""The Session's in-process face over NumPy arrays and small torch models: a checkpoint
(state_dict / load_state_dict) restored after the run moved on, load_version, wrap_optimizer.
Expected values come from the run's logs (read_version) and the values the test itself trained.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import decoupled_diloco as dd

TOKENS = 100
RATE = 0.01
H_OVER_P = 10  # configs/tiny.toml: diloco.H 40 over 4 fragments; fragment p is cut at step 10 (p + 1)


def train(session: dd.Session, parameters: dict[str, np.ndarray], steps: int) -> None:
    """`steps` inner steps of a known update: every value goes down by RATE."""
    for _ in range(steps):
        for value in parameters.values():
            value -= RATE
        session.step(tokens=TOKENS)


def copy(parameters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: value.copy() for name, value in parameters.items()}


@pytest.mark.parametrize("spill", [False, True], ids=["in-memory", "spilled"])
def test_a_restored_session_continues_at_the_saved_step_with_its_progress_rebased(run, layout, tmp_path, spill):
    """A learner restarted from a checkpoint older than its crash, after the run moved on, keeps
    the checkpoint's progress: its model becomes the new global version plus what it had trained
    since its base, and its next delta carries those steps. The same with the residuals and the
    values at a cut in a spill directory, which holds no file once the sessions are made."""
    # A checkpoint in the state topic at every version: a session joins at the newest version.
    merger = run.merger("--set", "merger.checkpoint_every=1")
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    kept = dict(spill_dir=spill_dir) if spill else {}
    parameters = layout(0)
    version_0 = copy(parameters)  # the run's first learner proposes version 0: these values
    first = run.session(parameters, learner_id="eu-0", **kept)
    train(first, parameters, 5)
    state, checkpoint = first.state_dict(), copy(parameters)
    train(first, parameters, 3)  # lost in the crash: the checkpoint is older
    first.close()

    mover = layout(1)
    other = run.session(mover, learner_id="us-0", region="us")
    train(other, mover, 4 * H_OVER_P)  # one delta of every fragment
    moved_to = run.poll_until_version(other, 1)
    other.close()
    newest, info = run.read_version()
    assert list(info["versions"].values()) == moved_to

    parameters = layout(2)  # what the restarted process holds before it restores its checkpoint
    restored = run.session(parameters, learner_id="eu-0", run_dir=run.folder / "eu-0", **kept)
    assert restored.step_count == 8  # the step the first session announced when it closed
    assert restored.versions == moved_to
    for name, value in checkpoint.items():
        np.testing.assert_array_equal(parameters[name], newest[name], err_msg=name)
        parameters[name][...] = value
    restored.load_state_dict(state)
    assert restored.step_count == 5
    for name, value in parameters.items():
        np.testing.assert_allclose(value, newest[name] + (checkpoint[name] - version_0[name]), rtol=0, atol=1e-6,
                                   err_msg=name)

    train(restored, parameters, H_OVER_P - 5)
    assert [(d["step"], d["fragment"], d["base_version"], d["inner_steps"]) for d in run.events("eu-0", "delta")] == \
           [(H_OVER_P, 0, moved_to[0], H_OVER_P)]
    assert list(spill_dir.iterdir()) == []  # the files are unlinked as they are made
    restored.close()
    assert merger.stop() == 0
    run.assert_audit_and_verify_pass()


def test_load_version_writes_exactly_the_arrays_of_read_version(run, merger, layout):
    """load_version is read_version written into a model: the same bits, by name, into torch
    parameters or NumPy arrays, at the newest version or an older one."""
    parameters = layout(0)
    version_0 = copy(parameters)
    session = run.session(parameters, learner_id="eu-0")
    train(session, parameters, 4 * H_OVER_P)
    run.poll_until_version(session, 1)
    session.close()

    newest, info = run.read_version()
    model = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.zeros(value.shape))
                                    for name, value in layout(1).items()})
    assert dd.load_version(run.config, model.named_parameters(), bootstrap=run.bootstrap,
                           overrides=run.overrides) == info
    for name, value in model.named_parameters():
        np.testing.assert_array_equal(value.detach().numpy(), newest[name], err_msg=name)
        assert not np.array_equal(newest[name], version_0[name]), f"{name} did not move from version 0"

    arrays = {name: np.zeros_like(value) for name, value in version_0.items()}
    dd.load_version(run.config, arrays, version=0, bootstrap=run.bootstrap, overrides=run.overrides)
    for name, value in arrays.items():
        np.testing.assert_array_equal(value, version_0[name], err_msg=name)


def test_wrap_optimizer_steps_the_session_once_per_optimizer_step(run, merger, layout):
    """The training loop needs no new line: each optimizer.step() inside the block is one step()."""
    model = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.from_numpy(value))
                                    for name, value in layout(0).items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = run.session(model.named_parameters(), learner_id="eu-0")

    def optimizer_step() -> None:
        sum((p * p).sum() for p in model.parameters()).backward()
        optimizer.step()
        optimizer.zero_grad()

    with session.wrap_optimizer(optimizer, tokens_per_step=TOKENS) as wrapped:
        assert wrapped is optimizer
        for _ in range(3):
            optimizer_step()
        assert (session.step_count, session.tokens) == (3, 3 * TOKENS)
    optimizer_step()  # after the block: the optimizer's own step, the session does not count it
    assert (session.step_count, session.tokens) == (3, 3 * TOKENS)
    assert "step" not in vars(optimizer)

