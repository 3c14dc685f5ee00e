"""bench/chaos's seeds, failure rates, commands and summary, on results written here by hand."""
import types

import pytest

from decoupled_diloco.tools import bench_chaos


def test_seeds_take_ranges_and_lists():
    assert bench_chaos.seeds("1-3,7") == [1, 2, 3, 7]
    assert bench_chaos.seeds("4") == [4]


def test_down_share_of_a_rate():
    # "high": learners killed 8 s of every 45 + 8, paused 5 of every 90 + 5, stopped with SIGTERM
    # 5 of every 60 + 5.
    assert bench_chaos.down_share("high") == pytest.approx(8 / 53 + 5 / 95 + 5 / 65)


def args(**extra):
    fields = dict(config="configs/tiny.toml", seconds=120, learners=3, mergers=1, nodes=1, learner_evals=False,
                  set=[], rates=["high"], modes=["decoupled", "sync"])
    return types.SimpleNamespace(**{**fields, **extra})


def test_command_of_a_run():
    cmd = bench_chaos.command(args(set=["merger.quorum=2"]), "low", "sync", 5, "/tmp/run")
    options = dict(zip(cmd[2::2], cmd[3::2]))
    assert cmd[1] == "configs/tiny.toml"
    assert (options["--seed"], options["--learner-mtbf"], options["--learner-mttr"]) == ("5", "120", "8")
    assert (options["--merger-mtbf"], options["--broker-mttr"]) == ("120", "8")
    assert "--sync" in cmd
    # Learners' own evals off first, so that --set can put them back.
    assert cmd[-4:] == ["--set", "train.eval_every=0", "--set", "merger.quorum=2"]


def test_summary_rows_and_means():
    def run(seed, **result):
        return {"rate": "high", "mode": "decoupled", "seed": seed, "result": result}
    results = [
        run(1, ok=True, goodput=0.6, goodput_of_available=0.75, longest_stall_seconds=4.0, final_loss=2.0,
            checks={"audit": True, "verify": True}, faults=5, merges=40, deltas={"merged": 30, "sent": 32}),
        run(2, ok=False, goodput=0.8, goodput_of_available=0.85, longest_stall_seconds=6.0, final_loss=2.5,
            checks={"audit": True, "verify": False}),
        {"rate": "high", "mode": "decoupled", "seed": 3, "error": "no chaos.json: gone"},
    ]
    info = dict(command="bench/chaos", date="today", machine="x", commit="abc")
    text = bench_chaos.summary(args(modes=["decoupled"]), results, info)
    assert "| high | decoupled | 1 | pass | 5 | 0.600 | 0.750 |" in text
    assert "| high | decoupled | 2 | FAIL: verify |" in text
    assert "| high | decoupled | 3 | no result (no chaos.json: gone) |" in text
    # Means over the two runs with a result: goodput (0.6 + 0.8) / 2, of up time (0.75 + 0.85) / 2,
    # stall (4 + 6) / 2, loss (2.0 + 2.5) / 2; one of the two passed every check.
    assert "| high | decoupled | 2 | 1/2 | 0.700 | 0.800 | 5.0 | 2.250 |" in text
