"""Quality benchmark: the global model's held-out loss of Decoupled DiLoCo against one learner,
one learner with M times the steps, data parallel at equal tokens, synchronous DiLoCo and per-step
synchronous averaging, on the same number of inner steps per learner, with fixed seeds.

Data parallel is run as what it is exactly: one learner with batch M x b for S steps (the
gradient of M learners' batches averaged every step, one optimizer state), its learning rate
from a grid (x1, x1.4, x2, x2.8, x4 of the config's); E_DP = (L_1 - L) / (L_1 - L_DP) is the share of its
gain over one learner that a row recovers, L_DP the best point of the grid.

Run by bench/quality (or diloco-bench-quality) with the project's Python (standard library and
python3-matplotlib).

    bench/quality --quick                       # M=2, one seed, thirteen rows, S=400
    bench/quality                               # M=2,4, seeds 1,2,3 for the headline rows
    bench/quality --rows "one learner,sync DiLoCo (fp32)" --m 2 --steps 100 --seeds 1
    bench/quality --decoupled-set diloco.cut_on_arrival=0.5 --set merger.grace_cap_steps=3
    bench/quality --dry-run                     # the runs and their commands, nothing run
    bench/quality --resume --out bench/results/quality-...   # continue an interrupted benchmark

Every row's overrides are in ROWS below. Cluster runs go through run_local (one merger,
M learners over the regions eu,us, one --eval-only learner); standalone runs are one
diloco-learner --standalone (no Kafka). The results folder gets one folder per run
(runs/M<m>/<row>-s<seed>/, with the processes' logs and metrics.jsonl and the run's result.json),
results.json, summary.md and the plots loss_vs_steps_M<m>.png and loss_vs_tokens_M<m>.png.
"""

import argparse
import bisect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from . import repository
from .run_local import read_jsonl

# ---- what is run --------------------------------------------------------------------------------

# The outer optimizers of the "Decoupled K=1+grace (int4, aligned)" rows, one row each.
# Each with the overrides it needs. dn's lr is per merge and it applies g / N between folds, so it
# gets lr x N (N = merger.dn_period = 2), as HALoS does: 1.4 gave 2.116 against 2.208 with 0.7
# (tiny, M = 2, S = 400, seed 1). Adam (cgad) steps about lr per element: of 0.005, 0.02 and 0.08,
# 0.02 was best (2.413, 2.312, 2.467); bench/RESULTS.md has the runs.
OPTIMIZERS = {"nesterov": [], "dn": ["merger.outer_lr=1.4"], "cgad": ["merger.outer_lr=0.02"]}

# "{M}" in an override is replaced by the number of learners of the run.
# The rows' codecs mean the same on every config: a dense row sets no top-k and tiny's int4 blocks
# of 64 also on a config with sparse deltas (configs/demo.toml), where an fp32 row would otherwise
# be refused (a top-k needs int8 or int4) and an int4 row would send the config's sparse form.
DENSE = ["codec.topk=0", "codec.downlink_topk=0"]
FP32 = ["codec.dtype=fp32", "codec.downlink_dtype=fp32"] + DENSE
INT4 = ["codec.dtype=int4", "codec.downlink_dtype=int4", "codec.block_size=64", "codec.downlink_block_size=64"] + DENSE
DECOUPLED_BASE = ["merger.quorum=1", "diloco.stagger=false"] + INT4
# The Decoupled rows run the defaults (diloco.adopt = rebase, diloco.cut_on_arrival = 0.5,
# merger.grace_tau = 4, merger.grace_cap_steps = 2); --decoupled-set adds to them.
DECOUPLED_POLICY = []
# What the learners did before schedules met: staggered, overwrite on adoption, no early cuts.
STAGGERED = ["merger.quorum=1", "diloco.stagger=true"] + INT4 + ["codec.downlink_dtype=fp32",
             "merger.optimizer=nesterov",
             "diloco.adopt=overwrite", "diloco.cut_on_arrival=0", "merger.grace_tau=2", "merger.grace_cap_steps=1"]


def decoupled_name(optimizer):
    return f"Decoupled K=1+grace (int4, aligned) {optimizer}"


# Sparse deltas as configs/demo.toml sends them: the 96 largest values of every block of 1024 in
# int4 (the rest stays in the learner's error-feedback residual), updates in int4 blocks of 1024,
# plain outer SGD at lr 2. On tiny (S = 800, M = 2, seeds 1-2) with 128 of 1024 kept: Nesterov
# 1.98, SGD at lr 1.0 / 1.5 / 2.0: 1.84 / 1.76 / 1.75; 96 kept, SGD 2: 1.79; dense int4 with
# Nesterov 1.75 (bench/RESULTS.md, "Sparse deltas").
SPARSE_ROW = "Decoupled sparse (top-k 96/1024, sgd 2)"
SPARSE = ["codec.block_size=1024", "codec.topk=96", "codec.downlink_block_size=1024", "codec.zstd_level=15",
          "merger.optimizer=sgd", "merger.outer_lr=2.0"]

# Every row: name; kind (standalone or cluster); steps as a multiple of S (standalone only);
# overrides; decoupled (gets --decoupled-set); headline (run with every seed, else the first one);
# only_m (run only at these M); quick (part of --quick); half_speed (one learner at half speed, with
# the wall-clock budget of the homogeneous "Decoupled ... nesterov" run of the same seed).
# Data parallel at equal tokens: one learner, batch M x b, S steps, the learning rate of the config
# times each of DP_LR_GRID (dp_lr): a row each. The grid grew while its best point was at its edge
# (a baseline tuned at the edge of its grid is undertuned): x2 beat x1 and x1.4 (tiny, M = 2,
# S = 400), then x2.8 beat x2 (S = 800, seeds 101-103: 1.498 against 1.517).
DP_LR_GRID = (1.0, 1.4, 2.0, 2.8, 4.0)


def dp_name(mult):
    return f"data parallel (batch M x b, lr x{mult:g})"


ROWS = [
    dict(name="one learner", kind="standalone", steps_mult=1, overrides=[], headline=True, quick=True),
    dict(name="one learner x M steps", kind="standalone", steps_mult="M", overrides=[], headline=True, quick=True),
] + [
    dict(name=dp_name(mult), kind="standalone", steps_mult=1, overrides=[], dp_lr=mult, headline=True, quick=True)
    for mult in DP_LR_GRID
] + [
    dict(name="per-step sync avg (fp32)", kind="cluster",
         overrides=["diloco.H=1", "diloco.fragments=1", "merger.quorum={M}", "diloco.wait_steps=0",
                    *FP32, "merger.optimizer=sgd", "merger.outer_lr=1", "merger.rule=avg",
                    "merger.share_scaling=false"]),
    dict(name="sync DiLoCo (fp32)", kind="cluster", headline=True, quick=True,
         overrides=["merger.quorum={M}", "diloco.wait_steps=0", *FP32, "merger.optimizer=nesterov"]),
    dict(name="sync DiLoCo (int4)", kind="cluster",
         overrides=["merger.quorum={M}", "diloco.wait_steps=0", *INT4, "merger.optimizer=nesterov"]),
] + [
    dict(name=decoupled_name(opt), kind="cluster", decoupled=True, headline=(opt == "nesterov"),
         quick=(opt == "nesterov"), overrides=DECOUPLED_BASE + DECOUPLED_POLICY + [f"merger.optimizer={opt}"] + extra)
    for opt, extra in OPTIMIZERS.items()
] + [
    dict(name="Decoupled staggered", kind="cluster", quick=True, overrides=STAGGERED),
] + [
    # The downlink's codec: the Decoupled nesterov row (int4 both ways) with int8 or fp32 updates.
    dict(name=f"Decoupled, {dtype} downlink", kind="cluster", decoupled=True, quick=True,
         overrides=DECOUPLED_BASE + DECOUPLED_POLICY + ["merger.optimizer=nesterov", f"codec.downlink_dtype={dtype}"])
    for dtype in ("int8", "fp32")
] + [
    # configs/demo.toml's codec: sparse deltas (top-k with error feedback) and plain outer SGD.
    dict(name=SPARSE_ROW, kind="cluster", decoupled=True, headline=True, quick=True,
         overrides=DECOUPLED_BASE + DECOUPLED_POLICY + SPARSE),
    dict(name="Decoupled avg rule", kind="cluster", decoupled=True,
         overrides=DECOUPLED_BASE + DECOUPLED_POLICY + ["merger.optimizer=nesterov", "merger.rule=avg"]),
    dict(name="Decoupled alpha 0.5", kind="cluster", decoupled=True,
         overrides=DECOUPLED_BASE + DECOUPLED_POLICY + ["merger.optimizer=nesterov", "merger.staleness_alpha=0.5"]),
    dict(name="Decoupled, one learner at half speed", kind="cluster", decoupled=True, only_m=[4], half_speed=True,
         overrides=DECOUPLED_BASE + DECOUPLED_POLICY + ["merger.optimizer=nesterov"]),
]
HOMOGENEOUS = decoupled_name("nesterov")  # the wall-clock reference of the half-speed row

# Tuning (--tune): every mode compared in the headline gets a grid of the same size over its outer
# optimizer, run on tuning seeds that are then never reported; --tuned applies each mode's best
# point to the report run. Data parallel's grid is its learning rate (the DP rows).
# Widened the same way: Decoupled's best of lr 0.5-1.0 x momentum 0.8-0.9 was lr 1.0, momentum 0.8;
# then both modes' best of momentum 0.7-0.9 was 0.7.
OUTER_GRID = [[f"merger.outer_lr={lr:g}", f"merger.outer_momentum={mom:g}"]
              for lr in (0.5, 0.7, 1.0, 1.4) for mom in (0.5, 0.6, 0.7, 0.8, 0.9)]
TUNED_ROWS = {"sync DiLoCo (fp32)": OUTER_GRID, decoupled_name("nesterov"): OUTER_GRID}
TUNE_SEEDS_HINT = "101,102,103"


def grid_label(point):
    """'outer_lr=0.7 outer_momentum=0.9' for a grid point's overrides."""
    return " ".join(o.split(".", 1)[1] for o in point)
SYNC_REFERENCE = "sync DiLoCo (fp32)"
# Overrides of every cluster run: the learners skip their own held-out evals (the evaluator measures
# the global model) and the evaluator measures often enough for a curve.
CLUSTER_COMMON = ["train.eval_every=0", "cluster.eval_interval=2"]
HALF_SPEED_FACTORS = "1,1,1,2"
HALF_SPEED_STEPS_MULT = 10  # its --steps: large, the time budget stops it

# The learners' `stop` event fields read for the utilisation (the first one present is used).
STOP_WAIT_KEYS = ["wait_seconds"]
STOP_COMPUTE_KEYS = ["compute_seconds"]

DEFAULT_STEPS = 800  # full mode
QUICK_STEPS = 400
# Seconds per inner step (per learner) and fixed seconds per run, measured on tiny on this 2-core
# machine while other jobs were compiling (load average 6-8; a quiet machine is 2-3x faster). Only
# used for the time estimate; the ETA is corrected by the runs already done.
EST_STANDALONE_STEP = 0.10  # eval every S/10 steps included
EST_STANDALONE_FIXED = 3.0
EST_CLUSTER_STEP = {1: 0.08, 2: 0.11, 4: 0.22}  # per M, at H=40
EST_CLUSTER_FIXED = 25.0  # topics (Kafka's Java tool), start-up, drain, shutdown
EST_PER_STEP_SYNC_FACTOR = 1.5  # per-step sync: a merge transaction per step


def say(message):
    print(message, flush=True)


def slug(name):
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def duration(seconds):
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# ---- the plan -----------------------------------------------------------------------------------

class Run:
    def __init__(self, row, m, seed, steps, args):
        self.row, self.m, self.seed, self.args = row, m, seed, args
        self.name = row["name"]
        self.kind = row["kind"]
        self.dir = os.path.join(args.out, "runs", f"M{m}", f"{slug(self.name)}-s{seed}")
        mult = row.get("steps_mult", 1)
        mult = m if mult == "M" else int(mult)
        self.steps = steps * mult  # steps of each learner (the budget; the half-speed row uses time)
        self.schedule_steps = steps * mult  # train.total_steps
        if row.get("half_speed"):
            self.steps = steps * HALF_SPEED_STEPS_MULT
            self.schedule_steps = steps
        over = [o.replace("{M}", str(m)) for o in row["overrides"]]
        if row.get("decoupled"):
            over += args.decoupled_set
        over += [f"train.total_steps={self.schedule_steps}", f"run.seed={seed}"]
        if self.kind == "cluster":
            over = CLUSTER_COMMON + over
        else:
            over += [f"train.eval_every={eval_every(self.steps)}"]
        over = [o for o in over if o.partition("=")[0] not in args.unset]
        self.overrides = over + args.set  # --set last: it wins
        if row.get("dp_lr"):  # after --set, from the batch and lr it leaves
            self.overrides += dp_overrides(args, m, row["dp_lr"])
            self.batch_mult = m
        else:
            self.batch_mult = 1
        self.max_seconds = None  # half-speed row: set from the homogeneous run before it starts

    def result_path(self):
        return os.path.join(self.dir, "result.json")

    def command(self):
        a = self.args
        sets = [x for o in self.overrides for x in ("--set", o)]
        if self.kind == "standalone":
            return [os.path.join(a.bin_dir, "diloco-learner"), "-c", a.config, "--standalone", "--steps",
                    str(self.steps), *sets, "--run-dir", self.dir]
        cmd = [sys.executable, "-m", f"{__package__}.run_local", a.config, "--learners", str(self.m),
               "--regions", "eu,us", "--steps", str(self.steps), "--no-report", "--bin-dir", a.bin_dir,
               "--run-dir", self.dir, *sets]
        if self.row.get("half_speed"):
            cmd += ["--speed-factors", HALF_SPEED_FACTORS,
                    "--max-seconds", f"{self.max_seconds:.1f}" if self.max_seconds else "<wall of the homogeneous run>"]
        return cmd

    def estimate(self):
        if self.kind == "standalone":
            return EST_STANDALONE_FIXED + self.steps * EST_STANDALONE_STEP * self.batch_mult
        per_step = EST_CLUSTER_STEP.get(self.m, EST_CLUSTER_STEP[4] * self.m / 4)
        if "diloco.H=1" in self.overrides:
            per_step *= EST_PER_STEP_SYNC_FACTOR
        steps = self.schedule_steps if self.row.get("half_speed") else self.steps
        return EST_CLUSTER_FIXED + steps * per_step

    def key(self):
        return "standalone" if self.kind == "standalone" else f"cluster-M{self.m}"

    def identity(self):
        """A standalone run is deterministic: the same command without its folder is the same run."""
        if self.kind != "standalone":
            return None
        cmd = self.command()
        i = cmd.index("--run-dir")
        return tuple(cmd[:i] + cmd[i + 2:])


# The run config's defaults of the keys the data-parallel rows derive from (core/config/run_config.h).
EVAL_BATCHES_DEFAULT = 8


def train_settings(args):
    """train.batch, train.lr, train.eval_batches and model.context of the runs: the config's, or the
    last --set of them."""
    import tomllib
    with open(args.config, "rb") as f:
        config = tomllib.load(f)
    train = config.get("train", {})
    batch, lr, eval_batches = train.get("batch"), train.get("lr"), train.get("eval_batches", EVAL_BATCHES_DEFAULT)
    context = config.get("model", {}).get("context")
    for o in args.set:
        key, _, value = o.partition("=")
        try:
            if key == "train.batch":
                batch = int(value)
            elif key == "train.lr":
                lr = float(value)
            elif key == "train.eval_batches":
                eval_batches = int(value)
            elif key == "model.context":
                context = int(value)
        except ValueError as e:
            raise SystemExit(f"bench/quality: --set {o}: {e}")
    if not isinstance(batch, int) or batch < 1 or not isinstance(lr, (int, float)) or lr <= 0:
        raise SystemExit(f"bench/quality: {args.config} has no usable train.batch and train.lr for the data-parallel "
                         f"rows (batch {batch!r}, lr {lr!r})")
    return dict(batch=batch, lr=float(lr), eval_batches=eval_batches,
                context=context if isinstance(context, int) else None)


def dp_overrides(args, m, lr_mult):
    """The data-parallel row's overrides at M = m: batch m x b, lr x lr_mult, and eval_batches / m
    held-out batches of that size, so that it evaluates the very sequences the others do (held-out
    sequence i is the same whatever the batch: core/data/corpus.cc)."""
    t = train_settings(args)
    if t["eval_batches"] % m:
        raise SystemExit(f"bench/quality: train.eval_batches = {t['eval_batches']} is not a multiple of M = {m}: the "
                         f"data-parallel row (batch M x b) could not evaluate the same held-out sequences; "
                         f"--set train.eval_batches=<a multiple of every M>")
    return [f"train.batch={m * t['batch']}", f"train.lr={t['lr'] * lr_mult:.6g}",
            f"train.eval_batches={t['eval_batches'] // m}"]


def allreduce_bytes_per_token(parameters, m, batch, context):
    """What data parallel would move per token trained (all learners together), each way: a ring
    all-reduce of the fp32 gradient every step has each of m learners send (and receive)
    2 (m - 1) / m x 4 x parameters bytes; a step trains m x batch x context tokens."""
    if not parameters or m < 2 or not batch or not context:
        return None
    return m * 2 * (m - 1) / m * 4 * parameters / (m * batch * context)


def eval_every(steps):
    """A divisor of steps near steps/10 (the eval at the last step is the final loss)."""
    best = steps
    for d in range(1, steps + 1):
        if steps % d == 0 and abs(d - steps / 10) < abs(best - steps / 10):
            best = d
    return best


def tuning_rows():
    """The rows --tune runs: every point of each tuned mode's grid (named "<row> [<point>]"), and
    the data-parallel rows."""
    out = []
    for row in ROWS:
        if row.get("dp_lr"):
            out.append(row)
        for point in TUNED_ROWS.get(row["name"], []):
            out.append(dict(row, name=f"{row['name']} [{grid_label(point)}]", overrides=row["overrides"] + point,
                            tuned_from=row["name"], point=point, headline=True))
    return out


def with_tuned(row, m, tuned):
    """A row of the report run after --tuned: a tuned mode with its best point's overrides; a
    data-parallel row only if its learning rate won (None: not run)."""
    best = tuned.get(str(m), {})
    if row.get("dp_lr"):
        won = best.get("data parallel")
        return row if won is None or won["row"] == row["name"] else None
    if row["name"] in best:
        point = best[row["name"]]["point"]
        return dict(row, overrides=row["overrides"] + point, tuned_point=grid_label(point))
    return row


def plan(args):
    runs = []
    filters = [f.strip().lower() for f in args.rows.split(",")] if args.rows else None
    tuned = getattr(args, "tuned_points", None) or {}
    for m in args.m:
        for row in (tuning_rows() if getattr(args, "tune", False) else ROWS):
            if args.quick and not row.get("quick"):
                continue
            if row.get("only_m") and m not in row["only_m"]:
                continue
            if filters and not any(f in row["name"].lower() for f in filters):
                continue
            row = with_tuned(row, m, tuned)
            if row is None:
                continue
            seeds = args.seeds if row.get("headline") else args.seeds[:1]
            for seed in seeds:
                runs.append(Run(row, m, seed, args.steps, args))
    # The half-speed row needs its homogeneous run (same M and seed) for its time budget.
    for r in runs:
        if r.row.get("half_speed"):
            r.reference = next((h for h in runs if h.name == HOMOGENEOUS and h.m == r.m and h.seed == r.seed), None)
            if r.reference is None:  # not selected: run it anyway, just before
                h = Run(next(x for x in ROWS if x["name"] == HOMOGENEOUS), r.m, r.seed, args.steps, args)
                runs.insert(runs.index(r), h)
                r.reference = h
    return runs


# ---- reading a run's metrics --------------------------------------------------------------------

def interp(xs, ys, x):
    if not xs:
        return None
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def learner_summary(events):
    """Steps, tokens, bytes sent and received, and wait/compute of one learner's metrics.jsonl."""
    start = next((e for e in events if e.get("event") == "start"), None)
    steps = [e for e in events if e.get("event") == "step"]
    stop = next((e for e in reversed(events) if e.get("event") == "stop"), None)
    shutdown = next((e for e in reversed(events) if e.get("event") == "shutdown"), None)
    times, step_values, token_values = [], [], []
    if start and "time_us" in start:
        times.append(start["time_us"])
        step_values.append(0)
        token_values.append(0)
    for e in steps + ([stop] if stop else []):
        if "time_us" in e and (not times or e["time_us"] >= times[-1]):
            times.append(e["time_us"])
            step_values.append(e.get("step", 0))
            token_values.append(e.get("tokens", 0))
    bytes_sent = None
    if shutdown and "bytes_sent" in shutdown:
        bytes_sent = shutdown["bytes_sent"]
    elif steps and "bytes_sent" in steps[-1]:
        bytes_sent = steps[-1]["bytes_sent"]
    # The downlink: parameter bytes received from mergers (binaries before it was counted: None).
    bytes_received = None
    if shutdown and "bytes_received" in shutdown:
        bytes_received = shutdown["bytes_received"]
    elif steps and "bytes_received" in steps[-1]:
        bytes_received = steps[-1]["bytes_received"]

    def first(d, *names):
        for n in names:
            if d and d.get(n) is not None:
                return d[n]
        return None
    wait = first(stop, *STOP_WAIT_KEYS)
    compute = first(stop, *STOP_COMPUTE_KEYS)
    return dict(times=times, steps=step_values, tokens=token_values,
                final_step=(stop or (steps[-1] if steps else {})).get("step", 0),
                final_tokens=(stop or (steps[-1] if steps else {})).get("tokens", 0),
                bytes_sent=bytes_sent, bytes_received=bytes_received, wait=wait, compute=compute,
                start_us=start.get("time_us") if start else None, stop_us=stop.get("time_us") if stop else None)


def cluster_result(run):
    d = run.dir
    learners = sorted(n for n in os.listdir(d) if n.startswith("learner-") and os.path.isdir(os.path.join(d, n)))
    ls = [learner_summary(read_jsonl(os.path.join(d, n, "metrics.jsonl"))) for n in learners]
    evals = [e for e in read_jsonl(os.path.join(d, "eval", "metrics.jsonl")) if e.get("event") == "global_eval"]
    merges, dropped, held = [], {}, 0
    for n in sorted(os.listdir(d)):
        if not n.startswith("merger-"):
            continue
        for e in read_jsonl(os.path.join(d, n, "metrics.jsonl")):
            if e.get("event") == "merge":
                merges.append(e)
                for x in e.get("dropped", []):
                    reason = x.get("reason", "?") if isinstance(x, dict) else str(x)
                    dropped[reason] = dropped.get(reason, 0) + 1
            elif e.get("event") == "stop_record":
                held += int(e.get("held", 0))
    curve = []
    for e in evals:
        t = e.get("time_us")
        if t is None:
            continue
        step_at = [interp(l["times"], l["steps"], t) for l in ls if l["times"]]
        tok_at = [interp(l["times"], l["tokens"], t) for l in ls if l["times"]]
        curve.append(dict(step=sum(step_at) / len(step_at) if step_at else 0, tokens=sum(tok_at) if tok_at else 0,
                          loss=e.get("eval_loss"), versions=e.get("versions")))
    hist = {}
    for e in merges:
        k = str(len(e.get("inputs", [])))
        hist[k] = hist.get(k, 0) + 1
    merged = sum(len(e.get("inputs", [])) for e in merges)
    tokens = sum(l["final_tokens"] or 0 for l in ls)
    sent = [l["bytes_sent"] for l in ls]
    bytes_sent = sum(sent) if sent and all(b is not None for b in sent) else None
    got = [l["bytes_received"] for l in ls]
    bytes_received = sum(got) if got and all(b is not None for b in got) else None
    waits = [l["wait"] for l in ls]
    computes = [l["compute"] for l in ls]
    wait = sum(waits) if ls and all(w is not None for w in waits) else None
    compute = sum(computes) if ls and all(c is not None for c in computes) else None
    run_json = {}
    try:
        with open(os.path.join(d, "run.json")) as f:
            run_json = json.load(f)
    except (OSError, ValueError):
        pass
    spans = [(l["stop_us"] - l["start_us"]) / 1e6 for l in ls if l["start_us"] and l["stop_us"]]
    return dict(final_loss=evals[-1].get("eval_loss") if evals else None,
                final_versions=evals[-1].get("versions") if evals else None,
                merges=len(merges), inputs_per_merge_mean=(merged / len(merges)) if merges else None,
                inputs_per_merge_hist=dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                deltas_merged=merged, deltas_dropped=dropped, deltas_held_at_stop=held,
                bytes_sent=bytes_sent, tokens=tokens,
                bytes_per_token=(bytes_sent / tokens) if bytes_sent is not None and tokens else None,
                bytes_received=bytes_received,
                downlink_bytes_per_token=(bytes_received / tokens) if bytes_received is not None and tokens else None,
                wait_seconds=wait, compute_seconds=compute,
                utilisation=(compute / (compute + wait)) if wait is not None and compute is not None
                and compute + wait > 0 else None,
                learner_steps=[l["final_step"] for l in ls], learner_seconds=max(spans) if spans else None,
                stop_reason=run_json.get("stop_reason"), exit_codes=run_json.get("exit_codes"), curve=curve)


def standalone_result(run):
    events = read_jsonl(os.path.join(run.dir, "metrics.jsonl"))
    evals = [e for e in events if e.get("event") == "eval"]
    l = learner_summary(events)
    final = next((e for e in reversed(evals) if e.get("step") == run.steps), None)
    curve = [dict(step=e.get("step", 0), tokens=e.get("tokens", 0), loss=e.get("eval_loss")) for e in evals]
    start = next((e for e in events if e.get("event") == "start"), {})
    return dict(final_loss=final.get("eval_loss") if final else None, parameters=start.get("parameters"),
                merges=None, inputs_per_merge_mean=None,
                inputs_per_merge_hist={}, deltas_merged=None, deltas_dropped={}, deltas_held_at_stop=None,
                bytes_sent=0, tokens=l["final_tokens"], bytes_per_token=0.0 if l["final_tokens"] else None,
                bytes_received=0, downlink_bytes_per_token=0.0 if l["final_tokens"] else None,
                wait_seconds=l["wait"], compute_seconds=l["compute"],
                utilisation=(l["compute"] / (l["compute"] + l["wait"])) if l["wait"] is not None
                and l["compute"] is not None and l["compute"] + l["wait"] > 0 else None,
                learner_steps=[l["final_step"]],
                learner_seconds=((l["stop_us"] - l["start_us"]) / 1e6) if l["start_us"] and l["stop_us"] else None,
                curve=curve)


# ---- running ------------------------------------------------------------------------------------

class Interrupted(Exception):
    pass


CHILD = []
STOP = []


def on_signal(signum, _frame):
    STOP.append(signum)
    for p in CHILD:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
            except ProcessLookupError:
                pass


def run_one(run, timeout):
    """Runs one run in its folder; returns (ok, wall seconds, log path)."""
    if os.path.isdir(run.dir):
        shutil.rmtree(run.dir)
    os.makedirs(run.dir)
    log_path = os.path.join(run.dir, "launcher.log" if run.kind == "cluster" else "learner.log")
    cmd = run.command()
    with open(os.path.join(run.dir, "command.txt"), "w") as f:
        f.write(" ".join(shell_quote(c) for c in cmd) + "\n")
    t0 = time.time()
    stopped = False
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=repository.root())
        CHILD.append(p)
        try:
            while True:
                try:
                    p.wait(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    if time.time() - t0 > timeout and not STOP and not stopped:
                        say(f"  {run.name}: no end after {duration(timeout)}: stopping it (SIGTERM)")
                        p.send_signal(signal.SIGTERM)
                        stopped = True
            # A second signal could interrupt the wait above; always reap the child.
        finally:
            while p.poll() is None:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            CHILD.remove(p)
    wall = time.time() - t0
    if STOP:
        raise Interrupted()
    return p.returncode == 0, wall, log_path


def shell_quote(s):
    return s if re.fullmatch(r"[A-Za-z0-9_@%+=:,./<>-]+", s) and "<" not in s else "'" + s.replace("'", "'\\''") + "'"


def tail(path, lines=6):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def load_result(run):
    """The run's result.json, else (--resume) its entry in the results folder's results.json: the
    runs/ folders of a kept benchmark are pruned to save space, its results.json keeps them all."""
    try:
        with open(run.result_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return getattr(run.args, "kept_results", {}).get(os.path.relpath(run.dir, run.args.out))


def kept_results(out):
    """results.json's runs in `out` by their run folder (relative to `out`); {} if none."""
    try:
        with open(os.path.join(out, "results.json")) as f:
            runs = json.load(f).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return {}
    # A reused entry (a standalone run shared by several M) names the folder of the run it copies.
    return {r["run_dir"]: r for r in runs
            if isinstance(r, dict) and isinstance(r.get("run_dir"), str) and not r.get("reused")}


# ---- outputs ------------------------------------------------------------------------------------

def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}"


def si(n):
    if n is None:
        return "-"
    for unit, k in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f}"


def grouped(results):
    """(M, row name) -> results in ROWS order, row names in the order they came."""
    out = {}
    for r in results:
        out.setdefault((r["M"], r["row"]), []).append(r)
    return out


def row_order(name):
    names = [r["name"] for r in ROWS]
    return names.index(name) if name in names else len(names)


def mean_curve(curves, axis, points=60):
    """Mean over seeds of loss against axis, on a common grid within the range all seeds cover."""
    curves = [[(c[axis], c["loss"]) for c in cu if c.get("loss") is not None and c.get(axis) is not None]
              for cu in curves]
    curves = [sorted(c) for c in curves if c]
    if not curves:
        return [], []
    if len(curves) == 1:
        return [x for x, _ in curves[0]], [y for _, y in curves[0]]
    lo = max(c[0][0] for c in curves)
    hi = min(c[-1][0] for c in curves)
    if hi <= lo:
        return [x for x, _ in curves[0]], [y for _, y in curves[0]]
    xs = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
    ys = [sum(interp([p[0] for p in c], [p[1] for p in c], x) for c in curves) / len(curves) for x in xs]
    return xs, ys


def write_plots(results, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plots (apt-get install python3-matplotlib)")
        return []
    files = []
    groups = grouped([r for r in results if r.get("ok")])
    for m in sorted({k[0] for k in groups}):
        for axis, label in (("step", "inner steps per learner"), ("tokens", "tokens trained (all learners)")):
            fig, ax = plt.subplots(figsize=(9, 5.5))
            for (gm, name), rs in sorted(groups.items(), key=lambda kv: row_order(kv[0][1])):
                if gm != m:
                    continue
                xs, ys = mean_curve([r.get("curve", []) for r in rs], axis)
                if not xs:
                    continue
                legend = f"{name} ({len(rs)} seed{'s' if len(rs) > 1 else ''})"
                if axis == "step" and name == "one learner x M steps":
                    xs = [x / m for x in xs]
                    legend = f"{name}, steps / {m} ({len(rs)} seed{'s' if len(rs) > 1 else ''})"
                style = "--" if rs[0]["kind"] == "standalone" else "-"
                ax.plot(xs, ys, style, label=legend, linewidth=1.4)
            ax.set_xlabel(label)
            ax.set_ylabel("global held-out loss (nats/char)")
            ax.set_title(f"M = {m}: global held-out loss (mean over seeds)")
            ax.grid(alpha=0.3)
            lows = [y for line in ax.get_lines() for y in line.get_ydata()]
            if lows:
                top = sorted(lows)[int(len(lows) * 0.9)] if len(lows) > 10 else max(lows)
                ax.set_ylim(min(lows) - 0.05, max(min(lows) + 0.1, top + 0.1))
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(out, f"loss_vs_{'steps' if axis == 'step' else 'tokens'}_M{m}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(path)
    return files


def machine():
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=repository.root()).stdout.strip()
        except OSError:
            return "?"
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    commit = run(["git", "rev-parse", "--short", "HEAD"]) or "?"
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no"])
    return dict(uname=run(["uname", "-a"]), nproc=run(["nproc"]), cpu=model, commit=commit,
                dirty=bool(dirty), loadavg=os.getloadavg())


def parallel_efficiency(l1, l1xm, lm):
    """(L_1 - L_M) / (L_1 - L_1xM): the share of the gain of one learner with M times the steps over
    one learner that a row of M learners recovered (1: all of it, 0: none). None when a loss is
    missing or the two references are equal."""
    return (l1 - lm) / (l1 - l1xm) if None not in (l1, l1xm, lm) and l1 != l1xm else None


def gap_to_sync_percent(lm, l_sync):
    """(L_M - L_sync) / L_sync in percent (negative: better than synchronous DiLoCo); None when a loss
    is missing or L_sync is 0."""
    return 100 * (lm - l_sync) / l_sync if None not in (lm, l_sync) and l_sync else None


def per_token(ok, key, cluster):
    """A bytes-per-token cell: measured (cluster rows), computed (data parallel's all-reduce, with a
    star), or `-`."""
    computed = bool(ok) and all(r.get("bytes_computed") for r in ok)
    if not cluster and not computed:
        return "-"
    return fmt(mean([r.get(key) for r in ok]), 2) + ("*" if computed else "")


def share_of_dp_gain(l1, l_dp, lm):
    """E_DP = (L_1 - L_M) / (L_1 - L_DP): the share of data parallel's gain over one learner (at
    equal tokens) that a row recovered (1: all of it). None when a loss is missing or the two
    references are equal."""
    return (l1 - lm) / (l1 - l_dp) if None not in (l1, l_dp, lm) and l1 != l_dp else None


def best_dp(means, m):
    """(name, mean loss) of the best data-parallel row of M = m, or (None, None)."""
    points = [(loss, name) for (gm, name), loss in means.items()
              if gm == m and name.startswith("data parallel") and loss is not None]
    if not points:
        return None, None
    loss, name = min(points)
    return name, loss


def write_summary(args, results, info, plots, complete):
    groups = grouped(results)
    lines = ["# Quality benchmark (`bench/quality`)", ""]
    lines += [f"Command: `{info['command']}`", "",
              f"Date: {info['date']} (started), " + (f"{info['resumed']} (resumed), " if info.get("resumed") else "")
              + f"{time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())} (written)"
              + ("" if complete else " - **incomplete: interrupted or runs failed**"), "",
              f"Machine: `{info['machine']['uname']}`, `nproc` = {info['machine']['nproc']}, "
              f"{info['machine']['cpu']}; load average at the start {', '.join(f'{x:.1f}' for x in info['loadavg'])}", "",
              f"Commit: {info['machine']['commit']}" + (" (with uncommitted changes)" if info['machine']['dirty'] else "")
              + f"; binaries from `{args.bin_dir}`", "",
              f"Config `{os.path.relpath(args.config, repository.root())}`, S = {args.steps} inner steps per learner, "
              f"seeds {','.join(map(str, args.seeds))} for the headline rows (the others: seed {args.seeds[0]}), "
              f"regions eu,us, one merger, one evaluator."
              + (f" Extra overrides of every run: `{' '.join(args.set)}`." if args.set else "")
              + (f" Extra overrides of the Decoupled rows: `{' '.join(args.decoupled_set)}`." if args.decoupled_set else "")
              + (f" Overrides of the keys `{' '.join(args.unset)}` dropped from every row (`--unset`)." if args.unset else ""),
              ""]
    lines += ["| M | row | seeds | **final global held-out loss**, mean (per seed) | wall s | merges | inputs/merge "
              "(histogram) | deltas merged | dropped | learners sent | learners received | tokens | bytes/token up | "
              "bytes/token down | utilisation |",
              "|---:|---|---:|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    means = {}
    for (m, name), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], row_order(kv[0][1]))):
        ok = [r for r in rs if r.get("ok") and r.get("final_loss") is not None]
        failed = [r for r in rs if not (r.get("ok") and r.get("final_loss") is not None)]
        loss = mean([r["final_loss"] for r in ok])
        means[(m, name)] = loss
        per_seed = ", ".join(f"{r['final_loss']:.3f}" for r in ok)
        loss_text = f"**{fmt(loss)}** ({per_seed})" if len(ok) > 1 else f"**{fmt(loss)}**"
        if failed:
            loss_text += f"; {len(failed)} failed (seed {', '.join(str(r['seed']) for r in failed)})"
        hist = {}
        for r in ok:
            for k, v in (r.get("inputs_per_merge_hist") or {}).items():
                hist[k] = hist.get(k, 0) + v
        dropped = {}
        for r in ok:
            for k, v in (r.get("deltas_dropped") or {}).items():
                dropped[k] = dropped.get(k, 0) + v
        n = len(ok) or 1
        cluster = rs[0]["kind"] == "cluster"
        ipm = mean([r.get("inputs_per_merge_mean") for r in ok])
        hist_text = " ".join(f"{k}:{v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
        lines.append("| " + " | ".join([
            str(m), name, str(len(rs)), loss_text, fmt(mean([r.get("wall_seconds") for r in ok]), 0),
            fmt(mean([r.get("merges") for r in ok]), 0) if cluster else "-",
            (f"{fmt(ipm, 2)} ({hist_text})" if ipm is not None else "-") if cluster else "-",
            fmt(mean([r.get("deltas_merged") for r in ok]), 0) if cluster else "-",
            (", ".join(f"{k} {v / n:.0f}" for k, v in sorted(dropped.items())) or "0") if cluster else "-",
            (si(mean([r.get("bytes_sent") for r in ok])) + "B") if cluster and ok else "-",
            (si(mean([r.get("bytes_received") for r in ok])) + "B")
            if cluster and ok and mean([r.get("bytes_received") for r in ok]) is not None else "-",
            si(mean([r.get("tokens") for r in ok])),
            per_token(ok, "bytes_per_token", cluster),
            per_token(ok, "downlink_bytes_per_token", cluster),
            fmt(mean([r.get("utilisation") for r in ok]), 3),
        ]) + " |")
    lines += ["", "(Means over the seeds that finished; wall s = the whole run, start-up and shutdown included; "
              "merges, deltas and bytes are per run. Dropped = deltas the merger dropped, by reason. "
              "Bytes per token up = what the learners sent (their deltas, as delivered to the broker); down = "
              "what they received from the mergers over ZeroMQ (new versions and answers to requests, as payload "
              "bytes without ZMTP and TCP/IP headers; the evaluator's copy is not counted). `-` where the binaries "
              "do not report it. Utilisation = compute / (compute + wait) "
              "summed over the learners, from their `stop` events; `-` where the binaries do not report it. "
              "`*`: data parallel's bytes are computed, not measured: a ring all-reduce of the fp32 gradient every "
              "step, 2 (M - 1) / M x 4 bytes per parameter each way per learner.)", ""]
    lines += ["## Parallel efficiency, share of data parallel's gain, gap to synchronous DiLoCo", "",
              "Efficiency = (L_1 - L_M) / (L_1 - L_1xM), L_1 = one learner, L_1xM = one learner x M steps, L_M = the "
              "row's final global held-out loss (means over seeds): 1 = as good as one learner with M times the "
              "steps, 0 = no better than one learner. E_DP = (L_1 - L_M) / (L_1 - L_DP), L_DP = the best "
              "data-parallel row of the same M (one learner at batch M x b: equal tokens), chosen on these same "
              "seeds (which favours data parallel). Gap = (L_M - L_sync) / L_sync in percent, L_sync = "
              f"`{SYNC_REFERENCE}` of the same M (negative = better).", "",
              "| M | row | L_M | efficiency | E_DP | gap to sync DiLoCo (fp32) |", "|---:|---|---:|---:|---:|---:|"]
    for m in sorted({k[0] for k in means}):
        l1, l1m, ls = means.get((m, "one learner")), means.get((m, "one learner x M steps")), means.get((m, SYNC_REFERENCE))
        dp_row, l_dp = best_dp(means, m)
        lines.append(f"| {m} | (L_1 = {fmt(l1)}, L_1xM = {fmt(l1m)}, L_DP = {fmt(l_dp)}"
                     + (f": {dp_row}" if dp_row else "") + ") | | | | |")
        for (gm, name), lm in sorted(means.items(), key=lambda kv: row_order(kv[0][1])):
            if gm != m or not (groups[(gm, name)][0]["kind"] == "cluster" or name.startswith("data parallel")):
                continue
            eff = parallel_efficiency(l1, l1m, lm)
            e_dp = share_of_dp_gain(l1, l_dp, lm)
            gap = gap_to_sync_percent(lm, ls)
            lines.append(f"| {m} | {name} | {fmt(lm)} | {fmt(eff, 2)} | {fmt(e_dp, 2)} | "
                         f"{(f'{gap:+.2f} %') if gap is not None else '-'} |")
    lines += [""]
    if getattr(args, "tune", False):
        lines += ["## Tuning: the best point of each mode", "",
                  f"Chosen by the mean final loss over seeds {','.join(map(str, args.seeds))} (points with a failed "
                  "seed cannot win); `--tuned tuned.json` runs each mode with it. Every tuned mode had the same grid "
                  f"of {len(OUTER_GRID)} points.", "", "| M | mode | best | mean loss |", "|---:|---|---|---:|"]
        for m, modes in sorted(choose_tuned(results).items(), key=lambda kv: int(kv[0])):
            for mode, b in sorted(modes.items()):
                lines.append(f"| {m} | {mode} | {b.get('label') or b.get('row')} | {fmt(b['loss'])} |")
        lines += [""]
    tuned = getattr(args, "tuned_points", None)
    if tuned:
        where = ("Tuned points applied on their own tuning seeds (`--lever-trial`: a lever tried on top of them, "
                 "to compare with the grid on the same seeds; not a report)"
                 if getattr(args, "lever_trial", False) else "Tuned on other seeds")
        lines += [f"{where} (`--tuned {args.tuned}`): "
                  + "; ".join(f"M={m} {mode}: {b.get('label') or b.get('row')}"
                              for m, modes in sorted(tuned.items(), key=lambda kv: int(kv[0]))
                              for mode, b in sorted(modes.items())) + ".", ""]
    if plots:
        lines += ["Plots: " + ", ".join(f"`{os.path.basename(p)}`" for p in plots) + " (global held-out loss against "
                  "inner steps per learner and against tokens trained by all learners; mean over seeds; the "
                  "`one learner x M steps` line is drawn at steps / M on the steps plot).", ""]
    failed = [r for r in results if not r.get("ok")]
    if failed:
        lines += ["Failed runs:", ""]
        for r in failed:
            lines.append(f"- {r['row']} M={r['M']} seed {r['seed']}: {r.get('error', '?')}".replace("\n", " / "))
        lines.append("")
    lines += ["Rows and their overrides (every cluster run also has "
              f"`{' '.join(CLUSTER_COMMON)}`, `train.total_steps=S` and `run.seed=SEED`):", ""]
    seen = set()
    for r in sorted(results, key=lambda r: (row_order(r["row"]), r["M"])):
        if (r["row"], r["M"]) in seen:
            continue
        seen.add((r["row"], r["M"]))
        extra = [o for o in r["overrides"] if o not in CLUSTER_COMMON and not o.startswith("run.seed=")]
        lines.append(f"- M={r['M']} {r['row']}: `{' '.join(extra)}`"
                     + (f" `--speed-factors {HALF_SPEED_FACTORS} --max-seconds {fmt(r.get('max_seconds'), 1)}`"
                        if r.get("max_seconds") else ""))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def choose_tuned(results):
    """The best grid point of each tuned mode and the best data-parallel row at each M, by the mean
    final loss over the seeds where every seed finished: {"M": {row: {"point", "label", "loss"},
    "data parallel": {"row", "loss"}}}."""
    losses = {}
    for r in results:
        key = (r["M"], r["row"])
        losses.setdefault(key, []).append(r.get("final_loss") if r.get("ok") else None)
    best = {}
    for (m, name), ls in losses.items():
        if None in ls:
            continue  # a point with a failed seed cannot win
        loss = sum(ls) / len(ls)
        base = next((t for t in TUNED_ROWS if name.startswith(t + " [")), None)
        key = base or ("data parallel" if name.startswith("data parallel") else None)
        if key is None:
            continue
        entry = best.setdefault(str(m), {}).get(key)
        if entry is None or loss < entry["loss"]:
            if base:
                point = next(p for p in TUNED_ROWS[base] if name == f"{base} [{grid_label(p)}]")
                best[str(m)][key] = dict(point=point, label=grid_label(point), loss=loss, seeds=len(ls))
            else:
                best[str(m)][key] = dict(row=name, loss=loss, seeds=len(ls))
    return best


def write_results_json(args, results, info, complete):
    """results.json. With --resume, the runs it held that this invocation has not reached yet stay
    in it (their folders may be gone): an interrupted resume loses nothing."""
    have = {r.get("run_dir") for r in results}
    kept = [r for d, r in getattr(args, "kept_results", {}).items() if d not in have]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(info=info, complete=complete, runs=results + kept), f, indent=1)


def write_outputs(args, results, info, complete):
    write_results_json(args, results, info, complete)
    if getattr(args, "tune", False):
        with open(os.path.join(args.out, "tuned.json"), "w") as f:
            json.dump(dict(seeds=args.seeds, steps=args.steps, config=os.path.relpath(args.config, repository.root()),
                           complete=complete, best=choose_tuned(results)), f, indent=1)
    plots = write_plots(results, args.out)
    write_summary(args, results, info, plots, complete)
    return plots


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/quality",
        description="Global held-out loss of Decoupled DiLoCo rows against one learner, one learner with M times the "
                    "steps, data parallel at equal tokens (one learner at batch M x b, lr grid x1, x1.4, x2, x2.8, x4), "
                    "synchronous DiLoCo and per-step averaging (same inner steps per learner), with fixed "
                    "seeds, on the local broker. Writes results.json, summary.md and plots into --out.")
    p.add_argument("--quick", action="store_true",
                   help=f"configs/tiny.toml, M=2, one seed, thirteen rows, S={QUICK_STEPS}")
    p.add_argument("--config", default="configs/tiny.toml", help="run config (default: configs/tiny.toml)")
    p.add_argument("--steps", type=int, help=f"S, inner steps per learner (default {DEFAULT_STEPS}; --quick {QUICK_STEPS})")
    p.add_argument("--seeds", default="1,2,3", help="seeds of the headline rows, comma-separated (the other rows "
                                                    "use the first one; default 1,2,3; --quick: 1)")
    p.add_argument("--m", default="2,4", help="learner counts, comma-separated (default 2,4; --quick: 2)")
    p.add_argument("--rows", help="only the rows whose name contains one of these comma-separated substrings "
                                  "(case-insensitive)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="config override of every run (repeatable)")
    p.add_argument("--decoupled-set", action="append", default=[], metavar="K=V",
                   help="config override of every Decoupled row (repeatable), e.g. diloco.cut_on_arrival=0.5")
    p.add_argument("--unset", action="append", default=[], metavar="KEY",
                   help="drop the overrides of this key from every row (repeatable), e.g. diloco.wait_steps for "
                        "binaries that do not know it yet")
    p.add_argument("--out", help="results folder (default bench/results/quality-<date>-<time>)")
    p.add_argument("--tune", action="store_true",
                   help="run the tuning grids instead of the rows: each tuned mode (sync DiLoCo (fp32), Decoupled "
                        "nesterov) over the same grid of outer lr x momentum, and data parallel's learning rates, on "
                        f"--seeds (use seeds you will not report, e.g. {TUNE_SEEDS_HINT}); writes tuned.json")
    p.add_argument("--tuned", metavar="TUNED_JSON",
                   help="tuned.json of a --tune run: each tuned mode runs with its best point, data parallel with its "
                        "best learning rate only (same config and steps; report on other seeds)")
    p.add_argument("--lever-trial", action="store_true",
                   help="with --tuned, run on the tuning seeds themselves: to try a lever (--set, --decoupled-set) on "
                        "top of each mode's tuned point against the grid's numbers on the same seeds; a lever that "
                        "wins is then reported on other seeds")
    p.add_argument("--resume", action="store_true", help="skip the runs whose folder already has a result.json, or that the "
                   "results folder's results.json holds (its run folders may have been pruned)")
    p.add_argument("--dry-run", action="store_true", help="print the runs and their commands, run nothing")
    p.add_argument("--bin-dir",
                   help="diloco-learner, diloco-merger, diloco-sample (default build/bin or $DILOCO_BIN_DIR)")
    args = p.parse_args(argv)
    root = repository.root()
    if args.quick:
        args.config = "configs/tiny.toml"
        if "--seeds" not in argv:
            args.seeds = "1"
        if "--m" not in argv:
            args.m = "2"
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.m = [int(s) for s in args.m.split(",") if s.strip()]
    except ValueError:
        p.error("--seeds and --m take comma-separated integers")
    if not args.seeds or not args.m or min(args.m) < 1 or args.steps < 1:
        p.error("need at least one seed, M >= 1 and --steps >= 1")
    args.tuned_points = None
    if args.tune and args.tuned:
        p.error("--tune runs the grids, --tuned uses their result: one or the other")
    if args.lever_trial and not args.tuned:
        p.error("--lever-trial runs on the seeds of a --tuned tuned.json: give --tuned")
    if args.tuned:
        try:
            with open(args.tuned) as f:
                tuned = json.load(f)
            args.tuned_points = tuned["best"]
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--tuned {args.tuned}: not a tuned.json of bench/quality --tune ({e})")
        overlap = sorted(set(tuned.get("seeds", [])) & set(args.seeds))
        if overlap and not args.lever_trial:
            p.error(f"--tuned: seeds {','.join(map(str, overlap))} were used for tuning; report on other seeds "
                    "(or try a lever on them with --lever-trial)")
        if tuned.get("steps") != args.steps:
            say(f"note: {args.tuned} was tuned at S = {tuned.get('steps')}, this run has S = {args.steps}")
        for m in args.m:
            if not args.tuned_points.get(str(m)):
                say(f"note: {args.tuned} has no tuned point for M = {m}: its rows run untuned")
    for o in args.set + args.decoupled_set:
        if "=" not in o or "." not in o.partition("=")[0]:
            p.error(f"override '{o}': expected section.key=value")
    config = os.path.abspath(args.config)
    if not os.path.isfile(config):
        config = os.path.join(root, args.config)
    if not os.path.isfile(config):
        p.error(f"no config file {args.config}")
    args.config = config
    args.bin_dir = os.path.abspath(args.bin_dir or repository.default_bin_dir())
    if args.out is None:
        args.out = os.path.join(root, "bench", "results", f"quality-{time.strftime('%Y%m%d-%H%M%S')}")
    args.out = os.path.abspath(args.out)
    return args


def main(argv=None) -> int:
    """bench/quality: the exit status (0 every run finished, 1 a run failed, 2 no run selected, 130
    interrupted)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config_name = os.path.relpath(args.config, repository.root())
    args.kept_results = kept_results(args.out) if args.resume else {}
    runs = plan(args)
    planned = {os.path.relpath(r.dir, args.out) for r in runs}  # a run no longer planned is not kept
    args.kept_results = {d: r for d, r in args.kept_results.items() if d in planned}
    if not runs:
        say("no run matches --rows / --m")
        return 2
    seen, repeats = set(), set()  # runs whose standalone twin comes earlier: reused, not run again
    for r in runs:
        if r.identity() in seen:
            repeats.add(id(r))
        elif r.identity():
            seen.add(r.identity())
    to_run = [r for r in runs if id(r) not in repeats and not (args.resume and load_result(r))]
    total_estimate = sum(r.estimate() for r in to_run)
    say(f"bench/quality: {len(runs)} run{'s' if len(runs) != 1 else ''}, config {config_name}, S = {args.steps}, "
        f"M = {','.join(map(str, args.m))}, seeds {','.join(map(str, args.seeds))}; results in {args.out}")
    say(f"estimated time of the {len(to_run)} to run: {duration(total_estimate)} (tiny runs measured on a loaded 2-core machine; a quiet one is faster)")
    if args.dry_run:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `bench/quality --dry-run | head`
        for i, r in enumerate(runs, 1):
            note = " [has a result: skipped with --resume]" if args.resume and load_result(r) else ""
            note += " [the same run as an earlier row: reused]" if id(r) in repeats else ""
            say(f"[{i}/{len(runs)}] M={r.m} {r.name} seed {r.seed} (~{duration(r.estimate())}){note}")
            say("    " + " ".join(shell_quote(c) for c in r.command()))
        return 0
    tools = ["diloco-learner"] + (["diloco-merger", "diloco-sample"] if any(r.kind == "cluster" for r in runs) else [])
    for tool in tools:
        if not os.access(os.path.join(args.bin_dir, tool), os.X_OK):
            say(f"error: {tool} is not in {args.bin_dir} (build first or pass --bin-dir)")
            return 1
    os.makedirs(args.out, exist_ok=True)
    info = dict(command=" ".join(shell_quote(a) for a in ["bench/quality"] + argv),
                date=time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime()), machine=machine(),
                loadavg=os.getloadavg(), config=config_name, steps=args.steps, m=args.m,
                seeds=args.seeds, set=args.set, decoupled_set=args.decoupled_set, unset=args.unset, optimizers=list(OPTIMIZERS),
                tune=args.tune, tuned=args.tuned, tuned_points=args.tuned_points,
                bin_dir=args.bin_dir)
    if args.resume:  # keep the date of the first start
        try:
            with open(os.path.join(args.out, "results.json")) as f:
                first_info = json.load(f).get("info", {})
            if first_info.get("date"):
                info["resumed"] = info["date"]
                info["date"] = first_info["date"]
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    results = []
    done_by_run = {}
    ratio = {}  # measured / estimated wall per kind of run
    last_cluster_start = 0.0
    interrupted = False
    done_by_identity = {}  # standalone runs shared by the rows of several M (one learner, same steps)
    for i, r in enumerate(runs, 1):
        tag = f"[{i}/{len(runs)}] M={r.m} {r.name} seed {r.seed}"
        same = done_by_identity.get(r.identity()) if r.identity() else None
        if same:
            say(f"{tag}: the same run as {same['run_dir']} (final loss {fmt(same.get('final_loss'))}): reused")
            results.append(dict(same, M=r.m, reused=True))
            done_by_run[id(r)] = results[-1]
            continue
        previous = load_result(r) if args.resume else None
        if previous:
            say(f"{tag}: kept (final loss {fmt(previous.get('final_loss'))}, {duration(previous.get('wall_seconds'))})")
            results.append(previous)
            done_by_run[id(r)] = previous
            if previous.get("ok") and r.identity():
                done_by_identity[r.identity()] = previous
            continue
        if r.row.get("half_speed"):
            ref = done_by_run.get(id(r.reference))
            budget = ref and (ref.get("learner_seconds") or ref.get("wall_seconds"))
            if not budget:
                say(f"{tag}: skipped (the homogeneous run {HOMOGENEOUS} seed {r.seed} has no result)")
                results.append(dict(row=r.name, M=r.m, seed=r.seed, kind=r.kind, overrides=r.overrides, ok=False,
                                    error="no homogeneous reference run"))
                continue
            r.max_seconds = budget
        if r.kind == "cluster":  # run ids are <config id>-<second>: one cluster run per second at most
            time.sleep(max(0.0, last_cluster_start + 1.1 - time.time()))
            last_cluster_start = time.time()
        say(f"{tag}: started ({r.steps} steps per learner"
            + (f", --max-seconds {r.max_seconds:.0f}" if r.max_seconds else "") + f", ~{duration(r.estimate())})")
        timeout = max(600.0, 6 * r.estimate()) + (r.max_seconds or 0)
        try:
            ok, wall, log_path = run_one(r, timeout)
        except Interrupted:
            say(f"{tag}: interrupted; the run was stopped and waited for")
            interrupted = True
            break
        res = dict(row=r.name, M=r.m, seed=r.seed, kind=r.kind, steps=r.steps, schedule_steps=r.schedule_steps,
                   overrides=r.overrides, command=r.command(), max_seconds=r.max_seconds,
                   speed_factors=HALF_SPEED_FACTORS if r.row.get("half_speed") else None,
                   wall_seconds=round(wall, 1) if wall else None, run_dir=os.path.relpath(r.dir, args.out))
        try:
            res.update(cluster_result(r) if r.kind == "cluster" else standalone_result(r))
        except Exception as e:  # a broken run folder must not stop the benchmark
            res.update(final_loss=None, error=f"cannot read metrics: {e}")
        if r.row.get("dp_lr"):  # what real data parallel would have moved: computed, not measured
            t = train_settings(args)
            per_token = allreduce_bytes_per_token(res.get("parameters"), r.m, t["batch"], t["context"])
            res.update(bytes_per_token=per_token, downlink_bytes_per_token=per_token, bytes_computed=True)
        res["ok"] = ok and res.get("final_loss") is not None
        if not res["ok"]:
            res.setdefault("error", f"exit code not 0 or no final loss; end of {os.path.relpath(log_path, args.out)}:\n"
                           + tail(log_path))
            say(f"{tag}: FAILED after {duration(wall)}:\n    " + tail(log_path).replace("\n", "\n    "))
        else:
            with open(r.result_path(), "w") as f:
                json.dump(res, f, indent=1)
        results.append(res)
        done_by_run[id(r)] = res
        if res["ok"] and r.identity():
            done_by_identity[r.identity()] = res
        if res["ok"]:
            ratio.setdefault(r.key(), []).append((wall or r.estimate()) / r.estimate())
        remaining = [r2 for r2 in runs[i:] if not (args.resume and load_result(r2)) and id(r2) not in repeats]
        factor_all = mean([x for v in ratio.values() for x in v]) or 1.0
        eta = sum(r2.estimate() * (mean(ratio.get(r2.key(), [])) or factor_all) for r2 in remaining)
        extra = ""
        if r.kind == "cluster" and res["ok"]:
            extra = (f", {res.get('merges')} merges, {fmt(res.get('inputs_per_merge_mean'), 2)} inputs/merge, "
                     f"versions {res.get('final_versions')}")
        left = f"ETA of the {len(remaining)} remaining run{'s' if len(remaining) != 1 else ''}: {duration(eta)}"
        if res["ok"]:
            say(f"{tag}: finished, final global held-out loss {fmt(res.get('final_loss'))}, wall {duration(wall)}{extra}; "
                + left)
        else:
            say(f"{tag}: {left}")
        # The summary so far: a long benchmark can be read while it runs.
        write_outputs(args, results, info, complete=False)

    complete = not interrupted and all(r.get("ok") for r in results) and len(results) == len(runs)
    plots = write_outputs(args, results, info, complete)
    say(f"results: {os.path.join(args.out, 'summary.md')}, results.json"
        + (", " + ", ".join(os.path.basename(p) for p in plots) if plots else ""))
    if interrupted:
        say("interrupted: continue with the same command plus --resume --out " + args.out)
        return 130
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
