"""Session overhead benchmark: the step rate of examples/pytorch/train.py with a
decoupled_diloco.Session (a learner of a fresh run, one C++ merger running) against the same loop
--standalone (no session, no broker, no merger), A/B alternating on the same machine with the same
seed, steps and config.

    bench/session_overhead                                # conv, 3 pairs of 600 steps, not pinned
    bench/session_overhead --pairs 2 --steps 300          # a quick look
    bench/session_overhead --pairs 6 --steps 1000 --pin both
    bench/session_overhead --set diloco.H=8               # a delta every 2 steps (P = 4): the worst case

Pair i runs the session's loop and the standalone loop, in the reverse order in every other pair
(AB, BA, ...), so slow drifts of a shared machine cancel. Every run trains with held-out evaluation
off (train.eval_every=0), on one thread (--threads 1, OPENBLAS_NUM_THREADS=1) and with a step
event every 10 steps. The step rate is
(last step - first step >= --skip) / (time between those two events) of the run's metrics.jsonl,
on the process's monotonic clock (a pause of the virtual machine is not counted, and reported as
paused_seconds): start-up, the run's version 0 and the first deltas are left out. While a run
trains, a sampler reads /proc every 0.1 s: the learner process's CPU (user + system, all threads),
its training thread's CPU and run-queue wait, the merger's and the broker's CPU and the machine's
busy CPUs, each taken per step over the same window. CPU per step leaves out the time the learner
waits for a CPU, so other load moves it less than the rate (though a co-tenant on the learner's
core still inflates it, through the caches), and the learner's CPU minus its training thread's is
what the session's background threads cost. What the session did in the window (deltas sent,
versions adopted, bytes up and down) is reported beside it, so the number is never that of an idle
session.

--pin puts the learner on CPU 0 and the merger, the broker and this tool on CPU 1, as when the
merger and the broker run on other machines (the broker's CPU affinity is restored on exit).

Writes into --out (default a new folder under /tmp, printed at the end): summary.json (the command
line, date, machine, commit, binaries' times, every run's numbers, the ratios) and one folder per
run (metrics.jsonl, the log, the CPU samples; the merger's too). Stops every process it started and
deletes its runs' topics (unless --keep-topics). Needs a running broker (scripts/broker start),
build/bin/diloco-merger and the package's native module.
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from . import repository
from .bench_quality import machine
from .run_local import read_jsonl

LOG_EVERY = 10  # the session's step-event interval (Session's log_every); the standalone loop gets the same
REGION = "r0"
PARTITIONS = 4
SAMPLE_SECONDS = 0.1
GOAL_RATIO = 0.98  # the session may cost at most 2 % of the step rate
# torch.set_num_threads(1) (train.py --threads 1) leaves OpenBLAS (Debian's torch) a worker thread
# per further CPU, which takes about a quarter of the process's CPU on 2 cores: one thread it is.
LEARNER_ENV = {"OPENBLAS_NUM_THREADS": "1"}
LEARNER_CPU, OTHERS_CPU = 0, 1  # --pin: the learner alone on one core, everything else on the other
# Per sample: unix time (us); the training thread's CPU and run-queue wait (ns, schedstat); the CPU
# of the learner process, of the merger and of the broker (clock ticks, -1: not running); the
# machine's busy CPU time (ticks, all processes).
COLUMNS = ["time_us", "main_cpu_ns", "main_wait_ns", "learner_ticks", "merger_ticks", "broker_ticks", "busy_ticks"]
KINDS = ("session", "standalone")


def say(message):
    print(message, flush=True)


# ---- what one run measured (pure) ---------------------------------------------------------------

def steady_window(events, skip):
    """The first and the last `step` event at step >= skip; ValueError when fewer than two."""
    steps = [e for e in events if e.get("event") == "step" and e["step"] >= skip]
    if len(steps) < 2:
        raise ValueError(f"fewer than two step events at step >= {skip}: lower --skip or raise --steps")
    return steps[0], steps[-1]


def steps_per_second(first, last):
    """From the events' "t", the process's monotonic clock: it stops while the virtual machine is
    paused, when the wall clock ("time_us") jumps ahead (17 s once on a shared 2-core guest)."""
    return (last["step"] - first["step"]) / (last["t"] - first["t"])


def counter_at(samples, column, t_us):
    """A counter of the samples linearly interpolated at t_us; None outside the samples or when it
    was not readable (-1) at either neighbour."""
    for a, b in zip(samples, samples[1:]):
        if a[0] <= t_us <= b[0]:
            if a[column] < 0 or b[column] < 0:
                return None
            if b[0] == a[0]:
                return float(a[column])
            return a[column] + (b[column] - a[column]) * (t_us - a[0]) / (b[0] - a[0])
    return None


def per_step(samples, column, first, last, scale):
    """The counter's growth between the two step events, times scale, per step. Samples and
    events meet on the wall clock, the one clock they share; CPU counters stand still in a pause."""
    start, end = counter_at(samples, column, first["time_us"]), counter_at(samples, column, last["time_us"])
    if start is None or end is None:
        return None
    return (end - start) * scale / (last["step"] - first["step"])


def session_activity(events, first, last):
    """What the session did between the two step events, and over the whole run."""
    shutdown = next((e for e in reversed(events) if e.get("event") == "shutdown"), {})
    final = next(e for e in reversed(events) if e.get("event") == "step")
    return dict(
        window=dict(deltas=sum(1 for e in events if e.get("event") == "delta" and first["step"] < e["step"] <= last["step"]),
                    adopted=last["adopted"] - first["adopted"],
                    bytes_up=last["bytes_sent"] - first["bytes_sent"],
                    bytes_down=last["bytes_received"] - first["bytes_received"]),
        run=dict(deltas_delivered=shutdown.get("delivered"), deltas_superseded=shutdown.get("superseded"),
                 adopted=final["adopted"], versions=final["versions"], bytes_up=shutdown.get("bytes_sent"),
                 bytes_down=shutdown.get("bytes_received"), kafka_sent=shutdown.get("kafka_sent"),
                 kafka_received=shutdown.get("kafka_received")))


def measure(events, samples, skip, hz):
    """A run's steady-state numbers from its metrics events and CPU samples (rows of COLUMNS);
    CPU figures are ms per step, busy_cpus the machine's busy CPUs over the window."""
    first, last = steady_window(events, skip)
    seconds = last["t"] - first["t"]
    wall_ms = seconds * 1e3 / (last["step"] - first["step"])
    tick_ms = 1e3 / hz
    col = COLUMNS.index
    busy = per_step(samples, col("busy_ticks"), first, last, tick_ms)
    out = dict(from_step=first["step"], to_step=last["step"], seconds=seconds,
               paused_seconds=max(0.0, (last["time_us"] - first["time_us"]) / 1e6 - seconds),  # not clock jitter
               steps_per_s=steps_per_second(first, last), wall_ms=wall_ms,
               cpu_ms=per_step(samples, col("learner_ticks"), first, last, tick_ms),
               main_cpu_ms=per_step(samples, col("main_cpu_ns"), first, last, 1e-6),
               main_wait_ms=per_step(samples, col("main_wait_ns"), first, last, 1e-6),
               merger_cpu_ms=per_step(samples, col("merger_ticks"), first, last, tick_ms),
               broker_cpu_ms=per_step(samples, col("broker_ticks"), first, last, tick_ms),
               busy_cpus=None if busy is None else busy / wall_ms)
    if "adopted" in last:  # a session's step event
        out["session"] = session_activity(events, first, last)
    return out


def spread(values):
    return dict(mean=statistics.mean(values), min=min(values), max=max(values))


def compare(runs):
    """Per pair (runs of one pin mode, each with pair, kind, steps_per_s and cpu_ms) the ratios
    session / standalone of the step rate (below 1: the session costs) and of the CPU per step
    (above 1: the session costs), with their mean, min and max over the complete pairs."""
    by_pair = {}
    for r in runs:
        by_pair.setdefault(r["pair"], {})[r["kind"]] = r
    pairs = []
    for i, p in sorted(by_pair.items()):
        if len(p) < 2:
            continue
        s, b = p["session"], p["standalone"]
        cpu = s["cpu_ms"] / b["cpu_ms"] if s.get("cpu_ms") and b.get("cpu_ms") else None
        pairs.append(dict(pair=i, rate_ratio=s["steps_per_s"] / b["steps_per_s"], cpu_ratio=cpu))
    if not pairs:
        return dict(pairs=[])
    rates = [p["rate_ratio"] for p in pairs]
    cpus = [p["cpu_ratio"] for p in pairs if p["cpu_ratio"] is not None]
    return dict(pairs=pairs, rate_ratio=spread(rates), cpu_ratio=spread(cpus) if cpus else None,
                overhead_percent=100 * (1 - statistics.mean(rates)),
                cpu_overhead_percent=100 * (statistics.mean(cpus) - 1) if cpus else None)


# ---- running ------------------------------------------------------------------------------------

def proc_ticks(pid):
    """utime + stime of a process (all its threads, the exited ones too); -1 when it is gone."""
    if not pid:
        return -1
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError):
        return -1


def busy_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait


class CpuSampler(threading.Thread):
    """Writes a row of COLUMNS every SAMPLE_SECONDS while the learner lives."""

    def __init__(self, learner, merger, broker, path):
        super().__init__(daemon=True)
        self.learner, self.merger, self.broker, self.path = learner, merger, broker, path
        self.done = threading.Event()

    def run(self):
        with open(self.path, "w") as out:
            out.write("\t".join(COLUMNS) + "\n")
            while not self.done.is_set():
                try:
                    with open(f"/proc/{self.learner}/task/{self.learner}/schedstat") as f:
                        cpu_ns, wait_ns = f.read().split()[:2]
                except OSError:
                    return
                row = [time.time_ns() // 1000, cpu_ns, wait_ns, proc_ticks(self.learner), proc_ticks(self.merger),
                       proc_ticks(self.broker), busy_ticks()]
                out.write("\t".join(map(str, row)) + "\n")
                out.flush()
                self.done.wait(SAMPLE_SECONDS)


def read_samples(path):
    with open(path) as f:
        next(f)
        return [[int(x) for x in line.split()] for line in f if line.strip()]


def set_affinity(pid, cpus):
    """Every thread of a process onto `cpus` (a thread started later inherits its creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def delete_topics(root, bootstrap, runs):
    """The runs' topics, with the bench scripts' own cleanup (bench/lib.sh, Kafka's topic tool)."""
    script = 'source "$ROOT/bench/lib.sh"; keep_topics=0; RUNS=("$@"); delete_topics'
    subprocess.run(["bash", "-c", script, "delete_topics", *runs], check=False,
                   env=dict(os.environ, ROOT=root, BOOTSTRAP=bootstrap))


class Started:
    """What the benchmark started or changed, undone by undo(): processes, the broker's CPU
    affinity, the runs' topics."""

    def __init__(self, root, bootstrap, keep_topics, create_topics):
        self.root, self.bootstrap, self.keep_topics = root, bootstrap, keep_topics
        self.create_topics = create_topics
        self.processes, self.runs, self.broker_affinity = [], [], None

    def new_run(self, run_id):
        self.create_topics(self.bootstrap, run_id, [REGION], PARTITIONS)
        self.runs.append(run_id)

    def start(self, cmd, log_path, cpu, env=None):
        prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []
        with open(log_path, "wb") as log:
            p = subprocess.Popen(prefix + cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                 env=dict(os.environ, **(env or {})))
        self.processes.append(p)
        return p

    def stop(self, p):
        """SIGTERM (a learner flushes, a merger records what it holds), SIGKILL after 30 s."""
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.processes.remove(p)

    def pin_broker(self, pid):
        self.broker_affinity = (pid, os.sched_getaffinity(pid))
        set_affinity(pid, {OTHERS_CPU})

    def undo(self):
        for p in list(reversed(self.processes)):
            self.stop(p)
        if self.broker_affinity:
            pid, cpus = self.broker_affinity
            try:
                set_affinity(pid, cpus)
            except FileNotFoundError:  # the broker stopped meanwhile
                pass
            self.broker_affinity = None
        if self.runs and not self.keep_topics:
            delete_topics(self.root, self.bootstrap, self.runs)
        self.runs = []


def train_command(args, kind, run_id, run_dir):
    sets = ["train.eval_every=0"] + args.set
    cmd = [sys.executable, os.path.join(repository.root(), "examples", "pytorch", "train.py"), "-c", args.config,
           "--model", args.model, "--steps", str(args.steps), "--threads", "1", "--log-every", str(LOG_EVERY),
           "--run-dir", run_dir]
    if kind == "standalone":
        cmd.append("--standalone")
    else:
        sets.insert(0, f'run.id="{run_id}"')
        cmd += ["--id", "learner", "--region", REGION, "--regions", REGION, "--bootstrap", args.bootstrap]
    return cmd + [x for s in sets for x in ("--set", s)]


def merger_command(args, run_id, run_dir):
    sets = [f'run.id="{run_id}"', "train.eval_every=0"] + args.set
    return [os.path.join(args.bin_dir, "diloco-merger"), "-c", args.config, "--id", "merger", "--bootstrap",
            args.bootstrap, "--run-dir", run_dir] + [x for s in sets for x in ("--set", s)]


def run_one(args, started, pinned, pair, kind, broker_pid):
    """One learner run (with its merger and fresh run for the session); returns its result dict."""
    name = f"{'pinned' if pinned else 'shared'}/{pair}-{kind}"
    run_dir = os.path.join(args.out, name)
    os.makedirs(run_dir)
    run_id = f"so{args.stamp}{'p' if pinned else 's'}{pair}"
    merger = None
    if kind == "session":
        started.new_run(run_id)
        merger = started.start(merger_command(args, run_id, os.path.join(run_dir, "merger")),
                               os.path.join(run_dir, "merger.log"), OTHERS_CPU if pinned else None)
    load1 = os.getloadavg()[0]
    cmd = train_command(args, kind, run_id, run_dir)
    t0 = time.time()
    learner = started.start(cmd, os.path.join(run_dir, "learner.log"), LEARNER_CPU if pinned else None, LEARNER_ENV)
    sampler = CpuSampler(learner.pid, merger.pid if merger else None, broker_pid, os.path.join(run_dir, "cpu.tsv"))
    sampler.start()
    try:
        code = learner.wait(args.timeout)
    except subprocess.TimeoutExpired:
        code = None
    wall = time.time() - t0
    sampler.done.set()
    sampler.join()
    started.stop(learner)
    result = dict(name=name, pinned=pinned, pair=pair, kind=kind, run_id=run_id if merger else None,
                  command=shlex.join(learner.args), exit_code=code, wall_seconds=wall, load1_at_start=load1)
    if merger:
        started.stop(merger)
        result["merges"] = sum(1 for e in read_jsonl(os.path.join(run_dir, "merger", "metrics.jsonl"))
                               if e.get("event") == "merge")
    if code != 0:
        with open(os.path.join(run_dir, "learner.log"), errors="replace") as f:
            tail = "".join(f.readlines()[-8:])
        raise RuntimeError(f"{name}: the learner {'timed out' if code is None else f'exited {code}'}:\n{tail}")
    result.update(measure(read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                          read_samples(os.path.join(run_dir, "cpu.tsv")), args.skip, os.sysconf("SC_CLK_TCK")))
    return result


# ---- reporting ----------------------------------------------------------------------------------

def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def print_run(r):
    w = (r.get("session") or {}).get("window", {})
    say(f"{r['name']:<20} {r['steps_per_s']:8.2f} {r['wall_ms']:7.2f} {fmt(r['cpu_ms']):>7} {fmt(r['main_cpu_ms']):>7} "
        f"{fmt(r['main_wait_ms']):>6} {fmt(r['merger_cpu_ms']):>6} {fmt(r['broker_cpu_ms']):>6} {fmt(r['busy_cpus']):>5} "
        f"{w.get('deltas', '-'):>6} {w.get('adopted', '-'):>7} {fmt(w.get('bytes_up', 0) / 1e3 if w else None, '.1f'):>8} "
        f"{fmt(w.get('bytes_down', 0) / 1e3 if w else None, '.1f'):>8} {r['load1_at_start']:5.2f} {r['paused_seconds']:6.1f}")


RUN_HEADER = (f"{'run':<20} {'steps/s':>8} {'wall':>7} {'cpu':>7} {'train':>7} {'wait':>6} {'merger':>6} {'broker':>6} "
              f"{'busy':>5} {'deltas':>6} {'adopted':>7} {'up kB':>8} {'down kB':>8} {'load1':>5} {'paused':>6}")
RUN_LEGEND = ("per step, ms: wall; CPU of the learner process (all threads); its training thread's CPU and run-queue "
              "wait; CPU of the merger and the broker; busy = CPUs busy on the machine; deltas, adopted, up and down: "
              "what the session did in the window; paused: seconds the virtual machine stood still in the window (not counted)")


def print_comparison(label, c, runs):
    if not c["pairs"]:
        say(f"{label}: no complete pair")
        return
    rate, cpu = c["rate_ratio"], c["cpu_ratio"]
    mean = lambda kind, k: statistics.mean(r[k] for r in runs if r["kind"] == kind)
    say(f"{label}: session {mean('session', 'steps_per_s'):.2f} steps/s, standalone {mean('standalone', 'steps_per_s'):.2f}; "
        "step rate session/standalone per pair " + ", ".join(f"{p['rate_ratio']:.3f}" for p in c["pairs"])
        + f"; mean {rate['mean']:.3f} (min {rate['min']:.3f}, max {rate['max']:.3f}): "
        f"overhead {c['overhead_percent']:.1f} % ({'within' if rate['mean'] >= GOAL_RATIO else 'above'} the 2 % goal)")
    if cpu:
        say(f"  learner CPU per step session/standalone per pair "
            + ", ".join(fmt(p["cpu_ratio"], ".3f") for p in c["pairs"])
            + f"; mean {cpu['mean']:.3f} (min {cpu['min']:.3f}, max {cpu['max']:.3f}): {c['cpu_overhead_percent']:+.1f} %; "
            f"session {mean('session', 'cpu_ms'):.2f} ms, standalone {mean('standalone', 'cpu_ms'):.2f} ms")
    sessions = [r for r in runs if r["kind"] == "session"]
    window = lambda k: statistics.mean(r["session"]["window"][k] for r in sessions)
    say(f"  the session in the window, mean per run: {window('deltas'):.1f} deltas sent, {window('adopted'):.1f} "
        f"versions adopted, {window('bytes_up') / 1e3:.1f} kB up, {window('bytes_down') / 1e3:.1f} kB down; "
        f"merges per run {statistics.mean(r['merges'] for r in sessions):.1f}")


def file_time(path):
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.path.getmtime(path)))
    except OSError:
        return None


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/session_overhead",
        description="What a decoupled_diloco.Session costs per inner step: the step rate (and the learner's CPU per "
                    "step) of examples/pytorch/train.py in a fresh run with one merger, against the same loop "
                    "--standalone, in alternating pairs on the same machine; the ratio session/standalone per pair "
                    "and its mean, min and max, beside what the session did (deltas, adoptions, bytes).",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.toml", help="run config (default %(default)s)")
    p.add_argument("--model", default="conv", choices=["conv", "builtin"], help="train.py's --model (default %(default)s)")
    p.add_argument("--steps", type=int, default=600, help="inner steps per run (default %(default)s)")
    p.add_argument("--pairs", type=int, default=3, help="session/standalone pairs per pin mode (default %(default)s)")
    p.add_argument("--skip", type=int, default=50,
                   help="the step rate is measured from this step on (start-up, version 0, first deltas; default %(default)s)")
    p.add_argument("--pin", nargs="?", const="yes", default="no", choices=["no", "yes", "both"],
                   help="yes: the learner on CPU 0, the merger, the broker and this tool on CPU 1; both: unpinned "
                        "pairs, then pinned ones (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override of every run, the merger's too (repeatable)")
    p.add_argument("--bootstrap", default=os.environ.get("DILOCO_BOOTSTRAP", "127.0.0.1:19092"),
                   help="Kafka bootstrap servers (default: $DILOCO_BOOTSTRAP or %(default)s)")
    p.add_argument("--out", help="results folder (default: a new folder under /tmp)")
    p.add_argument("--keep-topics", action="store_true", help="leave the runs' topics on the broker")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one learner run may take (default %(default)s)")
    p.add_argument("--bin-dir", help="where diloco-merger is (default build/bin or $DILOCO_BIN_DIR)")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.steps < args.skip + 2 * LOG_EVERY:
        p.error(f"need --pairs >= 1 and --steps >= --skip + {2 * LOG_EVERY}")
    root = repository.root()
    args.config = os.path.join(root, args.config) if not os.path.isfile(args.config) else os.path.abspath(args.config)
    if not os.path.isfile(args.config):
        p.error(f"no config file {args.config}")
    args.bin_dir = os.path.abspath(args.bin_dir or repository.default_bin_dir())
    if not os.access(os.path.join(args.bin_dir, "diloco-merger"), os.X_OK):
        p.error(f"no diloco-merger in {args.bin_dir}: build first (cmake --build build) or pass --bin-dir")
    if args.pin != "no" and not {LEARNER_CPU, OTHERS_CPU} <= os.sched_getaffinity(0):
        p.error(f"--pin needs CPUs {LEARNER_CPU} and {OTHERS_CPU}")
    args.out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="diloco-session-overhead-")
    args.stamp = time.strftime("%m%d%H%M%S")  # run ids: so<stamp><s|p><pair>
    return args


def broker_pid(root):
    """The pid of node 1 of the broker that scripts/broker runs ($DILOCO_BROKER_DIR), or None."""
    broker_dir = os.environ.get("DILOCO_BROKER_DIR") or os.path.join(root, ".run", "broker")
    try:
        with open(os.path.join(broker_dir, "node-1", "pid")) as f:
            pid = int(f.read())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    """bench/session_overhead: 0 when every run finished, 1 when one failed, 130 when interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    root = repository.root()
    from .. import _core

    broker = broker_pid(root)
    if args.pin != "no" and broker is None:
        say("error: --pin needs the broker's pid (node-1/pid under $DILOCO_BROKER_DIR or .run/broker)")
        return 1
    os.makedirs(args.out, exist_ok=True)
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.pin]
    info = dict(command=shlex.join(["bench/session_overhead"] + argv),
                date=time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime()), machine=machine(),
                config=os.path.relpath(args.config, root), model=args.model, steps=args.steps, pairs=args.pairs,
                skip=args.skip, pin=args.pin, set=args.set, learner_env=LEARNER_ENV, bootstrap=args.bootstrap, broker_pid=broker,
                binaries={"diloco-merger": file_time(os.path.join(args.bin_dir, "diloco-merger")),
                          "_core": file_time(_core.__file__),
                          "train.py": file_time(os.path.join(root, "examples", "pytorch", "train.py"))})
    say(f"# session_overhead: {info['date']} | nproc {info['machine']['nproc']} | {info['machine']['cpu']} | "
        f"commit {info['machine']['commit']}{' (uncommitted changes)' if info['machine']['dirty'] else ''}")
    say(f"# {args.model} on {info['config']}, {args.steps} steps per run, {args.pairs} pairs per mode, rate from step "
        f"{args.skip} on; load {os.getloadavg()[0]:.2f}; results in {args.out}")
    started = Started(root, args.bootstrap, args.keep_topics, _core.create_topics)
    own_cpus = os.sched_getaffinity(0)
    runs, failure, status = [], None, 0
    signal.signal(signal.SIGTERM, interrupt)
    try:
        for pinned in modes:
            if pinned:
                started.pin_broker(broker)
            os.sched_setaffinity(0, {OTHERS_CPU} if pinned else own_cpus)  # the sampler thread follows
            for pair in range(1, args.pairs + 1):
                for kind in (KINDS if pair % 2 else KINDS[::-1]):
                    runs.append(run_one(args, started, pinned, pair, kind, broker))
                    say(f"{runs[-1]['name']}: {runs[-1]['steps_per_s']:.2f} steps/s")
    except KeyboardInterrupt:
        failure, status = "interrupted", 130
    except (RuntimeError, ValueError, OSError) as e:
        failure, status = str(e), 1
    finally:
        started.undo()
        os.sched_setaffinity(0, own_cpus)
    comparisons = {("pinned" if pinned else "shared"): compare([r for r in runs if r["pinned"] == pinned])
                   for pinned in modes}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(dict(info=info, failure=failure, runs=runs, comparisons=comparisons), f, indent=1)
    if runs:
        say("\n" + RUN_LEGEND)
        say(RUN_HEADER)
        for r in runs:
            print_run(r)
        say("")
        for label, c in comparisons.items():
            print_comparison({"pinned": "pinned (learner CPU 0; merger, broker CPU 1)", "shared": "not pinned"}[label],
                             c, [r for r in runs if r["pinned"] == (label == "pinned")])
    if failure:
        say(f"error: {failure}")
    say(f"results: {os.path.join(args.out, 'summary.json')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
