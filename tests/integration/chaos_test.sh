#!/usr/bin/env bash
# scripts/chaos, CI-sized: the tiny config on a 3-node broker of its own (ports and folder), two
# learners and two mergers for 80 s under a seeded schedule that kills a learner, a merger
# and a broker node, pauses a learner, and stops a learner and a merger with SIGTERM (each must
# exit 0) before restarting them. Passes when scripts/chaos's checks pass (diloco-replay
# audit and verify, adoptions against the merge log), each kind of fault really happened, merges
# went on, goodput was measured, and nothing is left running.
#   usage: chaos_test.sh BIN_DIR
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export DILOCO_BIN_DIR="${1:?usage: chaos_test.sh BIN_DIR}"
export DILOCO_BROKER_DIR="$(mktemp -d /tmp/diloco-chaos-broker.XXXXXX)"
export DILOCO_BROKER_PORT="${DILOCO_TEST_CHAOS_PORT:-29192}"
export KAFKA_HEAP_OPTS="-Xms128m -Xmx384m"
tmp="$(mktemp -d /tmp/diloco-chaos-test.XXXXXX)"
fail() { echo "FAIL: $*" >&2; exit 1; }
cleanup() {
  "$root/scripts/broker" stop >/dev/null 2>&1 || true
  rm -rf "$DILOCO_BROKER_DIR"
  [[ -n "${KEEP:-}" ]] || rm -rf "$tmp"
}
trap cleanup EXIT

# Rates high enough that 80 s hold every kind of fault; the schedule is a function of the seed.
args=(configs/tiny.toml --seed 3 --seconds 80 --warmup 12 --cooldown 12 --learners 2 --mergers 2 --nodes 3
      --learner-mtbf 35 --learner-mttr 6 --pause-mtbf 40 --pause-mttr 4 --merger-mtbf 40 --merger-mttr 4
      --broker-mtbf 35 --broker-mttr 8 --term-mtbf 40 --term-mttr 4 --set train.eval_every=0)
"$root/scripts/chaos" "${args[@]}" --dry-run >"$tmp/schedule.jsonl" 2>/dev/null
for kind in '"learner-.*"kind": "kill"' '"learner-.*"kind": "pause"' '"learner-.*"kind": "term"' \
            '"merger-.*"kind": "kill"' '"merger-.*"kind": "term"' '"broker-.*"kind": "kill"'; do
  grep -q "$kind" "$tmp/schedule.jsonl" || fail "the schedule of seed 3 has no fault matching $kind: $(cat "$tmp/schedule.jsonl")"
done

run="$tmp/run"
"$root/scripts/chaos" "${args[@]}" --run-dir "$run" </dev/null >"$tmp/chaos.out" 2>&1 ||
  { tail -40 "$tmp/chaos.out"; fail "scripts/chaos exited with $?"; }
tail -8 "$tmp/chaos.out"

/usr/bin/python3 - "$run" <<'PY' || { tail -40 "$tmp/chaos.out"; fail "the run's result does not hold"; }
import json, sys
run = sys.argv[1]
r = json.load(open(f"{run}/chaos.json"))
timeline = [json.loads(l) for l in open(f"{run}/chaos.jsonl")]
problems = []
if not r["ok"]:
    problems.append(f"checks failed: {r['checks']} {r['problems'][:5]}")
for target, action in (("learner-", "kill"), ("learner-", "stop"), ("learner-", "term"), ("merger-", "kill"),
                       ("merger-", "term"), ("broker-", "kill")):
    if not any(e["target"].startswith(target) and e["action"] == action for e in timeline):
        problems.append(f"no {target}* {action} in chaos.jsonl")
downs = sum(1 for e in timeline if e["action"] in ("kill", "stop", "term") and e["target"] != "cluster")
if r["checks"].get("sigterm_clean_exit") is not True:
    problems.append(f"no clean exit of every SIGTERM stop checked: {r['checks']}")
ups = sum(1 for e in timeline if e["action"] in ("restart", "cont"))
if downs != ups:
    problems.append(f"{downs} faults but {ups} repairs")
if r["merges"] < 10:
    problems.append(f"only {r['merges']} merges")
if not (r["goodput"] and 0 < r["goodput"] <= 1):
    problems.append(f"goodput {r['goodput']}")
a = r["audit"]
if a["deltas"] < 10 or a["merged"] < 10:
    problems.append(f"audit saw too little: {a}")
print(f"chaos: {downs} faults, {r['merges']} merges, goodput {r['goodput']:.3f}, longest stall {r['longest_stall_seconds']} s, "
      f"audit {a}")
if problems:
    print("\n".join(problems), file=sys.stderr)
    sys.exit(1)
PY
[[ -s "$run/report/chaos_timeline.png" ]] || fail "the report has no chaos timeline"
left="$(pgrep -af -- "$run" || true)"
[[ -z "$left" ]] || fail "processes left behind: $left"
if "$root/scripts/broker" status >/dev/null 2>&1; then fail "the chaos broker still runs"; fi
echo "chaos: 1 passed, 0 failed"
