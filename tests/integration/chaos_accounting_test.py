"""scripts/chaos.py's compute accounting on hand-made logs (no broker, no processes): a pause
(SIGSTOP) inside a logged interval is not credited as compute, whatever the learner's clock says,
and the stop/continue windows are read from the run's timeline. Expected values are worked out
by hand in the comments."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import chaos  # noqa: E402

failures = []


def check(name, got, want):
    if got != want:
        failures.append(f"{name}: got {got!r}, want {want!r}")
    else:
        print(f"ok: {name}")


def step(n, wall, compute):
    return {"event": "step", "step": n, "time_us": int(wall * 1e6), "compute_seconds": compute}


events = [{"event": "start", "time_us": int(100e6)},
          step(10, 101.0, 1.0),
          # Stopped from 101.5 to 106.5 inside this interval: the clock counted 6 s of compute in 6 s
          # of wall time, 5 of them stopped; at most 6 - 5 = 1 s is credited.
          step(20, 107.0, 7.0),
          step(30, 108.0, 8.0)]  # 1 s, nothing stopped
check("no pause: the learner's own clock", chaos.compute_curve(events), [(0, 0.0), (10, 1.0), (20, 7.0), (30, 8.0)])
check("a pause inside a step is not compute", chaos.compute_curve(events, [(101.5, 106.5)]),
      [(0, 0.0), (10, 1.0), (20, 2.0), (30, 3.0)])
# A pause partly inside the interval (105 to 110 overlaps 101..107 by 2 s): 6 - 2 = 4 s at most,
# and 108 - 107 = 1 s of wall time minus 1 s stopped leaves nothing for the last interval.
check("a pause across two intervals", chaos.compute_curve(events, [(105.0, 110.0)]),
      [(0, 0.0), (10, 1.0), (20, 5.0), (30, 5.0)])
# A pause outside the learner's steps changes nothing.
check("a pause elsewhere", chaos.compute_curve(events, [(50.0, 60.0)]), [(0, 0.0), (10, 1.0), (20, 7.0), (30, 8.0)])

with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "chaos.jsonl")
    with open(path, "w") as f:
        for target, action, wall in [("learner-0", "stop", 101.5), ("learner-1", "kill", 102.0),
                                     ("learner-0", "cont", 106.5), ("learner-2", "stop", 110.0)]:
            f.write(json.dumps({"t": wall - 100, "time_us": int(wall * 1e6), "target": target, "action": action,
                                "kind": "pause" if action in ("stop", "cont") else "kill"}) + "\n")
        f.write('{"t": 12.0, "torn li')  # a line cut off by a kill
    check("stop/cont windows from the timeline", chaos.stopped_windows(path),
          {"learner-0": [(101.5, 106.5)], "learner-2": [(110.0, float("inf"))]})

if failures:
    print("\n".join("FAIL: " + f for f in failures))
    sys.exit(1)
