#!/usr/bin/env bash
# bench-codec of this change and of its parent commit (a4421a4, built in a second worktree), on the
# gaussian data and on a real outer gradient (4 fp32 deltas, one per fragment, dumped from a demo
# run; see README.md). Writes machine.txt and the raw outputs beside this script.
#   bench/results/codec-sparse-20261206/run.sh BASE_BENCH_CODEC DUMP_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
base="$1"
dump="$2"
{
  date -u
  uname -a
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|MHz|L1d|L2|L3'
  echo "commit $(git -C "$root" rev-parse HEAD) (bench binary built from it; the parent's from a4421a4)"
  uptime
} > "$here/machine.txt"
deltas=()
for p in 0 1 2 3; do deltas+=(--deltas "$dump/eu-p$p-o1.safetensors"); done
"$base" --runs 5 > "$here/gaussian-parent-a4421a4.txt"
"$root/build/bin/bench-codec" --runs 5 > "$here/gaussian.txt"
"$root/build/bin/bench-codec" --runs 20 "${deltas[@]}" > "$here/real-deltas.txt"
uptime >> "$here/machine.txt"
