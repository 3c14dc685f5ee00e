#!/usr/bin/env bash
# scripts/wan-sim leaves nothing behind. Two runs of the tiny config, two regions behind 20 Mbit/s
# links, on a broker of the harness's own inside its core namespace:
#   1. a short run to its budget: it trains across the namespaces (merges happen, learners adopt
#      versions, bytes cross the links), exits 0, and no namespace, veth or queue of its tag is
#      left, nor any process of the run;
#   2. a run whose harness is killed with kill -9 while the learners train: its watchdog removes
#      the namespaces, with every veth and queue in them, and kills every process of the run.
# Needs root (network namespaces), which CI has; without root it reports a skip (exit 77).
#   usage: wan_sim_test.sh BIN_DIR
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export DILOCO_BIN_DIR="${1:?usage: wan_sim_test.sh BIN_DIR}"
export KAFKA_HEAP_OPTS="-Xms128m -Xmx384m"
if [[ "$(id -u)" != 0 ]]; then echo "SKIP: scripts/wan-sim needs root"; exit 77; fi
tmp="$(mktemp -d /tmp/diloco-wan-test.XXXXXX)"
tag1="ddt$((RANDOM % 10000))a" tag2="ddt$((RANDOM % 10000))b"
fail() { echo "FAIL: $*" >&2; exit 1; }
cleanup() {
  "$root/scripts/wan-sim" --cleanup "$tag1" >/dev/null 2>&1 || true
  "$root/scripts/wan-sim" --cleanup "$tag2" >/dev/null 2>&1 || true
  [[ -n "${KEEP:-}" ]] || rm -rf "$tmp"
}
trap cleanup EXIT

# Nothing of the tag in the namespaces, the root namespace's links and queues, or the processes.
left_behind() {
  local tag="$1" run="$2"
  ip netns list | grep -q "^$tag-" && { echo "namespaces: $(ip netns list | grep "^$tag-" | tr '\n' ' ')"; return 0; }
  ip -o link show | grep -q "$tag[cr][0-9]" && { echo "links: $(ip -o link show | grep "$tag[cr][0-9]")"; return 0; }
  tc qdisc show | grep -q "$tag" && { echo "queues: $(tc qdisc show | grep "$tag")"; return 0; }
  pgrep -f "$run" >/dev/null && { echo "processes: $(pgrep -af "$run")"; return 0; }
  return 1
}

args=(configs/tiny.toml --learners 2 --regions eu,us --rate 20mbit --set train.eval_every=0 --no-report)

# 1. A run to its budget.
run1="$tmp/run1"
"$root/scripts/wan-sim" "${args[@]}" --tag "$tag1" --steps 120 --run-dir "$run1" </dev/null >"$tmp/wan1.out" 2>&1 ||
  { tail -40 "$tmp/wan1.out"; fail "scripts/wan-sim exited with $?"; }
tail -5 "$tmp/wan1.out"
grep -q "regions behind their links\|region(s) behind their links" "$tmp/wan1.out" || fail "no links were set up"
/usr/bin/python3 - "$run1" <<'PY' || { tail -40 "$tmp/wan1.out"; fail "the run did not train across the links"; }
import json, sys
run = sys.argv[1]
wan = json.load(open(f"{run}/wan.json"))
assert set(wan["links"]) == {"eu", "us"}, wan
assert all(l["rate"] == "20mbit" for l in wan["links"].values()), wan
info = json.load(open(f"{run}/run.json"))
assert info["bootstrap"] == "10.77.0.1:19092", info["bootstrap"]
assert info["exit_codes"] and all(c == 0 for c in info["exit_codes"].values()), info["exit_codes"]
def events(name, kind):
    return [json.loads(l) for l in open(f"{run}/{name}/metrics.jsonl") if f'"event":"{kind}"' in l]
merges = events("merger-0", "merge")
assert len(merges) >= 4, f"{len(merges)} merges"
for learner in ("learner-0", "learner-1"):
    assert events(learner, "adopt"), f"{learner} adopted no version"
    shutdown = events(learner, "shutdown")[-1]
    assert shutdown["bytes_sent"] > 0 and shutdown["bytes_received"] > 0, shutdown
print(f"trained across the links: {len(merges)} merges")
PY
if what="$(left_behind "$tag1" "$run1")"; then fail "after a normal exit, left behind: $what"; fi

# 2. The harness killed with kill -9 while its learners train.
run2="$tmp/run2"
"$root/scripts/wan-sim" "${args[@]}" --tag "$tag2" --steps 100000 --run-dir "$run2" </dev/null >"$tmp/wan2.out" 2>&1 &
harness=$!
for _ in $(seq 1 180); do
  [[ -f "$run2/learner-0/metrics.jsonl" ]] && grep -q '"event":"adopt"' "$run2/learner-0/metrics.jsonl" && break
  kill -0 "$harness" 2>/dev/null || { tail -40 "$tmp/wan2.out"; fail "the second harness ended before its learners trained"; }
  sleep 1
done
grep -q '"event":"adopt"' "$run2/learner-0/metrics.jsonl" || fail "no adoption within 180 s"
ip netns list | grep -q "^$tag2-core" || fail "the namespaces of the second run are not there"
pyharness="$(pgrep -f "decoupled_diloco.tools.wan_sim.*--tag $tag2" | head -1)"
[[ -n "$pyharness" ]] || fail "the harness process is not found"
kill -KILL "$pyharness"
gone=0
for _ in $(seq 1 60); do
  if ! left_behind "$tag2" "$run2" >/dev/null; then gone=1; break; fi
  sleep 1
done
((gone)) || fail "60 s after kill -9 of the harness, left behind: $(left_behind "$tag2" "$run2")"
grep -q "removed" "$run2/wan-watchdog.log" || fail "the watchdog did not say what it removed: $(cat "$run2/wan-watchdog.log")"
cat "$run2/wan-watchdog.log"
echo "PASS: nothing left behind after a normal exit and after kill -9 of the harness"
