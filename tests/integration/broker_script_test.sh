#!/usr/bin/env bash
# scripts/broker with three nodes on its own ports and folder: starts, creates the run's topics
# with replication factor 3, a second start says so and succeeds, a start with another node
# count is refused, status shows every node, stop leaves nothing running.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export DILOCO_BROKER_DIR="$(mktemp -d /tmp/diloco-broker-test.XXXXXX)"
export DILOCO_BROKER_PORT="${DILOCO_TEST_BROKER_PORT:-29092}"
export KAFKA_HEAP_OPTS="-Xms128m -Xmx384m"
broker="$root/scripts/broker"
fail() { echo "FAIL: $*" >&2; exit 1; }
cleanup() { "$broker" stop >/dev/null 2>&1 || true; rm -rf "$DILOCO_BROKER_DIR"; }
trap cleanup EXIT

servers="$("$broker" start --nodes 3 --run scripttest --regions a,b --partitions 2)"
[[ "$servers" == "127.0.0.1:$DILOCO_BROKER_PORT,127.0.0.1:$((DILOCO_BROKER_PORT + 2)),127.0.0.1:$((DILOCO_BROKER_PORT + 4))" ]] ||
  fail "unexpected bootstrap servers '$servers'"

status="$("$broker" status)"
echo "$status"
[[ $(grep -c '  up (pid' <<<"$status") == 3 ]] || fail "status does not show 3 live nodes"
for topic in deltas.a deltas.b merges state; do
  grep -q "diloco.scripttest.$topic  partitions=2  replication=3" <<<"$status" || fail "topic $topic missing or wrong"
done
grep -q "diloco.scripttest.members  partitions=1  replication=3" <<<"$status" || fail "members topic missing"

again="$("$broker" start 2>&1)" || fail "second start failed"
grep -q "already running" <<<"$again" || fail "second start did not say the broker runs: $again"

if "$broker" start --nodes 1 >/dev/null 2>&1; then fail "start --nodes 1 on a 3-node broker was accepted"; fi

"$broker" stop
for i in 0 2 4; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$((DILOCO_BROKER_PORT + i))") 2>/dev/null; then fail "port $((DILOCO_BROKER_PORT + i)) still open after stop"; fi
done
if "$broker" status >/dev/null 2>&1; then fail "status reports a running broker after stop"; fi
echo "broker script: 1 passed, 0 failed"
