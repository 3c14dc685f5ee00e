"""WAN benchmark: wall clock to a target held-out loss of Decoupled DiLoCo, synchronous DiLoCo and
per-step synchronous averaging, with every region behind a rate-limited link (scripts/wan-sim),
at several link rates, on the same model, seed and token budget.

Run by bench/wan (or diloco-bench-wan) with the project's Python (standard library); needs root
(scripts/wan-sim).

    bench/wan --rates 2860kbit,715kbit --target 2.3          # the scaled rate and 4x lower (docs/wan.md)
    bench/wan --modes decoupled --rates 2860kbit --dry-run   # the commands, nothing run
    bench/wan --speed-factors 1,2 --deep-target 0.8 --modes sync,decoupled,single --rates 2860kbit
                                                             # one learner at half speed, time budget

Learners of different speed (--speed-factors, learner i slowed by the i-th factor) are the case
Decoupled DiLoCo exists for. With --deep-target F the target is not a fixed loss: synchronous
DiLoCo runs first on its step budget (the slowest learner paces it), and the target is the best
held-out loss it reached by F of its training time; every other mode then gets the wall clock that
synchronous DiLoCo's learners took as its budget (its learners train until then, the step budget
lifted, the same learning-rate schedule), since what a user pays for is time on every island, and
a fast learner of synchronous DiLoCo spends that time waiting. The mode `single` is one learner
alone (the first, at its speed) under the same budget.

Each run is one scripts/wan-sim on configs/tiny.toml (2 learners in regions eu and us, one merger and
the evaluator in the core namespace) with the overrides of bench/quality's row of that mode. Measured
per run, from the processes' metrics.jsonl:
- seconds to target: from the first learner's start to the first evaluation of the global model
  (the evaluator, every `cluster.eval_interval` s) at or below --target; and the same from the
  moment training began (the first learner's first logged step less the compute and wait seconds
  before it), without the start-up (Kafka, topics, the wait for version 0) that every mode pays;
- bytes per token, both directions: what the learners sent (deltas) and received (parameters), and
  the same counting every byte of their Kafka sockets too, over the tokens they trained;
- utilisation: the learners' compute seconds over their wall seconds from their first logged step
  (every 10 steps) to their stop, summed over the learners (start-up excluded), and the seconds
  they waited for merges (from their `stop` events).
- staleness: versions of a fragment between a merged delta's base and its merge, and inputs per
  merge, from the mergers' merge events.
The results folder gets one folder per run (runs/<rate>-<mode>/), results.json, summary.md and one
plot per rate (held-out loss against wall clock, every mode).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from . import bench_quality  # the rows' overrides: one definition of each mode
from . import repository
from .report import Plotter
from .run_local import read_jsonl

MODES = {
    "decoupled": "Decoupled K=1+grace (int4, aligned) nesterov",
    "single": "one learner (Decoupled's settings)",
    "sparse": bench_quality.SPARSE_ROW,  # the same with configs/demo.toml's sparse deltas and outer SGD
    "sync": "sync DiLoCo (int4)",
    "perstep": "per-step sync avg (fp32)",
}
LEARNERS = 2
ROW_OF = {"single": "decoupled"}  # a mode that runs another mode's row with one learner
# With --deep-target, a run under a time budget may take this many times its step budget's steps.
UNBOUNDED_STEPS = 100


def say(message):
    print(f"bench/wan: {message}", flush=True)


def learners_of(mode):
    return 1 if mode == "single" else LEARNERS


def overrides_of(mode):
    row = next(r for r in bench_quality.ROWS if r["name"] == MODES[ROW_OF.get(mode, mode)])
    return [o.replace("{M}", str(learners_of(mode))) for o in row["overrides"]]


def parse_mode_sets(items, modes):
    """--mode-set MODE:K=V items as {mode: [K=V, ...]}; exits with a message on a malformed item."""
    out = {}
    for item in items:
        mode, sep, kv = item.partition(":")
        if not sep or "=" not in kv or mode not in MODES:
            sys.exit(f"bench/wan: --mode-set {item!r}: expected MODE:KEY=VALUE with MODE one of {', '.join(MODES)}")
        if mode not in modes:
            say(f"note: --mode-set {item} is for mode {mode}, which --modes does not run")
        out.setdefault(mode, []).append(kv)
    return out


def command(args, mode, rate, run_dir, time_budget=None):
    """The scripts/wan-sim command of one run. time_budget (seconds): the learners train until then
    (each learner's --max-seconds), the step budget lifted; else the step budget args.steps."""
    n = learners_of(mode)
    steps = args.steps * UNBOUNDED_STEPS if time_budget else args.steps
    max_seconds = f"{time_budget:.1f}" if time_budget else str(args.max_seconds)
    cmd = [os.path.join(repository.root(), "scripts", "wan-sim"), args.config, "--rate", rate,
           "--learners", str(n),
           "--regions", "eu,us" if n > 1 else "eu", "--steps", str(steps), "--run-dir", run_dir, "--no-report",
           "--max-seconds", max_seconds, "--tag", f"ddb{os.getpid() % 10000}"]
    if args.speed_factors:
        cmd += ["--speed-factors", ",".join(f"{f:g}" for f in args.speed_factors[:n])]
    # train.total_steps stays the step budget: every mode has the same learning-rate schedule.
    for o in bench_quality.CLUSTER_COMMON[:1] + [f"cluster.eval_interval={args.eval_interval}",
                                                 f"train.total_steps={args.steps}", f"run.seed={args.seed}"] \
            + overrides_of(mode) + args.set + args.mode_sets.get(mode, []):
        cmd += ["--set", o]
    return cmd


def deep_target(result, fraction):
    """(target, seconds): the best held-out loss a run reached by `fraction` of its training time
    (from the moment training began to its last learner's stop), and that moment in seconds since
    its first learner started; (None, None) if the run has no such evaluation."""
    start, end = result.get("startup_seconds"), result.get("last_stop_seconds")
    if start is None or end is None:
        return None, None
    at = start + fraction * (end - start)
    losses = [loss for t, loss in result.get("curve", []) if t <= at]
    return (min(losses), round(at, 2)) if losses else (None, None)


def measure(run_dir, target, learners=LEARNERS):
    learners = [f"learner-{i}" for i in range(learners)]
    events = {n: read_jsonl(os.path.join(run_dir, n, "metrics.jsonl")) for n in learners + ["eval"]}
    # Each learner's first start and last stop (a learner started again has several).
    first_start = {n: next((e["time_us"] for e in events[n] if e.get("event") == "start"), None) for n in learners}
    last_stop = {n: next((e for e in reversed(events[n]) if e.get("event") == "stop"), None) for n in learners}
    starts = [t for t in first_start.values() if t is not None]
    if not starts:
        return {"error": "no learner started"}
    t0 = min(starts)
    # When training began: a learner's first logged step (step 10) less the compute and wait
    # seconds it took to get there; the earliest learner's.
    first_step = {n: next((e for e in events[n] if e.get("event") == "step" and "compute_seconds" in e), None)
                  for n in learners}
    trained = [e["time_us"] - 1e6 * (e["compute_seconds"] + e.get("wait_seconds", 0.0)) for e in first_step.values() if e]
    t_train = min(trained) if trained else None
    evals = [(e["time_us"], e["eval_loss"]) for e in events["eval"] if e.get("event") == "global_eval"]
    # Compared as the curve keeps them (4 decimals): a --deep-target is read off the curve.
    reached = next((t for t, loss in evals if round(loss, 4) <= target), None)
    out = {"seconds_to_target": round((reached - t0) / 1e6, 1) if reached is not None else None,
           "training_seconds_to_target": round((reached - t_train) / 1e6, 1) if reached is not None and t_train else None,
           "startup_seconds": round((t_train - t0) / 1e6, 1) if t_train else None,
           "final_loss": round(evals[-1][1], 4) if evals else None,
           "best_loss": round(min(l for _, l in evals), 4) if evals else None,
           "curve": [[round((t - t0) / 1e6, 2), round(l, 4)] for t, l in evals]}
    if reached is not None:  # tokens trained by then: each learner's last logged step before it
        out["tokens_to_target"] = sum(
            max((e.get("tokens", 0) for e in events[n] if e.get("event") == "step" and e["time_us"] <= reached),
                default=0) for n in learners)
    stops = [e["time_us"] for e in last_stop.values() if e]
    lifetimes = [(last_stop[n]["time_us"] - first_start[n]) / 1e6 for n in learners
                 if first_start[n] is not None and last_stop[n]]
    out["last_stop_seconds"] = round((max(stops) - t0) / 1e6, 2) if stops else None
    # The longest a learner ran, from its start to its stop: the time budget of --deep-target's runs.
    out["learner_seconds_max"] = round(max(lifetimes), 2) if lifetimes else None
    sent = received = kafka_sent = kafka_received = tokens = compute = wait = wall = 0
    for n in learners:
        stop = last_stop[n]
        shutdown = [e for e in events[n] if e.get("event") == "shutdown"]
        if stop:
            tokens += stop.get("tokens", 0)
            wait += stop.get("wait_seconds", 0.0)
            first = first_step[n]
            if first:  # the training phase: from the first logged step to the stop (start-up excluded)
                compute += stop.get("compute_seconds", 0.0) - first["compute_seconds"]
                wall += stop["t"] - first["t"]
        if shutdown:
            s = shutdown[-1]
            sent += s.get("bytes_sent", 0)
            received += s.get("bytes_received", 0)
            kafka_sent += s.get("kafka_sent", 0)
            kafka_received += s.get("kafka_received", 0)
    out.update(tokens=tokens, compute_seconds=round(compute, 1), wait_seconds=round(wait, 1),
               training_wall_seconds=round(wall, 1),
               utilisation=round(compute / wall, 3) if wall > 0 else None,
               bytes_up=sent, bytes_down=received, kafka_sent=kafka_sent, kafka_received=kafka_received,
               bytes_per_token_up=round(sent / tokens, 3) if tokens else None,
               bytes_per_token_down=round(received / tokens, 3) if tokens else None,
               socket_bytes_per_token=round((kafka_sent + kafka_received + received) / tokens, 3) if tokens else None)
    # How late deltas met the global model: their staleness (versions of their fragment between
    # their base and the merge) and how many met in one merge, from every merger's merge events.
    merges = [e for d in sorted(os.listdir(run_dir)) if d.startswith("merger-")
              for e in read_jsonl(os.path.join(run_dir, d, "metrics.jsonl")) if e.get("event") == "merge"]
    staleness = [i.get("staleness", 0) for e in merges for i in e.get("inputs", [])]
    out.update(merges=len(merges),
               inputs_per_merge=round(len(staleness) / len(merges), 2) if merges else None,
               staleness_mean=round(sum(staleness) / len(staleness), 2) if staleness else None,
               staleness_max=max(staleness) if staleness else None)
    return out


def write_plots(args, results, out_dir):
    """One plot per rate: the global model's held-out loss against seconds since the first learner
    started, every mode, the target as a line; log time, since the modes differ by 10x and more."""
    try:
        plotter = Plotter(out_dir)
    except ImportError:
        say("no matplotlib (python3-matplotlib): no plots")
        return []
    names = []
    for rate in args.rates:
        runs = [(mode, results[f"{rate}-{mode}"]) for mode in args.modes if results.get(f"{rate}-{mode}", {}).get("curve")]
        if not runs:
            continue
        fig, ax = plotter.figure(f"Held-out loss of the global model, every region behind {rate}",
                                 "seconds since the first learner started (log)", "held-out loss (nats/char)")
        for mode, r in runs:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, label=MODES[mode])
        target = results.get(f"{rate}-deep-target", {}).get("target", args.target)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xscale("log")
        ax.set_ylim(top=min(4.8, max(y for _, r in runs for _, y in r["curve"]) + 0.1))
        ax.legend(fontsize=8)
        name = f"heldout_vs_time_{rate}.png"
        plotter.save(fig, name)
        names.append(name)
    return names


def write_summary(args, results, path, argv):
    speeds = (f"learner speed factors {','.join(f'{f:g}' for f in args.speed_factors)} (2 = half speed)"
              if args.speed_factors else "every learner at full speed")
    if args.deep_target:
        budget = (f"the target is the best held-out loss synchronous DiLoCo reached by {args.deep_target:g} of its "
                  f"training time on its step budget of S = {args.steps} steps per learner; the other modes train "
                  f"until the time sync DiLoCo's learners took (the same schedule of {args.steps} steps)")
    else:
        budget = f"S = {args.steps} steps per learner at most, target held-out loss {args.target}"
    lines = ["# WAN benchmark (`bench/wan`)", "",
             f"Command: `bench/wan {' '.join(argv)}`", "",
             f"Date: {time.strftime('%a %b %d %H:%M:%S %Z %Y')}; machine: `{' '.join(os.uname())}`, `nproc` = {os.cpu_count()}",
             "",
             f"Config `{args.config}`, {LEARNERS} learners (regions eu, us: one each behind its link; mode `single`: "
             f"one, in eu), {speeds}; seed {args.seed}; {budget}; evaluator every {args.eval_interval} s, each run at "
             f"most {args.max_seconds} s.", ""]
    for rate in args.rates:
        deep = results.get(f"{rate}-deep-target")
        if deep:
            lines.append(f"- {rate}: target **{deep['target']}** (sync DiLoCo's best by {deep['at_seconds']} s), "
                         f"time budget {deep['time_budget']} s per learner")
    lines += ["", "| rate | mode | s to target (training s) | vs Decoupled (training) | tokens to target | final loss | "
              "tokens | utilisation | wait s | B/token up | B/token down | socket B/token | inputs/merge | "
              "staleness mean (max) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate in args.rates:
        base = results.get(f"{rate}-decoupled", {})
        for mode in args.modes:
            r = results.get(f"{rate}-{mode}")
            if not r:
                continue
            t, tt = r.get("seconds_to_target"), r.get("training_seconds_to_target")
            ratio = (f"{t / base['seconds_to_target']:.2f}x ({tt / base['training_seconds_to_target']:.2f}x)"
                     if t and tt and base.get("seconds_to_target") and base.get("training_seconds_to_target") else "-")
            lines.append(f"| {rate} | {MODES[mode]} | {f'{t} ({tt})' if t is not None else 'not reached'} | {ratio} | "
                         f"{r.get('tokens_to_target', '-')} | "
                         f"{r.get('final_loss')} | {r.get('tokens')} | {r.get('utilisation')} | {r.get('wait_seconds')} | "
                         f"{r.get('bytes_per_token_up')} | {r.get('bytes_per_token_down')} | {r.get('socket_bytes_per_token')} | "
                         f"{r.get('inputs_per_merge')} | {r.get('staleness_mean')} ({r.get('staleness_max')}) |")
    lines += ["", "Modes and their overrides (bench/quality's rows):", ""]
    for mode in args.modes:
        lines.append(f"- {MODES[mode]}: `{' '.join(overrides_of(mode) + args.mode_sets.get(mode, []))}`")
    plots = write_plots(args, results, os.path.dirname(path))
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    """bench/wan: runs (or with --dry-run prints) every rate and mode and writes the summary; the exit
    status."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="bench/wan", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--rates", default="2860kbit,715kbit",
                   help="link rates, comma-separated, as tc writes them (default: the scaled rate of docs/wan.md's "
                        "'Scaling across regions' and 4x less)")
    p.add_argument("--modes", default="decoupled,sync,perstep", help="comma-separated of " + ", ".join(MODES))
    p.add_argument("--steps", type=int, default=400, help="steps per learner (the token budget; default 400)")
    p.add_argument("--target", type=float, default=2.3, help="target held-out loss of the global model (default 2.3)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-interval", type=float, default=1.0, help="seconds between the evaluator's evaluations")
    p.add_argument("--max-seconds", type=int, default=1200, help="time budget of each run (default 1200)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="config override of every run")
    p.add_argument("--mode-set", action="append", default=[], metavar="MODE:K=V",
                   help="config override of one mode's runs (repeatable), e.g. decoupled:merger.outer_momentum=0.7 "
                        "(each mode's tuned point from bench/quality --tune)")
    p.add_argument("--speed-factors", help="per-learner slow-down factors, comma-separated (e.g. 1,2: the second "
                                           "learner at half speed; default: all at full speed)")
    p.add_argument("--deep-target", type=float, metavar="F",
                   help="instead of --target: the best loss synchronous DiLoCo reaches by F (e.g. 0.8) of its "
                        "training time; the other modes run on the time sync's learners took (needs mode sync)")
    p.add_argument("--out")
    p.add_argument("--resume", action="store_true", help="keep the runs that have a result")
    p.add_argument("--reanalyse", action="store_true", help="measure the runs of --out again (e.g. for another --target)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    root = repository.root()
    args.out = args.out or os.path.join(root, "bench", "results", f"wan-{time.strftime('%Y%m%d-%H%M%S')}")
    args.rates = [r for r in args.rates.split(",") if r]
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            sys.exit(f"bench/wan: unknown mode '{m}' (expected one of {', '.join(MODES)})")
    args.mode_sets = parse_mode_sets(args.mode_set, args.modes)
    try:
        args.speed_factors = [float(f) for f in args.speed_factors.split(",")] if args.speed_factors else []
    except ValueError:
        sys.exit(f"bench/wan: --speed-factors {args.speed_factors!r}: expected numbers >= 1, comma-separated")
    if any(f < 1 for f in args.speed_factors):
        sys.exit(f"bench/wan: --speed-factors {args.speed_factors}: each factor must be >= 1 (2 = half speed)")
    if args.deep_target is not None:
        if not 0 < args.deep_target <= 1:
            sys.exit(f"bench/wan: --deep-target {args.deep_target}: expected a fraction in (0, 1]")
        if "sync" not in args.modes:
            sys.exit("bench/wan: --deep-target takes its target from synchronous DiLoCo: add sync to --modes")
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.json")
    results = json.load(open(results_path)) if (args.resume or args.reanalyse) and os.path.exists(results_path) else {}

    def save():
        with open(results_path, "w") as f:
            json.dump(results, f, indent=2)

    for rate in args.rates:
        target, budget = args.target, None
        # With --deep-target, synchronous DiLoCo first: it sets the target and the others' time budget.
        modes = sorted(args.modes, key=lambda m: m != "sync") if args.deep_target else args.modes
        for mode in modes:
            key = f"{rate}-{mode}"
            run_dir = os.path.join(args.out, "runs", key)
            if args.dry_run and args.deep_target and mode != "sync":
                budget = float(args.max_seconds)  # a stand-in: the sync run's time is not known yet
            cmd = command(args, mode, rate, run_dir, budget)
            if args.dry_run:
                if args.deep_target and mode != "sync":
                    print("# with the time budget that the sync run takes (--max-seconds here is a stand-in):")
                print(" ".join(cmd))
                continue
            n = learners_of(mode)
            if args.reanalyse:  # measure again what ran, run nothing
                if key in results:
                    results[key] = {**measure(run_dir, target, n), "exit_code": results[key].get("exit_code"),
                                    "time_budget": results[key].get("time_budget")}
            elif not (key in results and args.resume):
                if os.path.exists(run_dir):  # an earlier attempt of this run (stopped, or without a result)
                    shutil.rmtree(run_dir)
                say(f"{key}: started" + (f" (time budget {budget:.1f} s, target {target})" if budget else ""))
                with open(os.path.join(args.out, f"{key}.log"), "w") as log:
                    code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root).returncode
                results[key] = {**measure(run_dir, target, n), "exit_code": code, "time_budget": budget}
                r = results[key]
                say(f"{key}: exit {code}, to target {r.get('seconds_to_target')} s, final loss {r.get('final_loss')}, "
                    f"utilisation {r.get('utilisation')}, bytes/token up {r.get('bytes_per_token_up')} down "
                    f"{r.get('bytes_per_token_down')}")
            if args.deep_target and mode == "sync" and key in results:
                deep, at = deep_target(results[key], args.deep_target)
                budget = results[key].get("learner_seconds_max")
                if deep is None or not budget:
                    say(f"{key}: no evaluation by {args.deep_target:g} of its training time, or no learner stopped: "
                        f"no deep target at {rate} (see {run_dir})")
                    break
                target = deep
                results[f"{rate}-deep-target"] = dict(target=deep, at_seconds=at, fraction=args.deep_target,
                                                       time_budget=budget)
                results[key] = {**measure(run_dir, target, n), "exit_code": results[key].get("exit_code"),
                                "time_budget": None}
                say(f"{rate}: deep target {deep} (sync DiLoCo's best by {at} s), time budget of the others {budget} s")
            if not args.dry_run:
                save()
    if not args.dry_run:
        write_summary(args, results, os.path.join(args.out, "summary.md"), argv)
        say(f"summary: {os.path.join(args.out, 'summary.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
