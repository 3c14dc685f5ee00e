"""bench/chaos: scripts/chaos over many seeds, Decoupled against synchronous DiLoCo on the same
seeded schedules, at named failure rates; one run at a time. Writes summary.md and results.json
into the results folder (each run's folder, with its chaos.json and report, under runs/).

    bench/chaos --seeds 1-6 --rates low,high --modes decoupled,sync      # the comparison
    bench/chaos --seeds 7-12 --nodes 3 --modes decoupled                 # broker kills too
    bench/chaos --resume --out bench/results/chaos-...                   # continue
"""

import argparse
import json
import os
import subprocess
import sys
import time

from . import repository

# Failure rates: mean seconds up and to repair, per kind. A learner is down about
# mttr / (mtbf + mttr) of the time for each kind: "high" about 15% killed + 5% paused + 8%
# stopped with SIGTERM = 28%, "low" about 6% + 3% + 3% = 12%. "term" applies to learners and
# mergers alike (a clean stop at a random moment, then a restart).
RATES = {
    "low": {"learner": (120, 8), "pause": (150, 4), "merger": (120, 4), "broker": (90, 8), "term": (150, 5)},
    "high": {"learner": (45, 8), "pause": (90, 5), "merger": (60, 5), "broker": (45, 8), "term": (60, 5)},
}


def say(message):
    print(f"bench/chaos: {message}", file=sys.stderr, flush=True)


def seeds(text):
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def down_share(rate):
    (lu, lr), (pu, pr), (tu, tr) = RATES[rate]["learner"], RATES[rate]["pause"], RATES[rate]["term"]
    return lr / (lu + lr) + pr / (pu + pr) + tr / (tu + tr)


def command(args, rate, mode, seed, run_dir):
    r = RATES[rate]
    cmd = [os.path.join(repository.root(), "scripts", "chaos"), args.config, "--seed", str(seed),
           "--seconds", str(args.seconds),
           "--learners", str(args.learners), "--mergers", str(args.mergers), "--nodes", str(args.nodes),
           "--learner-mtbf", str(r["learner"][0]), "--learner-mttr", str(r["learner"][1]),
           "--pause-mtbf", str(r["pause"][0]), "--pause-mttr", str(r["pause"][1]),
           "--merger-mtbf", str(r["merger"][0]), "--merger-mttr", str(r["merger"][1]),
           "--broker-mtbf", str(r["broker"][0]), "--broker-mttr", str(r["broker"][1]),
           "--term-mtbf", str(r["term"][0]), "--term-mttr", str(r["term"][1]),
           "--run-dir", run_dir, "--no-report"]
    if mode == "sync":
        cmd.append("--sync")
    if not args.learner_evals:
        cmd += ["--set", "train.eval_every=0"]  # before --set, which may put it back
    for s in args.set:
        cmd += ["--set", s]
    return cmd


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summary(args, results, info):
    lines = ["# Chaos benchmark (`bench/chaos`)", "",
             f"Command: `{info['command']}`", "",
             f"Date: {info['date']} (started), {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())} (written)", "",
             f"Machine: `{info['machine']}`, `nproc` = {os.cpu_count()}; commit {info['commit']}", "",
             f"Config `{args.config}`, {args.learners} learners, {args.mergers} merger(s), {args.nodes} broker node(s), "
             f"{args.seconds:.0f} s per run, learners "
             + ("running their own evals" if args.learner_evals else "not evaluating (the evaluator process measures the loss)")
             + ". Rates (mean seconds up / to repair): "
             + "; ".join(f"**{n}**: " + ", ".join(f"{k} {u}/{d}" for k, (u, d) in r.items())
                         + f" (each learner down about {100 * down_share(n):.0f}% of the time)"
                         for n, r in RATES.items() if n in args.rates), "",
             "| rate | mode | seed | checks | faults | goodput | goodput of up time | longest stall s (merger alive) "
             "| a fragment's merge interval s | merges | final loss | deltas merged / sent |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        c = r.get("result") or {}
        d = c.get("deltas") or {}
        checks = "pass" if c.get("ok") else ("FAIL: " + ", ".join(k for k, v in (c.get("checks") or {}).items() if not v)
                                             if c else f"no result ({r.get('error', '')[:60]})")
        lines.append(f"| {r['rate']} | {r['mode']} | {r['seed']} | {checks} | {c.get('faults', '-')} | "
                     f"{fmt(c.get('goodput'))} | {fmt(c.get('goodput_of_available'))} | "
                     f"{c.get('longest_stall_seconds', '-')} ({c.get('longest_stall_while_a_merger_lives_seconds', '-')}) | "
                     f"{c.get('fragment_merge_interval_seconds', '-')} | {c.get('merges', '-')} | {fmt(c.get('final_loss'))} | "
                     f"{d.get('merged', '-')} / {d.get('sent', '-')} |")
    lines += ["", "## Means", "", "| rate | mode | runs | all checks pass | goodput | goodput of up time | "
              "longest stall s | final loss |", "|---|---|---:|---|---:|---:|---:|---:|"]
    for rate in args.rates:
        for mode in args.modes:
            rs = [r.get("result") for r in results if r["rate"] == rate and r["mode"] == mode and r.get("result")]
            if not rs:
                continue
            lines.append(f"| {rate} | {mode} | {len(rs)} | {sum(1 for x in rs if x['ok'])}/{len(rs)} | "
                         f"{fmt(mean([x['goodput'] for x in rs]))} | {fmt(mean([x['goodput_of_available'] for x in rs]))} | "
                         f"{fmt(mean([x['longest_stall_seconds'] for x in rs]), 1)} | {fmt(mean([x['final_loss'] for x in rs]))} |")
    lines += ["", "Goodput = learner compute whose deltas were merged over the learner-seconds provisioned (every "
              "learner slot from its first inner step to the end of the budget, down or not); \"of up time\" divides by the learner-seconds the learners were not killed "
              "or paused. Checks: `diloco-replay audit` and `verify`, adoptions against the merge log (scripts/chaos)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """bench/chaos: the exit status (0 when every run passed its checks)."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="bench/chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--seeds", type=seeds, default=seeds("1-3"), help="e.g. 1-6 or 1,4,9 (default 1-3)")
    p.add_argument("--rates", default="high", help=f"comma-separated of {', '.join(RATES)} (default high)")
    p.add_argument("--modes", default="decoupled,sync", help="decoupled, sync or both (default both)")
    p.add_argument("--seconds", type=float, default=120, help="wall-clock budget of each run (default 120)")
    p.add_argument("--learners", type=int, default=3)
    p.add_argument("--mergers", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1, choices=(1, 3))
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="config override of every run")
    p.add_argument("--learner-evals", action="store_true",
                   help="let every learner run its own held-out evals (train.eval_every of the config). By default "
                        "they do not, as in bench/quality: the cluster's evaluator process measures the held-out loss "
                        "of the merged model, and evals on the learners would take their time from training "
                        "(about 8%% on tiny)")
    p.add_argument("--out")
    p.add_argument("--resume", action="store_true", help="keep the runs that have a chaos.json")
    args = p.parse_args(argv)
    root = repository.root()
    args.out = args.out or os.path.join(root, "bench", "results", time.strftime("chaos-%Y%m%d-%H%M%S"))
    args.rates = [r for r in args.rates.split(",") if r]
    args.modes = [m for m in args.modes.split(",") if m]
    for r in args.rates:
        if r not in RATES:
            p.error(f"unknown rate {r} (known: {', '.join(RATES)})")
    for m in args.modes:
        if m not in ("decoupled", "sync"):
            p.error(f"unknown mode {m}")
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    info = {"command": "bench/chaos " + " ".join(argv), "date": time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime()),
            "machine": " ".join(os.uname()), "commit": commit}
    plan = [(rate, seed, mode) for rate in args.rates for seed in args.seeds for mode in args.modes]
    say(f"{len(plan)} runs of {args.seconds:.0f} s; results in {args.out}")
    results = []
    for i, (rate, seed, mode) in enumerate(plan, 1):
        run_dir = os.path.join(args.out, "runs", f"{rate}-{mode}-s{seed}")
        result_path = os.path.join(run_dir, "chaos.json")
        entry = {"rate": rate, "mode": mode, "seed": seed, "run_dir": os.path.relpath(run_dir, args.out)}
        if not (args.resume and os.path.exists(result_path)):
            cmd = command(args, rate, mode, seed, run_dir)
            say(f"[{i}/{len(plan)}] {rate} {mode} seed {seed}: started")
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(args.out, "runs", f"{rate}-{mode}-s{seed}.log"), "w") as log:
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root).returncode
            entry["exit_code"] = code
        try:
            with open(result_path) as f:
                entry["result"] = json.load(f)
            c = entry["result"]
            say(f"[{i}/{len(plan)}] {rate} {mode} seed {seed}: {'pass' if c['ok'] else 'FAIL'}, goodput {fmt(c['goodput'])} "
                f"({fmt(c['goodput_of_available'])} of up time), longest stall {c['longest_stall_seconds']} s, "
                f"loss {fmt(c['final_loss'])}")
        except (OSError, ValueError) as e:
            entry["error"] = f"no chaos.json: {e}"
            say(f"[{i}/{len(plan)}] {rate} {mode} seed {seed}: no result (see runs/{rate}-{mode}-s{seed}.log)")
        results.append(entry)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"info": info, "args": vars(args), "rates": RATES, "runs": results}, f, indent=1)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(summary(args, results, info))
    say(f"summary: {os.path.join(args.out, 'summary.md')}")
    return 0 if all(r.get("result", {}).get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
