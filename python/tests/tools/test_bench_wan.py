"""bench/wan's measurements of a run folder written here by hand: the time to a target loss (from the
first start and from the moment training began), bytes per token both ways, utilisation and
staleness. Expected values are worked out by hand in the comments."""
import types

import pytest

from decoupled_diloco.tools import bench_wan


@pytest.fixture
def run_dir(tmp_path, at, write_jsonl):
    def event(name, seconds, **fields):
        return {"event": name, "t": seconds, "time_us": at(seconds), **fields}

    write_jsonl(str(tmp_path / "learner-0" / "metrics.jsonl"), [
        event("start", 0),
        # Its first logged step at 5 s after 2 s of compute and 0.5 s of waiting: training began at 2.5 s.
        event("step", 5, step=10, compute_seconds=2.0, wait_seconds=0.5, tokens=100),
        event("step", 16, step=20, compute_seconds=6.0, wait_seconds=0.5, tokens=200),
        event("stop", 25, tokens=1000, compute_seconds=12.0, wait_seconds=1.0),
        event("shutdown", 25.5, bytes_sent=2000, bytes_received=3000, kafka_sent=500, kafka_received=700),
    ])
    write_jsonl(str(tmp_path / "learner-1" / "metrics.jsonl"), [
        event("start", 1),
        event("step", 4, step=10, compute_seconds=1.0, tokens=100),  # began at 3 s
        event("step", 14, step=20, compute_seconds=5.0, tokens=200),
        event("stop", 24, tokens=1000, compute_seconds=15.0, wait_seconds=2.0),
        event("shutdown", 24.5, bytes_sent=1000, bytes_received=2000, kafka_sent=300, kafka_received=500),
    ])
    write_jsonl(str(tmp_path / "eval" / "metrics.jsonl"), [
        event("global_eval", 10, eval_loss=2.6), event("global_eval", 15, eval_loss=2.29),
        event("global_eval", 20, eval_loss=2.35),
    ])
    write_jsonl(str(tmp_path / "merger-0" / "metrics.jsonl"), [
        event("merge", 8, inputs=[{"staleness": 0}, {"staleness": 2}]),
        event("merge", 12, inputs=[{"staleness": 1}]),
    ])
    return str(tmp_path)


def test_time_to_target(run_dir):
    m = bench_wan.measure(run_dir, 2.3)
    # 2.29 at 15 s is the first evaluation at or below 2.3; the first start was at 0 s, training
    # began at 2.5 s (learner-0: 5 - 2 - 0.5).
    assert (m["seconds_to_target"], m["training_seconds_to_target"], m["startup_seconds"]) == (15.0, 12.5, 2.5)
    assert (m["final_loss"], m["best_loss"]) == (2.35, 2.29)
    assert m["curve"] == [[10.0, 2.6], [15.0, 2.29], [20.0, 2.35]]


def test_a_target_not_reached(run_dir):
    m = bench_wan.measure(run_dir, 2.0)
    assert (m["seconds_to_target"], m["training_seconds_to_target"]) == (None, None)


def test_bytes_per_token_and_utilisation(run_dir):
    m = bench_wan.measure(run_dir, 2.3)
    assert (m["tokens"], m["bytes_up"], m["bytes_down"]) == (2000, 3000, 5000)
    # 3,000 / 2,000 up, 5,000 / 2,000 down; the sockets: (800 + 1,200) of Kafka + 5,000 received.
    assert (m["bytes_per_token_up"], m["bytes_per_token_down"], m["socket_bytes_per_token"]) == (1.5, 2.5, 3.5)
    # Compute from the first logged step to the stop: (12 - 2) + (15 - 1) = 24 s over (25 - 5) +
    # (24 - 4) = 40 s of wall time; waiting 1 + 2 s.
    assert (m["compute_seconds"], m["training_wall_seconds"], m["utilisation"], m["wait_seconds"]) == (24.0, 40.0, 0.6, 3.0)


def test_staleness_and_inputs_per_merge(run_dir):
    m = bench_wan.measure(run_dir, 2.3)
    assert (m["merges"], m["inputs_per_merge"], m["staleness_mean"], m["staleness_max"]) == (2, 1.5, 1.0, 2)


def test_no_learner_started(tmp_path):
    assert bench_wan.measure(str(tmp_path), 2.3) == {"error": "no learner started"}


def test_each_mode_runs_the_overrides_of_its_quality_row():
    # Synchronous DiLoCo waits for both learners: the row's "{M}" becomes 2.
    assert "merger.quorum=2" in bench_wan.overrides_of("sync")
    assert "diloco.H=1" in bench_wan.overrides_of("perstep")
    assert "codec.topk=96" in bench_wan.overrides_of("sparse")


def test_tokens_to_target_and_the_learners_times(run_dir):
    m = bench_wan.measure(run_dir, 2.3)
    # Reached at 15 s: learner-0's last step by then is at 5 s (100 tokens), learner-1's at 14 s (200).
    assert m["tokens_to_target"] == 300
    # The last stop at 25 s; learner-0 ran 0-25 s, learner-1 1-24 s.
    assert (m["last_stop_seconds"], m["learner_seconds_max"]) == (25.0, 25.0)
    assert "tokens_to_target" not in bench_wan.measure(run_dir, 2.0)


def test_deep_target_is_the_best_loss_by_a_share_of_the_training_time(run_dir):
    m = bench_wan.measure(run_dir, 2.3)
    # Training from 2.5 s to the last stop at 25 s: 0.8 of it ends at 2.5 + 0.8 * 22.5 = 20.5 s, by when
    # the evaluations were 2.6, 2.29, 2.35; 0.5 of it ends at 13.75 s, when only 2.6 was.
    assert bench_wan.deep_target(m, 0.8) == (2.29, 20.5)
    assert bench_wan.deep_target(m, 0.5) == (2.6, 13.75)
    assert bench_wan.deep_target(dict(m, curve=[[30.0, 2.0]]), 0.8) == (None, None)
    assert bench_wan.deep_target({"curve": []}, 0.8) == (None, None)


def args_of(**extra):
    base = dict(config="configs/tiny.toml", steps=400, max_seconds=1200, speed_factors=[1.0, 2.0], eval_interval=1.0,
                seed=3, set=["merger.grace_tau=3"], mode_sets={"decoupled": ["merger.outer_momentum=0.7"]})
    base.update(extra)
    return types.SimpleNamespace(**base)


def option(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_a_time_budget_lifts_the_step_budget_but_keeps_the_schedule():
    cmd = bench_wan.command(args_of(), "decoupled", "2860kbit", "/tmp/r", time_budget=31.25)
    assert (option(cmd, "--max-seconds"), option(cmd, "--steps")) == ("31.2", str(400 * bench_wan.UNBOUNDED_STEPS))
    assert option(cmd, "--speed-factors") == "1,2"
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
    assert "train.total_steps=400" in sets and "run.seed=3" in sets
    # --set, then the mode's own --mode-set last (it wins)
    assert sets[-2:] == ["merger.grace_tau=3", "merger.outer_momentum=0.7"]
    cmd = bench_wan.command(args_of(), "sync", "2860kbit", "/tmp/r")
    assert (option(cmd, "--max-seconds"), option(cmd, "--steps")) == ("1200", "400")
    assert "merger.outer_momentum=0.7" not in cmd


def test_single_is_one_learner_with_decoupleds_settings_at_the_first_speed():
    cmd = bench_wan.command(args_of(), "single", "2860kbit", "/tmp/r")
    assert (option(cmd, "--learners"), option(cmd, "--regions"), option(cmd, "--speed-factors")) == ("1", "eu", "1")
    assert "merger.quorum=1" in bench_wan.overrides_of("single")
    assert bench_wan.overrides_of("single") == bench_wan.overrides_of("decoupled")


def test_mode_sets_are_checked():
    assert bench_wan.parse_mode_sets(["sync:merger.outer_lr=1", "sync:merger.outer_momentum=0.7"], ["sync"]) == \
        {"sync": ["merger.outer_lr=1", "merger.outer_momentum=0.7"]}
    for bad in ["merger.outer_lr=1", "nomode:a=1", "sync:no_value"]:
        with pytest.raises(SystemExit):
            bench_wan.parse_mode_sets([bad], ["sync"])


def test_a_deep_target_read_off_the_curve_is_reached_where_the_curve_has_it(run_dir, at, write_jsonl):
    # The evaluator's 2.29004 is 2.29 on the curve; the deep target taken from the curve is 2.29,
    # and the run reaches it at that evaluation (15 s), not at a later, lower one.
    write_jsonl(run_dir + "/eval/metrics.jsonl", [
        {"event": "global_eval", "t": 10, "time_us": at(10), "eval_loss": 2.6},
        {"event": "global_eval", "t": 15, "time_us": at(15), "eval_loss": 2.29004},
        {"event": "global_eval", "t": 20, "time_us": at(20), "eval_loss": 2.2}])
    m = bench_wan.measure(run_dir, 2.3)
    # 0.6 of the training time (2.5 s to 25 s) ends at 16 s: the evaluations by then are 2.6 and 2.29.
    assert bench_wan.deep_target(m, 0.6) == (2.29, 16.0)
    target = 2.29
    assert bench_wan.measure(run_dir, target)["seconds_to_target"] == 15.0


@pytest.mark.parametrize("argv, message", [
    (["--speed-factors", "1,x"], "expected numbers >= 1"),
    (["--speed-factors", "1,0.5"], "each factor must be >= 1"),
    (["--deep-target", "0", "--modes", "sync,decoupled"], "expected a fraction in (0, 1]"),
    (["--deep-target", "1.5", "--modes", "sync,decoupled"], "expected a fraction in (0, 1]"),
    (["--deep-target", "0.8", "--modes", "decoupled,single"], "add sync to --modes"),
])
def test_bad_speed_factors_and_deep_targets_are_refused_before_anything_runs(tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        bench_wan.main([*argv, "--out", str(tmp_path / "out")])
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_learner_started_again_counts_from_its_first_start_to_its_last_stop(tmp_path, at, write_jsonl):
    def event(name, seconds, **fields):
        return {"event": name, "t": seconds, "time_us": at(seconds), **fields}

    write_jsonl(str(tmp_path / "learner-0" / "metrics.jsonl"), [
        event("start", 0), event("step", 5, step=10, compute_seconds=4.0, tokens=100),
        event("stop", 10, tokens=200, compute_seconds=8.0),  # killed and started again at 12 s
        event("start", 12), event("step", 15, step=30, compute_seconds=10.0, tokens=300),
        event("stop", 30, tokens=600, compute_seconds=24.0),
    ])
    write_jsonl(str(tmp_path / "eval" / "metrics.jsonl"), [event("global_eval", 20, eval_loss=2.0)])
    m = bench_wan.measure(str(tmp_path), 2.3, learners=1)
    # From its first start (0 s) to its last stop (30 s); tokens and compute of the last stop, the
    # training phase from its first logged step (5 s, 4 s of compute): 24 - 4 = 20 s in 30 - 5 = 25 s.
    assert (m["learner_seconds_max"], m["last_stop_seconds"]) == (30.0, 30.0)
    assert (m["tokens"], m["compute_seconds"], m["training_wall_seconds"], m["utilisation"]) == (600, 20.0, 25.0, 0.8)
