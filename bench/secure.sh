#!/usr/bin/env bash
# What security costs: the same cluster (scripts/run-local, same config, steps and seed) plain and
# secured (--secure: Kafka over TLS with SASL/SCRAM and ACLs, parameters over ZeroMQ CURVE), in
# pairs whose order alternates (plain first in odd pairs, secured first in even ones), each on a
# broker of its own started once for the whole benchmark (both stay up throughout, so both runs
# share the same background). For each run: the learners' step rate (steps over the seconds
# between their first and last step lines), the global model's final held-out loss (the
# evaluator's last global_eval), the learners' application bytes (Kafka as librdkafka counts them,
# before TLS; parameters as received), and every byte on the loopback interface while the run
# lasted (/proc/net/dev: TLS records, CURVE boxes and handshakes included, so the machine should
# be otherwise quiet). Ratios secured / plain per pair and their mean.
#
#   bench/secure.sh [--config configs/demo.toml] [--steps 1000] [--pairs 1] [--set K=V ...] [--out DIR]
#                   [--resume]
#
# --resume keeps the runs of --out that ended (their run.json) and runs the others; a kept run
# without its loopback count (loopback.json) is left out of that ratio.
# Writes each run's folder (metrics, logs, run.json; no model weights), summary.json and
# summary.txt into --out (default bench/results/secure-<date>). Needs the build (build/bin) and
# .venv (scripts/bootstrap); ports 19592 (plain) and 19692 (secured) must be free.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
need_python

config="configs/demo.toml" steps=1000 pairs=1 out="" sets=() resume=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --pairs) pairs="$2"; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --resume) resume=1; shift ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ "$pairs" =~ ^[1-9][0-9]*$ ]] || die "--pairs must be a positive number"
out="${out:-$ROOT/bench/results/secure-$(date +%Y%m%d)}"
mkdir -p "$out"
work="$(mktemp -d /tmp/diloco-bench-secure.XXXXXX)"
export DILOCO_BIN_DIR="${DILOCO_BIN_DIR:-$ROOT/build/bin}" KAFKA_HEAP_OPTS="-Xms256m -Xmx1g"
plain_env=(DILOCO_BROKER_DIR="$work/broker-plain" DILOCO_BROKER_PORT=19592)
secure_env=(DILOCO_BROKER_DIR="$work/broker-secure" DILOCO_BROKER_PORT=19692)
cleanup() {
  env "${plain_env[@]}" "$ROOT/scripts/broker" stop >/dev/null 2>&1 || true
  env "${secure_env[@]}" "$ROOT/scripts/broker" stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

"$ROOT/scripts/secure" init "$work/secure" --keys-bin "$DILOCO_BIN_DIR/diloco-keys" >"$out/secure-init.log" 2>&1 ||
  die "scripts/secure init failed: $out/secure-init.log"
env "${plain_env[@]}" "$ROOT/scripts/broker" start >/dev/null
env "${secure_env[@]}" "$ROOT/scripts/broker" start --secure "$work/secure" >/dev/null
{
  echo "bench/secure.sh --config $config --steps $steps --pairs $pairs ${sets[*]}"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  machine: $(nproc) cores, $(uname -r)  commit: $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo '+changes')"
} >"$out/command.txt"

loopback_bytes() { awk -F'[: ]+' '$2 == "lo" {printf "%.0f\n", $3 + $11}' /proc/net/dev; }

run_one() {  # name mode
  local name="$1" mode="$2" before after start
  local flags=() envs=("${plain_env[@]}")
  if ((resume)) && [[ -f "$out/$name/run.json" ]]; then say "bench/secure: $name done already (--resume)"; return; fi
  if [[ "$mode" == secure ]]; then flags=(--secure --secure-dir "$work/secure"); envs=("${secure_env[@]}"); fi
  say "bench/secure: $name ($mode), $steps steps"
  before="$(loopback_bytes)" start="$(date +%s.%N)"
  env "${envs[@]}" "$ROOT/scripts/run-local" "$config" --steps "$steps" "${sets[@]}" "${flags[@]}" --no-report \
    --run-dir "$out/$name" </dev/null >"$out/$name.out" 2>&1 || die "run $name failed: $out/$name.out"
  after="$(loopback_bytes)"
  rm -f "$out/$name/final_model.safetensors"  # weights are not kept
  echo "{\"loopback_bytes\": $(awk -v a="$before" -v b="$after" 'BEGIN {printf "%.0f", b - a}'), \"wall_seconds\": $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')}" >"$out/$name/loopback.json"
}

for ((i = 1; i <= pairs; i++)); do
  if ((i % 2)); then run_one "plain-$i" plain; run_one "secure-$i" secure
  else run_one "secure-$i" secure; run_one "plain-$i" plain; fi
done

"$DILOCO_PYTHON" - "$out" "$pairs" <<'PY'
import glob, json, os, statistics, sys

out, pairs = sys.argv[1], int(sys.argv[2])

def lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.startswith("{")]

def measure(run):
    d = os.path.join(out, run)
    rates, app_bytes = [], 0
    for path in sorted(glob.glob(os.path.join(d, "learner-*", "metrics.jsonl"))):
        steps = [e for e in lines(path) if e.get("event") == "step"]
        if len(steps) >= 2 and steps[-1]["t"] > steps[0]["t"]:
            rates.append((steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["t"] - steps[0]["t"]))
        last = steps[-1] if steps else {}
        app_bytes += last.get("kafka_sent", 0) + last.get("kafka_received", 0) + last.get("bytes_received", 0)
    evals = [e for e in lines(os.path.join(d, "eval", "metrics.jsonl")) if e.get("event") == "global_eval"]
    path = os.path.join(d, "loopback.json")
    loop = json.load(open(path)) if os.path.exists(path) else {
        "loopback_bytes": None, "wall_seconds": json.load(open(os.path.join(d, "run.json")))["wall_seconds"]}
    return {"step_rate": statistics.mean(rates), "final_heldout": evals[-1]["eval_loss"] if evals else None,
            "learner_app_bytes": app_bytes, **loop}

runs = {f"{m}-{i}": measure(f"{m}-{i}") for i in range(1, pairs + 1) for m in ("plain", "secure")}
ratios = {k: [runs[f"secure-{i}"][k] / runs[f"plain-{i}"][k] for i in range(1, pairs + 1)
              if runs[f"secure-{i}"][k] and runs[f"plain-{i}"][k]]
          for k in ("step_rate", "learner_app_bytes", "loopback_bytes", "wall_seconds")}
ratios = {k: v for k, v in ratios.items() if v}
summary = {"runs": runs, "ratios_secure_over_plain": ratios,
           "mean_ratios": {k: statistics.mean(v) for k, v in ratios.items()}}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write(f"{'run':<10}{'steps/s':>9}{'held-out':>10}{'app MB':>9}{'loopback MB':>13}{'wall s':>8}\n")
    for name, r in runs.items():
        held = f"{r['final_heldout']:.4f}" if r["final_heldout"] is not None else "-"
        loop = f"{r['loopback_bytes'] / 1e6:.2f}" if r["loopback_bytes"] is not None else "-"
        f.write(f"{name:<10}{r['step_rate']:>9.3f}{held:>10}{r['learner_app_bytes'] / 1e6:>9.2f}"
                f"{loop:>13}{r['wall_seconds']:>8.0f}\n")
    f.write("secured / plain: " + ", ".join(f"{k} {statistics.mean(v):.3f} ({', '.join(f'{x:.3f}' for x in v)})"
                                            for k, v in ratios.items()) + "\n")
print(open(os.path.join(out, "summary.txt")).read())
PY
