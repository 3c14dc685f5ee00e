#!/usr/bin/env bash
# Merger throughput (1 and 2 instances) and failover time, on the real broker.
#
#   bench/merger_throughput.sh [--config configs/demo.toml] [--rounds 150] [--learners 4]
#                              [--timeouts "10000 6000"] [--pace 0.25]
#                              [--only throughput|failover] [--cases "1:4 2:4 1:1"]
#                              [--keep] [--keep-topics]
#
# Throughput: a fresh run (region r0, 4 partitions) gets its version 0 (commit_genesis), is
# pre-filled by bench-produce_deltas with --rounds rounds of --learners fake learners for each of
# the model's 4 fragments (int4 deltas of the config's real model and layout, see
# bench/produce_deltas.cc), then the merger(s) start with merger.quorum = --learners, recover
# version 0 and drain the backlog. Every delta is on version 0 from a learner that sends only it
# (bench-produce_deltas --bases genesis): a backlog whose deltas named the
# versions 1, 2, ... would be dropped as "base from the future" by a merger that has not made them
# yet. A merger that is behind reads on before it merges (MergerTimeouts::catch_up_ms), so a merge
# takes every pending delta of its fragment: many inputs per merge, not K. The script checks that
# the merged inputs add up to the deltas produced. Rates are taken from the mergers'
# metrics.jsonl: "steady" over the window in which every instance is merging (from each
# instance's first merge after its last assignment, that first merge, which carries the
# transaction start-up, excluded, to the earliest last merge of the instances), and "drain" from
# the last assignment of any instance to the last merge.
# MB/s = 10^6 bytes of fp32 delta values (fragment size x 4 bytes) merged per second: decode,
# checks, merge arithmetic, outer step, transaction (merge record, a checkpoint every
# merger.checkpoint_every versions, offsets) and the ZeroMQ publish of the new fragment included.
# Cases (--cases, instances:quorum): 1 instance with quorum K, 2 instances with quorum K, 1
# instance with quorum 1 (before the catch-up reading this made one transaction per delta; now it
# too merges what is pending; it drains a third of the rounds). DILOCO_BIN=dir runs the binaries of another build.
#
# Failover: 2 instances (--session-timeout-ms from --timeouts, one case each) commit the fake
# learners' version 0 (--genesis), then a steady stream of rounds (one every --pace seconds), both
# instances merging; then kill -9 of one instance and the time from the kill to the first merge,
# by the survivor, of a fragment the killed one owned.
#
# Needs a running broker (scripts/broker start) and the build (build/bin/diloco-merger,
# build/bin/bench-produce_deltas). Never starts or stops the broker; kills every process it started
# on exit; deletes the topics of its runs at the end unless --keep-topics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DILOCO_BIN:-$ROOT/build/bin}"
BOOTSTRAP="${DILOCO_BOOTSTRAP:-127.0.0.1:19092}"

config="configs/demo.toml" rounds=150 learners=4 timeouts="10000 6000" pace=0.25 only="" keep=0 keep_topics=0
cases=""  # instances:quorum list; default "1:K 2:K 1:1" with K = --learners
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --learners) learners="$2"; shift 2 ;;
    --timeouts) timeouts="$2"; shift 2 ;;
    --pace) pace="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --cases) cases="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --keep-topics) keep_topics=1; shift ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

cd "$ROOT"
for b in diloco-merger bench-produce_deltas; do
  [[ -x "$BIN/$b" ]] || { echo "missing $BIN/$b: cmake --build build" >&2; exit 1; }
done
OUT="$(mktemp -d /tmp/diloco-merger-bench.XXXXXX)"
source "$ROOT/bench/lib.sh"
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

new_run() {  # prefix -> sets RUN to a fresh run id and creates its topics
  RUN="$1$(date +%s%N | cut -c8-15)"
  scripts/broker topics --run "$RUN" --regions r0 --partitions 4 >/dev/null 2>&1
  RUNS+=("$RUN")
}

start_merger() {  # run id session_timeout quorum -> sets MERGER_PID
  local run="$1" id="$2" timeout="$3" quorum="$4"
  "$BIN/diloco-merger" -c "$config" --set "run.id=\"$run\"" --set "merger.quorum=$quorum" --id "$id" \
    --bootstrap "$BOOTSTRAP" --run-dir "$OUT/$run/$id" --session-timeout-ms "$timeout" >"$OUT/$run/$id.log" 2>&1 &
  MERGER_PID=$!
  PIDS+=("$MERGER_PID")
}

# Version 0 of every fragment before the backlog is made: the mergers commit it only from a
# proposal, and reject deltas of a fragment without one. A merger of its own commits the fake
# learners' proposal and stops cleanly, so the measured mergers start, as before, on a run at
# version 0 with a backlog to drain (its metrics stay out of the run's folder and the rates).
commit_genesis() {  # run id
  local run="$1" merger
  "$BIN/diloco-merger" -c "$config" --set "run.id=\"$run\"" --id genesis --bootstrap "$BOOTSTRAP" \
    --run-dir "$OUT/$run-genesis" >"$OUT/$run-genesis.log" 2>&1 &
  merger=$!
  PIDS+=("$merger")
  "$BIN/bench-produce_deltas" -c "$config" --set "run.id=\"$run\"" --genesis --rounds 0 --region r0 \
    --bootstrap "$BOOTSTRAP" 2>"$OUT/$run-genesis-producer.log" ||
    { cat "$OUT/$run-genesis-producer.log" "$OUT/$run-genesis.log" >&2; return 1; }
  stop_pid "$merger"
}

merged_inputs() {  # run dir -> total inputs over every merge event of every instance
  { cat "$1"/*/metrics.jsonl 2>/dev/null || true; } | jq -s '[.[] | select(.event == "merge") | .inputs | length] | add // 0'
}

cpu_seconds() {  # pid -> user+system CPU seconds so far
  awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat" 2>/dev/null || echo 0
}

echo "# merger_throughput: $(date -u) | nproc $(nproc) | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "# config $config, $learners fake learners, $rounds rounds; load: $(cut -d' ' -f1-3 /proc/loadavg)"

throughput_case() {  # instances quorum rounds
  local instances="$1" quorum="$2" rounds="$3" run i
  new_run mt; run="$RUN"
  mkdir -p "$OUT/$run"
  commit_genesis "$run"
  "$BIN/bench-produce_deltas" -c "$config" --set "run.id=\"$run\"" --learners "$learners" --rounds "$rounds" \
    --region r0 --bootstrap "$BOOTSTRAP" --summary "$OUT/$run/produced.json" 2>"$OUT/$run/producer.log"
  local total; total="$(jq .deltas "$OUT/$run/produced.json")"
  local pids=() load; load="$(cut -d' ' -f1 /proc/loadavg)"
  local broker_pid broker0; broker_pid="$(cat "${DILOCO_BROKER_DIR:-$ROOT/.run/broker}/node-1/pid" 2>/dev/null || echo 0)"
  broker0="$(cpu_seconds "$broker_pid")"
  for ((i = 0; i < instances; i++)); do
    start_merger "$run" "M$i" 10000 "$quorum"
    pids+=("$MERGER_PID")
  done
  local done_ok=0 last=-1 still=0
  while true; do
    local n; n="$(merged_inputs "$OUT/$run")"
    ((n >= total)) && { done_ok=1; break; }
    if ((n == last)); then ((still += 1)); else still=0; last=$n; fi
    ((still < 240)) || break  # 60 s without progress
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || { cat "$OUT/$run"/*.log >&2; return 1; }; done
    sleep 0.25
  done
  local cpu=()
  for p in "${pids[@]}"; do cpu+=("$(cpu_seconds "$p")"); done
  local broker_cpu; broker_cpu="$(awk -v a="$broker0" -v b="$(cpu_seconds "$broker_pid")" 'BEGIN {print b - a}')"
  # Stop every instance at once: stopping one first would hand its fragments to the other.
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do stop_pid "$p"; done
  ((done_ok)) || echo "WARNING: run $run merged only $(merged_inputs "$OUT/$run") of $total deltas" >&2
  python3 - "$OUT/$run" "$instances" "$quorum" "$load" "${cpu[*]}" "$broker_cpu" <<'PY'
import json, sys, glob, os
d, instances, quorum, load, cpu, broker_cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5].split(), float(sys.argv[6])
produced = json.load(open(f"{d}/produced.json"))
frag_bytes = produced["fp32_bytes_per_fragment"]
inst = {}
for f in sorted(glob.glob(f"{d}/*/metrics.jsonl")):
    ev = [json.loads(l) for l in open(f)]
    name = os.path.basename(os.path.dirname(f))
    merges = [e for e in ev if e["event"] == "merge"]
    assigned = [e for e in ev if e["event"] == "assigned" and e["time_us"] < merges[-1]["time_us"]]
    last_assigned = assigned[-1]["time_us"]
    steady = [e for e in merges if e["time_us"] > last_assigned]
    inst[name] = dict(merges=merges, steady=steady, first=ev[0]["time_us"], assigned=assigned,
                      start=steady[0]["time_us"], end=steady[-1]["time_us"],
                      partitions=assigned[-1]["partitions"],
                      recovered=[e for e in ev if e["event"] == "recovered"])
start = max(i["start"] for i in inst.values())
end = min(i["end"] for i in inst.values())
win = [m for i in inst.values() for m in i["merges"] if start < m["time_us"] <= end]
deltas = sum(len(m["inputs"]) for m in win)
fp32 = sum(len(m["inputs"]) * frag_bytes[m["fragment"]] for m in win)
secs = (end - start) / 1e6
all_merges = [m for i in inst.values() for m in i["merges"]]
merged = sum(len(m["inputs"]) for m in all_merges)
dropped = sum(len(m["dropped"]) for m in all_merges)
t0 = min(i["first"] for i in inst.values())
t_last = max(i["end"] for i in inst.values())
wire = produced["wire_bytes_per_delta"]
print(f"\n{instances} instance(s), quorum {quorum}: {produced['deltas']} deltas produced "
      f"({produced['learners']} learners x {produced['fragments']} fragments x {produced['rounds']} rounds; "
      f"fp32 {frag_bytes} bytes per fragment, {wire} wire bytes per delta), "
      f"{merged} merged, {dropped} dropped, {len(all_merges)} merges; load1 at start {load}")
for name, i in inst.items():
    s = i["steady"]
    n = sum(len(m["inputs"]) for m in s[1:])
    b = sum(len(m["inputs"]) * frag_bytes[m["fragment"]] for m in s[1:])
    t = (i["end"] - i["start"]) / 1e6
    rec = [r for r in i["recovered"] if r["time_us"] <= i["start"]]
    print(f"  {name}: partitions {i['partitions']} after {len(i['assigned'])} assignment(s); steady window {t:.2f} s: "
          f"{n} deltas, {n / t:.1f} deltas/s, {(len(s) - 1) / t:.1f} merges/s, {b / t / 1e6:.1f} MB/s fp32")
if secs > 0 and win:
    print(f"  together (window where every instance merges, {secs:.2f} s): {deltas} deltas, {deltas / secs:.1f} deltas/s, "
          f"{len(win) / secs:.1f} merges/s, {fp32 / secs / 1e6:.1f} MB/s fp32 ({deltas * wire / secs / 1e6:.1f} MB/s on the wire)")
else:
    print("  together: n/a (the instances' steady windows do not overlap)")
# Drain: from the last assignment of any instance (recovery included) to the last merge, every
# delta merged after it; a merger behind reads on before it merges, so merges take many inputs.
drain_start = max(i["assigned"][-1]["time_us"] for i in inst.values())
after = [m for m in all_merges if m["time_us"] > drain_start]
drain_secs = (t_last - drain_start) / 1e6
drained = sum(len(m["inputs"]) for m in after)
drained_fp32 = sum(len(m["inputs"]) * frag_bytes[m["fragment"]] for m in after)
if drain_secs > 0 and after:
    print(f"  drain (last assignment to last merge, {drain_secs:.2f} s): {drained} deltas in {len(after)} merges "
          f"({drained / len(after):.1f} inputs per merge): {drained / drain_secs:.1f} deltas/s, "
          f"{drained_fp32 / drain_secs / 1e6:.1f} MB/s fp32 ({drained * wire / drain_secs / 1e6:.1f} MB/s on the wire)")
print(f"  end to end (first process start to last merge, recovery and rebalances included): {(t_last - t0) / 1e6:.2f} s; "
      f"merger CPU seconds {' + '.join(cpu)}; broker CPU {broker_cpu:.1f} s over the same time "
      f"({broker_cpu / len(all_merges) * 1e3:.1f} ms per merge; other users of the broker included)")
PY
}

failover_case() {  # session timeout ms
  local timeout="$1" run
  new_run fo; run="$RUN"
  mkdir -p "$OUT/$run"
  start_merger "$run" MA "$timeout" "$learners"; local a=$MERGER_PID
  start_merger "$run" MB "$timeout" "$learners"; local b=$MERGER_PID
  "$BIN/bench-produce_deltas" -c "$config" --set "run.id=\"$run\"" --learners "$learners" --rounds 1000000 \
    --genesis --pace "$pace" --region r0 --bootstrap "$BOOTSTRAP" 2>"$OUT/$run/producer.log" &
  local producer=$!
  PIDS+=("$producer")
  # Steady state: both instances own 2 partitions and have merged at least 3 times since.
  local ready=0
  for _ in $(seq 1 480); do
    ready="$(python3 - "$OUT/$run" <<'PY'
import json, sys, glob
ok = 0
for f in glob.glob(f"{sys.argv[1]}/*/metrics.jsonl"):
    ev = [json.loads(l) for l in open(f)]
    a = [e for e in ev if e["event"] == "assigned"]
    if a and len(a[-1]["partitions"]) == 2 and sum(1 for e in ev if e["event"] == "merge" and e["time_us"] > a[-1]["time_us"]) >= 3:
        ok += 1
print(1 if ok == 2 else 0)
PY
)"
    ((ready)) && break
    sleep 0.25
  done
  ((ready)) || { echo "failover: the two mergers never settled" >&2; return 1; }
  sleep 3
  kill -KILL "$a"
  local kill_us; kill_us="$(date +%s%6N)"
  wait "$a" 2>/dev/null || true
  forget "$a"
  local found=0
  for _ in $(seq 1 360); do
    found="$(python3 - "$OUT/$run" "$kill_us" <<'PY'
import json, sys
d, kill = sys.argv[1], int(sys.argv[2])
a = [json.loads(l) for l in open(f"{d}/MA/metrics.jsonl")]
victim = set(p for p in [e for e in a if e["event"] == "assigned"][-1]["partitions"])
b = [json.loads(l) for l in open(f"{d}/MB/metrics.jsonl")]
print(1 if any(e["event"] == "merge" and e["time_us"] > kill and e["fragment"] % 4 in victim for e in b) else 0)
PY
)"
    ((found)) && break
    sleep 0.25
  done
  stop_pid "$producer"
  stop_pid "$b"
  python3 - "$OUT/$run" "$kill_us" "$timeout" <<'PY'
import json, sys
d, kill, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
a = [json.loads(l) for l in open(f"{d}/MA/metrics.jsonl")]
b = [json.loads(l) for l in open(f"{d}/MB/metrics.jsonl")]
victim = sorted(set([e for e in a if e["event"] == "assigned"][-1]["partitions"]))
last_a = max(e["time_us"] for e in a if e["event"] == "merge")
after = [e for e in b if e["time_us"] > kill]
def first(pred):
    for e in after:
        if pred(e): return (e["time_us"] - kill) / 1e6
    return None
revoked = first(lambda e: e["event"] == "revoked")
assigned = first(lambda e: e["event"] == "assigned")
rec = [e for e in after if e["event"] == "recovered"]
recovered = (rec[-1]["time_us"] - kill) / 1e6 if rec else None
victim_merge = first(lambda e: e["event"] == "merge" and e["fragment"] % 4 in victim)
own_merge = None
if assigned is not None:
    own_merge = first(lambda e: e["event"] == "merge" and e["fragment"] % 4 not in victim and e["time_us"] - kill > assigned * 1e6)
replayed = sum(e["replayed"] for e in rec)
fmt = lambda x: "never" if x is None else f"{x:.2f} s"
# Exactly once across the failover: no (fragment, learner, seq) in two merges, versions contiguous.
seen, twice = set(), 0
versions = {}
for e in a + b:
    if e["event"] != "merge": continue
    versions.setdefault(e["fragment"], []).append(e["version"])
    for i in e["inputs"]:
        k = (e["fragment"], i["learner"], i["seq"])
        twice += k in seen
        seen.add(k)
gaps = sum(1 for v in versions.values() for x, y in zip(sorted(v), sorted(v)[1:]) if y != x + 1)
print(f"\nfailover, session timeout {timeout} ms: killed MA (partitions {victim}) {(kill - last_a) / 1e6:.2f} s after its last merge; "
      f"MB: revoked at {fmt(revoked)}, assigned all at {fmt(assigned)}, recovered {len(rec)} fragments "
      f"(replaying {replayed} merge records) by {fmt(recovered)}, first merge of a fragment of MA at {fmt(victim_merge)} "
      f"(of its own fragments, which the eager rebalance also revoked: {fmt(own_merge)}) after the kill; "
      f"{len(seen)} deltas merged, {twice} of them twice, {gaps} version gaps")
PY
}

if [[ -z "$only" || "$only" == throughput ]]; then
  for c in ${cases:-1:$learners 2:$learners 1:1}; do
    # Quorum 1 merges one delta per transaction: a third of the rounds keeps it under a minute.
    r="$rounds"
    [[ "${c#*:}" == 1 && "$learners" != 1 ]] && r=$(((rounds + 2) / 3))
    throughput_case "${c%%:*}" "${c#*:}" "$r"
  done
fi
if [[ -z "$only" || "$only" == failover ]]; then
  for t in $timeouts; do failover_case "$t"; done
fi
