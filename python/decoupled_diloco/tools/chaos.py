"""scripts/chaos: a local cluster run under a seeded failure schedule (installed as diloco-chaos).

Starts the cluster of scripts/run-local (run_local's Cluster) for a wall-clock budget
and, on a schedule drawn from --seed, kills learners and mergers with SIGKILL and restarts them
under the same id, stops them with SIGTERM at a random moment (each must exit 0 within 60 s: a
clean stop, whatever it interrupted) and restarts them, pauses learners with SIGSTOP/SIGCONT (an
island cut off or stalled), and with
--nodes 3 kills and restarts one Kafka broker at a time. Each kind of fault has a mean time
between failures (of its target's uptime) and a mean time to repair, both exponential; a target
has one fault at a time, and one broker node at most is down.

After the ordered stop it checks the run: `diloco-replay audit` (every delta merged exactly once,
dropped with a reason or pending at the clean stop; no learner's progress merged twice; versions
move forward by one), `diloco-replay verify` (every version rebuilds to its checksum), and that
every version a learner adopted is one the merge log committed, with the same checksum. It
writes chaos.jsonl (the timeline: every fault and repair) and chaos.json (schedule, goodput,
stalls, loss, checks) into the run folder, and the report shows the timeline.

Goodput (ALGORITHM.md): learner compute time whose result reached a merged global version over
the learner-seconds provisioned (every learner slot from its first inner step to the end of the
budget, down or not; the cluster's own start-up is not counted). A step's
compute counts for a fragment when a merged delta of that learner and fragment covers it (the
delta carries the steps since its base was adopted); a step counts 1/P for each of the P
fragments. Reported also over the learner-seconds the learners were up (provisioned minus the
scheduled downtime of kills and pauses): what a fault costs beyond its own downtime, i.e. lost
unsent progress, restarts, and (synchronous modes) the others' waiting.
"""

import argparse
import bisect
import json
import os
import random
import signal
import subprocess
import sys
import time

from . import repository, run_local


def say(message):
    print(f"chaos: {message}", file=sys.stderr, flush=True)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# ---- the schedule -------------------------------------------------------------------------------

def draw_faults(rng, target, kind, mtbf, mttr, start, end, min_down=1.0):
    """Faults of one target: up for Exp(mtbf) seconds, then down for Exp(mttr) (at least min_down),
    from `start` until `end` (no fault starts after end - mttr, so the run ends with it repaired)."""
    faults, t = [], start
    if not mtbf:
        return faults
    while True:
        t += rng.expovariate(1.0 / mtbf)
        down = max(min_down, rng.expovariate(1.0 / mttr))
        if t + down > end:
            return faults
        faults.append({"at": round(t, 2), "down": round(down, 2), "target": target, "kind": kind})
        t += down


def schedule(args, learner_names, merger_names):
    """Every fault of the run, drawn from --seed alone (the same seed gives the same schedule, so two
    modes can be compared on it)."""
    rng = random.Random(args.seed)
    start, end = args.warmup, args.seconds - args.cooldown
    faults = []
    for name in learner_names:
        # Kills and pauses of one learner are one alternating process, so they never overlap.
        kills = draw_faults(random.Random(rng.random()), name, "kill", args.learner_mtbf, args.learner_mttr, start, end)
        pauses = draw_faults(random.Random(rng.random()), name, "pause", args.pause_mtbf, args.pause_mttr, start, end)
        faults += kills + [p for p in pauses
                           if not any(k["at"] - 1 < p["at"] + p["down"] and p["at"] < k["at"] + k["down"] + 1 for k in kills)]
    for name in merger_names:
        faults += draw_faults(random.Random(rng.random()), name, "kill", args.merger_mtbf, args.merger_mttr, start, end)
    if args.nodes > 1:
        node_rng = random.Random(rng.random())
        for f in draw_faults(random.Random(rng.random()), "broker", "kill", args.broker_mtbf, args.broker_mttr, start, end):
            f["target"] = f"broker-{node_rng.randrange(1, args.nodes + 1)}"
            faults.append(f)
    # SIGTERM stops come from a generator of their own, so the schedule of the other kinds of a
    # seed is the one it was before they existed; a stop never overlaps another fault of its target.
    term_rng = random.Random(f"term-{args.seed}")
    for name in learner_names + merger_names:
        others = [f for f in faults if f["target"] == name]
        for t in draw_faults(random.Random(term_rng.random()), name, "term", args.term_mtbf, args.term_mttr, start, end):
            if not any(o["at"] - 1 < t["at"] + t["down"] and t["at"] < o["at"] + o["down"] + 1 for o in others):
                faults.append(t)
    return sorted(faults, key=lambda f: f["at"])


# ---- running it ---------------------------------------------------------------------------------

class Timeline:
    def __init__(self, path, t0):
        self.f = open(path, "a")
        self.t0 = t0

    def add(self, target, action, kind, **extra):
        e = {"t": round(time.time() - self.t0, 3), "time_us": int(time.time() * 1e6), "target": target,
             "action": action, "kind": kind, **extra}
        self.f.write(json.dumps(e) + "\n")
        self.f.flush()
        say(f"{e['t']:7.1f} s  {target}: {action}")


STARTING_NODES = []  # `scripts/broker start-node` processes still waiting for their node


def broker_node(action, node):
    """Kills a broker node (at once), or starts it again in the background: a node takes seconds
    to come up, and the schedule goes on meanwhile."""
    argv = [os.path.join(repository.root(), "scripts", "broker"), f"{action}-node", "--node", str(node)]
    if action == "start":
        STARTING_NODES.append((node, subprocess.Popen(argv, cwd=repository.root(), stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.PIPE, text=True)))
        return
    r = subprocess.run(argv, cwd=repository.root(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/broker {action}-node --node {node}: {r.stderr.strip()}")


def wait_for_nodes(timeout=120):
    for node, proc in STARTING_NODES:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"broker node {node} did not come back within {timeout} s")
        if proc.returncode != 0:
            raise RuntimeError(f"scripts/broker start-node --node {node}: {err.strip()}")
    STARTING_NODES.clear()


TERM_EXIT_SECONDS = 60  # how long a process stopped with SIGTERM may take to exit


def inject(cluster, fault, timeline, args):
    target, kind = fault["target"], fault["kind"]
    if target.startswith("broker-"):
        node = int(target.split("-")[1])
        wait_for_nodes()  # one node down at a time: RF 3 with min ISR 2 stays writable
        broker_node("kill", node)
        timeline.add(target, "kill", kind, node=node)
        return
    child = cluster.children[target]
    if not child.running():  # exited on its own (a budget): nothing to break
        return
    if kind == "pause":
        child.signal(signal.SIGSTOP)
        timeline.add(target, "stop", kind, pid=child.proc.pid)
    elif kind == "term":
        # A clean stop at whatever moment it lands: the process must exit 0, and soon.
        child.signal(signal.SIGTERM)
        code = child.wait(TERM_EXIT_SECONDS)
        if code is None:
            child.signal(signal.SIGKILL)
            child.wait(10)
        timeline.add(target, "term", kind, pid=child.proc.pid, code=code)
    else:
        child.signal(signal.SIGKILL)
        child.wait(10)
        timeline.add(target, "kill", kind, pid=child.proc.pid)


def repair(cluster, fault, timeline, args, end_time):
    target, kind = fault["target"], fault["kind"]
    if target.startswith("broker-"):
        node = int(target.split("-")[1])
        broker_node("start", node)
        timeline.add(target, "restart", kind, node=node)
        return
    child = cluster.children[target]
    if kind == "pause":
        child.signal(signal.SIGCONT)
        timeline.add(target, "cont", kind, pid=child.proc.pid)
        return
    if target in cluster.merger_names:
        child = cluster.start_merger(target)
    else:
        left = max(1.0, end_time - time.time())
        child = cluster.start_learner(cluster.learner_names.index(target), max_seconds=left)
    timeline.add(target, "restart", kind, pid=child.proc.pid)


def run(args, cluster, faults):
    timeline = Timeline(os.path.join(cluster.run_dir, "chaos.jsonl"), time.time())
    cluster.start()
    timeline.t0 = cluster.start_time
    end_time = cluster.start_time + args.seconds
    view = run_local.View(cluster.run_dir, cluster.learner_names, cluster.merger_names, cluster.fragments, cluster.steps)
    todo = [dict(f, due=f["at"], phase="inject") for f in faults]
    down = set()  # targets whose fault is in force (their exit is expected)
    last_line = 0.0
    failure = None
    stop_requested = []
    signal.signal(signal.SIGINT, lambda *_: stop_requested.append("Ctrl-C"))
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append("SIGTERM"))
    while not stop_requested and time.time() < end_time:
        time.sleep(0.2)
        now = time.time() - cluster.start_time
        while todo and todo[0]["due"] <= now:
            f = todo.pop(0)
            if f["phase"] == "inject":
                inject(cluster, f, timeline, args)
                down.add(f["target"])
                bisect.insort(todo, dict(f, due=f["at"] + f["down"], phase="repair"), key=lambda x: x["due"])
            else:
                repair(cluster, f, timeline, args, end_time)
                down.discard(f["target"])
        view.update()
        if time.time() - last_line >= 5:
            last_line = time.time()
            print("chaos: " + run_local.summary_line(view, now).removeprefix("run-local: "), flush=True)
        c = cluster.crashed(expected=down)
        if c:
            failure = f"{c.name} exited with code {c.proc.returncode}; the end of {c.log_path}:\n{c.tail()}"
            break
    # Repair whatever is still down, so that the stop is the clean one every check assumes.
    for f in [f for f in todo if f["phase"] == "repair"]:
        repair(cluster, f, timeline, args, end_time)
    wait_for_nodes()
    reason = stop_requested[0] if stop_requested else ("a process failed" if failure else "time budget")
    say(f"stopping ({reason})")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    timeline.add("cluster", "end", reason)
    codes = cluster.stop(view, failure)
    return reason, codes, failure


# ---- what the run shows -------------------------------------------------------------------------

def incarnations(events):
    """A metrics.jsonl split into the processes that appended to it (each begins with "start")."""
    runs = []
    for e in events:
        if e.get("event") == "start" or not runs:
            runs.append([])
        runs[-1].append(e)
    return runs


def stopped_windows(timeline_path):
    """Per target, the (begin, end) wall-clock seconds between each SIGSTOP and its SIGCONT, from
    the run's timeline (a stop with no continue lasts to the end)."""
    windows, open_at = {}, {}
    for e in run_local.read_jsonl(timeline_path):
        if e.get("action") == "stop":
            open_at[e["target"]] = e["time_us"] / 1e6
        elif e.get("action") == "cont" and e.get("target") in open_at:
            windows.setdefault(e["target"], []).append((open_at.pop(e["target"]), e["time_us"] / 1e6))
    for target, begin in open_at.items():
        windows.setdefault(target, []).append((begin, float("inf")))
    return windows


def compute_curve(events, stopped=()):
    """(step, compute seconds) points of one incarnation, starting at (its first step, 0): 0, or
    where a restarted learner resumed (its "resume" event).

    `stopped`: (begin, end) wall-clock seconds in which the process was SIGSTOPped. A learner's
    compute clock runs on through a stop that lands inside a step, so between two logged points
    the compute credited is at most the wall time between them less the time stopped in it."""
    first = next((e.get("step", 0) for e in events if e.get("event") == "resume"), 0)
    points = [(first, 0.0)]
    last_wall = next((e["time_us"] / 1e6 for e in events if "time_us" in e), None)
    last_raw = 0.0
    for e in events:
        if e.get("event") in ("step", "stop") and "compute_seconds" in e and e.get("step", 0) > points[-1][0]:
            raw = e["compute_seconds"]
            credited = raw - last_raw
            wall = e["time_us"] / 1e6 if "time_us" in e else None
            if wall is not None and last_wall is not None:
                inside = sum(max(0.0, min(wall, b) - max(last_wall, a)) for a, b in stopped)
                if inside > 0:
                    credited = min(credited, max(0.0, wall - last_wall - inside))
            last_raw = raw
            if wall is not None:
                last_wall = wall
            points.append((e["step"], points[-1][1] + credited))
    return points


def compute_at(points, step):
    steps = [p[0] for p in points]
    i = bisect.bisect_right(steps, step) - 1
    if i < 0:
        return 0.0
    if i + 1 >= len(points):  # past the last point: extrapolate at the mean rate
        s, c = points[-1]
        rate = c / s if s else 0.0
        return c + (step - s) * rate
    (s0, c0), (s1, c1) = points[i], points[i + 1]
    return c0 + (c1 - c0) * (step - s0) / (s1 - s0)


def longest_outside(points, excluded):
    """(seconds, start) of the longest stretch between consecutive times in `points` that no
    interval of `excluded` covers (a stall while every merger was up)."""
    best = (0.0, points[0] if points else 0.0)
    for a, b in zip(points, points[1:]):
        cuts = sorted((max(a, x), min(b, y)) for x, y in excluded if x < b and y > a)
        t = a
        for x, y in cuts + [(b, b)]:
            if x - t > best[0]:
                best = (x - t, t)
            t = max(t, y)
    return best


def replay(cluster, *argv):
    cmd = [os.path.join(cluster.bin_dir, "diloco-replay"), "-c", os.path.join(cluster.run_dir, "config.toml"),
           "--bootstrap", cluster.servers, *[a for o in cluster.overrides for a in ("--set", o)], *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=repository.root())


def analyse(cluster, args, faults, wall_seconds):
    fragments = cluster.fragments
    checks, problems = {}, []

    audit_run = replay(cluster, "audit", "--json")
    try:
        audit = json.loads(audit_run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        audit = {"ok": False, "problems": [f"diloco-replay audit failed: {audit_run.stderr.strip()[-400:]}"], "versions": {}}
    checks["audit"] = audit["ok"]
    problems += audit.get("problems", [])
    verify_run = replay(cluster, "verify")
    checks["verify"] = verify_run.returncode == 0
    if verify_run.returncode != 0:
        problems.append("diloco-replay verify: " + (verify_run.stdout.strip() or verify_run.stderr.strip())[-400:])

    committed = {(int(p), v["version"]): v["checksum"] for p, vs in audit.get("versions", {}).items() for v in vs}
    fates_run = replay(cluster, "list", "--json")
    fates = {}
    for line in fates_run.stdout.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        fates[(d.get("learner"), d.get("fragment"), d.get("seq"))] = d.get("fate")

    # Adoptions: every version a learner or the evaluator adopted was committed, with its checksum,
    # and no process adopted a version older than one it held.
    adopted_unknown = 0
    backwards = 0
    for name in cluster.learner_names + ["eval"]:
        for inc in incarnations(run_local.read_jsonl(os.path.join(cluster.run_dir, name, "metrics.jsonl"))):
            held = {}
            for e in inc:
                if e.get("event") != "adopt":
                    continue
                p, v = e.get("fragment"), e.get("version")
                if committed.get((p, v)) != e.get("checksum"):
                    adopted_unknown += 1
                    if adopted_unknown <= 5:
                        problems.append(f"{name} adopted fragment {p} version {v} (checksum {e.get('checksum')}), "
                                        "which the merge log does not hold with that checksum")
                if v <= held.get(p, -1):
                    backwards += 1
                    problems.append(f"{name} adopted fragment {p} version {v} after holding {held[p]}")
                held[p] = v
    checks["adopted_committed"] = adopted_unknown == 0
    checks["no_version_backwards"] = backwards == 0

    # Every process stopped with SIGTERM exited 0 within TERM_EXIT_SECONDS.
    terms = [e for e in run_local.read_jsonl(os.path.join(cluster.run_dir, "chaos.jsonl")) if e.get("action") == "term"]
    unclean = [e for e in terms if e.get("code") != 0]
    if terms:
        checks["sigterm_clean_exit"] = not unclean
    for e in unclean:
        problems.append(f"{e['target']} stopped with SIGTERM at {e['t']} s: " +
                        (f"exit code {e['code']}" if e.get("code") is not None
                         else f"still running after {TERM_EXIT_SECONDS} s (killed)"))

    # Goodput: per learner and fragment, the steps covered by merged deltas, in compute seconds
    # (none credited for the time a pause stopped the learner).
    stopped = stopped_windows(os.path.join(cluster.run_dir, "chaos.jsonl"))
    good = 0.0
    computed = 0.0
    deltas = {"sent": 0, "merged": 0}
    for name in cluster.learner_names:
        for inc in incarnations(run_local.read_jsonl(os.path.join(cluster.run_dir, name, "metrics.jsonl"))):
            curve = compute_curve(inc, stopped.get(name, ()))
            computed += curve[-1][1]
            covered = {p: [] for p in range(fragments)}
            for e in inc:
                if e.get("event") != "delta" or "step" not in e:
                    continue
                deltas["sent"] += 1
                if fates.get((name, e["fragment"], e["seq"])) != "merged":
                    continue
                deltas["merged"] += 1
                covered[e["fragment"]].append((e["step"] - e.get("inner_steps", 0), e["step"]))
            for p, spans in covered.items():
                merged_until = float("-inf")
                for a, b in sorted(spans):  # the union of the spans
                    a = max(a, merged_until)
                    if b > a:
                        good += (compute_at(curve, b) - compute_at(curve, a)) / fragments
                    merged_until = max(merged_until, b)
    # Provisioned: every learner slot from its first inner step (the cluster's start-up is not a
    # fault) to the end of the budget, down or not.
    run_end_us = (cluster.start_time + wall_seconds) * 1e6
    provisioned = 0.0
    for name in cluster.learner_names:
        first = next((e for e in run_local.read_jsonl(os.path.join(cluster.run_dir, name, "metrics.jsonl"))
                      if e.get("event") == "step" and "time_us" in e), None)
        began = first["time_us"] - 1e6 * first.get("compute_seconds", 0) if first else run_end_us
        provisioned += max(0.0, run_end_us - began) / 1e6
    # The learner-seconds of processes that were up (not killed, not paused): what a method could
    # use at best; goodput over this shows what a fault costs beyond its own downtime.
    learner_down = sum(max(0.0, min(f["at"] + f["down"], wall_seconds) - min(f["at"], wall_seconds))
                       for f in faults if f["target"] in cluster.learner_names)
    available = provisioned - learner_down

    # Stalls: the longest time with no new version of any fragment, and the usual gap.
    times = sorted(v["time_ms"] / 1000.0 for vs in audit.get("versions", {}).values() for v in vs)
    run_start = cluster.start_time
    run_end = run_start + wall_seconds
    # From the first merge (before it, the learners start and train their first H / P steps) to
    # the end of the budget.
    points = [t for t in times if run_start <= t <= run_end] + [run_end]
    gaps = [(b - a, a) for a, b in zip(points, points[1:])]
    longest = max(gaps) if gaps else (wall_seconds, run_start)
    inner = sorted(b - a for a, b in zip(times, times[1:]))
    median_gap = inner[len(inner) // 2] if inner else None
    # The normal merge interval: how often one fragment gets a new version (the median over the
    # fragments of the median gap between their versions).
    per_fragment = []
    for vs in audit.get("versions", {}).values():
        ts = sorted(v["time_ms"] / 1000.0 for v in vs)
        g = sorted(b - a for a, b in zip(ts, ts[1:]))
        if g:
            per_fragment.append(g[len(g) // 2])
    fragment_interval = sorted(per_fragment)[len(per_fragment) // 2] if per_fragment else None
    merger_down = [(run_start + f["at"], run_start + f["at"] + f["down"]) for f in faults
                   if f["target"] in cluster.merger_names]
    longest_live = longest_outside(points, merger_down)

    evals = [e for e in run_local.read_jsonl(os.path.join(cluster.run_dir, "eval", "metrics.jsonl")) if e.get("event") == "global_eval"]
    final_loss = evals[-1].get("eval_loss") if evals else None
    deltas["unaccounted"] = sum(1 for p in problems if "neither merged" in p)

    return {
        "ok": all(checks.values()),
        "checks": checks,
        "problems": problems[:50],
        "goodput": good / provisioned if provisioned else None,
        "goodput_of_available": good / available if available > 0 else None,
        "learner_down_seconds": round(learner_down, 2),
        "good_compute_seconds": round(good, 2),
        "compute_seconds": round(computed, 2),
        "provisioned_learner_seconds": round(provisioned, 2),
        "longest_stall_seconds": round(longest[0], 2),
        "longest_stall_at": round(longest[1] - run_start, 2),
        "longest_stall_while_a_merger_lives_seconds": round(longest_live[0], 2),
        "median_merge_interval_seconds": round(median_gap, 3) if median_gap is not None else None,
        "fragment_merge_interval_seconds": round(fragment_interval, 3) if fragment_interval is not None else None,
        "merges": len(times),
        "final_loss": final_loss,
        "deltas": deltas,
        "audit": {k: audit.get(k) for k in ("deltas", "merge_records", "merged", "dropped", "pending_at_stop", "rejected")},
    }


# ---- the command --------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="Runs the local cluster of scripts/run-local for --seconds under a seeded failure schedule "
                    "(kill -9 and restart of learners and mergers, SIGSTOP/SIGCONT of learners, with --nodes 3 kill "
                    "and restart of broker nodes), then checks that no delta was lost or merged twice, that every "
                    "version verifies and that learners adopted only committed versions, and reports goodput, the "
                    "longest stall and the final loss. Exit 0 when every check passes, 1 when one fails, 2 when "
                    "the run could not be made.",
        epilog="Times are seconds. A target is down about MTTR / (MTBF + MTTR) of the time: --learner-mtbf 40 "
               "--learner-mttr 10 keeps each learner down about 20%. The same --seed gives the same schedule, so "
               "--sync (synchronous DiLoCo: merger.quorum = learners, diloco.wait_steps = 0) can be compared on it.")
    p.add_argument("config", nargs="?", default="configs/tiny.toml", help="run config (default: configs/tiny.toml)")
    p.add_argument("--seed", type=int, default=1, help="seed of the failure schedule (default 1)")
    p.add_argument("--seconds", type=float, default=180, help="wall-clock budget of the run (default 180)")
    p.add_argument("--warmup", type=float, default=15, help="no fault before this many seconds (default 15)")
    p.add_argument("--cooldown", type=float, default=10,
                   help="every fault is repaired this many seconds before the end (default 10)")
    p.add_argument("--learners", type=int, help="learners (default: cluster.learners of the config, else 3)")
    p.add_argument("--regions", help="regions, comma-separated (default: cluster.regions)")
    p.add_argument("--mergers", type=int, help="merger instances (default: cluster.mergers, else 1)")
    p.add_argument("--learner-mtbf", type=float, default=60, help="kill -9 of a learner: mean up time (0: never; default 60)")
    p.add_argument("--learner-mttr", type=float, default=10, help="kill -9 of a learner: mean time to restart (default 10)")
    p.add_argument("--pause-mtbf", type=float, default=90, help="SIGSTOP of a learner: mean up time (0: never; default 90)")
    p.add_argument("--pause-mttr", type=float, default=5, help="SIGSTOP of a learner: mean time to SIGCONT (default 5)")
    p.add_argument("--term-mtbf", type=float, default=120,
                   help="SIGTERM of a learner or merger (a clean stop, then a restart): mean up time (0: never; "
                        "default 120)")
    p.add_argument("--term-mttr", type=float, default=5, help="SIGTERM stop: mean time to restart (default 5)")
    p.add_argument("--merger-mtbf", type=float, default=90, help="kill -9 of a merger: mean up time (0: never; default 90)")
    p.add_argument("--merger-mttr", type=float, default=5, help="kill -9 of a merger: mean time to restart (default 5)")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 3),
                   help="Kafka broker nodes; with 3, broker kills too (default 1: no broker faults)")
    p.add_argument("--broker-mtbf", type=float, default=60, help="kill of a broker node (--nodes 3): mean up time (default 60)")
    p.add_argument("--broker-mttr", type=float, default=10, help="kill of a broker node: mean time to restart (default 10)")
    p.add_argument("--sync", action="store_true",
                   help="synchronous DiLoCo on the same binaries: merger.quorum = learners, diloco.wait_steps = 0")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="config override for every process (repeatable)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run id>)")
    p.add_argument("--no-report", action="store_true", help="skip the text sample and the report")
    p.add_argument("--dry-run", action="store_true", help="print the schedule and exit")
    p.add_argument("--bin-dir", help="where the diloco binaries are (default: build/bin or $DILOCO_BIN_DIR)")
    run_local.add_python_learner_args(p)
    run_local.add_secure_args(p)
    args = p.parse_args(argv)
    if args.seconds <= args.warmup + args.cooldown:
        p.error("--seconds must be above --warmup + --cooldown")
    for name in ("learner_mttr", "pause_mttr", "merger_mttr", "broker_mttr"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    """scripts/chaos: the exit status (0 every check passes, 1 one fails, 2 the run could not be made)."""
    args = parse_args(argv)
    root = repository.root(exit_status=2)
    args.bin_dir = args.bin_dir or repository.default_bin_dir()
    # What run_local.cluster_from_args reads; the step budget is far away, the time budget decides.
    args.steps, args.tokens, args.speed_factors, args.max_seconds = 1_000_000, None, None, args.seconds
    config_path = args.config if os.path.isfile(args.config) else os.path.join(root, args.config)
    if not os.path.isfile(config_path):
        fail(f"no config file '{args.config}' (try configs/tiny.toml)")
    config = run_local.load_config(args.bin_dir, config_path, args.overrides)
    learners, _, mergers, _, _ = run_local.cluster_shape(config, args)
    if args.sync:
        args.overrides = [f"merger.quorum={learners}", "diloco.wait_steps=0"] + args.overrides
    faults = schedule(args, [f"learner-{i}" for i in range(learners)], [f"merger-{m}" for m in range(mergers)])
    say(f"seed {args.seed}: {len(faults)} faults in {args.seconds:.0f} s: " +
        ", ".join(f"{k} {sum(1 for f in faults if (f['target'].split('-')[0], f['kind']) == k_)}"
                  for k, k_ in (("learner kills", ("learner", "kill")), ("learner pauses", ("learner", "pause")),
                                ("learner stops", ("learner", "term")), ("merger kills", ("merger", "kill")),
                                ("merger stops", ("merger", "term")), ("broker kills", ("broker", "kill")))))
    if args.dry_run:
        for f in faults:
            print(json.dumps(f), flush=True)
        return 0
    cluster = run_local.cluster_from_args(args)
    with open(os.path.join(cluster.run_dir, "chaos_schedule.json"), "w") as f:
        json.dump({"seed": args.seed, "args": {k: v for k, v in vars(args).items() if k != "bin_dir"}, "faults": faults},
                  f, indent=1)
    codes, failure = {}, None
    try:
        cluster.prepare_secure()  # before a broker of several nodes starts: its certificate
        if args.nodes > 1:
            status = run_local.broker("status", check=False)
            up = sum(1 for line in status.stdout.splitlines() if line.startswith("node "))
            if status.returncode == 0 and up != args.nodes:
                fail(f"a {up}-node broker is running; --nodes {args.nodes} needs `scripts/broker stop` first "
                     "(or DILOCO_BROKER_PORT and DILOCO_BROKER_DIR of another cluster)")
            if status.returncode != 0:
                say(f"starting a {args.nodes}-node Kafka cluster")
                run_local.broker("start", "--nodes", str(args.nodes))
                cluster.started_broker = True
        cluster.prepare_broker()
        reason, codes, failure = run(args, cluster, faults)
        wall = time.time() - cluster.start_time
        result = analyse(cluster, args, faults, min(wall, args.seconds))
    except BaseException:
        cluster.kill()
        if cluster.started_broker:
            run_local.broker("stop", check=False)
        raise
    result.update(seed=args.seed, mode="sync" if args.sync else "decoupled", reason=reason, exit_codes=codes,
                  faults=len(faults), failure=failure)
    if failure:
        result["ok"] = False
        result["problems"].insert(0, failure)
    with open(os.path.join(cluster.run_dir, "chaos.json"), "w") as f:
        json.dump(result, f, indent=1)
    cluster.finish(reason, codes)
    if not args.no_report:
        cluster.sample_and_report()
    gp = result["goodput"]
    ga = result["goodput_of_available"]
    say(f"{'PASS' if result['ok'] else 'FAIL'}: goodput " + (f"{gp:.3f}" if gp is not None else "?") +
        " of the provisioned learner-seconds, " + (f"{ga:.3f}" if ga is not None else "?") + " of those the learners were up; "
        f"longest stall {result['longest_stall_seconds']} s ({result['longest_stall_while_a_merger_lives_seconds']} s "
        f"while a merger lived; a fragment's median merge interval {result['fragment_merge_interval_seconds']} s), final loss "
        f"{result['final_loss']}, {result['merges']} merges; checks {result['checks']}")
    for p in result["problems"][:10]:
        say(f"PROBLEM {p}")
    say(f"run folder: {cluster.run_dir} (chaos.json, chaos.jsonl)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
