"""bench/session_overhead's arithmetic: the steady-state window and step rate of a run's step
events, CPU per step from /proc samples interpolated at the window's ends, what the session did in
the window, and the ratios session / standalone per pair. Expected values are worked out by hand
in the comments."""
import pytest

from decoupled_diloco.tools import bench_session_overhead as overhead
from decoupled_diloco.tools.run_local import read_jsonl


def session_step(step, seconds, at, adopted, sent, received):
    return {"event": "step", "step": step, "t": seconds, "time_us": at(seconds), "adopted": adopted, "bytes_sent": sent,
            "bytes_received": received, "versions": [adopted, adopted, 0, 0]}


def test_steady_rate_skips_the_start(at):
    events = [{"event": "start", "t": 0.0, "time_us": at(0)}] + [
        {"event": "step", "step": step, "t": seconds, "time_us": at(seconds)}
        for step, seconds in [(10, 1.0), (20, 2.0), (30, 3.0), (40, 3.5), (50, 4.5), (60, 5.0)]]
    first, last = overhead.steady_window(events, skip=20)
    # From step 20 (2.0 s) to step 60 (5.0 s): 40 steps in 3 s.
    assert (first["step"], last["step"]) == (20, 60)
    assert overhead.steps_per_second(first, last) == pytest.approx(40 / 3)
    # The wall clock jumps 10 s ahead over a pause of the machine; the monotonic "t" does not.
    last = dict(last, time_us=last["time_us"] + 10_000_000)
    assert overhead.steps_per_second(first, last) == pytest.approx(40 / 3)
    with pytest.raises(ValueError, match="fewer than two step events"):
        overhead.steady_window(events, skip=60)


def test_counter_interpolation(at):
    samples = [[at(1.0), 100], [at(2.0), 300], [at(4.0), -1]]
    # A quarter of the way from 1 s to 2 s: 100 + 0.25 * 200.
    assert overhead.counter_at(samples, 1, at(1.25)) == pytest.approx(150)
    assert overhead.counter_at(samples, 1, at(2.0)) == pytest.approx(300)
    assert overhead.counter_at(samples, 1, at(3.0)) is None  # unreadable at the later neighbour
    assert overhead.counter_at(samples, 1, at(0.5)) is None  # before the first sample


def test_a_session_run_measured_from_its_files(tmp_path, at, write_jsonl):
    metrics = write_jsonl(str(tmp_path / "metrics.jsonl"), [
        {"event": "start", "time_us": at(0)},
        session_step(10, 1.0, at, 0, 0, 0),
        {"event": "delta", "step": 10, "time_us": at(1.0)},
        session_step(20, 2.0, at, 1, 1000, 3000),
        {"event": "delta", "step": 20, "time_us": at(2.0)},
        {"event": "delta", "step": 30, "time_us": at(3.0)},
        session_step(30, 3.0, at, 2, 3000, 6000),
        {"event": "delta", "step": 40, "time_us": at(4.5)},
        session_step(40, 4.5, at, 4, 5000, 9000),
        {"event": "stop", "step": 40, "time_us": at(4.6)},
        {"event": "shutdown", "delivered": 4, "superseded": 0, "bytes_sent": 6000, "bytes_received": 9000,
         "kafka_sent": 7000, "kafka_received": 500, "time_us": at(4.7)},
    ])
    # Samples at 1.5, 2.5, 3.5 and 5 s. Training thread 0.8 CPU, its run-queue wait 0.1 s/s, the
    # learner process 90 ticks/s, the merger unreadable at the first sample, the broker 10 ticks/s,
    # the machine 200 ticks/s (2 busy CPUs).
    cpu = tmp_path / "cpu.tsv"
    cpu.write_text("\t".join(overhead.COLUMNS) + "\n" + "".join(
        "\t".join(map(str, row)) + "\n" for row in [
            [at(1.5), 800_000_000, 150_000_000, 135, -1, 100, 300],
            [at(2.5), 1_600_000_000, 250_000_000, 225, 10, 110, 500],
            [at(3.5), 2_400_000_000, 350_000_000, 315, 12, 120, 700],
            [at(5.0), 3_600_000_000, 500_000_000, 450, 15, 135, 1000]]))
    m = overhead.measure(read_jsonl(metrics), overhead.read_samples(str(cpu)), skip=20, hz=100)
    # Window: step 20 at 2.0 s to step 40 at 4.5 s: 20 steps in 2.5 s, 8 steps/s, 125 ms a step.
    assert (m["from_step"], m["to_step"], m["seconds"]) == (20, 40, pytest.approx(2.5))
    assert m["steps_per_s"] == pytest.approx(8.0)
    assert m["wall_ms"] == pytest.approx(125.0)
    # Training thread: 1.2e9 ns at 2.0 s, 3.2e9 at 4.5 s: 2000 ms / 20 steps. Wait: 2e8 to 4.5e8 ns.
    assert m["main_cpu_ms"] == pytest.approx(100.0)
    assert m["main_wait_ms"] == pytest.approx(12.5)
    # Learner process: 180 to 405 ticks = 2250 ms; broker 105 to 130 ticks = 250 ms; per 20 steps.
    assert m["cpu_ms"] == pytest.approx(112.5)
    assert m["broker_cpu_ms"] == pytest.approx(12.5)
    assert m["merger_cpu_ms"] is None
    # Machine: 400 to 900 ticks = 5000 ms over 2500 ms of window.
    assert m["busy_cpus"] == pytest.approx(2.0)
    # In the window: the deltas of steps 30 and 40, adoptions 4 - 1, bytes 5000 - 1000 and 9000 - 3000.
    assert m["session"]["window"] == {"deltas": 2, "adopted": 3, "bytes_up": 4000, "bytes_down": 6000}
    assert m["session"]["run"]["deltas_delivered"] == 4
    assert m["session"]["run"]["bytes_up"] == 6000


def test_a_standalone_run_has_no_session_numbers(at):
    # Steps 10, 20 and 30 at 1, 2 and 3 s; the machine paused 0.5 s before step 30 (its wall
    # clock 0.5 s ahead of the monotonic one from then on).
    events = [{"event": "step", "step": s, "t": s / 10, "time_us": at(s / 10 + (0.5 if s == 30 else 0))}
              for s in (10, 20, 30)]
    samples = [[at(0), 0, 0, 0, -1, -1, 0], [at(4), 4_000_000_000, 0, 400, -1, -1, 400]]
    m = overhead.measure(events, samples, skip=10, hz=100)
    # 20 steps in 2 s of monotonic time; 0.5 s paused. The process 1 CPU on the samples' wall
    # clock: at 1 s 100 ticks, at 3.5 s 350 ticks: 2500 ms over 20 steps.
    assert m["steps_per_s"] == pytest.approx(10.0)
    assert m["paused_seconds"] == pytest.approx(0.5)
    assert m["cpu_ms"] == pytest.approx(125.0)
    assert "session" not in m


def test_ratios_per_pair_and_their_spread():
    runs = [
        dict(pair=1, kind="session", steps_per_s=9.8, cpu_ms=55.0),
        dict(pair=1, kind="standalone", steps_per_s=10.0, cpu_ms=50.0),
        dict(pair=2, kind="standalone", steps_per_s=10.0, cpu_ms=50.0),
        dict(pair=2, kind="session", steps_per_s=10.5, cpu_ms=50.0),
        dict(pair=3, kind="session", steps_per_s=1.0, cpu_ms=1.0),  # incomplete: left out
    ]
    c = overhead.compare(runs)
    # Rates 9.8 / 10 and 10.5 / 10; CPU 55 / 50 and 50 / 50.
    assert [p["pair"] for p in c["pairs"]] == [1, 2]
    assert [p["rate_ratio"] for p in c["pairs"]] == pytest.approx([0.98, 1.05])
    assert [p["cpu_ratio"] for p in c["pairs"]] == pytest.approx([1.1, 1.0])
    assert c["rate_ratio"] == pytest.approx(dict(mean=1.015, min=0.98, max=1.05))
    assert c["cpu_ratio"] == pytest.approx(dict(mean=1.05, min=1.0, max=1.1))
    # Overhead: 1 - 1.015 (the session ran faster on average) and 1.05 - 1, in percent.
    assert c["overhead_percent"] == pytest.approx(-1.5)
    assert c["cpu_overhead_percent"] == pytest.approx(5.0)
    assert overhead.compare(runs[4:]) == dict(pairs=[])
