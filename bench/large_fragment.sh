#!/usr/bin/env bash
# One fragment far above Kafka's 64 MiB message limit, trained end to end on the real broker:
# tiny's config widened to width 512 and 4 layers (12.7M parameters) in a single fragment, so a
# checkpoint is about 150 MB and travels as pieces of codec.chunk_bytes; then the run's audit and
# verify. Records the merger's and the largest learner's peak resident memory (ps, every 0.2 s),
# the merges' sync times and the pieces in the logs.
#
#   bench/large_fragment.sh [--bin-dir DIR] [--steps 60] [--learners 2] [--out DIR]
#
# Needs a running broker (scripts/broker start) and the build (build/bin or --bin-dir).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DILOCO_BIN_DIR:-$ROOT/build/bin}"
steps=60 learners=2 out="/tmp/diloco-large-fragment"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin-dir) BIN="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --learners) learners="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "large_fragment.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
sets=(--set model.width=512 --set model.layers=4 --set model.heads=8 --set diloco.fragments=1 --set diloco.H=20
      --set merger.checkpoint_every=1 --set train.eval_every=0 --set cluster.eval_interval=60)
run="large$(date +%s)"
mkdir -p "$out"
peaks="$out/$run.peaks"
( merger=0 learner=0
  while true; do
    m=$(ps -C diloco-merger -o rss= | sort -n | tail -1 || true); m=${m:-0}
    l=$(ps -C diloco-learner -o rss= | sort -n | tail -1 || true); l=${l:-0}
    if (( m > merger )); then merger=$m; fi
    if (( l > learner )); then learner=$l; fi
    echo "$merger $learner" > "$peaks"
    sleep 0.2
  done ) &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT
"$ROOT/scripts/run-local" "$ROOT/configs/tiny.toml" --learners "$learners" --steps "$steps" --bin-dir "$BIN" \
  "${sets[@]}" --set run.id="$run" --run-dir "$out/$run" --no-report > "$out/$run.log" 2>&1
kill $sampler 2>/dev/null || true
dir="$out/$run"
run=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["run_id"])' "$dir/run.json")  # run-local dates it
read -r merger_kb learner_kb < "$peaks"
echo "run $run: peak RSS merger $((merger_kb / 1024)) MiB, largest learner $((learner_kb / 1024)) MiB"
python3 - "$dir/merger-0/metrics.jsonl" <<'PY'
import json, sys
merges = [json.loads(l) for l in open(sys.argv[1]) if '"event":"merge"' in l]
print("merges:", len(merges), "sync seconds:", " ".join(f"{m['sync_seconds']:.2f}" for m in merges))
PY
"$BIN/diloco-replay" -c "$ROOT/configs/tiny.toml" "${sets[@]}" --run "$run" audit | tail -2
"$BIN/diloco-replay" -c "$ROOT/configs/tiny.toml" "${sets[@]}" --run "$run" verify | tail -2
