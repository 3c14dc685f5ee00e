"""A Python learner killed with SIGKILL and started again under the same id resumes as
diloco-learner does (learner/resume.h): at the step it announced last, with its budget going on,
and the run loses none of its deltas and merges none twice.
"""
from __future__ import annotations

# Room for the kill: it comes about 2.5 s into training (the first heartbeat after step 0),
# around step 70 at the 0.0375 s a step of examples/pytorch/README.md.
STEPS = 300
TOKENS_PER_STEP = 16 * 64  # configs/tiny.toml: train.batch sequences of model.context characters
LOG_EVERY = 10  # the Session's default: a `step` line every 10 steps


def test_a_killed_python_learner_resumes_at_its_step_and_trains_to_its_budget(run, merger):
    """A crash must cost a learner at most its last seconds of progress, never its schedule,
    its budget or a delta."""
    options = ("--model", "builtin", "--steps", str(STEPS), "--eval-every", "0")
    first = run.python_learner("eu-0", "eu", *options)

    def announced_after_deltas() -> int:
        member = run.members().get("eu-0")
        return member["step"] if member and len(first.events("delta")) >= 2 else 0

    announced = first.wait_for(announced_after_deltas, 120, "two deltas sent and a step past 0 announced")
    first.kill()
    reached = first.events("step")[-1]["step"]
    assert reached < STEPS and not first.events("stop")

    second = run.python_learner("eu-0", "eu", *options, name="eu-0-restarted")
    assert second.wait(timeout=120) == 0
    resume = second.events("resume")
    assert len(resume) == 1
    resumed = resume[0]["step"]
    print(f"announced step {announced} before the kill, killed after step {reached} "
          f"(lines every {LOG_EVERY}), resumed at step {resumed}")
    # The last announcement is at least the one seen before the kill, and at most the step the
    # process was at: below the next line it would have written.
    assert 0 < announced <= resumed < reached + LOG_EVERY
    stop = second.events("stop")[-1]
    assert stop["reason"] == "budget" and stop["step"] == STEPS
    assert stop["tokens"] == (STEPS - resumed) * TOKENS_PER_STEP
    assert second.events("delta")[0]["step"] > resumed

    assert merger.stop() == 0
    audit = run.assert_audit_and_verify_pass()
    assert audit["merged"] > 0
