#!/usr/bin/env bash
# Global model quality with and without share scaling of merges (merger.share_scaling), next to
# one learner on its own, on the real broker.
#
#   bench/share_scaling.sh [--config configs/tiny.toml] [--learners 3] [--steps 240]
#                          [--seeds "1 2 3"] [--out DIR]
#
# For each seed: a local cluster (decoupled_diloco.tools.run_local: 1 merger, --learners learners
# over two regions, quorum from the config) with merger.share_scaling=true, the same with false, and
# a standalone learner (--standalone, no Kafka) for the same number of steps. Prints the evaluator's
# final global held-out loss of each cluster, the learners' last training losses, and the
# standalone learner's held-out loss at its last step. Run folders are kept under --out.
#
# Needs a running broker (scripts/broker start) and the build (build/bin or $DILOCO_BIN_DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DILOCO_BIN_DIR:-$ROOT/build/bin}"
source "$ROOT/scripts/lib.sh"
need_python

config="configs/tiny.toml" learners=3 steps=240 seeds="1 2 3" out="/tmp/diloco-share-scaling"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --learners) learners="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "share_scaling.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
cd "$ROOT"
mkdir -p "$out"

echo "config $config, $learners learners, $steps steps each; $(date -u '+%a %b %d %Y %H:%M UTC'), commit $(git rev-parse --short HEAD)"
printf '%-6s %-22s %-14s %s\n' seed case "global loss" "learners' last training losses"
for seed in $seeds; do
  for scaling in true false; do
    dir="$out/share-$scaling-s$seed"
    rm -rf "$dir"
    "$DILOCO_PYTHON" -m decoupled_diloco.tools.run_local "$config" --learners "$learners" --regions eu,us --steps "$steps" \
      --no-report --bin-dir "$BIN" --set merger.share_scaling="$scaling" --set run.seed="$seed" \
      --set train.eval_every=0 --run-dir "$dir" >"$dir.log" 2>&1 || echo "run-local failed: see $dir.log" >&2
    global="$(grep -o 'global held-out [0-9.]*' "$dir.log" | tail -1 | awk '{print $3}')"
    losses="$(grep -o "learner-[0-9]* step $steps loss [0-9.]*" "$dir.log" | tail -"$learners" | awk '{print $5}' | tr '\n' ' ')"
    printf '%-6s %-22s %-14s %s\n' "$seed" "share_scaling=$scaling" "${global:-?}" "$losses"
  done
  dir="$out/standalone-s$seed"
  rm -rf "$dir"
  "$BIN/diloco-learner" -c "$config" --standalone --steps "$steps" --set run.seed="$seed" \
    --set train.eval_every="$steps" --run-dir "$dir" >"$dir.log" 2>&1 || echo "standalone failed: see $dir.log" >&2
  printf '%-6s %-22s %-14s\n' "$seed" "one learner" "$(grep -o "step $steps .*held-out [0-9.]*" "$dir.log" | awk '{print $NF}')"
done
