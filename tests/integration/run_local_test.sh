#!/usr/bin/env bash
# The main job's smoke test: scripts/run-local on the tiny config, with the binaries of this build,
# against the running broker. Checks the run folder (metrics of every process, at least one merged
# version per fragment, the final model, a text sample, the report), that no process is left
# behind, and that Ctrl-C (SIGINT) mid-run stops every child and still leaves a complete folder.
#   usage: run_local_test.sh BIN_DIR
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export DILOCO_BIN_DIR="${1:?usage: run_local_test.sh BIN_DIR}"
tmp="$(mktemp -d /tmp/diloco-run-local-test.XXXXXX)"
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "ok: $*"; }

# Every child process of a run has its run folder in its command line.
check_no_leftovers() {
  local left
  left="$(pgrep -af -- "$1" || true)"
  [[ -z "$left" ]] || fail "processes left behind: $left"
}

check_folder() {
  local dir="$1" fragments="$2"
  for f in config.toml run.json merger-0/metrics.jsonl eval/metrics.jsonl learner-0/metrics.jsonl learner-1/metrics.jsonl \
           learner-2/metrics.jsonl final_model.safetensors report/index.html report/index.md report/heldout_loss_tokens.png; do
    [[ -s "$dir/$f" ]] || fail "$dir/$f is missing or empty"
  done
  # At least one merged version per fragment, from the mergers' own logs.
  /usr/bin/python3 - "$dir" "$fragments" <<'PY' || fail "not every fragment was merged"
import glob, json, sys
run, fragments = sys.argv[1], int(sys.argv[2])
merged = set()
for path in glob.glob(f"{run}/merger-*/metrics.jsonl"):
    for line in open(path):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "merge" and e.get("inputs") and e.get("version", 0) >= 1:
            merged.add(e["fragment"])
missing = sorted(set(range(fragments)) - merged)
if missing:
    print(f"fragments never merged: {missing}", file=sys.stderr)
    sys.exit(1)
PY
  pass "$dir: metrics, merged versions of all $fragments fragments, final model, report"
}

# 1. A whole run on the budget.
run="$tmp/budget"
start=$(date +%s)
"$root/scripts/run-local" configs/tiny.toml --steps 120 --run-dir "$run" </dev/null >"$tmp/budget.out" 2>&1 ||
  { cat "$tmp/budget.out"; fail "run-local exited with $?"; }
echo "run-local on tiny took $(($(date +%s) - start)) s"
check_folder "$run" 4
[[ -s "$run/sample.txt" ]] || fail "no text sample"
grep -q "report: $run/report/index.html" "$tmp/budget.out" || { cat "$tmp/budget.out"; fail "the report's path was not printed"; }
grep -q "run-local: .*learner-0 step" "$tmp/budget.out" || fail "no progress line on a non-terminal output"
/usr/bin/python3 -c "import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if all(c == 0 for c in r['exit_codes'].values()) else 1)" \
  "$run/run.json" || fail "a process exited uncleanly: $(cat "$run/run.json")"
# The same folder again: refused before anything starts (the processes append to their metrics, so
# two runs would mix in every measurement).
if "$root/scripts/run-local" configs/tiny.toml --steps 120 --run-dir "$run" </dev/null >"$tmp/again.out" 2>&1; then
  fail "a second run into $run was not refused"
fi
grep -q "holds an earlier run" "$tmp/again.out" || { cat "$tmp/again.out"; fail "no clear error for a used run folder"; }
pass "a run folder that holds a run is refused"
check_no_leftovers "$run"
pass "a budgeted run ends cleanly"
# The run folder's config.toml names the run: replay verifies every version from the logs alone.
"$DILOCO_BIN_DIR/diloco-replay" -c "$run/config.toml" verify >"$tmp/verify.out" 2>&1 ||
  { cat "$tmp/verify.out"; fail "diloco-replay verify failed on the run"; }
grep -q '^PASS' "$tmp/verify.out" || { cat "$tmp/verify.out"; fail "verify did not say PASS"; }
pass "diloco-replay verify passes on the run folder's config"

# diloco-status on the finished run: every process announced itself; a missing run is an error.
run_id="$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['run_id'])" "$run/run.json")"
"$DILOCO_BIN_DIR/diloco-status" --run "$run_id" --json >"$tmp/status.json" 2>"$tmp/status.err" ||
  { cat "$tmp/status.err"; fail "diloco-status failed on the run"; }
/usr/bin/python3 - "$tmp/status.json" <<'PY' || fail "diloco-status does not show the run's members and lag"
import json, sys
s = json.load(open(sys.argv[1]))
roles = {m["id"]: m["role"] for m in s["members"]}
want = {"learner-0": "learner", "learner-1": "learner", "learner-2": "learner", "merger-0": "merger", "eval": "evaluator"}
bad = {k: v for k, v in want.items() if roles.get(k) != v}
if bad or not s["consumer_lag"]:
    print(f"members {roles}, expected {want}; lag {s['consumer_lag']}", file=sys.stderr)
    sys.exit(1)
PY
"$DILOCO_BIN_DIR/diloco-status" --run "$run_id" | grep -q "^learner-1 " || fail "the status table does not list learner-1"
if "$DILOCO_BIN_DIR/diloco-status" --run "no-such-run-$$" >"$tmp/missing.out" 2>&1; then fail "a missing run exited 0"; fi
grep -q "has no topics" "$tmp/missing.out" || { cat "$tmp/missing.out"; fail "a missing run is not named"; }
if "$DILOCO_BIN_DIR/diloco-sample" "$tmp/no-model.safetensors" >"$tmp/sample.out" 2>&1; then fail "diloco-sample on a missing file exited 0"; fi
grep -q "no model file" "$tmp/sample.out" || { cat "$tmp/sample.out"; fail "diloco-sample does not name the missing file"; }
pass "diloco-status shows the run's members and lag; missing runs and model files are clear errors"

# 2. Ctrl-C in the middle: every child stops, the folder is complete.
run="$tmp/interrupted"
"$root/scripts/run-local" configs/tiny.toml --steps 100000 --run-dir "$run" </dev/null >"$tmp/int.out" 2>&1 &
launcher=$!
for _ in $(seq 1 120); do
  if grep -qs '"event":"merge"' "$run"/merger-0/metrics.jsonl && [[ $(grep -cs '"event":"merge"' "$run/merger-0/metrics.jsonl") -ge 8 ]]; then break; fi
  sleep 1
done
kill -INT "$launcher"
for _ in $(seq 1 180); do kill -0 "$launcher" 2>/dev/null || break; sleep 1; done
kill -0 "$launcher" 2>/dev/null && fail "run-local still running 180 s after Ctrl-C"
wait "$launcher" || true
grep -q "stopping (Ctrl-C)" "$tmp/int.out" || { cat "$tmp/int.out"; fail "Ctrl-C was not reported"; }
check_no_leftovers "$run"
check_folder "$run" 4
pass "Ctrl-C stops every process and leaves a complete run folder"

# 3. A process that fails: run-local names it, stops the others and leaves nothing behind. The
# config leaves train.batch and model.context out, so run.json shows the binaries' defaults.
run="$tmp/failing"
grep -v -E '^(batch|context) *=' "$root/configs/tiny.toml" >"$tmp/no-batch.toml"
defaults="$("$DILOCO_BIN_DIR/diloco-learner" -c "$tmp/no-batch.toml" --print-config)"
want_tokens="$(/usr/bin/python3 -c "import json,sys; c=json.loads(sys.argv[1]); print(c['train']['batch'] * c['model']['context'])" "$defaults")"
if DILOCO_FAULT_FAIL_COMMIT=bogus "$root/scripts/run-local" "$tmp/no-batch.toml" --steps 100000 --no-report --run-dir "$run" \
     </dev/null >"$tmp/failing.out" 2>&1; then
  fail "run-local exited 0 although its merger failed"
fi
grep -q "merger-0 exited with code" "$tmp/failing.out" || { cat "$tmp/failing.out"; fail "the failed process is not named"; }
grep -q "DILOCO_FAULT_FAIL_COMMIT must be a count" "$tmp/failing.out" || { cat "$tmp/failing.out"; fail "the merger's error is not shown"; }
check_no_leftovers "$run"
got_tokens="$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['tokens_per_step'])" "$run/run.json")"
[[ "$got_tokens" == "$want_tokens" ]] || fail "run.json has tokens_per_step $got_tokens, the binaries' defaults give $want_tokens"
pass "a failing process stops the run with its error, nothing is left behind, defaults come from the binaries"

# 4. A bad config is refused before anything starts, with the binaries' message.
if "$root/scripts/run-local" configs/tiny.toml --set train.batch=0 --run-dir "$tmp/bad" </dev/null >"$tmp/bad.out" 2>&1; then
  fail "run-local accepted train.batch=0"
fi
grep -q "train.batch must be at least 1" "$tmp/bad.out" || { cat "$tmp/bad.out"; fail "the config error is not shown"; }
check_no_leftovers "$tmp/bad"
pass "a bad config is refused before any process starts"

# 5. Python learners: a combination that cannot run is refused before anything starts, with the
# reason; --print-config shows which learners run examples/pytorch/train.py, and starts nothing.
if "$root/scripts/run-local" configs/tiny.toml --python-learners 2 --python-model conv --run-dir "$tmp/conv" \
     </dev/null >"$tmp/conv.out" 2>&1; then
  fail "run-local accepted the conv model beside diloco-learner"
fi
grep -q "conv needs every learner in Python" "$tmp/conv.out" || { cat "$tmp/conv.out"; fail "the conv refusal is not explained"; }
[[ ! -e "$tmp/conv" ]] || fail "a refused run made its folder"
"$root/scripts/run-local" configs/tiny.toml --python-learners 1 --print-config --run-dir "$tmp/printed" \
  </dev/null >"$tmp/printed.json" 2>"$tmp/printed.err" || { cat "$tmp/printed.err"; fail "--print-config failed"; }
/usr/bin/python3 - "$tmp/printed.json" <<'PY' || fail "--print-config does not show the Python learner"
import json, shlex, sys
c = json.load(open(sys.argv[1]))
argvs = {name: shlex.split(command) for name, command in c["processes"].items()}
programs = {name: argv[1] if argv[1].endswith("train.py") else argv[0] for name, argv in argvs.items()}
want = {"merger-0": "diloco-merger", "learner-0": "diloco-learner", "learner-1": "diloco-learner",
        "learner-2": "train.py", "eval": "diloco-learner"}
ok = {n: p.endswith(want[n]) for n, p in programs.items()} == {n: True for n in want}
if not ok or c["python_learners"] != ["learner-2"] or c["python_model"] != "builtin":
    print(json.dumps(c, indent=1), file=sys.stderr)
    sys.exit(1)
PY
[[ ! -e "$tmp/printed" ]] || fail "--print-config made the run folder"
pass "impossible Python learners are refused; --print-config shows the cluster and starts nothing"

# 6. The conv model: every learner and the evaluator are examples/pytorch/train.py. They stop in
# order like diloco-learner, their metrics feed the report, and no text sample is attempted.
run="$tmp/conv-run"
"$root/scripts/run-local" configs/tiny.toml --learners 2 --python-learners 2 --python-model conv --steps 60 \
  --run-dir "$run" </dev/null >"$tmp/conv-run.out" 2>&1 || { cat "$tmp/conv-run.out"; fail "run-local with the conv model failed"; }
for f in learner-0/metrics.jsonl learner-1/metrics.jsonl eval/metrics.jsonl final_model.safetensors report/index.html; do
  [[ -s "$run/$f" ]] || fail "$run/$f is missing or empty"
done
[[ ! -e "$run/sample.txt" ]] || fail "a text sample of the conv model was attempted"
grep -q "no text sample: diloco-sample runs the built-in model" "$tmp/conv-run.out" || { cat "$tmp/conv-run.out"; fail "the missing sample is not explained"; }
/usr/bin/python3 - "$run" <<'PY' || fail "the Python learners' run is incomplete"
import glob, json, sys
run = sys.argv[1]
info = json.load(open(f"{run}/run.json"))
events = {name: [json.loads(l) for l in open(f"{run}/{name}/metrics.jsonl")] for name in ("learner-0", "learner-1", "eval")}
merged = {i["learner"] for e in (json.loads(l) for l in open(f"{run}/merger-0/metrics.jsonl")) if e["event"] == "merge"
          for i in e["inputs"]}
problems = [f"exit codes {info['exit_codes']}"] if any(info["exit_codes"].values()) else []
problems += [f"{n} is not a Python learner" for n in ("learner-0", "learner-1") if events[n][0].get("client") != "python"]
problems += [f"{n} has no stop event" for n in ("learner-0", "learner-1") if not any(e["event"] == "stop" for e in events[n])]
problems += ["no global evaluation"] if not any(e["event"] == "global_eval" for e in events["eval"]) else []
problems += [f"no delta of {n} merged" for n in ("learner-0", "learner-1") if n not in merged]
if problems:
    print("; ".join(problems), file=sys.stderr)
    sys.exit(1)
PY
check_no_leftovers "$run"
pass "the conv model runs with every learner and the evaluator in Python"
