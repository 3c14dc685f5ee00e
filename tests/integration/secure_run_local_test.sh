#!/usr/bin/env bash
# The secured main job: scripts/run-local --secure on the tiny config, with a broker of its own
# (mutual TLS, ACLs; scripts/broker --secure) on a port apart from the shared one. Checks the
# run folder, that every process ran as its own principal with CURVE on the parameters, that the
# private keys are the owner's only and none reached a log, run.json or config.toml, that the run's config.toml reads the logs
# as the read-only `replay` principal (audit and verify PASS, diloco-status shows the members),
# and that the broker the launcher started is stopped again.
#   usage: secure_run_local_test.sh BIN_DIR
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export DILOCO_BIN_DIR="${1:?usage: secure_run_local_test.sh BIN_DIR}"
tmp="$(mktemp -d /tmp/diloco-secure-run-local-test.XXXXXX)"
export DILOCO_BROKER_DIR="$tmp/broker" DILOCO_BROKER_PORT="${DILOCO_TEST_SECURE_RUN_PORT:-19492}"
export KAFKA_HEAP_OPTS="-Xms128m -Xmx512m"
cleanup() {
  "$root/scripts/broker" stop >/dev/null 2>&1 || true
  [[ -n "${KEEP:-}" ]] || rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "ok: $*"; }

# The broker first (run-local would stop a broker it started itself, and the checks below read the
# logs after the run): its CA, certificate and the admin's key from scripts/secure init.
"$root/scripts/secure" init "$tmp/secure" --keys-bin "$DILOCO_BIN_DIR/diloco-keys" >"$tmp/init.out" 2>&1 ||
  { cat "$tmp/init.out"; fail "scripts/secure init failed"; }
"$root/scripts/broker" start --secure "$tmp/secure" >"$tmp/broker.out" 2>&1 ||
  { cat "$tmp/broker.out"; fail "scripts/broker start --secure failed"; }
servers="$("$root/scripts/broker" servers)"

run="$tmp/run"
"$root/scripts/run-local" configs/tiny.toml --secure --secure-dir "$tmp/secure" --steps 120 --no-report \
  --run-dir "$run" </dev/null >"$tmp/run.out" 2>&1 || { cat "$tmp/run.out"; fail "run-local --secure failed"; }
grep -q "secured run" "$tmp/run.out" || { cat "$tmp/run.out"; fail "the run does not say it is secured"; }
for f in config.toml run.json merger-0/metrics.jsonl eval/metrics.jsonl learner-0/metrics.jsonl final_model.safetensors; do
  [[ -s "$run/$f" ]] || fail "$run/$f is missing or empty"
done
/usr/bin/python3 -c "import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if all(c == 0 for c in r['exit_codes'].values()) else 1)" \
  "$run/run.json" || fail "a process exited uncleanly: $(cat "$run/run.json")"
grep -q "parameters authenticated (CURVE)" "$run/merger-0.log" || fail "the merger did not authenticate parameters"
pass "run-local --secure trains tiny to the end, parameters over CURVE"

# Secrets: files of mode 0600 in a folder of mode 0700, and no private key in the run folder or the output.
[[ "$(stat -c %a "$tmp/secure")" == 700 ]] || fail "$tmp/secure is not mode 0700"
for f in "$tmp"/secure/tls/*.pem "$tmp/secure/ca.key" "$tmp"/secure/curve/learners/*.key_secret; do
  [[ "$(stat -c %a "$f")" == 600 ]] || fail "$f is not mode 0600"
done
for f in "$tmp"/secure/tls/*.pem; do
  key_line="$(sed -n '2p' "$f")"  # a line of the private key's base64
  [[ -n "$key_line" ]] || fail "$f holds no key"
  if grep -rqF -- "$key_line" "$run" "$tmp/run.out"; then fail "the private key of $f is in the run folder or the output"; fi
done
grep -q 'kafka_certificate = .*tls/replay.pem' "$run/config.toml" || fail "the run's config.toml does not name the replay principal's certificate"
pass "keys are 0600, none reached the run folder or the output; config.toml reads as replay"

# The run folder's config.toml reads as `replay`: audit and verify pass, status shows the members.
for command in audit verify; do
  "$DILOCO_BIN_DIR/diloco-replay" -c "$run/config.toml" --bootstrap "$servers" "$command" >"$tmp/$command.out" 2>&1 ||
    { cat "$tmp/$command.out"; fail "diloco-replay $command failed on the secured run"; }
  grep -q 'PASS' "$tmp/$command.out" || { cat "$tmp/$command.out"; fail "diloco-replay $command did not say PASS"; }
done
run_id="$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['run_id'])" "$run/run.json")"
"$DILOCO_BIN_DIR/diloco-status" -c "$run/config.toml" --bootstrap "$servers" --run "$run_id" >"$tmp/status.out" 2>&1 ||
  { cat "$tmp/status.out"; fail "diloco-status -c RUN/config.toml failed"; }
grep -q "^learner-1 " "$tmp/status.out" || { cat "$tmp/status.out"; fail "diloco-status does not list learner-1"; }
# Without the config it is a plaintext client: the secured broker does not answer it.
if "$DILOCO_BIN_DIR/diloco-status" --bootstrap "$servers" --run "$run_id" >"$tmp/plain.out" 2>&1; then
  fail "a plaintext diloco-status read the secured broker"
fi
pass "the run's config.toml reads the logs as replay: audit and verify PASS, diloco-status lists the members"
