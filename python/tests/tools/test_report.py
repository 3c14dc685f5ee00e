"""The report's figures and tables, derived from a run folder written here by hand.

tests/integration/report_test.sh checks the PNG files, the headline table, partial runs and bad
input through scripts/report; these check the data behind each plot, the per-learner and
per-fragment tables and the chaos section. Every expected value is worked out in the comments.

The run (seconds after its first event): learner-0 (eu) trains 20 steps and 200 tokens, publishes
deltas of 1,000 and 3,000 bytes; learner-1 (us) trains 20 steps and 200 tokens, restarts at 3 s
(counting from zero again) and trains 10 more steps and 100 tokens; merger-0 merges fragment 0 at
2.5 s and 5.5 s and fragment 1 at 3.5 s; the evaluator measures at 2, 4 and 6.5 s.
"""
import json
import os

import pytest

from decoupled_diloco.tools import report

KIB = 1 << 10
MIB = 1 << 20


@pytest.fixture
def run_dir(tmp_path, at, write_jsonl):
    run = tmp_path / "run"
    write_jsonl(str(run / "learner-0" / "metrics.jsonl"), [
        {"event": "start", "region": "eu", "parameters": 100, "config": "configs/x.toml", "time_us": at(0)},
        {"event": "delta", "fragment": 0, "wire_bytes": 1000, "time_us": at(1)},
        {"event": "step", "step": 10, "loss": 3.0, "loss_ema": 3.5, "tokens": 100, "tokens_per_s": 50.0,
         "bytes_sent": 1000, "bytes_received": 400, "deltas_delivered": 1, "deltas_superseded": 0,
         "max_rss_kb": 2048, "time_us": at(2)},
        {"event": "adopt", "fragment": 0, "version": 1, "time_us": at(2.6)},
        {"event": "delta", "fragment": 1, "wire_bytes": 3000, "time_us": at(3)},
        {"event": "step", "step": 20, "loss": 2.0, "loss_ema": 3.0, "tokens": 200, "tokens_per_s": 60.0,
         "bytes_sent": 4000, "bytes_received": 900, "deltas_delivered": 2, "deltas_superseded": 0,
         "max_rss_kb": 3072, "time_us": at(4)},
        {"event": "eval", "step": 20, "eval_loss": 2.5, "tokens": 200, "time_us": at(4.5)},
        {"event": "stop", "step": 20, "tokens": 200, "reason": "budget", "time_us": at(5)},
        {"event": "shutdown", "delivered": 2, "superseded": 0, "undelivered": [], "bytes_received": 1000,
         "time_us": at(5.1)},
    ])
    write_jsonl(str(run / "learner-1" / "metrics.jsonl"), [
        {"event": "start", "region": "us", "parameters": 100, "time_us": at(0)},
        {"event": "step", "step": 10, "loss": 3.2, "loss_ema": 3.6, "tokens": 100, "tokens_per_s": 40.0, "time_us": at(1)},
        {"event": "step", "step": 20, "loss": 3.0, "loss_ema": 3.4, "tokens": 200, "tokens_per_s": 40.0, "time_us": at(2)},
        # Restarted as a Python learner (a decoupled_diloco.Session): the last start names it.
        {"event": "start", "region": "us", "parameters": 100, "client": "python", "time_us": at(3)},
        {"event": "step", "step": 10, "loss": 2.8, "loss_ema": 3.2, "tokens": 100, "tokens_per_s": 45.0, "time_us": at(6)},
        {"event": "stop", "step": 10, "tokens": 100, "reason": "budget", "time_us": at(7)},
    ])
    write_jsonl(str(run / "merger-0" / "metrics.jsonl"), [
        {"event": "recovered", "fragment": 0, "version": 0, "time_us": at(0.5)},
        # Fragment 1's version 0 comes from a learner's proposal, committed at 0.7 s.
        {"event": "genesis", "fragment": 1, "learner": "learner-1", "time_us": at(0.7)},
        # learner-0's proposal came second: not needed, not a fault.
        {"event": "rejected", "reason": "genesis_exists", "time_us": at(0.8)},
        {"event": "rejected", "reason": "wrong_fingerprint", "time_us": at(0.9)},
        {"event": "merge", "fragment": 0, "version": 1, "sync_seconds": 0.1, "time_us": at(2.5),
         "inputs": [{"learner": "learner-0", "staleness": 0}], "dropped": []},
        {"event": "merge", "fragment": 1, "version": 1, "sync_seconds": 0.2, "time_us": at(3.5),
         "inputs": [{"learner": "learner-0", "staleness": 1}, {"learner": "learner-1", "staleness": 3}],
         "dropped": [{"reason": "superseded"}]},
        {"event": "merge", "fragment": 0, "version": 2, "sync_seconds": 0.3, "time_us": at(5.5),
         "inputs": [{"learner": "learner-1", "staleness": 1}],
         "dropped": [{"reason": "too_stale"}, {"reason": "superseded"}]},
        # The same version logged twice (a merger's log after a restart): counted once.
        {"event": "merge", "fragment": 0, "version": 2, "sync_seconds": 9.9, "time_us": at(5.6),
         "inputs": [{"learner": "learner-1", "staleness": 7}], "dropped": [{"reason": "too_stale"}]},
        {"event": "stop_record", "held": 2, "time_us": at(8)},
    ])
    write_jsonl(str(run / "eval" / "metrics.jsonl"), [
        {"event": "global_eval", "eval_loss": 3.0, "version_sum": 1, "time_us": at(2)},
        {"event": "global_eval", "eval_loss": 2.6, "version_sum": 3, "time_us": at(4)},
        {"event": "global_eval", "eval_loss": 2.4, "version_sum": 4, "time_us": at(6.5)},
    ])
    return str(run)


@pytest.fixture
def figures(monkeypatch):
    """name -> the matplotlib figure the report saved under that name."""
    saved = {}

    class RecordingPlotter(report.Plotter):
        def save(self, fig, name):
            saved[name] = fig
            super().save(fig, name)

    monkeypatch.setattr(report, "Plotter", RecordingPlotter)
    return saved


def lines_of(fig, axes=0):
    """(x, y) of every line drawn on one axes of a figure, as lists."""
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[axes].lines]


def page(run_dir):
    with open(os.path.join(run_dir, "report", "index.md"), encoding="utf-8") as f:
        return f.read()


def test_heldout_loss_against_tokens_holds_a_restarted_learner_flat(run_dir, figures):
    report.report(run_dir, None)
    (global_x, global_y), (local_x, local_y) = lines_of(figures["heldout_loss_tokens.png"])
    # Tokens of all learners at each global evaluation:
    #   2 s: learner-0 100 (its step at 2 s) + learner-1 200 (its step at 2 s) = 300
    #   4 s: learner-0 200 + learner-1 200: restarted at 3 s, it holds its 200 until its next step
    #        at 6 s (a linear interpolation would give 233) = 400
    #   6.5 s: learner-0 200 (stopped) + learner-1 200 + 100 after the restart = 500
    assert global_x == pytest.approx([300, 400, 500])
    assert global_y == pytest.approx([3.0, 2.6, 2.4])
    # learner-0's own eval at 4.5 s: 200 + 200 tokens.
    assert (local_x, local_y) == (pytest.approx([400]), pytest.approx([2.5]))


def test_heldout_loss_against_wall_clock(run_dir, figures):
    report.report(run_dir, None)
    (global_x, global_y), (local_x, _) = lines_of(figures["heldout_loss_time.png"])
    assert global_x == pytest.approx([2, 4, 6.5])  # seconds since learner-0's start, the first event
    assert global_y == pytest.approx([3.0, 2.6, 2.4])
    assert local_x == pytest.approx([4.5])


def test_wire_bytes_are_cumulative_per_learner(run_dir, figures):
    report.report(run_dir, None)
    lines = lines_of(figures["wire_bytes.png"])
    published, acknowledged = lines[0], lines[1]
    # learner-0's deltas at 1 s and 3 s: 1,000 then 1,000 + 3,000 bytes.
    assert published == (pytest.approx([1, 3]), pytest.approx([1000 / MIB, 4000 / MIB]))
    # What Kafka acknowledged at each step event, from 0 at its start.
    assert acknowledged == (pytest.approx([0, 2, 4]), pytest.approx([0, 1000 / MIB, 4000 / MIB]))


def test_staleness_histogram_and_deltas_not_merged(run_dir, figures):
    report.report(run_dir, None)
    fig = figures["staleness.png"]
    hist, reasons = fig.axes
    # Staleness of the merged deltas 0, 1, 3, 1 (the repeated version is not counted): one bar per
    # value from 0 to 3.
    assert [p.get_height() for p in hist.patches] == [1, 2, 0, 1]
    assert hist.lines[0].get_xdata()[0] == pytest.approx(1.25)  # the mean
    # Dropped: superseded 1 + 1, too_stale 1; 2 held at the merger's stop. Bars in label order.
    assert [t.get_text() for t in reasons.get_yticklabels()] == ["held at merger stop", "superseded", "too_stale"]
    assert [p.get_width() for p in reasons.patches] == [2, 2, 1]


def test_fragment_versions_step_from_genesis_or_recovery_to_the_last_event(run_dir, figures):
    report.report(run_dir, None)
    fragment0, fragment1 = lines_of(figures["fragment_versions.png"])
    # Recovered at version 0 at 0.5 s, merged at 2.5 s and 5.5 s; held to the run's last event (8 s).
    assert fragment0 == (pytest.approx([0.5, 2.5, 5.5, 8]), [0, 1, 2, 2])
    # Version 0 committed at 0.7 s, merged at 3.5 s.
    assert fragment1 == (pytest.approx([0.7, 3.5, 8]), [0, 1, 1])


def test_training_loss_counts_steps_across_a_restart(run_dir, figures):
    report.report(run_dir, None)
    ema0, raw0, ema1, raw1 = lines_of(figures["training_loss.png"])
    assert ema0 == ([10, 20], [3.5, 3.0])
    assert raw0 == ([10, 20], [3.0, 2.0])
    # learner-1's step 10 after its restart is its 30th step.
    assert ema1 == ([10, 20, 30], [3.6, 3.4, 3.2])
    assert raw1 == ([10, 20, 30], [3.2, 3.0, 2.8])


def test_throughput_per_learner(run_dir, figures):
    report.report(run_dir, None)
    learner0, learner1 = lines_of(figures["tokens_per_s.png"])
    assert learner0 == (pytest.approx([2, 4]), [50.0, 60.0])
    assert learner1 == (pytest.approx([1, 2, 6]), [40.0, 40.0, 45.0])


def test_learner_and_fragment_tables(run_dir, figures):
    report.report(run_dir, None)
    text = page(run_dir)
    # learner-0: 20 steps, 200 tokens, 2 deltas (4,000 B, 2,000 B each), 2 merged (fragment 0 v1,
    # fragment 1 v1), 1,000 B received (its shutdown), 1 adoption, last average loss 3.0, last
    # held-out 2.5, 60 tokens/s, at most 3,072 kB = 3 MiB resident.
    assert ("| learner-0 | eu | 20 | 200 | budget | 2 | 2 | 0 | 0 | 2 | 4,000 B (3.9 KiB) | 2,000 B (2.0 KiB) "
            "| 1,000 B | 1 | 3.0000 | 2.5000 | 60 | 3 MiB |") in text
    # learner-1: 20 + 10 steps, 200 + 100 tokens over two starts and one stop, no delta of its own in
    # the fixture, 2 merged (fragment 1 v1, fragment 0 v2).
    assert ("| learner-1 | us | 30 | 300 | budget (an earlier start has no stop) | 0 | 0 | 0 | 0 | 2 | 0 B | – "
            "| 0 B | 0 | 3.2000 | – | 45 | – |") in text
    # Fragment 0: versions 1 and 2, staleness 0 and 1; fragment 1: version 1, staleness 1 and 3.
    assert "| 0 | 2 | 2 | 2 | 0.50 |" in text
    assert "| 1 | 1 | 1 | 2 | 2.00 |" in text


def test_headline_numbers_of_this_run(run_dir, figures):
    report.report(run_dir, None)
    text = page(run_dir)
    for row in [
        "| Final global held-out loss | 2.4000 (at 6.5 s, 500 tokens, version sum 4) |",
        "| Global evaluations | 3 |",
        "| Tokens trained (all learners) | 500 |",
        "| Inner steps (all learners) | 50 |",
        "| Wall time | 8.0 s |",
        "| Learners | 2 (learner-0 in eu, learner-1 in us, python) |",
        "| Merges | 3 |",
        "| Deltas merged | 4 |",
        "| Deltas dropped by reason | superseded 2, too_stale 1 |",
        "| Deltas held when a merger stopped | 2 |",
        "| Mean staleness of merged deltas | 1.25 (max 3) |",
        "| Versions per fragment | 0: 2, 1: 1 |",
        "| Version 0 proposed by | learner-1 (fragments 1); 1 later proposal(s) not needed |",
        "| Messages rejected by reason | wrong_fingerprint 1 |",
        # (0.1 + 0.2 + 0.3) / 3; the repeated record's 9.9 is not counted.
        "| Mean merge sync time | 0.200 s |",
        # 2 x 4 B x 100 parameters x 50 steps = 40,000 B against 4,000 B up + 1,000 B down: 8x.
        "| fp32 data parallel at the same steps (2 x 4 B x parameters per learner step) | 40,000 B (39.1 KiB) |",
        "| Both directions against fp32 data parallel | 5,000 B (4.9 KiB): 8x fewer bytes |",
    ]:
        assert row in text
    assert "learner-1 started 2 times" in text
    assert "1 merge event(s) repeat a fragment version already logged; counted once." in text


def test_the_final_model_file_is_named_with_its_size(run_dir, figures):
    with open(os.path.join(run_dir, "final_model.safetensors"), "wb") as f:
        f.write(b"\0" * 2048)
    report.report(run_dir, None)
    assert "Final model: `final_model.safetensors`, 2,048 B (2.0 KiB)." in page(run_dir)


def chaos_events(at):
    return [
        {"time_us": at(2), "target": "learner-1", "action": "kill", "kind": "kill"},
        {"time_us": at(3), "target": "learner-1", "action": "restart", "kind": "kill"},
        {"time_us": at(4), "target": "learner-0", "action": "stop", "kind": "pause"},
        {"time_us": at(4.5), "target": "learner-0", "action": "cont", "kind": "pause"},
        {"time_us": at(6), "target": "merger-0", "action": "kill", "kind": "kill"},
        {"time_us": at(7.5), "target": "cluster", "action": "end", "kind": "time budget"},
    ]


def test_down_intervals_run_from_fault_to_repair(at):
    intervals = report.down_intervals(chaos_events(at), at(8))
    assert dict(intervals) == {
        "learner-1": [(at(2), at(3), "kill")],
        "learner-0": [(at(4), at(4.5), "pause")],
        "merger-0": [(at(6), at(8), "kill")],  # never restarted: down to the end
    }


def test_chaos_section_and_timeline(run_dir, figures, at, write_jsonl):
    write_jsonl(os.path.join(run_dir, "chaos.jsonl"), chaos_events(at), torn='{"time_us": 1')
    with open(os.path.join(run_dir, "chaos.json"), "w") as f:
        json.dump({"mode": "decoupled", "seed": 3, "goodput": 0.75, "goodput_of_available": 0.9,
                   "checks": {"audit": True, "verify": False}}, f)
    report.report(run_dir, None)
    text = page(run_dir)
    for row in ["| learner kills | 1 |", "| learner pauses | 1 |", "| merger kills | 1 |",
                "| Goodput (merged learner compute / provisioned learner-seconds) | 0.750 |",
                "| Goodput of the learner-seconds the learners were up | 0.900 |",
                "| Checks | audit pass, verify FAIL |"]:
        assert row in text
    ax = figures["chaos_timeline.png"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["learner-0", "learner-1", "merger-0", "merges"]
    # One bar per fault, in the order of the targets: the pause 4-4.5 s, the kill 2-3 s, the
    # merger's kill from 6 s to the last event (8 s).
    spans = [c.get_paths()[0].get_extents() for c in ax.collections]
    assert [(b.x0, b.x1) for b in spans] == [pytest.approx((4, 4.5)), pytest.approx((2, 3)), pytest.approx((6, 8))]
    # Merges (versions above 0) on the top row.
    assert lines_of(figures["chaos_timeline.png"])[0] == (pytest.approx([2.5, 3.5, 5.5]), [3, 3, 3])


def test_cumulative_counter_survives_a_restart():
    def event(name, seconds, value):
        return {"event": name, "time_us": seconds * 1e6, "tokens": value}
    records = [event("start", 0, None), event("step", 1, 100), event("step", 2, 300),
               event("start", 3, None), event("step", 4, 50), event("step", 5, 250)]
    # After the restart the counter starts from zero again: 300 + 50, 300 + 250.
    assert report.cumulative(records, {"step": "tokens"}) == [
        (0, 0.0, True), (1e6, 100, False), (2e6, 300, False), (3e6, 300, True), (4e6, 350, False), (5e6, 550, False)]
