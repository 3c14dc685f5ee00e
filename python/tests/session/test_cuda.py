"""Parameters on a CUDA device: the Session copies the fragment it cuts to host and writes the
versions it adopts back into the device tensors. The same scenario runs on CPU tensors (the
reference, always) and on CUDA where torch.cuda.is_available().

By hand, from configs/tiny.toml: fragment p is cut at step 10 (p + 1), so after 40 steps of
"every value down by 0.01" its delta is 0.01 * 10 (p + 1) everywhere; one learner's merge (rule
rda, Nesterov with outer_lr 0.7 and momentum 0.9, from zero momentum) moves version 0 by
-1.0 * (1 + 0.5) times it; and the learner, adopting with rebase, keeps the steps it did on p
after its cut, 0.01 * (40 - 10 (p + 1)).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

STEPS = 40
RATE = 0.01
OUTER = 1.0 * (1 + 0.5)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="torch.cuda.is_available() is False: no CUDA device here")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_versions_arrive_in_the_device_tensors_and_match_the_deltas_sent(run, merger, layout, device):
    """Only the fragment being cut or adopted crosses between device and host: a stale host copy
    would send a wrong delta, and an adoption not written back would leave the device model behind."""
    version_0 = layout(0)
    model = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.from_numpy(value.copy()).to(device))
                                    for name, value in version_0.items()})
    session = run.session(model.named_parameters(), learner_id="eu-0", run_dir=run.folder / "eu-0")
    with torch.no_grad():
        for _ in range(STEPS):
            for parameter in model.values():
                parameter -= RATE
            session.step(tokens=64)
    assert run.poll_until_version(session, 1) == [1, 1, 1, 1]
    assert all(p.device.type == device for p in model.values())

    assert [(d["step"], d["fragment"], d["base_version"], d["inner_steps"]) for d in run.events("eu-0", "delta")] == \
           [(10 * (p + 1), p, 0, 10 * (p + 1)) for p in range(4)]

    newest, _ = run.read_version()
    for p, names in enumerate(session.fragments):
        cut_at = 10 * (p + 1)
        for name in names:
            np.testing.assert_allclose(newest[name], version_0[name] - OUTER * RATE * cut_at, rtol=0, atol=1e-4,
                                       err_msg=f"{name}: version 1")
            np.testing.assert_allclose(model[name].detach().cpu().numpy(), newest[name] - RATE * (STEPS - cut_at),
                                       rtol=0, atol=1e-5, err_msg=f"{name}: the model after adopting version 1")
    session.close()
    assert merger.stop() == 0
    run.assert_audit_and_verify_pass()
