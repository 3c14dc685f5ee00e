"""bench/link-cut on a run folder written here by hand: region us cut off from 10 to 20 s. Expected
values are worked out by hand in the comments."""
import json

import pytest

from decoupled_diloco.tools import bench_link_cut


@pytest.fixture
def run_dir(tmp_path, at, write_jsonl):
    def event(name, seconds, **fields):
        return {"event": name, "time_us": at(seconds), **fields}

    def merge(seconds, *inputs):
        return event("merge", seconds, inputs=[{"learner": n, "staleness": s} for n, s in inputs])

    write_jsonl(str(tmp_path / "wan.jsonl"), [
        {"event": "links_up", "time_us": at(0)},
        {"event": "cut", "region": "us", "time_us": at(10)},
        {"event": "restored", "region": "us", "time_us": at(20)},
    ])
    (tmp_path / "run.json").write_text(json.dumps({"learner_regions": {"learner-0": "eu", "learner-1": "us"}}))
    write_jsonl(str(tmp_path / "learner-0" / "metrics.jsonl"), [
        event("step", 1, tokens=100), event("step", 9, tokens=900),      # 100 tokens/s before
        event("step", 10, tokens=1000), event("step", 20, tokens=2000),  # and during
        event("shutdown", 40, delivered=9, superseded=0, undelivered=[], bytes_received=3000),
    ])
    write_jsonl(str(tmp_path / "learner-1" / "metrics.jsonl"), [
        event("step", 2, tokens=100), event("step", 6, tokens=300),      # 50 tokens/s before
        event("step", 12, tokens=400), event("step", 18, tokens=700),    # and during
        event("adopt", 21, fragment=0, version=5),
        event("shutdown", 40, delivered=5, superseded=2, undelivered=["d"], bytes_received=4000),
    ])
    write_jsonl(str(tmp_path / "merger-0" / "metrics.jsonl"), [
        merge(5, ("learner-0", 0), ("learner-1", 0)),
        merge(15, ("learner-0", 1)),
        merge(20.4, ("learner-1", 6)),
        merge(25, ("learner-1", 2), ("learner-0", 0)),
        merge(35, ("learner-1", 1)),
        event("status", 39, metrics={"snapshot_requests_total": 3, "snapshots_published_total": 2,
                                     'params_bytes_published_total{kind="snapshot_to_one"}': 9000,
                                     'params_bytes_published_total{kind="update"}': 1000}),
    ])
    write_jsonl(str(tmp_path / "eval" / "metrics.jsonl"), [
        event("global_eval", seconds, eval_loss=loss)
        for seconds, loss in [(8, 3.0), (15, 2.9), (19, 2.8), (30, 2.5), (45, 2.2)]])
    (tmp_path / "wan-check.json").write_text('{"audit": true, "verify": true}')
    return str(tmp_path)


def test_merges_during_the_cut(run_dir):
    out = bench_link_cut.analyse(run_dir)
    assert (out["region"], out["cut_seconds"]) == ("us", 10.0)
    # One merge between the first (5 s) and the cut (10 s): 0.2/s; one in the 10 s of the cut.
    assert (out["merges_per_s_before"], out["merges_during_cut"], out["merges_per_s_during"]) == (0.2, 1, 0.1)


def test_the_cut_region_trains_on_and_catches_up(run_dir):
    learner = bench_link_cut.analyse(run_dir)["learners"]["learner-1"]
    assert learner["cut"] is True
    assert (learner["tokens_per_s_before"], learner["tokens_per_s_during"]) == (50, 50)
    assert (learner["deltas_delivered"], learner["deltas_superseded_before_sending"],
            learner["deltas_undelivered_at_stop"], learner["bytes_received"]) == (5, 2, 1, 4000)
    # Its first merge 0.4 s after the restore, 6 versions stale; its first adoption 1 s after.
    assert (learner["first_merge_after_restore_s"], learner["first_merge_after_restore_staleness"]) == (0.4, 6)
    assert learner["first_adopt_after_restore_s"] == 1.0
    # Staleness of its merged deltas in 10 s windows after the restore: (6 + 2) / 2, then 1.
    assert [w["mean"] for w in learner["staleness_after_restore"]] == [4.0, 1.0, None, None]


def test_the_other_region(run_dir):
    learner = bench_link_cut.analyse(run_dir)["learners"]["learner-0"]
    assert learner["cut"] is False
    assert (learner["tokens_per_s_before"], learner["tokens_per_s_during"]) == (100, 100)
    assert (learner["first_merge_after_restore_s"], learner["first_merge_after_restore_staleness"]) == (5.0, 0)
    assert learner["first_adopt_after_restore_s"] is None


def test_downlink_heldout_loss_and_checks(run_dir):
    out = bench_link_cut.analyse(run_dir)
    assert (out["snapshot_requests"], out["snapshots_published"], out["snapshot_bytes"], out["update_bytes"]) == \
        (3, 2, 9000, 1000)
    # The last evaluation at or before the cut (10 s), the restore (20 s), 20 s after it, and the end.
    assert out["heldout"] == {"at_cut": 3.0, "at_restore": 2.8, "restore_plus_20s": 2.5, "end": 2.2}
    assert out["checks"] == {"audit": True, "verify": True}


def test_a_run_without_a_cut_is_refused(run_dir, write_jsonl):
    write_jsonl(f"{run_dir}/wan.jsonl", [{"event": "links_up", "time_us": 0}])
    with pytest.raises(SystemExit, match="no cut and restore"):
        bench_link_cut.analyse(run_dir)
