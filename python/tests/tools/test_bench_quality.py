"""bench/quality's arithmetic: parallel efficiency and the gap to synchronous DiLoCo, the summary's
tables, a cluster run's and a standalone run's result from hand-made run folders, the mean curve
over seeds and the plan of runs. Expected values are worked out by hand in the comments."""
import json
import os
import types

import pytest

from decoupled_diloco.tools import bench_quality as quality

DECOUPLED = "Decoupled K=1+grace (int4, aligned) nesterov"
# The config by its full path: ctest runs these tests from its build folder.
TINY = os.path.join(quality.repository.root(), "configs", "tiny.toml")


def test_parallel_efficiency_is_the_share_of_the_gain_recovered():
    # One learner 2.0, one learner with M x the steps 1.5: a row at 1.75 recovers half of the 0.5.
    assert quality.parallel_efficiency(2.0, 1.5, 1.75) == pytest.approx(0.5)
    assert quality.parallel_efficiency(2.0, 1.5, 1.5) == pytest.approx(1.0)
    assert quality.parallel_efficiency(2.0, 1.5, 2.25) == pytest.approx(-0.5)
    assert quality.parallel_efficiency(2.0, 2.0, 1.75) is None
    assert quality.parallel_efficiency(None, 1.5, 1.75) is None


def test_gap_to_sync_is_relative_in_percent():
    assert quality.gap_to_sync_percent(2.0, 1.6) == pytest.approx(25.0)
    assert quality.gap_to_sync_percent(1.2, 1.6) == pytest.approx(-25.0)
    assert quality.gap_to_sync_percent(1.2, None) is None
    assert quality.gap_to_sync_percent(1.2, 0) is None


def result(row, seed, kind, final_loss, **extra):
    return dict(row=row, M=2, seed=seed, kind=kind, ok=True, final_loss=final_loss, overrides=[], **extra)


def test_summary_tables(tmp_path):
    results = [
        result("one learner", 1, "standalone", 2.1), result("one learner", 2, "standalone", 2.3),
        result("one learner x M steps", 1, "standalone", 1.8),
        result("data parallel (batch M x b, lr x1)", 1, "standalone", 1.85, bytes_per_token=48.0,
               downlink_bytes_per_token=48.0, bytes_computed=True),
        result("data parallel (batch M x b, lr x1)", 2, "standalone", 1.95, bytes_per_token=48.0,
               downlink_bytes_per_token=48.0, bytes_computed=True),
        result("data parallel (batch M x b, lr x1.4)", 1, "standalone", 1.75),
        result("data parallel (batch M x b, lr x1.4)", 2, "standalone", 1.85),
        result("sync DiLoCo (fp32)", 1, "cluster", 1.9),
        result(DECOUPLED, 1, "cluster", 1.95, wall_seconds=90, merges=10, inputs_per_merge_mean=1.5,
               inputs_per_merge_hist={"1": 3, "2": 7}, deltas_merged=15, deltas_dropped={"superseded": 2},
               bytes_sent=1e6, bytes_received=4e6, tokens=1000, bytes_per_token=1000, downlink_bytes_per_token=4000,
               utilisation=0.9),
        result(DECOUPLED, 2, "cluster", 2.05, wall_seconds=110, merges=20, inputs_per_merge_mean=2.5,
               inputs_per_merge_hist={"1": 1, "2": 9}, deltas_merged=45, deltas_dropped={"superseded": 4},
               bytes_sent=3e6, bytes_received=6e6, tokens=1000, bytes_per_token=3000, downlink_bytes_per_token=6000,
               utilisation=0.8),
    ]
    args = types.SimpleNamespace(out=str(tmp_path), bin_dir="/bin", config=TINY,
                                 steps=400, seeds=[1, 2], set=[], decoupled_set=[], unset=[])
    info = dict(command="bench/quality", date="today", loadavg=(1.0, 1.0, 1.0),
                machine=dict(uname="x", nproc="2", cpu="cpu", commit="abc", dirty=False))
    quality.write_summary(args, results, info, [], complete=True)
    with open(tmp_path / "summary.md") as f:
        text = f.read()
    # The Decoupled row, means over its two seeds: loss (1.95 + 2.05) / 2, wall (90 + 110) / 2,
    # merges 15, inputs per merge (1.5 + 2.5) / 2 with the histograms added, deltas merged 30,
    # dropped 6 over 2 runs, bytes 2 MB up and 5 MB down, 1 k tokens, 2,000 and 5,000 bytes per
    # token, utilisation 0.85.
    assert ("| 2 | Decoupled K=1+grace (int4, aligned) nesterov | 2 | **2.000** (1.950, 2.050) | 100 | 15 "
            "| 2.00 (1:4 2:16) | 30 | superseded 3 | 2.00 MB | 5.00 MB | 1.00 k | 2000.00 | 5000.00 | 0.850 |") in text
    # Data parallel's bytes are computed: shown with a star; the rows without them as `-`.
    assert "| 2 | data parallel (batch M x b, lr x1) | 2 | **1.900** (1.850, 1.950) | - | - | - | - | - | - | - " \
           "| - | 48.00* | 48.00* | - |" in text
    # L_1 = (2.1 + 2.3) / 2 = 2.2, L_1xM = 1.8, L_DP = 1.8 (lr x1.4: (1.75 + 1.85) / 2, below x1's
    # 1.9): sync DiLoCo at 1.9 recovers 0.3 / 0.4 of both gains and is the reference; Decoupled at
    # 2.0 recovers 0.2 / 0.4 and is (2.0 - 1.9) / 1.9 = 5.26 % above it.
    assert "| 2 | (L_1 = 2.200, L_1xM = 1.800, L_DP = 1.800: data parallel (batch M x b, lr x1.4)) | | | | |" in text
    assert "| 2 | data parallel (batch M x b, lr x1) | 1.900 | 0.75 | 0.75 | +0.00 % |" in text
    assert "| 2 | data parallel (batch M x b, lr x1.4) | 1.800 | 1.00 | 1.00 | -5.26 % |" in text
    assert "| 2 | sync DiLoCo (fp32) | 1.900 | 0.75 | 0.75 | +0.00 % |" in text
    assert "| 2 | Decoupled K=1+grace (int4, aligned) nesterov | 2.000 | 0.50 | 0.50 | +5.26 % |" in text


def test_cluster_result_from_a_run_folder(tmp_path, at, write_jsonl):
    run = tmp_path / "run"
    write_jsonl(str(run / "learner-0" / "metrics.jsonl"), [
        {"event": "start", "time_us": at(0)},
        {"event": "step", "step": 10, "tokens": 100, "time_us": at(10)},
        {"event": "step", "step": 20, "tokens": 200, "time_us": at(20)},
        {"event": "stop", "step": 20, "tokens": 200, "wait_seconds": 1.0, "compute_seconds": 15.0, "time_us": at(21)},
        {"event": "shutdown", "bytes_sent": 5000, "bytes_received": 7000, "time_us": at(21.5)},
    ])
    write_jsonl(str(run / "learner-1" / "metrics.jsonl"), [
        {"event": "start", "time_us": at(1)},
        {"event": "step", "step": 10, "tokens": 100, "time_us": at(11)},
        {"event": "stop", "step": 10, "tokens": 100, "wait_seconds": 3.0, "compute_seconds": 5.0, "time_us": at(13)},
        {"event": "shutdown", "bytes_sent": 3000, "bytes_received": 1000, "time_us": at(13.5)},
    ])
    write_jsonl(str(run / "eval" / "metrics.jsonl"), [
        {"event": "global_eval", "eval_loss": 2.5, "versions": [1, 1], "time_us": at(15)},
        {"event": "global_eval", "eval_loss": 2.0, "versions": [2, 1], "time_us": at(22)},
    ])
    write_jsonl(str(run / "merger-0" / "metrics.jsonl"), [
        {"event": "merge", "inputs": [{}, {}], "dropped": [{"reason": "superseded"}]},
        {"event": "merge", "inputs": [{}], "dropped": []},
        {"event": "merge", "inputs": [{}, {}]},
        {"event": "stop_record", "held": 1},
    ])
    with open(run / "run.json", "w") as f:
        f.write('{"stop_reason": "budget reached", "exit_codes": {"learner-0": 0}}')

    r = quality.cluster_result(types.SimpleNamespace(dir=str(run)))
    assert r["final_loss"] == 2.0 and r["final_versions"] == [2, 1]
    assert (r["merges"], r["deltas_merged"], r["inputs_per_merge_hist"]) == (3, 5, {"1": 1, "2": 2})
    assert r["inputs_per_merge_mean"] == pytest.approx(5 / 3)
    assert (r["deltas_dropped"], r["deltas_held_at_stop"]) == ({"superseded": 1}, 1)
    # 5,000 + 3,000 bytes up, 7,000 + 1,000 down, over 200 + 100 tokens.
    assert (r["bytes_sent"], r["bytes_received"], r["tokens"]) == (8000, 8000, 300)
    assert r["bytes_per_token"] == pytest.approx(8000 / 300)
    assert r["downlink_bytes_per_token"] == pytest.approx(8000 / 300)
    # Compute 15 + 5 s, waiting 1 + 3 s.
    assert (r["compute_seconds"], r["wait_seconds"]) == (20.0, 4.0)
    assert r["utilisation"] == pytest.approx(20 / 24)
    # learner-0 ran 0 to 21 s, learner-1 1 to 13 s.
    assert (r["learner_steps"], r["learner_seconds"]) == ([20, 10], 21.0)
    assert (r["stop_reason"], r["exit_codes"]) == ("budget reached", {"learner-0": 0})
    # At 15 s learner-0 is halfway from step 10 to 20 (150 tokens), learner-1 past its stop at step
    # 10 (100 tokens): mean step 12.5, 250 tokens. At 22 s: steps 20 and 10, 300 tokens.
    assert r["curve"] == [dict(step=12.5, tokens=250, loss=2.5, versions=[1, 1]),
                          dict(step=15, tokens=300, loss=2.0, versions=[2, 1])]


def test_standalone_result_takes_the_eval_at_the_last_step(tmp_path, at, write_jsonl):
    run = tmp_path / "run"
    write_jsonl(str(run / "metrics.jsonl"), [
        {"event": "start", "time_us": at(0)},
        {"event": "eval", "step": 50, "tokens": 500, "eval_loss": 3.0, "time_us": at(5)},
        {"event": "eval", "step": 100, "tokens": 1000, "eval_loss": 2.5, "time_us": at(10)},
        {"event": "stop", "step": 100, "tokens": 1000, "wait_seconds": 0.0, "compute_seconds": 9.0, "time_us": at(12)},
    ])
    r = quality.standalone_result(types.SimpleNamespace(dir=str(run), steps=100))
    assert r["final_loss"] == 2.5
    assert (r["tokens"], r["bytes_per_token"], r["utilisation"], r["learner_seconds"]) == (1000, 0.0, 1.0, 12.0)
    assert r["curve"] == [dict(step=50, tokens=500, loss=3.0), dict(step=100, tokens=1000, loss=2.5)]
    # The budget was 200 steps: no eval at the last step, no final loss.
    assert quality.standalone_result(types.SimpleNamespace(dir=str(run), steps=200))["final_loss"] is None


def test_mean_curve_over_seeds_on_the_range_all_cover():
    a = [dict(step=0, loss=4.0), dict(step=10, loss=2.0)]
    b = [dict(step=2, loss=3.0), dict(step=12, loss=1.0)]
    xs, ys = quality.mean_curve([a, b], "step", points=5)
    assert xs == pytest.approx([2, 4, 6, 8, 10])
    # At 2: a = 3.6, b = 3.0; at 6: 2.8 and 2.2; at 10: 2.0 and 1.4.
    assert [ys[0], ys[2], ys[4]] == pytest.approx([3.3, 2.5, 1.7])


def test_eval_every_divides_the_steps_near_a_tenth():
    assert quality.eval_every(800) == 80
    assert quality.eval_every(100) == 10
    assert quality.eval_every(7) == 1


def test_plan_runs_the_homogeneous_reference_before_the_half_speed_row(tmp_path):
    args = types.SimpleNamespace(m=[2, 4], seeds=[1, 2], steps=100, rows="half speed", quick=False, out=str(tmp_path),
                                 set=["model.layers=1"], decoupled_set=["merger.grace_tau=3"], unset=[],
                                 config="tiny.toml", bin_dir="/bin")
    reference, half_speed = quality.plan(args)
    # Only at M = 4, one seed (not a headline row), its reference inserted just before it.
    assert (reference.name, reference.m, reference.seed) == (DECOUPLED, 4, 1)
    assert (half_speed.name, half_speed.m, half_speed.seed) == ("Decoupled, one learner at half speed", 4, 1)
    assert half_speed.reference is reference
    # Its step budget is far away (the time budget stops it); its schedule is S steps.
    assert (half_speed.steps, half_speed.schedule_steps) == (1000, 100)
    assert half_speed.overrides[:2] == quality.CLUSTER_COMMON
    assert half_speed.overrides[-4:] == ["merger.grace_tau=3", "train.total_steps=100", "run.seed=1", "model.layers=1"]
    command = half_speed.command()
    assert command[1:3] == ["-m", "decoupled_diloco.tools.run_local"]
    assert command[command.index("--speed-factors") + 1] == "1,1,1,2"


def test_share_of_data_parallels_gain():
    # One learner 2.0, data parallel 1.6: a row at 1.7 recovers 0.3 of the 0.4.
    assert quality.share_of_dp_gain(2.0, 1.6, 1.7) == pytest.approx(0.75)
    assert quality.share_of_dp_gain(2.0, 1.6, 2.1) == pytest.approx(-0.25)
    assert quality.share_of_dp_gain(2.0, 2.0, 1.7) is None
    assert quality.share_of_dp_gain(2.0, None, 1.7) is None


def test_allreduce_bytes_per_token():
    # 120,000 parameters, M = 2, batch 16 per learner, context 64: each learner sends
    # 2 x 1/2 x 4 x 120,000 = 480,000 bytes a step, both 960,000, for 2 x 16 x 64 = 2,048 tokens.
    assert quality.allreduce_bytes_per_token(120_000, 2, 16, 64) == pytest.approx(468.75)
    # M = 4: 2 x 3/4 x 4 x 120,000 = 720,000 each, 2,880,000 for 4,096 tokens.
    assert quality.allreduce_bytes_per_token(120_000, 4, 16, 64) == pytest.approx(703.125)
    assert quality.allreduce_bytes_per_token(None, 2, 16, 64) is None
    assert quality.allreduce_bytes_per_token(120_000, 1, 16, 64) is None


def test_plan_has_the_data_parallel_grid_at_m_times_the_batch(tmp_path):
    args = types.SimpleNamespace(m=[2, 4], seeds=[1, 2], steps=100, rows="data parallel", quick=False,
                                 out=str(tmp_path), set=["train.lr=0.01"], decoupled_set=[], unset=[],
                                 config=TINY, bin_dir="/bin")
    runs = quality.plan(args)
    # Five learning rates, a headline row each (both seeds), at M = 2 and 4.
    assert len(runs) == 2 * 5 * 2
    by = {(r.m, r.name, r.seed): r for r in runs}
    # configs/tiny.toml has batch 16; --set train.lr=0.01 is the base of the grid, set after it.
    x14 = by[(2, "data parallel (batch M x b, lr x1.4)", 1)]
    assert x14.kind == "standalone" and x14.steps == 100
    # Its 8 held-out batches of 16 become 4 of 32: the same 128 sequences.
    assert x14.overrides[-4:] == ["train.lr=0.01", "train.batch=32", "train.lr=0.014", "train.eval_batches=4"]
    x2 = by[(4, "data parallel (batch M x b, lr x2)", 2)]
    assert x2.overrides[-3:] == ["train.batch=64", "train.lr=0.02", "train.eval_batches=2"]
    assert "run.seed=2" in x2.overrides
    # Four times the batch: four times one learner's estimate per step.
    one = quality.Run(quality.ROWS[0], 4, 1, 100, args)
    assert x2.estimate() - quality.EST_STANDALONE_FIXED == pytest.approx(4 * (one.estimate() - quality.EST_STANDALONE_FIXED))


def test_data_parallel_needs_eval_batches_divisible_by_m(tmp_path):
    args = types.SimpleNamespace(m=[4], seeds=[1], steps=100, rows="data parallel", quick=False, out=str(tmp_path),
                                 set=["train.eval_batches=6"], decoupled_set=[], unset=[],
                                 config=TINY, bin_dir="/bin")
    with pytest.raises(SystemExit, match="eval_batches = 6 is not a multiple of M = 4"):
        quality.plan(args)


SYNC = "sync DiLoCo (fp32)"


def tune_args(tmp_path, **extra):
    base = dict(m=[2], seeds=[101, 102], steps=100, rows=None, quick=False, out=str(tmp_path), set=[],
                decoupled_set=["merger.grace_tau=3"], unset=[], config=TINY,
                bin_dir="/bin", tune=True, tuned_points=None)
    base.update(extra)
    return types.SimpleNamespace(**base)


def test_tune_runs_the_same_grid_for_every_tuned_mode(tmp_path):
    runs = quality.plan(tune_args(tmp_path))
    names = sorted({r.name for r in runs})
    # 4 learning rates x 5 momenta for each of the two modes, and data parallel's 5 learning rates.
    assert len(names) == 20 + 20 + 5
    assert len(runs) == 45 * 2  # every one on both tuning seeds
    point = next(r for r in runs if r.name == f"{DECOUPLED} [outer_lr=0.7 outer_momentum=0.8]" and r.seed == 102)
    assert "merger.outer_lr=0.7" in point.overrides and "merger.outer_momentum=0.8" in point.overrides
    assert "merger.grace_tau=3" in point.overrides  # a Decoupled row keeps --decoupled-set
    assert "merger.quorum=2" in next(r for r in runs if r.name.startswith(SYNC + " [")).overrides


def test_choose_tuned_takes_the_lowest_mean_of_complete_points():
    def res(row, seed, loss, ok=True):
        return dict(row=row, M=2, seed=seed, ok=ok, final_loss=loss)
    a, b = f"{SYNC} [outer_lr=0.5 outer_momentum=0.8]", f"{SYNC} [outer_lr=1 outer_momentum=0.9]"
    c = f"{DECOUPLED} [outer_lr=0.7 outer_momentum=0.9]"
    results = [res(a, 101, 2.0), res(a, 102, 2.2),        # mean 2.1
               res(b, 101, 1.9), res(b, 102, 2.1),        # mean 2.0: the best of sync DiLoCo
               res(c, 101, 1.5), res(c, 102, None, ok=False),  # a failed seed: cannot win
               res(quality.dp_name(1.4), 101, 1.8), res(quality.dp_name(1.4), 102, 1.8),
               res(quality.dp_name(2.0), 101, 1.7), res(quality.dp_name(2.0), 102, 1.75)]
    best = quality.choose_tuned(results)["2"]
    assert best[SYNC]["point"] == ["merger.outer_lr=1", "merger.outer_momentum=0.9"]
    assert best[SYNC]["loss"] == pytest.approx(2.0)
    assert DECOUPLED not in best
    assert best["data parallel"]["row"] == quality.dp_name(2.0)


def test_tuned_applies_each_modes_best_point(tmp_path):
    tuned = {"2": {SYNC: {"point": ["merger.outer_lr=1", "merger.outer_momentum=0.8"]},
                   "data parallel": {"row": quality.dp_name(2.0)}}}
    runs = quality.plan(tune_args(tmp_path, tune=False, tuned_points=tuned, seeds=[1]))
    sync = next(r for r in runs if r.name == SYNC)
    assert sync.overrides[-4:-2] == ["merger.outer_lr=1", "merger.outer_momentum=0.8"]
    # Decoupled was not tuned here: its row as it is.
    assert not any(o.startswith("merger.outer_lr") for o in next(r for r in runs if r.name == DECOUPLED).overrides)
    # Only data parallel's winning learning rate runs.
    assert [r.name for r in runs if r.name.startswith("data parallel")] == [quality.dp_name(2.0)]


def test_tuned_refuses_the_tuning_seeds(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text('{"seeds": [101, 102], "steps": 800, "best": {}}')
    with pytest.raises(SystemExit):
        quality.parse_args(["--tuned", str(path), "--seeds", "1,102", "--out", str(tmp_path / "out")])


def test_tuned_says_which_m_it_has_no_point_for(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    path.write_text('{"seeds": [101], "steps": 800, "best": {"2": {"sync DiLoCo (fp32)": '
                    '{"point": ["merger.outer_lr=1"]}}}}')
    args = quality.parse_args(["--tuned", str(path), "--m", "2,4", "--seeds", "1", "--out", str(tmp_path / "o")])
    assert args.tuned_points["2"]["sync DiLoCo (fp32)"]["point"] == ["merger.outer_lr=1"]
    out = capsys.readouterr().out
    assert "no tuned point for M = 4" in out and "M = 2:" not in out


def test_resume_takes_results_json_where_the_run_folders_were_pruned(tmp_path):
    args = tune_args(tmp_path)
    runs = quality.plan(args)
    kept, pruned, on_disk = runs[0], runs[1], runs[2]
    # results.json holds `kept` and `pruned` (no folder of either exists) and a reused copy of
    # `pruned` from another M, which must not shadow its own entry.
    entries = [dict(run_dir=os.path.relpath(kept.dir, args.out), final_loss=1.5, ok=True),
               dict(run_dir=os.path.relpath(pruned.dir, args.out), final_loss=1.6, ok=True),
               dict(run_dir=os.path.relpath(pruned.dir, args.out), final_loss=1.6, ok=True, M=4, reused=True)]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(info={}, runs=entries), f)
    os.makedirs(on_disk.dir)
    with open(on_disk.result_path(), "w") as f:
        json.dump(dict(final_loss=1.7, ok=True), f)

    args.kept_results = quality.kept_results(args.out)
    assert quality.load_result(kept)["final_loss"] == 1.5
    assert "reused" not in quality.load_result(pruned)
    assert quality.load_result(on_disk)["final_loss"] == 1.7
    assert quality.load_result(runs[3]) is None  # neither in results.json nor on disk
    args.kept_results = {}  # without --resume only the run folders count
    assert quality.load_result(kept) is None


def test_kept_results_of_a_folder_without_results_json_is_empty(tmp_path):
    assert quality.kept_results(str(tmp_path)) == {}
    (tmp_path / "results.json").write_text("not json")
    assert quality.kept_results(str(tmp_path)) == {}


def test_an_interrupted_resume_keeps_the_results_it_has_not_reached(tmp_path):
    args = tune_args(tmp_path, tune=False)
    args.kept_results = {"runs/M2/a-s101": dict(run_dir="runs/M2/a-s101", final_loss=1.5, ok=True),
                         "runs/M2/b-s101": dict(run_dir="runs/M2/b-s101", final_loss=1.6, ok=True)}
    done = [dict(run_dir="runs/M2/a-s101", final_loss=1.5, ok=True), dict(run_dir="runs/M2/c-s101", final_loss=1.7, ok=True)]
    quality.write_results_json(args, done, dict(command="bench/quality", date="now"), complete=False)
    with open(os.path.join(args.out, "results.json")) as f:
        written = json.load(f)["runs"]
    # a and c as run, and b, which this invocation had not reached, from the earlier results.json
    assert sorted(r["run_dir"] for r in written) == ["runs/M2/a-s101", "runs/M2/b-s101", "runs/M2/c-s101"]


def test_lever_trial_runs_tuned_points_on_the_tuning_seeds_and_only_with_tuned(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text('{"seeds": [101, 102], "steps": 800, "best": {"2": {}}}')
    args = quality.parse_args(["--tuned", str(path), "--lever-trial", "--seeds", "101,102", "--m", "2",
                               "--steps", "800", "--out", str(tmp_path / "out")])
    assert args.seeds == [101, 102] and args.lever_trial
    with pytest.raises(SystemExit):
        quality.parse_args(["--lever-trial", "--seeds", "101", "--out", str(tmp_path / "out")])
    # A bad tuned.json is named in a clear error, not a traceback.
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        quality.parse_args(["--tuned", str(tmp_path / "bad.json"), "--seeds", "1", "--out", str(tmp_path / "out")])


def test_rows_mean_the_same_codec_on_a_config_with_sparse_deltas(tmp_path):
    # configs/demo.toml sends top-k 96 of blocks of 1024: an fp32 row that kept its top-k was
    # refused by the binaries ("codec.topk = 96 needs an int8 or int4 codec"), and a dense int4 row
    # sent the sparse form. Each row's codec, as the last --set of each key leaves it:
    demo = os.path.join(quality.repository.root(), "configs", "demo.toml")
    args = types.SimpleNamespace(m=[2], seeds=[1], steps=100, rows="", quick=False, out=str(tmp_path), set=[],
                                 decoupled_set=[], unset=[], config=demo, bin_dir="/bin")
    by = {r.name: dict(o.split("=", 1) for o in r.overrides) for r in quality.plan(args)}
    for name in ("sync DiLoCo (fp32)", "per-step sync avg (fp32)"):
        assert (by[name]["codec.dtype"], by[name]["codec.topk"], by[name]["codec.downlink_topk"]) == ("fp32", "0", "0")
    for name in ("sync DiLoCo (int4)", DECOUPLED, "Decoupled avg rule"):
        codec = by[name]
        assert (codec["codec.dtype"], codec["codec.topk"], codec["codec.block_size"]) == ("int4", "0", "64")
        assert (codec["codec.downlink_dtype"], codec["codec.downlink_block_size"]) == ("int4", "64")
    sparse = by[quality.SPARSE_ROW]
    assert (sparse["codec.topk"], sparse["codec.block_size"], sparse["merger.optimizer"]) == ("96", "1024", "sgd")
    assert by["Decoupled staggered"]["codec.downlink_dtype"] == "fp32"
