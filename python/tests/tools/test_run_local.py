"""scripts/run-local's live view, folded from metrics files written here by hand, and the run's
config and cluster shape. Expected values are worked out by hand in the comments."""
import types

import pytest

from decoupled_diloco.tools import run_local


@pytest.fixture
def view(tmp_path, write_jsonl):
    write_jsonl(str(tmp_path / "learner-0" / "metrics.jsonl"), [
        {"event": "start", "region": "eu"},
        {"event": "step", "step": 10, "t": 10.0, "loss_ema": 3.5, "tokens_per_s": 100.0, "adopted": 1,
         "bytes_sent": 1000, "bytes_received": 2000},
        {"event": "step", "step": 30, "t": 20.0, "loss_ema": 3.0, "tokens_per_s": 120.0, "adopted": 3,
         "bytes_sent": 3000, "bytes_received": 5000},
        {"event": "eval", "eval_loss": 2.9},
    ], torn='{"event": "step", "step": 40')
    write_jsonl(str(tmp_path / "merger-0" / "metrics.jsonl"), [
        {"event": "assigned", "partitions": [0, 1]},
        {"event": "merge", "fragment": 1, "version": 1, "time_us": 5e6, "inputs": [{}, {}], "dropped": []},
        {"event": "merge", "fragment": 1, "version": 2, "time_us": 6e6, "inputs": [{}],
         "dropped": [{"reason": "superseded"}]},
        {"event": "stop_record", "dropped": [{"reason": "too_stale"}, {"reason": "superseded"}]},
    ])
    write_jsonl(str(tmp_path / "eval" / "metrics.jsonl"), [
        {"event": "global_eval", "eval_loss": 2.75, "versions": [0, 2]}])
    v = run_local.View(str(tmp_path), ["learner-0"], ["merger-0"], fragments=2, steps_budget=100)
    v.update()
    return v


def test_view_folds_learner_events(view):
    s = view.learners["learner-0"]
    assert (s["region"], s["step"], s["loss"], s["tok_s"], s["adopted"], s["eval"]) == ("eu", 30, 3.0, 120.0, 3, 2.9)
    assert (view.bytes_sent(), view.bytes_received()) == (3000, 5000)
    assert view.wire_text() == "wire up 0.00 MB, down 0.01 MB"
    # 20 steps in 10 s since its first logged step: 70 steps left take 35 s.
    assert view.eta_seconds() == pytest.approx(35.0)


def test_view_folds_merger_events(view):
    assert (view.versions, view.owner) == ([0, 2], ["merger-0", "merger-0"])
    assert (view.merges, view.merged) == (2, 3)
    # Dropped in merges and in the stop record.
    assert view.dropped == {"superseded": 2, "too_stale": 1}
    assert view.dropped_text() == "dropped 3 (superseded 2, too_stale 1)"
    assert view.global_text() == "global held-out 2.750 at versions [0, 2]"


def test_view_reads_a_torn_line_once_it_is_complete(view, tmp_path):
    with open(tmp_path / "learner-0" / "metrics.jsonl", "a") as f:
        f.write(', "t": 25.0}\n')
    view.update()
    assert view.learners["learner-0"]["step"] == 40


def test_run_config_names_the_run(tmp_path):
    def written(text, overrides=()):
        source, out = tmp_path / "in.toml", tmp_path / "out.toml"
        source.write_text(text)
        run_local.write_run_config(str(source), list(overrides), "demo-1", str(out))
        header, *body = out.read_text().splitlines()
        return header, body

    header, body = written('[run]\nid = "demo"\nseed = 1\n', ["merger.quorum=2"])
    assert header.endswith("as run by scripts/run-local with --set merger.quorum=2")
    assert body == ["[run]", 'id = "demo-1"  # set by scripts/run-local', "seed = 1"]
    assert written("[run]\nseed = 1\n")[1] == ["[run]", 'id = "demo-1"  # set by scripts/run-local', "seed = 1"]
    assert written("[model]\nlayers = 2\n")[1] == ["[run]", 'id = "demo-1"  # set by scripts/run-local', "",
                                                   "[model]", "layers = 2"]


def test_cluster_shape_command_line_over_config():
    config = {"cluster": {"learners": 3, "regions": ["eu", "us"], "mergers": 1, "speed_factors": [1, 2],
                          "eval_interval": 5}}
    plain = types.SimpleNamespace(learners=None, regions=None, mergers=None, speed_factors=None)
    assert run_local.cluster_shape(config, plain) == (3, ["eu", "us"], 1, [1.0, 2.0], 5.0)
    given = types.SimpleNamespace(learners=4, regions="a,b,c", mergers=2, speed_factors="1,1,1,3")
    assert run_local.cluster_shape(config, given) == (4, ["a", "b", "c"], 2, [1.0, 1.0, 1.0, 3.0], 5.0)


def test_durations_and_sizes():
    assert [run_local.duration(s) for s in (None, 59.9, 61, 3600)] == ["?", "59s", "1m01s", "60m00s"]
    assert run_local.megabytes(1_234_567) == "1.23 MB"
