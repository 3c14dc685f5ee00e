#!/usr/bin/env bash
# Learner publishing overhead (ARCHITECTURE.md section 8, invariant 3): the step rate of a learner
# that publishes its deltas against the same learner with --no-publish, on the real broker with a
# real merger, one learner at a time (A/B alternating, so slow drifts of a shared machine cancel).
#
#   bench/learner_overhead.sh [--config configs/tiny.toml] [--steps 400] [--pairs 3]
#                             [--H "8 default 8/nomerger"] [--skip 50] [--keep] [--keep-topics] [--pin]
#
# For every case in --H (an H value, "default" = the config's value; "/nomerger": stop the merger
# once version 0 is committed, so the deltas wait in Kafka and nothing is merged or adopted: the
# learner's own cost of publishing, without the merger's and the broker's transaction work on the
# same two cores) it creates a fresh run (topics on the running broker, region r0, 4 partitions),
# starts one merger, then runs --pairs pairs of learners: publish then no-publish, and the reverse
# order in the next pair. The first learner proposes the run's version 0 and waits for the merger
# to commit it before its first step; with /nomerger a --no-publish learner of one step does that
# before the merger stops. Each learner runs --steps inner steps with held-out evaluation off
# (train.eval_every=0) and logs a step event every 10 steps. Step rate = (last logged step - first logged step >= --skip) / (wall time between
# those two events), from the learner's metrics.jsonl. Prints every run, then per H the ratio
# publish / no-publish of each pair and their mean, min and max.
#
# --pin: the learner (all its threads) runs on CPU 0, the merger and the broker on CPU 1, as when
# the merger and the broker run on other machines: the ratio is then the learner's own cost of
# publishing (its training thread and its producer, inbox and heartbeat threads sharing one core),
# without the merger's and the broker's work competing for the learner's core. The broker's CPU
# affinity is restored on exit.
#
# Needs: a running broker (scripts/broker start), build/bin/diloco-{learner,merger}, python3.
# Never starts or stops the broker; kills every process it started on exit and deletes the topics
# of its runs (unless --keep-topics); --keep keeps the metrics files (the path is printed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DILOCO_BIN:-$ROOT/build/bin}"
BOOTSTRAP="${DILOCO_BOOTSTRAP:-127.0.0.1:19092}"

config="configs/tiny.toml" steps=400 pairs=3 hs="8 default 8/nomerger" skip=50 keep=0 keep_topics=0 pin=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --pairs) pairs="$2"; shift 2 ;;
    --H) hs="$2"; shift 2 ;;
    --skip) skip="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --keep-topics) keep_topics=1; shift ;;
    --pin) pin=1; shift ;;
    -h|--help) sed -n "2,29p" "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

cd "$ROOT"
[[ -x "$BIN/diloco-learner" && -x "$BIN/diloco-merger" ]] || { echo "build first: cmake --build build" >&2; exit 1; }
OUT="$(mktemp -d /tmp/diloco-learner-overhead.XXXXXX)"
source "$ROOT/bench/lib.sh"

pin_learner=() pin_merger=() broker_mask=""
cleanup() {
  [[ -z "$broker_mask" ]] || taskset -a -p "$broker_mask" "$broker_pid" >/dev/null 2>&1 || true
  bench_cleanup
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Samples, every 0.1 s while the learner lives: time, the training thread's CPU and run-queue wait
# (schedstat, ns), the learner's CPU over all its threads, the merger's and the broker's CPU and the
# machine's busy CPU (clock ticks), so the report can say where the time of a step goes.
cat >"$OUT/sampler.py" <<'PY'
import os, sys, time
learner, merger, broker, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), open(sys.argv[4], "w")
def ticks(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    except OSError:
        return -1
def busy():
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return sum(v) - v[3] - v[4]
def steal():
    return int(open("/proc/stat").readline().split()[8])
while True:
    try:
        main = open(f"/proc/{learner}/task/{learner}/schedstat").read().split()
        total = 0
        for t in os.listdir(f"/proc/{learner}/task"):
            try: total += int(open(f"/proc/{learner}/task/{t}/schedstat").read().split()[0])
            except OSError: pass
    except OSError:
        break
    out.write(f"{time.time_ns() // 1000} {main[0]} {main[1]} {total} {ticks(merger)} {ticks(broker)} {busy()} {steal()}\n")
    out.flush()
    time.sleep(0.1)
PY
broker_pid="$(cat "${DILOCO_BROKER_DIR:-$ROOT/.run/broker}/node-1/pid" 2>/dev/null || echo 0)"
if ((pin)); then
  ((broker_pid > 0)) || { echo "--pin needs the broker's pid in \${DILOCO_BROKER_DIR:-.run/broker}/node-1/pid" >&2; exit 1; }
  broker_mask="$(taskset -p "$broker_pid" | awk '{print $NF}')"
  taskset -a -p -c 1 "$broker_pid" >/dev/null
  pin_learner=(taskset -c 0) pin_merger=(taskset -c 1)
fi

echo "# learner_overhead: $(date -u) | nproc $(nproc) | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "# config $config, $steps steps per learner, $pairs pairs per H, rate from step $skip on; pinned: $( ((pin)) && echo "learner CPU 0, merger and broker CPU 1" || echo no); load: $(cut -d' ' -f1-3 /proc/loadavg)"
results="$OUT/results.tsv"
: >"$results"

for case_ in $hs; do
  H="${case_%%/*}" merger_on=1
  [[ "$case_" == */nomerger ]] && merger_on=0
  run="lo$(date +%s%N | cut -c8-15)h$H$( ((merger_on)) || echo n)"
  sets=(--set "run.id=\"$run\"" --set "train.eval_every=0")
  [[ "$H" == default ]] || sets+=(--set "diloco.H=$H")
  scripts/broker topics --run "$run" --regions r0 --partitions 4 >/dev/null 2>&1
  RUNS+=("$run")
  "${pin_merger[@]}" "$BIN/diloco-merger" -c "$config" "${sets[@]}" --id M0 --bootstrap "$BOOTSTRAP" --run-dir "$OUT/$run/M0" \
    >"$OUT/$run-M0.log" 2>&1 &
  merger=$!
  PIDS+=("$merger")
  if ((!merger_on)); then
    # A learner proposes version 0 and waits until the merger committed it; with no merger after
    # that, no learner of this case could start otherwise.
    "$BIN/diloco-learner" -c "$config" "${sets[@]}" --no-publish --steps 1 --id genesis --region r0 --regions r0 \
      --bootstrap "$BOOTSTRAP" >"$OUT/$run-genesis.log" 2>&1 || { cat "$OUT/$run-genesis.log" "$OUT/$run-M0.log" >&2; exit 1; }
    stop_pid "$merger"
    merger=0
  fi
  for ((i = 1; i <= pairs; i++)); do
    order=(publish no-publish)
    ((i % 2)) || order=(no-publish publish)
    for mode in "${order[@]}"; do
      id="$mode-$i"
      flags=()
      [[ "$mode" == no-publish ]] && flags=(--no-publish)
      load="$(cut -d' ' -f1 /proc/loadavg)"
      "${pin_learner[@]}" "$BIN/diloco-learner" -c "$config" "${sets[@]}" "${flags[@]}" --id "$id" --region r0 --regions r0 \
        --bootstrap "$BOOTSTRAP" --steps "$steps" --log-every 10 --run-dir "$OUT/$run/$id" >"$OUT/$run-$id.log" 2>&1 &
      learner=$!
      PIDS+=("$learner")
      python3 "$OUT/sampler.py" "$learner" "$merger" "$broker_pid" "$OUT/$run/$id.cpu" &
      PIDS+=("$!")
      wait "$learner" || { echo "learner $id failed:" >&2; cat "$OUT/$run-$id.log" >&2; exit 1; }
      wait "${PIDS[-1]}" 2>/dev/null || true
      PIDS=()
      ((merger == 0)) || PIDS=("$merger")
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$case_" "$i" "$mode" "$OUT/$run/$id" "$load" "$run" >>"$results"
    done
  done
  ((merger == 0)) || stop_pid "$merger"
  merges="$(count_events "$OUT/$run/M0/metrics.jsonl" merge)"
  printf 'H=%s run %s: the merger made %s merges\n' "$case_" "$run" "$merges"
done

python3 - "$results" "$skip" "$(getconf CLK_TCK)" <<'PY'
import bisect, json, sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
skip, hz = int(sys.argv[2]), int(sys.argv[3])
def at(samples, t, k):  # column k linearly interpolated at time t (us)
    ts = [s[0] for s in samples]
    i = min(max(bisect.bisect_left(ts, t), 1), len(ts) - 1)
    a, b = samples[i - 1], samples[i]
    if a[k] < 0 or b[k] < 0: return float("nan")
    return a[k] + (b[k] - a[k]) * (t - a[0]) / max(1, b[0] - a[0])
def measure(d):
    steps, us, deltas, adopted = [], [], 0, 0
    for line in open(f"{d}/metrics.jsonl"):
        j = json.loads(line)
        ev = j.get("event")
        if ev == "step" and j["step"] >= skip:
            steps.append(j["step"]); us.append(j["time_us"]); adopted = j.get("adopted", 0)
        elif ev == "delta":
            deltas += 1
    n, wall = steps[-1] - steps[0], (us[-1] - us[0]) / 1e6
    samples = [list(map(int, l.split())) for l in open(f"{d}.cpu")]
    per_step = lambda k, scale: (at(samples, us[-1], k) - at(samples, us[0], k)) * scale / n * 1e3
    main_cpu, main_wait = per_step(1, 1e-9), per_step(2, 1e-9)
    all_cpu = per_step(3, 1e-9)
    return dict(rate=n / wall, wall=wall / n * 1e3, main_cpu=main_cpu, main_wait=main_wait,
                other=all_cpu - main_cpu, blocked=wall / n * 1e3 - main_cpu - main_wait,
                merger=per_step(4, 1 / hz), broker=per_step(5, 1 / hz), busy=per_step(6, 1 / hz) / (wall / n * 1e3),
                steal=per_step(7, 1 / hz) / (wall / n * 1e3),
                deltas=deltas, adopted=adopted)
print("\nper step, in ms: wall; the training thread's CPU, run-queue wait and the rest (blocked or sleeping);")
print("CPU of the learner's other threads, of the merger, of the broker; busy = CPUs busy on the machine (all processes), steal = CPUs taken by the hypervisor")
print(f"{'H':>8} {'pair':>4} {'mode':>10} {'steps/s':>8} {'wall':>6} {'train':>6} {'wait':>6} {'rest':>6} {'others':>6} {'merger':>6} {'broker':>6} {'busy':>5} {'steal':>5} {'deltas':>6} {'adopted':>7} {'load1':>5}")
by = {}
for H, pair, mode, d, load, run in rows:
    m = measure(d)
    by.setdefault(H, {}).setdefault(int(pair), {})[mode] = m
    print(f"{H:>8} {pair:>4} {mode:>10} {m['rate']:8.2f} {m['wall']:6.2f} {m['main_cpu']:6.2f} {m['main_wait']:6.2f} {m['blocked']:6.2f} "
          f"{m['other']:6.2f} {m['merger']:6.2f} {m['broker']:6.2f} {m['busy']:5.2f} {m['steal']:5.2f} {m['deltas']:6d} {m['adopted']:7d} {load:>5}")
print()
for H, pairs in by.items():
    full = [p for p in pairs.values() if len(p) == 2]
    ratios = [p["publish"]["rate"] / p["no-publish"]["rate"] for p in full]
    mean = lambda mode, k: statistics.mean(p[mode][k] for p in full)
    print(f"H={H}: publish {mean('publish', 'rate'):.2f} steps/s, no-publish {mean('no-publish', 'rate'):.2f} steps/s; "
          f"ratio publish/no-publish per pair " + ", ".join(f"{x:.3f}" for x in ratios) +
          f"; mean {statistics.mean(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(f"  training thread CPU per step: publish {mean('publish', 'main_cpu'):.2f} ms, no-publish {mean('no-publish', 'main_cpu'):.2f} ms "
          f"(ratio {mean('no-publish', 'main_cpu') / mean('publish', 'main_cpu'):.3f}); run-queue wait per step: "
          f"publish {mean('publish', 'main_wait'):.2f} ms, no-publish {mean('no-publish', 'main_wait'):.2f} ms")
PY
