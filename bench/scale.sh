#!/usr/bin/env bash
# The data plane at model scale, no training: fake learners (bench-produce_deltas, int4 deltas of
# the config's layout) through the real broker into 1 and then 2 merger instances, and out to two
# subscribers (bench-subscribe: a learner's parameter inbox without a model), one there from the
# start and one that joins after the last merge (the late joiner). Every version a subscriber
# reconstructs is checked against the merge log's checksum, and diloco-replay verifies every
# version. Records per case: parameters merged per second per instance, the peak RSS of every
# process (ps, every 0.5 s, also written as a timeline, `rss-timeline`: unix time, name, KiB;
# `peaks-rounds`: the peaks before the late joiner; diloco-replay's audit and verify from getrusage), bytes per parameter up (deltas) and down (what the first subscriber
# received over ZeroMQ, per version it holds), the late joiner's time to hold every fragment, and
# where a merge's time goes (the merge events' timings). With --tensors, the newest version is
# also rebuilt whole and fragment by fragment, and the two compared (rebuild_check).
#
#   bench/scale.sh [--width 1024] [--layers 8] [--fragments 8] [--learners 2] [--rounds 3]
#                  [--pace 0] [--instances "1 2"] [--tensors SPEC] [--only LIST] [--checkpoint-every 1000]
#                  [--learner fake|runtime] [--spill-dir DIR] [--restart] [--bin-dir DIR] [--keep] [--keep-topics]
#
# The model is configs/tiny.toml widened (--width, --layers; heads 16): about 12 x width^2 x layers
# parameters; or, with --tensors "embed=128256x4096,...", those tensors, a tensor larger than a
# fragment cut into blocks of rows over several fragments (core/fragments/partition.h). With --only "0,3" only those
# fragments travel (a model too large for the machine: the others get no version 0 and no deltas, the subscribers
# wait for those alone, no rebuild check). Version 0 is proposed by bench-produce_deltas --genesis before the rounds; every
# delta is on it (bench-produce_deltas --bases genesis), and the mergers run with merger.quorum 1, so a merge takes whatever is pending (with a quorum of K, a merge that
# took more than K deltas could leave a last one waiting for good); --pace S (seconds between rounds) spreads the rounds so that
# merges take about one round each; --checkpoint-every N is merger.checkpoint_every (each merger writes a
# fragment's checkpoint every N versions). --learner runtime replaces the fake learners and the
# first subscriber with one process of the real learner runtime (bench-runtime_learner: --learners 1,
# diloco.wait_steps 0 so that every delta is merged on the version of the one before): it proposes
# version 0 itself, cuts with error feedback, and adopts every version, which is checked where it
# lands (the fragment's values in its buffers against the merge log). --restart: once the mergers
# stopped, each is started again and must recover every fragment it owned at the newest version
# with the merge log's checksum, from its newest checkpoint (with --checkpoint-every: one above
# 2 GiB read back at full size) and the merge records after it. --spill-dir DIR: the runtime keeps
# its residuals and values at a cut in files there (RuntimeOptions::spill_dir). Needs a running broker (scripts/broker start) and the build (build/bin or --bin-dir).
# Kills every process it started on exit; deletes the topics of its runs unless --keep-topics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DILOCO_BIN_DIR:-$ROOT/build/bin}"
BOOTSTRAP="${DILOCO_BOOTSTRAP:-127.0.0.1:19092}"
width=1024 layers=8 fragments=8 learners=2 rounds=3 pace=0 instances="1 2" keep=0 keep_topics=0 tensors="" checkpoint_every=1000 only="" learner=fake restart=0 spill_dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --width) width="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --fragments) fragments="$2"; shift 2 ;;
    --learners) learners="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --pace) pace="$2"; shift 2 ;;
    --instances) instances="$2"; shift 2 ;;
    --tensors) tensors="$2"; shift 2 ;;
    --checkpoint-every) checkpoint_every="$2"; shift 2 ;;
    --bin-dir) BIN="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --keep-topics) keep_topics=1; shift ;;
    --only) only="$2"; shift 2 ;;
    --learner) learner="$2"; shift 2 ;;
    --restart) restart=1; shift ;;
    --spill-dir) spill_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scale.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
cd "$ROOT"
case "$learner" in
  fake) ;;
  runtime) ((learners == 1)) || { echo "scale.sh: --learner runtime runs one learner process: add --learners 1" >&2; exit 2; } ;;
  *) echo "scale.sh: --learner $learner: fake or runtime" >&2; exit 2 ;;
esac
for b in diloco-merger diloco-replay bench-produce_deltas bench-subscribe bench-runtime_learner; do
  [[ -x "$BIN/$b" ]] || { echo "scale.sh: missing $BIN/$b: cmake --build build (or --bin-dir)" >&2; exit 1; }
done
OUT="$(mktemp -d /tmp/diloco-scale.XXXXXX)"
source "$ROOT/bench/lib.sh"
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

config=configs/tiny.toml
partitions=$(( fragments < 4 ? fragments : 4 ))
sets=(--set model.width="$width" --set model.layers="$layers" --set model.heads=16 --set diloco.fragments="$fragments"
      --set merger.quorum=1 --set merger.checkpoint_every="$checkpoint_every" --set train.eval_every=0
      --set diloco.H="$(( (40 + fragments - 1) / fragments * fragments ))")  # tiny's 40, or the next multiple of P
[[ "$learner" != runtime ]] || sets+=(--set diloco.wait_steps=0)
echo "# scale: $(date -u) | nproc $(nproc) | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') | $(free -g | awk '/Mem:/ {print $2}') GiB"
echo "# ${tensors:+tensors $tensors, }${only:+only fragments $only, }width $width, layers $layers, $fragments fragments, $learners $learner learner(s), $rounds rounds; load $(cut -d' ' -f1-3 /proc/loadavg)"

# Runs a command and appends "NAME <peak RSS KiB of it and its children>" to FILE (the sampler is
# stopped by then); returns the command's status.
with_peak() {  # file name command...
  local file="$1" name="$2"; shift 2
  python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[3:])
with open(sys.argv[1], "a") as f: f.write(f"{sys.argv[2]} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\n")
sys.exit(rc)' "$file" "$name" "$@"
}
merged_inputs() { { cat "$1"/M*/metrics.jsonl 2>/dev/null || true; } | jq -s '[.[] | select(.event == "merge") | .inputs | length] | add // 0'; }

# With --tensors: diloco-replay rebuilds the newest version whole and each fragment alone; every
# tensor of the whole file must have its --tensors shape, and every block of rows a fragment holds
# must equal those rows of the whole file (the fragments' own versions are what verify checked).
rebuild_check() {  # dir, config overrides...
  local dir="$1"; shift
  local newest
  newest=$(jq '[.versions[] | .[-1].version] | min' "$dir/audit.json")
  "$BIN/diloco-replay" -c "$config" "$@" --bootstrap "$BOOTSTRAP" rebuild --version "$newest" \
    --out "$dir/whole.safetensors" > "$dir/rebuild.log" 2>&1 || { echo "scale.sh: rebuild failed" >&2; return 1; }
  local p
  for ((p = 0; p < fragments; p++)); do
    "$BIN/diloco-replay" -c "$config" "$@" --bootstrap "$BOOTSTRAP" rebuild --version "$newest" --fragment "$p" \
      --out "$dir/fragment-$p.safetensors" >> "$dir/rebuild.log" 2>&1 || { echo "scale.sh: rebuild of fragment $p failed" >&2; return 1; }
  done
  PYTHONPATH="$ROOT/python" "$ROOT/.venv/bin/python" - "$dir" "$fragments" "$tensors" <<'PY' | tee "$dir/rebuild-check.txt"
import re, sys
import numpy as np
from decoupled_diloco import safetensors
d, fragments, spec = sys.argv[1], int(sys.argv[2]), sys.argv[3]
whole = safetensors.load_file(f"{d}/whole.safetensors")
shapes = {name: tuple(int(x) for x in dims.split("x")) for name, dims in (t.split("=") for t in spec.split(","))}
assert {k: v.shape for k, v in whole.items()} == shapes, f"whole file: {[(k, v.shape) for k, v in whole.items()]}"
checked = 0
for p in range(fragments):
    for name, values in safetensors.load_file(f"{d}/fragment-{p}.safetensors").items():
        m = re.fullmatch(r"(.+)\[(\d+):(\d+)\]", name)
        base, rows = (m.group(1), slice(int(m.group(2)), int(m.group(3)))) if m else (name, slice(None))
        assert np.array_equal(whole[base][rows], values), f"fragment {p}: {name} differs from the whole file"
        checked += values.size
total = sum(v.size for v in whole.values())
assert checked == total, f"the fragments hold {checked} values, the model {total}"
print(f"  rebuild: the whole model ({', '.join(f'{k} {list(v.shape)}' for k, v in whole.items())}) equals its "
      f"{fragments} fragments rebuilt alone, {checked} values: PASS")
PY
  local rc=${PIPESTATUS[0]}
  rm -f "$dir"/whole.safetensors "$dir"/fragment-*.safetensors
  return "$rc"
}

scale_case() {  # instances
  local n="$1" run="sc$(date +%s%N | cut -c8-15)" i
  RUNS+=("$run")
  local dir="$OUT/$run"
  mkdir -p "$dir"
  scripts/broker topics --run "$run" --regions r0 --partitions "$partitions" >/dev/null
  local rs=("${sets[@]}" --set "run.id=\"$run\"")
  local model=()
  [[ -z "$tensors" ]] || model=(--tensors "$tensors")
  [[ -z "$only" ]] || model+=(--only "$only")
  # Peak RSS (KiB) of every process of the case, by name.
  ( declare -A peak
    while true; do
      while read -r rss args; do
        name="$(basename "${args%% *}")"
        case "$args" in *"--id M"*) name="merger-${args##*--id }"; name="${name%% *}" ;; esac
        case "$args" in *subscribe*"late"*) name="subscriber-late" ;; *subscribe*) name="subscriber" ;; esac
        case "$args" in *produce_deltas*--genesis*) name="genesis-proposer" ;; *runtime_learner*) name="learner-runtime" ;; esac
        [[ "$args" == *"$run"* || "$name" == java ]] || continue
        (( rss > ${peak[$name]:-0} )) && peak[$name]=$rss
        echo "$(date +%s.%N) $name $rss" >> "$dir/rss-timeline"
      done < <(ps -eo rss=,args= | grep -E "diloco-merger|bench-|java.*kafka" | grep -v grep || true)
      for k in "${!peak[@]}"; do echo "$k ${peak[$k]}"; done > "$dir/peaks.tmp" && mv "$dir/peaks.tmp" "$dir/peaks"
      sleep 0.5
    done ) &
  local sampler=$!
  PIDS+=("$sampler")
  local mergers=()
  for ((i = 0; i < n; i++)); do
    "$BIN/diloco-merger" -c "$config" "${rs[@]}" --id "M$i" --bootstrap "$BOOTSTRAP" --run-dir "$dir/M$i" \
      >"$dir/M$i.log" 2>&1 &
    mergers+=($!); PIDS+=($!)
  done
  local sub="" t0
  if [[ "$learner" == runtime ]]; then
    # The learner runtime proposes version 0, trains, and adopts every version (it is the first
    # subscriber); it returns once it holds a version per delta it cut.
    t0=$(date +%s.%N)
    "$BIN/bench-runtime_learner" -c "$config" "${rs[@]}" "${model[@]}" --rounds "$rounds" --region r0 \
      ${spill_dir:+--spill-dir "$spill_dir"} --bootstrap "$BOOTSTRAP" --run-dir "$dir/learner" --summary "$dir/produced.json" 2>"$dir/learner.log" ||
      { echo "scale.sh: bench-runtime_learner failed:" >&2; tail -n 20 "$dir/learner.log" >&2; return 1; }
  else
    "$BIN/bench-subscribe" -c "$config" "${rs[@]}" "${model[@]}" --bootstrap "$BOOTSTRAP" --summary "$dir/subscriber.json" \
      2>"$dir/subscriber.log" &
    sub=$!; PIDS+=("$sub")
    # Version 0 first, as a learner would propose it, committed by the running mergers (they reject
    # deltas of a fragment without one); the produce-to-last-merge time starts after it, as before.
    "$BIN/bench-produce_deltas" -c "$config" "${rs[@]}" "${model[@]}" --genesis --rounds 0 --region r0 --bootstrap "$BOOTSTRAP" \
      2>"$dir/genesis.log" || { echo "scale.sh: version 0 was not committed:" >&2; tail -n 20 "$dir/genesis.log" >&2; return 1; }
    t0=$(date +%s.%N)
    "$BIN/bench-produce_deltas" -c "$config" "${rs[@]}" "${model[@]}" --learners "$learners" --rounds "$rounds" --pace "$pace" --region r0 \
      --bootstrap "$BOOTSTRAP" --summary "$dir/produced.json" 2>"$dir/producer.log" ||
      { echo "scale.sh: bench-produce_deltas failed:" >&2; tail -n 20 "$dir/producer.log" >&2; return 1; }
  fi
  local total; total="$(jq .deltas "$dir/produced.json")"
  local last=-1 still=0 got
  while true; do
    got="$(merged_inputs "$dir")"
    ((got >= total)) && break
    if ((got == last)); then ((still += 1)); else still=0; last=$got; fi
    ((still < 600)) || { echo "scale.sh: $got of $total deltas merged, no progress for 5 minutes" >&2; cat "$dir"/M*.log >&2; return 1; }
    for p in "${mergers[@]}"; do kill -0 "$p" 2>/dev/null || { cat "$dir"/M*.log >&2; return 1; }; done
    sleep 0.5
  done
  local t1; t1=$(date +%s.%N)
  # The first subscriber takes the last versions, then stops before the late joiner starts, so
  # that the two do not hold the model at once.
  sleep 3
  # The peaks so far: the rounds (version 0, the merges, the updates), before any snapshot is
  # asked for by the late joiner.
  cp "$dir/peaks" "$dir/peaks-rounds" 2>/dev/null || true
  [[ -z "$sub" ]] || stop_pid "$sub" || true
  # The late joiner: starts after the last merge and must get a snapshot of every fragment.
  "$BIN/bench-subscribe" -c "$config" "${rs[@]}" "${model[@]}" --bootstrap "$BOOTSTRAP" --summary "$dir/subscriber-late.json" \
    2>"$dir/subscriber-late.log" & 
  local late=$!; PIDS+=("$late")
  for _ in $(seq 1 1200); do grep -q "holding all" "$dir/subscriber-late.log" 2>/dev/null && break; sleep 0.5; done
  local rc=0
  stop_pid "$late" || true
  for p in "${mergers[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${mergers[@]}"; do stop_pid "$p"; done
  if ((restart)); then
    # Each merger again, from its checkpoint and the records after it, until it recovered every
    # fragment (the `recovered` events of its second start, checked below against the merge log).
    for ((i = 0; i < n; i++)); do
      local lines; lines=$(wc -l < "$dir/M$i/metrics.jsonl")
      "$BIN/diloco-merger" -c "$config" "${rs[@]}" --id "M$i" --bootstrap "$BOOTSTRAP" --run-dir "$dir/M$i" \
        >"$dir/M$i-restart.log" 2>&1 &
      local again=$!; PIDS+=("$again")
      for _ in $(seq 1 2400); do  # "owns fragments ... (recovered in S s)" once it rebuilt them
        grep -q "owns fragments" "$dir/M$i-restart.log" && break
        kill -0 "$again" 2>/dev/null || break
        sleep 0.5
      done
      tail -n +"$((lines + 1))" "$dir/M$i/metrics.jsonl" | grep '"event":"recovered"' > "$dir/M$i-recovered.jsonl" || true
      kill -TERM "$again" 2>/dev/null || true; stop_pid "$again" || true
    done
  fi
  kill "$sampler" 2>/dev/null || true; forget "$sampler"
  with_peak "$dir/peaks" replay-audit "$BIN/diloco-replay" -c "$config" "${rs[@]}" --bootstrap "$BOOTSTRAP" --run "$run" \
    audit --json > "$dir/audit.json" || rc=1
  local verified=PASS
  with_peak "$dir/peaks" replay-verify "$BIN/diloco-replay" -c "$config" "${rs[@]}" --bootstrap "$BOOTSTRAP" --run "$run" \
    verify > "$dir/verify.log" 2>&1 || verified=FAIL
  [[ -z "$tensors" || -n "$only" ]] || rebuild_check "$dir" "${rs[@]}" || rc=1
  python3 - "$dir" "$n" "$t0" "$t1" "$verified ($(grep -m1 '^verified' "$dir/verify.log" || tail -1 "$dir/verify.log"))" <<'PY' || rc=1
import glob, json, os, sys
d, n, t0, t1, verify = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
produced = json.load(open(f"{d}/produced.json"))
audit = json.load(open(f"{d}/audit.json"))
# Parameters of each fragment sent (with --only, some of the layout's), by fragment id.
sizes = [b // 4 for b in produced["fp32_bytes_per_fragment"]]
frag = dict(zip(produced.get("fragment_ids", range(len(sizes))), sizes))
params = sum(frag.values())
truth = {(int(p), v["version"]): v["checksum"] for p, vs in audit["versions"].items() for v in vs}
ok = audit["ok"] and verify.startswith("PASS")
print(f"\n{n} merger instance(s): {params / 1e6:.1f}M parameters in {len(frag)} fragments; "
      f"{produced['deltas']} deltas produced, {audit['merged']} merged, {audit['merge_records']} merge records; "
      f"audit {'PASS' if audit['ok'] else 'FAIL'}; verify: {verify}")
runtime = "learner" in produced
if runtime:  # the learner runtime held every version it adopted: [version, checksum in its buffers]
    wrong = [(int(p), v[0]) for p, vs in produced["versions"].items() for v in vs if truth.get((int(p), v[0])) != v[1]]
    adopted = sum(len(vs) for vs in produced["versions"].values())
    ok = ok and not wrong and produced["complete"] and adopted > 0
    print(f"  learner runtime: {produced['deltas']} deltas cut, {adopted} versions adopted, {len(wrong)} not matching "
          f"the merge log; peak RSS {produced['max_rss_kib'] // 1024} MiB ({produced['bytes_per_parameter']:.1f} bytes "
          f"per parameter of its {produced['parameters'] / 1e6:.1f}M)")
for name in ("subscriber-late",) if runtime else ("subscriber", "subscriber-late"):
    s = json.load(open(f"{d}/{name}.json"))
    held = [(int(p), v[0], v[1]) for p, vs in s["versions"].items() for v in vs]
    wrong = [h for h in held if truth.get((h[0], h[1])) != h[2] and h[1] != 0]
    ok = ok and not wrong and s["mismatched"] == 0 and s["complete_seconds"] >= 0
    per_message = params / len(frag)  # the fragments' mean size
    print(f"  {name}: {len(held)} versions held, {s['skipped']} skipped, {len(wrong)} not matching the merge log, "
          f"{s['rejected']} rejected; every fragment held after {s['complete_seconds']:.2f} s; "
          f"{s['bytes_received'] / 1e6:.1f} MB received: {s['snapshots']} snapshots "
          f"{s['snapshot_bytes'] / 1e6:.1f} MB (about {s['snapshot_bytes'] / max(1, s['snapshots'] * per_message):.3f} bytes per parameter), "
          f"{s['updates']} updates {s['update_bytes'] / 1e6:.1f} MB "
          f"(about {s['update_bytes'] / max(1, s['updates'] * per_message):.3f} bytes per parameter per version)")
print(f"  up: {produced['wire_bytes_per_delta']} wire bytes per delta = "
      f"{produced['wire_bytes_per_delta'] * len(frag) / params:.3f} bytes per parameter")
for f in sorted(glob.glob(f"{d}/M*/metrics.jsonl")):
    ev = [json.loads(l) for l in open(f)]
    merges = [e for e in ev if e["event"] == "merge"]
    if not merges:
        print(f"  {os.path.basename(os.path.dirname(f))}: no merges"); continue
    inputs = sum(len(m["inputs"]) * frag[m["fragment"]] for m in merges)
    span = (merges[-1]["time_us"] - ev[0]["time_us"]) / 1e6
    sync = sum(m.get("sync_seconds", 0) for m in merges)
    parts = {k: sum(m.get("seconds", {}).get(k, 0) for m in merges) for k in ("merge", "commit", "publish")}
    rec = [e for e in ev if e["event"] == "recovered"]
    genesis = [e for e in ev if e["event"] == "genesis"]
    print(f"  {os.path.basename(os.path.dirname(f))}: {len(merges)} merges, {inputs / 1e6:.1f}M delta parameters merged; "
          f"{inputs / span / 1e6:.1f}M parameters/s from start to last merge ({span:.1f} s, start-up and recovery included); "
          f"sync (merge to published) {sync:.1f} s in all, {sync / len(merges):.2f} s per merge "
          f"(arithmetic {parts['merge']:.1f} s, {inputs / max(1e-9, parts['merge']) / 1e6:.0f}M delta parameters/s; "
          f"record and checkpoint commit {parts['commit']:.1f} s; publish {parts['publish']:.1f} s); "
          f"{len(rec)} fragments recovered, version 0 of {len(genesis)} committed")
for f in sorted(glob.glob(f"{d}/M*-recovered.jsonl")):  # --restart
    rec = [json.loads(l) for l in open(f)]
    newest = {}
    for (p, v) in truth:
        newest[p] = max(newest.get(p, -1), v)
    got = {r["fragment"]: r for r in rec}
    wrong = [p for p in newest if p not in got or (got[p]["version"], got[p]["checksum"]) != (newest[p], truth[(p, newest[p])])]
    ok = ok and bool(rec) and not wrong
    print(f"  {os.path.basename(f).split('-')[0]} restarted: {len(rec)} fragments recovered "
          + ", ".join(f"{r['fragment']} at version {r['version']} from a checkpoint of {r['checkpoint_pieces']} pieces "
                      f"and {r['replayed']} records" for r in rec)
          + f"; {len(wrong)} not at the newest version with the merge log's checksum")
peaks = dict(l.split() for l in open(f"{d}/peaks")) if os.path.exists(f"{d}/peaks") else {}
print("  peak RSS: " + ", ".join(f"{k} {int(v) // 1024} MiB" for k, v in sorted(peaks.items())))
rounds = dict(l.split() for l in open(f"{d}/peaks-rounds")) if os.path.exists(f"{d}/peaks-rounds") else {}
print("  peak RSS in the rounds (before the late joiner asked for snapshots): " +
      ", ".join(f"{k} {int(v) // 1024} MiB" for k, v in sorted(rounds.items())))
print(f"  produce to last merge: {t1 - t0:.1f} s; {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
  return $rc
}

status=0
for n in $instances; do scale_case "$n" || status=1; done
exit $status
