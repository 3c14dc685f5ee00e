"""scripts/chaos's schedule and accounting on hand-made logs (no broker, no processes): a pause
(SIGSTOP) inside a logged interval is not credited as compute, whatever the learner's clock says;
goodput counts the compute of merged deltas only, once per fragment; stalls and checks come from
the merge log. Expected values are worked out by hand in the comments."""
import json
import subprocess
import types

import pytest

from decoupled_diloco.tools import chaos


def step(n, wall, compute):
    return {"event": "step", "step": n, "time_us": int(wall * 1e6), "compute_seconds": compute}


EVENTS = [{"event": "start", "time_us": int(100e6)},
          step(10, 101.0, 1.0),
          # 6 s of compute in 6 s of wall time by the learner's own clock.
          step(20, 107.0, 7.0),
          step(30, 108.0, 8.0)]


def test_compute_curve_without_a_pause_is_the_learners_clock():
    assert chaos.compute_curve(EVENTS) == [(0, 0.0), (10, 1.0), (20, 7.0), (30, 8.0)]


def test_a_pause_inside_a_step_is_not_compute():
    # Stopped from 101.5 to 106.5 inside the 101..107 interval: at most 6 - 5 = 1 s is credited.
    assert chaos.compute_curve(EVENTS, [(101.5, 106.5)]) == [(0, 0.0), (10, 1.0), (20, 2.0), (30, 3.0)]


def test_a_pause_across_two_intervals():
    # 105..110 overlaps 101..107 by 2 s: 6 - 2 = 4 s at most; 107..108 is stopped throughout: nothing.
    assert chaos.compute_curve(EVENTS, [(105.0, 110.0)]) == [(0, 0.0), (10, 1.0), (20, 5.0), (30, 5.0)]


def test_a_pause_elsewhere_changes_nothing():
    assert chaos.compute_curve(EVENTS, [(50.0, 60.0)]) == [(0, 0.0), (10, 1.0), (20, 7.0), (30, 8.0)]


def test_a_resumed_learner_starts_at_its_resume_step():
    events = [{"event": "start", "time_us": 0}, {"event": "resume", "step": 40, "time_us": 0},
              step(50, 2.0, 1.5)]
    assert chaos.compute_curve(events) == [(40, 0.0), (50, 1.5)]


def test_stop_and_continue_windows_from_the_timeline(tmp_path, write_jsonl):
    path = write_jsonl(str(tmp_path / "chaos.jsonl"), [
        {"time_us": int(wall * 1e6), "target": target, "action": action}
        for target, action, wall in [("learner-0", "stop", 101.5), ("learner-1", "kill", 102.0),
                                     ("learner-0", "cont", 106.5), ("learner-2", "stop", 110.0)]],
        torn='{"t": 12.0, "torn li')
    assert chaos.stopped_windows(path) == {"learner-0": [(101.5, 106.5)], "learner-2": [(110.0, float("inf"))]}


def test_compute_at_interpolates_and_extrapolates_at_the_mean_rate():
    points = [(0, 0.0), (10, 1.0), (20, 7.0)]
    assert chaos.compute_at(points, -1) == 0.0
    assert chaos.compute_at(points, 5) == pytest.approx(0.5)
    assert chaos.compute_at(points, 15) == pytest.approx(4.0)
    # Past the last point at 7 s / 20 steps: 7 + 10 x 0.35.
    assert chaos.compute_at(points, 30) == pytest.approx(10.5)


def test_longest_stall_outside_the_excluded_intervals():
    # Gaps 0-10, 10-12, 12-30; with 2-9 and 15-25 excluded the stretches are 2, 1, 2, 3 and 5 s long.
    assert chaos.longest_outside([0, 10, 12, 30], [(2, 9), (15, 25)]) == (5, 25)
    assert chaos.longest_outside([0, 10, 12, 30], []) == (18, 12)


def test_incarnations_split_at_each_start():
    events = [{"event": "step"}, {"event": "start"}, {"event": "step"}, {"event": "start"}]
    assert chaos.incarnations(events) == [[{"event": "step"}], [{"event": "start"}, {"event": "step"}],
                                          [{"event": "start"}]]


class FixedDraws:
    """A random source whose exponential draws are the given values, in order."""

    def __init__(self, values):
        self.values = list(values)

    def expovariate(self, _rate):
        return self.values.pop(0)


def test_draw_faults_alternates_up_and_down_times():
    # Up 5 s from 10: a fault at 15 for 2 s; up 10 s: at 27 for max(1, 0.5) = 1 s; up 100 s: past the end.
    faults = chaos.draw_faults(FixedDraws([5, 2, 10, 0.5, 100, 1]), "learner-0", "kill", 60, 10, 10, 40)
    assert faults == [{"at": 15, "down": 2, "target": "learner-0", "kind": "kill"},
                      {"at": 27, "down": 1, "target": "learner-0", "kind": "kill"}]
    assert chaos.draw_faults(FixedDraws([]), "learner-0", "kill", 0, 10, 10, 40) == []


def schedule_args(seed, term_mtbf=40):
    return types.SimpleNamespace(seed=seed, warmup=15, seconds=300, cooldown=10, learner_mtbf=30, learner_mttr=10,
                                 pause_mtbf=20, pause_mttr=5, merger_mtbf=40, merger_mttr=5, nodes=3,
                                 broker_mtbf=30, broker_mttr=10, term_mtbf=term_mtbf, term_mttr=5)


def test_schedule_is_a_function_of_the_seed():
    learners, mergers = ["learner-0", "learner-1"], ["merger-0"]
    faults = chaos.schedule(schedule_args(7), learners, mergers)
    assert faults == chaos.schedule(schedule_args(7), learners, mergers)
    assert faults != chaos.schedule(schedule_args(8), learners, mergers)
    assert [f["at"] for f in faults] == sorted(f["at"] for f in faults)
    assert all(15 <= f["at"] and f["at"] + f["down"] <= 290 for f in faults)
    assert {f["target"] for f in faults} <= {"learner-0", "learner-1", "merger-0", "broker-1", "broker-2", "broker-3"}
    # A learner's pauses never overlap its kills (nor come within a second of one).
    for name in learners:
        kills = [f for f in faults if f["target"] == name and f["kind"] == "kill"]
        pauses = [f for f in faults if f["target"] == name and f["kind"] == "pause"]
        assert kills and pauses
        for p in pauses:
            assert all(p["at"] + p["down"] <= k["at"] - 1 or p["at"] >= k["at"] + k["down"] + 1 for k in kills)


def test_sigterm_stops_of_learners_and_mergers_overlap_no_other_fault_and_leave_the_rest_of_the_schedule_as_it_was():
    learners, mergers = ["learner-0", "learner-1"], ["merger-0"]
    faults = chaos.schedule(schedule_args(7), learners, mergers)
    terms = [f for f in faults if f["kind"] == "term"]
    assert {f["target"] for f in terms} == {"learner-0", "learner-1", "merger-0"}
    for t in terms:
        others = [f for f in faults if f["target"] == t["target"] and f is not t]
        assert all(t["at"] + t["down"] <= o["at"] - 1 or t["at"] >= o["at"] + o["down"] + 1 for o in others)
    # The stops draw from their own generator: without them, the other faults are the same.
    assert [f for f in faults if f["kind"] != "term"] == chaos.schedule(schedule_args(7, term_mtbf=0), learners, mergers)


# ---- analyse(): goodput, stalls and checks of a finished run ------------------------------------

START = 1000.0  # the cluster's start, unix seconds


def us(seconds):
    return int((START + seconds) * 1e6)


def ms(seconds):
    return (START + seconds) * 1000


# The merge log as `diloco-replay audit --json` gives it: fragment 0 at versions 1 (4 s) and 2
# (13 s), fragment 1 at version 1 (7 s).
AUDIT = {"ok": True, "problems": [], "deltas": 4, "merge_records": 3, "merged": 3, "dropped": 1,
         "pending_at_stop": 0, "rejected": 0,
         "versions": {"0": [{"version": 1, "checksum": 11, "time_ms": ms(4)},
                            {"version": 2, "checksum": 12, "time_ms": ms(13)}],
                      "1": [{"version": 1, "checksum": 21, "time_ms": ms(7)}]}}
# `diloco-replay list --json`: the fate of each delta (learner, fragment, seq).
FATES = [("learner-0", 0, 1, "merged"), ("learner-0", 1, 2, "merged"), ("learner-0", 0, 3, "dropped"),
         ("learner-0", 0, 4, "merged")]


@pytest.fixture
def finished_run(tmp_path, write_jsonl, monkeypatch):
    """One learner, two fragments, 20 s; a pause of learner-0 from 7 to 8.5 s, a kill of merger-0 from
    14 to 18 s."""
    def delta(fragment, seq, at_step, inner_steps, seconds):
        return {"event": "delta", "fragment": fragment, "seq": seq, "step": at_step, "inner_steps": inner_steps,
                "time_us": us(seconds)}

    def learner_step(n, seconds, compute):
        return {"event": "step", "step": n, "time_us": us(seconds), "compute_seconds": compute}

    write_jsonl(str(tmp_path / "learner-0" / "metrics.jsonl"), [
        {"event": "start", "time_us": us(0)},
        learner_step(10, 3, 2.0), delta(0, 1, 10, 10, 3),   # covers steps 0-10 of fragment 0
        learner_step(20, 6, 4.0), delta(1, 2, 20, 20, 6),   # 0-20 of fragment 1
        learner_step(30, 9, 6.0), delta(0, 3, 30, 20, 9),   # dropped
        learner_step(40, 12, 8.0), delta(0, 4, 40, 35, 12),  # 5-40 of fragment 0
        {"event": "adopt", "fragment": 0, "version": 1, "checksum": 11, "time_us": us(4.1)},
        {"event": "adopt", "fragment": 0, "version": 2, "checksum": 12, "time_us": us(13.1)},
        {"event": "stop", "step": 40, "compute_seconds": 8.0, "time_us": us(13)},
    ])
    write_jsonl(str(tmp_path / "eval" / "metrics.jsonl"), [
        {"event": "adopt", "fragment": 1, "version": 1, "checksum": 21, "time_us": us(7.1)},
        {"event": "global_eval", "eval_loss": 2.5, "time_us": us(10)},
        {"event": "global_eval", "eval_loss": 2.25, "time_us": us(19)},
    ])
    write_jsonl(str(tmp_path / "chaos.jsonl"), [
        {"time_us": us(7), "target": "learner-0", "action": "stop", "kind": "pause"},
        {"time_us": us(8.5), "target": "learner-0", "action": "cont", "kind": "pause"},
    ])

    def replay(_cluster, command, *_args):
        if command == "audit":
            return subprocess.CompletedProcess([], 0, stdout=json.dumps(AUDIT) + "\n", stderr="")
        if command == "list":
            lines = [json.dumps({"learner": n, "fragment": p, "seq": s, "fate": fate}) for n, p, s, fate in FATES]
            return subprocess.CompletedProcess([], 0, stdout="\n".join(lines) + "\n", stderr="")
        return subprocess.CompletedProcess([], 0, stdout="PASS\n", stderr="")

    monkeypatch.setattr(chaos, "replay", replay)
    cluster = types.SimpleNamespace(fragments=2, learner_names=["learner-0"], merger_names=["merger-0"],
                                    run_dir=str(tmp_path), start_time=START)
    faults = [{"at": 7, "down": 1.5, "target": "learner-0", "kind": "pause"},
              {"at": 14, "down": 4, "target": "merger-0", "kind": "kill"}]
    return cluster, faults


def test_goodput_credits_merged_deltas_once_per_fragment(finished_run):
    cluster, faults = finished_run
    result = chaos.analyse(cluster, None, faults, 20)
    # The compute curve: 2 s by step 10, 4 s by 20; 6..9 s held the pause 7..8.5, so step 30 gets
    # min(2, 3 - 1.5) = 1.5 s (5.5 in all), step 40 2 s more (7.5).
    assert result["compute_seconds"] == 7.5
    # Merged: fragment 0 over steps 0-10 and 5-40 (their union, 0-40, counts once), fragment 1 over
    # 0-20, each step 1/2 per fragment: (2 + (7.5 - 2)) / 2 + 4 / 2 = 5.75 s.
    assert result["good_compute_seconds"] == 5.75
    # Provisioned: from the first step's start (3 s - 2 s of compute = 1 s) to the end (20 s): 19 s;
    # the learner was up 19 - 1.5 of them.
    assert result["provisioned_learner_seconds"] == 19.0
    assert result["learner_down_seconds"] == 1.5
    assert result["goodput"] == pytest.approx(5.75 / 19)
    assert result["goodput_of_available"] == pytest.approx(5.75 / 17.5)
    assert result["deltas"] == {"sent": 4, "merged": 3, "unaccounted": 0}


def test_stalls_and_merge_intervals_from_the_merge_log(finished_run):
    cluster, faults = finished_run
    result = chaos.analyse(cluster, None, faults, 20)
    # Versions at 4, 7 and 13 s, the budget ends at 20 s: the longest gap is 13-20.
    assert (result["longest_stall_seconds"], result["longest_stall_at"]) == (7.0, 13.0)
    # merger-0 was down 14-18 s, which splits 13-20 into 1 s and 2 s: 7-13 is the longest then.
    assert result["longest_stall_while_a_merger_lives_seconds"] == 6.0
    assert result["median_merge_interval_seconds"] == 6.0      # gaps 3 and 6: the upper median
    assert result["fragment_merge_interval_seconds"] == 9.0    # fragment 0: 4 to 13 s
    assert result["merges"] == 3
    assert result["final_loss"] == 2.25


def test_checks_pass_when_every_adoption_is_committed(finished_run):
    cluster, faults = finished_run
    result = chaos.analyse(cluster, None, faults, 20)
    assert result["checks"] == {"audit": True, "verify": True, "adopted_committed": True, "no_version_backwards": True}
    assert result["ok"] and result["problems"] == []


def test_checks_catch_an_uncommitted_or_backward_adoption(finished_run, write_jsonl):
    cluster, faults = finished_run
    write_jsonl(f"{cluster.run_dir}/eval/metrics.jsonl", [
        {"event": "adopt", "fragment": 1, "version": 1, "checksum": 99, "time_us": us(7.1)},
        {"event": "adopt", "fragment": 0, "version": 2, "checksum": 12, "time_us": us(13.1)},
        {"event": "adopt", "fragment": 0, "version": 1, "checksum": 11, "time_us": us(13.2)},
    ])
    result = chaos.analyse(cluster, None, faults, 20)
    assert result["checks"]["adopted_committed"] is False
    assert result["checks"]["no_version_backwards"] is False
    assert not result["ok"]
    assert result["problems"] == [
        "eval adopted fragment 1 version 1 (checksum 99), which the merge log does not hold with that checksum",
        "eval adopted fragment 0 version 1 after holding 2"]
