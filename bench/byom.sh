#!/usr/bin/env bash
# Bring your own model, measured: M Python learners of the example's convolutional model
# (examples/pytorch/conv_lm.py, a model the C++ side has never seen) train through the real broker
# and the C++ merger (scripts/run-local --python-learners M --python-model conv), against one conv
# learner alone (train.py --standalone) with the same steps, seed and config. For each seed: the
# global model's held-out loss over time (the Python evaluator's global_eval events), at the end,
# and the single learner's at the same step; diloco-replay audit and verify of the run.
#
#   bench/byom.sh [--config configs/tiny.toml] [--learners 2] [--steps 1000] [--seeds 1,2,3]
#                 [--set K=V ...] [--out DIR] [--keep-topics]
#
# --steps also sets train.total_steps (the learning rate's cosine ends there, for both). The
# cluster's learners evaluate nothing themselves (train.eval_every=0); the evaluator measures the
# global model every cluster.eval_interval seconds and once more at the stop. Writes per seed the
# evaluator's and the single learner's metrics.jsonl, run.json and the audit, plus summary.json
# (every number below) and summary.txt into --out (default bench/results/byom-<date>). The runs'
# topics are deleted at the end unless --keep-topics.
#
# Needs a running broker (scripts/broker start), the build (build/bin, and the native module:
# cmake --build build) and .venv (scripts/bootstrap).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
source "$ROOT/bench/lib.sh"
need_python

config="configs/tiny.toml" learners=2 steps=1000 seeds="1,2,3" out="" sets=() keep_topics=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --learners) learners="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --keep-topics) keep_topics=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
cd "$ROOT"
bin="${DILOCO_BIN_DIR:-$ROOT/build/bin}"
out="${out:-$ROOT/bench/results/byom-$(date -u +%Y%m%d-%H%M)}"
mkdir -p "$out"
scratch="$(mktemp -d /tmp/diloco-byom.XXXXXX)"
trap 'delete_topics; rm -rf "$scratch"' EXIT  # delete_topics: bench/lib.sh, for RUNS on BOOTSTRAP
{
  echo "# bench/byom.sh $config --learners $learners --steps $steps --seeds $seeds ${sets[*]}"
  echo "# $(date -u +%FT%TZ) | $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "# commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'), diloco-merger $(date -u -r "$bin/diloco-merger" +%FT%TZ)"
} >"$out/header.txt"
cat "$out/header.txt"

IFS=, read -r -a seed_list <<<"$seeds"
alone_every=$((steps % 100 == 0 ? 100 : steps))  # the single learner evaluates at step --steps
for seed in "${seed_list[@]}"; do
  common=(--set "run.seed=$seed" --set "train.total_steps=$steps" "${sets[@]}")
  say "byom: seed $seed: $learners Python conv learners through the broker and the merger"
  DILOCO_BIN_DIR="$bin" scripts/run-local "$config" --learners "$learners" --python-learners "$learners" \
    --python-model conv --steps "$steps" --set train.eval_every=0 "${common[@]}" --run-dir "$scratch/cluster-$seed" \
    --no-report >"$scratch/cluster-$seed.out" 2>&1 || { tail -30 "$scratch/cluster-$seed.out" >&2; die "the cluster of seed $seed failed"; }
  read -r run_id BOOTSTRAP < <("$DILOCO_PYTHON" -c 'import json,sys; r = json.load(open(sys.argv[1])); print(r["run_id"], r["bootstrap"])' \
    "$scratch/cluster-$seed/run.json")
  RUNS+=("$run_id")
  replay=("$bin/diloco-replay" -c "$config" --run "$run_id" "${common[@]}")
  "${replay[@]}" audit --json >"$scratch/audit-$seed.json" || true
  "${replay[@]}" verify >"$scratch/verify-$seed.txt" 2>/dev/null || true
  say "byom: seed $seed: one conv learner alone"
  "$DILOCO_PYTHON" examples/pytorch/train.py -c "$config" --model conv --standalone --steps "$steps" --eval-every "$alone_every" \
    "${common[@]}" --id alone --run-dir "$scratch/alone-$seed" >"$scratch/alone-$seed.out" 2>&1 ||
    { tail -30 "$scratch/alone-$seed.out" >&2; die "the single learner of seed $seed failed"; }
  mkdir -p "$out/seed-$seed"
  cp "$scratch/cluster-$seed/eval/metrics.jsonl" "$out/seed-$seed/eval.metrics.jsonl"
  cp "$scratch/cluster-$seed/run.json" "$out/seed-$seed/run.json"
  cp "$scratch/alone-$seed/metrics.jsonl" "$out/seed-$seed/alone.metrics.jsonl"
  cp "$scratch/audit-$seed.json" "$out/seed-$seed/audit.json"
  tail -1 "$scratch/verify-$seed.txt" >"$out/seed-$seed/verify.txt"
  for l in "$scratch/cluster-$seed"/learner-*/metrics.jsonl; do
    n="$(basename "$(dirname "$l")")"
    grep -E '"event": ?"(start|shutdown|stop)"' "$l" >"$out/seed-$seed/$n.events.jsonl" || true
  done
done

"$DILOCO_PYTHON" - "$out" "$steps" "${seed_list[@]}" <<'PY'
import json, sys
out, steps, seeds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def events(path, kind):
    return [e for e in map(json.loads, open(path)) if e.get("event") == kind]
rows = []
for seed in seeds:
    d = f"{out}/seed-{seed}"
    curve = events(f"{d}/eval.metrics.jsonl", "global_eval")
    alone = {e["step"]: e["eval_loss"] for e in events(f"{d}/alone.metrics.jsonl", "eval")}
    audit = json.load(open(f"{d}/audit.json"))
    verify = open(f"{d}/verify.txt").read().strip()
    row = {"seed": seed, "global_first": curve[0]["eval_loss"], "global_final": curve[-1]["eval_loss"],
           "final_versions": curve[-1]["versions"], "alone_final": alone[steps],
           "gap_percent": 100 * (curve[-1]["eval_loss"] / alone[steps] - 1),
           "audit_ok": audit["ok"], "verify": verify, "merges": audit["merge_records"], "deltas": audit["deltas"]}
    rows.append(row)
json.dump({"steps": steps, "seeds": rows}, open(f"{out}/summary.json", "w"), indent=1)
lines = [f"{'seed':>4} {'global start':>12} {'global end':>10} {'alone at ' + str(steps):>14} {'gap':>8}  audit verify merges"]
for r in rows:
    lines.append(f"{r['seed']:>4} {r['global_first']:12.4f} {r['global_final']:10.4f} {r['alone_final']:14.4f} "
                 f"{r['gap_percent']:+7.2f}%  {'PASS' if r['audit_ok'] else 'FAIL'}  {r['verify']:>6} {r['merges']}")
open(f"{out}/summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
say "byom: results in $out"
