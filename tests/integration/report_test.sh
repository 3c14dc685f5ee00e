#!/usr/bin/env bash
# scripts/report on run folders written here by hand: the expected PNGs are real PNG images, the
# page states the headline numbers worked out by hand from the fixture, partial runs (a truncated
# last line, a merger that never merged, no eval folder, an empty one) still give a report, and
# bad input (a missing folder, a folder that is not a run) exits 1 with a clear message.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
report="$root/scripts/report"
tmp="$(mktemp -d /tmp/diloco-report-test.XXXXXX)"
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$tmp"' EXIT  # KEEP=1 keeps the reports to look at
fail() { echo "FAIL: $*" >&2; exit 1; }
passed=0
pass() { passed=$((passed + 1)); echo "ok: $*"; }

plots=(heldout_loss_tokens heldout_loss_time wire_bytes staleness fragment_versions training_loss tokens_per_s)

# Every plot exists, starts with the PNG signature, is at least 400x250 pixels and not tiny.
check_pngs() {
  local dir="$1" name file magic width height
  for name in "${plots[@]}"; do
    file="$dir/$name.png"
    [[ -f "$file" ]] || fail "$file missing"
    magic="$(od -An -tx1 -N8 "$file" | tr -d ' \n')"
    [[ "$magic" == 89504e470d0a1a0a ]] || fail "$file is not a PNG (starts with $magic)"
    width=$((16#$(od -An -tx1 -j16 -N4 "$file" | tr -d ' \n')))
    height=$((16#$(od -An -tx1 -j20 -N4 "$file" | tr -d ' \n')))
    ((width >= 400 && height >= 250)) || fail "$file is ${width}x$height"
    (($(stat -c %s "$file") > 5000)) || fail "$file is only $(stat -c %s "$file") bytes"
  done
}

expect() {  # FILE TEXT: the file contains TEXT literally
  grep -qF -- "$2" "$1" || fail "$1 does not contain '$2'"
}

# --- The fixture: two learners, two mergers (one never merges), the eval-only learner. ---------
# Times are unix microseconds; T is the first event. learner-1 was killed mid-write: its last
# line is cut off and it has no stop event.
T=1800000000000000
at() { echo $((T + $1 * 100000)); }  # tenths of a second after T
run="$tmp/run"
mkdir -p "$run"/{learner-0,learner-1,merger-0,merger-1,eval}
cat >"$run/learner-0/metrics.jsonl" <<EOF
{"event":"start","learner":"learner-0","mode":"train","region":"eu","config":"configs/fixture.toml + run.id=\"fixture-1\"","parameters":1000,"fragments":2,"fingerprint":1,"t":0.0,"time_us":$(at 0)}
{"event":"eval","learner":"learner-0","step":0,"eval_loss":4.6,"tokens":0,"t":1.0,"time_us":$(at 10)}
{"event":"delta","learner":"learner-0","fragment":0,"seq":1,"base_version":0,"inner_steps":10,"tokens":1024,"wire_bytes":1000,"t":2.0,"time_us":$(at 20)}
{"event":"step","learner":"learner-0","step":10,"loss":3.5,"loss_ema":3.9,"step_time":0.1,"tokens":1024,"tokens_per_s":1000.0,"adopted":0,"bytes_received":5000,"bytes_sent":1000,"deltas_delivered":1,"deltas_superseded":0,"versions":[0,0],"max_rss_kb":200000,"t":2.0,"time_us":$(at 20)}
{"event":"adopt","learner":"learner-0","fragment":0,"version":1,"versions_behind":1,"checksum":7,"t":2.5,"time_us":$(at 25)}
{"event":"delta","learner":"learner-0","fragment":1,"seq":2,"base_version":0,"inner_steps":10,"tokens":1024,"wire_bytes":1200,"t":3.0,"time_us":$(at 30)}
{"event":"step","learner":"learner-0","step":20,"loss":3.2,"loss_ema":3.6,"step_time":0.1,"tokens":2048,"tokens_per_s":1100.0,"adopted":1,"bytes_received":9000,"bytes_sent":2200,"deltas_delivered":2,"deltas_superseded":0,"versions":[1,0],"max_rss_kb":210000,"t":3.0,"time_us":$(at 30)}
{"event":"delta","learner":"learner-0","fragment":0,"seq":3,"base_version":1,"inner_steps":10,"tokens":1024,"wire_bytes":1100,"t":4.0,"time_us":$(at 40)}
{"event":"step","learner":"learner-0","step":30,"loss":3.0,"loss_ema":3.3,"step_time":0.1,"tokens":3072,"tokens_per_s":1200.0,"adopted":1,"bytes_received":9000,"bytes_sent":2200,"kafka_sent":500,"kafka_received":600,"deltas_delivered":2,"deltas_superseded":0,"versions":[1,1],"max_rss_kb":210000,"t":4.0,"time_us":$(at 40)}
{"event":"eval","learner":"learner-0","step":30,"eval_loss":3.0,"tokens":3072,"t":4.5,"time_us":$(at 45)}
{"event":"stop","learner":"learner-0","step":30,"tokens":3072,"reason":"budget","t":5.0,"time_us":$(at 50)}
{"event":"shutdown","learner":"learner-0","delivered":3,"superseded":0,"undelivered":[],"kafka_sent":600,"kafka_received":700,"t":5.1,"time_us":$(at 51)}
EOF
cat >"$run/learner-1/metrics.jsonl" <<EOF
{"event":"start","learner":"learner-1","mode":"train","region":"us","config":"configs/fixture.toml + run.id=\"fixture-1\"","parameters":1000,"fragments":2,"fingerprint":1,"t":0.0,"time_us":$(at 5)}
{"event":"delta","learner":"learner-1","fragment":1,"seq":1,"base_version":0,"inner_steps":10,"tokens":1024,"wire_bytes":2000,"t":2.0,"time_us":$(at 25)}
{"event":"step","learner":"learner-1","step":10,"loss":3.6,"loss_ema":4.0,"step_time":0.1,"tokens":1024,"tokens_per_s":900.0,"adopted":0,"bytes_received":4000,"bytes_sent":2000,"deltas_delivered":1,"deltas_superseded":0,"versions":[0,0],"max_rss_kb":190000,"t":2.0,"time_us":$(at 25)}
{"event":"delta","learner":"learner-1","fragment":0,"seq":2,"base_version":1,"inner_steps":10,"tokens":1024,"wire_bytes":2100,"t":3.0,"time_us":$(at 35)}
{"event":"step","learner":"learner-1","step":20,"loss":3.3,"loss_ema":3.7,"step_time":0.1,"tokens":2048,"tokens_per_s":950.0,"adopted":1,"bytes_received":8000,"bytes_sent":4100,"kafka_sent":400,"kafka_received":800,"deltas_delivered":2,"deltas_superseded":0,"versions":[1,1],"max_rss_kb":195000,"t":3.0,"time_us":$(at 35)}
EOF
printf '%s' '{"event":"step","learner":"learner-1","step":30,"loss":3.1,"tok' >>"$run/learner-1/metrics.jsonl"
cat >"$run/merger-0/metrics.jsonl" <<EOF
{"event":"start","merger":"merger-0","endpoint":"tcp://127.0.0.1:1","partitions":2,"fragments":2,"fingerprint":1,"t":0.1,"time_us":$(at 1)}
{"event":"recovered","merger":"merger-0","fragment":0,"version":0,"replayed":0,"from_genesis":true,"t":0.2,"time_us":$(at 2)}
{"event":"recovered","merger":"merger-0","fragment":1,"version":0,"replayed":0,"from_genesis":true,"t":0.2,"time_us":$(at 2)}
{"event":"merge","merger":"merger-0","fragment":0,"version":1,"checksum":11,"checkpoint":false,"sync_seconds":0.05,"inputs":[{"learner":"learner-0","base":0,"seq":1,"staleness":0,"tokens":1024,"weight":1.0}],"dropped":[],"t":2.2,"time_us":$(at 22)}
{"event":"merge","merger":"merger-0","fragment":1,"version":1,"checksum":12,"checkpoint":false,"sync_seconds":0.05,"inputs":[{"learner":"learner-1","base":0,"seq":1,"staleness":0,"tokens":1024,"weight":1.0},{"learner":"learner-0","base":0,"seq":2,"staleness":0,"tokens":1024,"weight":1.0}],"dropped":[],"t":3.2,"time_us":$(at 32)}
{"event":"merge","merger":"merger-0","fragment":0,"version":2,"checksum":13,"checkpoint":false,"sync_seconds":0.05,"inputs":[{"learner":"learner-1","base":1,"seq":2,"staleness":1,"tokens":1024,"weight":0.5}],"dropped":[{"learner":"learner-1","seq":9,"reason":"superseded"}],"t":3.7,"time_us":$(at 37)}
{"event":"merge","merger":"merger-0","fragment":0,"version":3,"checksum":14,"checkpoint":false,"sync_seconds":0.05,"inputs":[{"learner":"learner-0","base":1,"seq":3,"staleness":2,"tokens":1024,"weight":0.3}],"dropped":[{"learner":"learner-1","seq":10,"reason":"too_stale"},{"learner":"learner-0","seq":11,"reason":"too_stale"}],"t":4.2,"time_us":$(at 42)}
{"event":"stop_record","merger":"merger-0","fragment":1,"version":1,"held":1,"t":6.0,"time_us":$(at 60)}
{"event":"stop","merger":"merger-0","exit_code":0,"kafka_sent":3000,"kafka_received":9000,"t":6.0,"time_us":$(at 60)}
EOF
cat >"$run/merger-1/metrics.jsonl" <<EOF
{"event":"start","merger":"merger-1","endpoint":"tcp://127.0.0.1:2","partitions":2,"fragments":2,"fingerprint":1,"t":0.1,"time_us":$(at 1)}
{"event":"assigned","merger":"merger-1","partitions":[],"epoch":1,"t":0.2,"time_us":$(at 2)}
EOF
cat >"$run/eval/metrics.jsonl" <<EOF
{"event":"start","learner":"eval","mode":"eval-only","region":"eu","config":"configs/fixture.toml + run.id=\"fixture-1\"","parameters":1000,"fragments":2,"fingerprint":1,"t":0.0,"time_us":$(at 0)}
{"event":"global_eval","learner":"eval","eval_loss":4.61,"versions":[0,0],"version_sum":0,"t":1.0,"time_us":$(at 10)}
{"event":"global_eval","learner":"eval","eval_loss":3.3125,"versions":[1,1],"version_sum":2,"t":3.0,"time_us":$(at 30)}
{"event":"global_eval","learner":"eval","eval_loss":2.875,"versions":[3,1],"version_sum":4,"t":5.0,"time_us":$(at 50)}
{"event":"global_eval","learner":"eval","eval_loss":2.9375,"versions":[3,1],"version_sum":4,"t":7.0,"time_us":$(at 70)}
{"event":"shutdown","learner":"eval","delivered":0,"superseded":0,"undelivered":[],"t":7.5,"time_us":$(at 75)}
EOF
printf '[run]\nid = "fixture"\n# FIXTURE-CONFIG-LINE\n' >"$run/config.toml"
printf 'And God said, Let there be <light>: FIXTURE-SAMPLE\n' >"$run/sample.txt"
echo 'merger merger-0: owns fragments 0@v0 1@v0' >"$run/merger-0.log"

out="$("$report" "$run" 2>"$tmp/stderr")" || { cat "$tmp/stderr" >&2; fail "report on the fixture exited non-zero"; }
[[ "$out" == "$run/report/index.html" ]] || fail "printed '$out', not the path of index.html"
check_pngs "$run/report"
pass "fixture: every plot is a PNG"

# Worked out by hand from the lines above.
md="$run/report/index.md" page="$run/report/index.html"
for text in "| Final global held-out loss | 2.9375 (at 7.0 s, 5,120 tokens, version sum 4) |" \
            "| Best global held-out loss | 2.8750 " \
            "| Tokens trained (all learners) | 5,120 |" \
            "| Inner steps (all learners) | 50 |" \
            "| Wall time | 7.5 s |" \
            "| Merges | 4 |" \
            "| Deltas merged | 5 |" \
            "| Deltas dropped by reason | superseded 1, too_stale 2 |" \
            "| Deltas held when a merger stopped | 1 |" \
            "| Bytes on the wire (published deltas, all learners) | 7,400 B (7.2 KiB) |" \
            "| Bytes on the wire, learner-0 | 3,300 B (3.2 KiB) |" \
            "| Bytes on the wire, learner-1 | 4,100 B (4.0 KiB) |" \
            "| Mean bytes per delta | 1,480 B (1.4 KiB) |" \
            "| Bytes received from mergers (parameters, all learners) | 17,000 B (16.6 KiB) |" \
            "| fp32 data parallel at the same steps (2 x 4 B x parameters per learner step) | 400,000 B (390.6 KiB) |" \
            "| Both directions against fp32 data parallel | 24,400 B (23.8 KiB): 16x fewer bytes |" \
            "| Kafka sockets of the learners (sent / received, protocol and heartbeats included) | 1,000 B / 1,500 B (1.5 KiB) |" \
            "| Learners' sockets, both directions (Kafka and parameters received), against fp32 data parallel | 19,500 B (19.0 KiB): 21x fewer bytes |" \
            "| Kafka sockets of the mergers (sent / received: records, checkpoints, deltas read) | 3,000 B (2.9 KiB) / 9,000 B (8.8 KiB) (1 of 2 recorded) |" \
            "| Mean staleness of merged deltas | 0.60 (max 2) |" \
            "| Versions per fragment | 0: 3, 1: 1 |" \
            "# Run fixture-1" \
            "FIXTURE-SAMPLE" "FIXTURE-CONFIG-LINE" \
            "skipped 1 line(s)" "learner-1 has no stop event" "merger-1 never merged"; do
  expect "$md" "$text"
done
for text in "<td>Final global held-out loss</td><td>2.9375 (at 7.0 s, 5,120 tokens, version sum 4)</td>" \
            "<td>Best global held-out loss</td><td>2.8750 " \
            "<td>Tokens trained (all learners)</td><td>5,120</td>" \
            "<td>Merges</td><td>4</td>" \
            "<td>Deltas dropped by reason</td><td>superseded 1, too_stale 2</td>" \
            "<td>Bytes on the wire (published deltas, all learners)</td><td>7,400 B (7.2 KiB)</td>" \
            "<td>Mean staleness of merged deltas</td><td>0.60 (max 2)</td>" \
            "<td>Versions per fragment</td><td>0: 3, 1: 1</td>" \
            "Let there be &lt;light&gt;: FIXTURE-SAMPLE" "FIXTURE-CONFIG-LINE"; do
  expect "$page" "$text"
done
for name in "${plots[@]}"; do
  expect "$page" "<img src=\"$name.png\""
  expect "$md" "]($name.png)"
done
pass "fixture: index.md and index.html state the headline numbers"

# --out puts the report elsewhere; links to the run's files still resolve from there.
out="$("$report" "$run" --out "$tmp/elsewhere" 2>/dev/null)" || fail "--out exited non-zero"
[[ "$out" == "$tmp/elsewhere/index.html" ]] || fail "--out printed '$out'"
check_pngs "$tmp/elsewhere"
link="$(grep -o 'href="[^"]*merger-0.log"' "$tmp/elsewhere/index.html" | sed 's/href="//; s/"$//')"
[[ -f "$tmp/elsewhere/$link" ]] || fail "log link '$link' does not resolve from the --out folder"
pass "--out"

# A learner that was killed and started again appends to its metrics.jsonl and counts from zero:
# its tokens add up across the restart, and the global evaluation at 4.0 s, while the restarted
# learner waits for the global state, counts only what it trained before (2,048 tokens).
restart="$tmp/restart"
mkdir -p "$restart"/{learner-0,eval}
cat >"$restart/learner-0/metrics.jsonl" <<EOF
{"event":"start","learner":"learner-0","region":"eu","t":0.0,"time_us":$(at 0)}
{"event":"step","learner":"learner-0","step":10,"loss":3.5,"loss_ema":3.9,"tokens":1024,"tokens_per_s":1000.0,"t":1.0,"time_us":$(at 10)}
{"event":"step","learner":"learner-0","step":20,"loss":3.3,"loss_ema":3.7,"tokens":2048,"tokens_per_s":1000.0,"t":2.0,"time_us":$(at 20)}
{"event":"start","learner":"learner-0","region":"eu","t":0.0,"time_us":$(at 30)}
{"event":"step","learner":"learner-0","step":10,"loss":3.2,"loss_ema":3.6,"tokens":1024,"tokens_per_s":1000.0,"t":2.0,"time_us":$(at 50)}
{"event":"stop","learner":"learner-0","step":10,"tokens":1024,"reason":"budget","t":2.5,"time_us":$(at 55)}
EOF
cat >"$restart/eval/metrics.jsonl" <<EOF
{"event":"global_eval","learner":"eval","eval_loss":4.0,"versions":[0],"version_sum":0,"t":2.0,"time_us":$(at 20)}
{"event":"global_eval","learner":"eval","eval_loss":3.0,"versions":[1],"version_sum":1,"t":4.0,"time_us":$(at 40)}
{"event":"global_eval","learner":"eval","eval_loss":3.5,"versions":[2],"version_sum":2,"t":6.0,"time_us":$(at 60)}
EOF
"$report" "$restart" >/dev/null 2>"$tmp/stderr" || { cat "$tmp/stderr" >&2; fail "report on a restarted learner failed"; }
check_pngs "$restart/report"
for text in "| Tokens trained (all learners) | 3,072 |" \
            "| Inner steps (all learners) | 30 |" \
            "| Best global held-out loss | 3.0000 (at 4.0 s, 2,048 tokens) |" \
            "| Final global held-out loss | 3.5000 (at 6.0 s, 3,072 tokens, version sum 2) |" \
            "learner-0 started 2 times" "budget (an earlier start has no stop)"; do
  expect "$restart/report/index.md" "$text"
done
pass "a restarted learner"

# --- Partial runs. ---------------------------------------------------------------------------
# A learner killed before its first step (only a truncated start line), no eval folder, a
# merger that never merged.
early="$tmp/early"
mkdir -p "$early"/{learner-0,merger-0}
printf '%s' '{"event":"start","learner":"learner-0","mo' >"$early/learner-0/metrics.jsonl"
printf '{"event":"start","merger":"merger-0","partitions":1,"fragments":1,"t":0.1,"time_us":%s}\n' "$(at 1)" \
  >"$early/merger-0/metrics.jsonl"
"$report" "$early" >/dev/null 2>"$tmp/stderr" || { cat "$tmp/stderr" >&2; fail "report on an early-killed run failed"; }
check_pngs "$early/report"
expect "$early/report/index.md" "No \`eval/\` folder"
expect "$early/report/index.md" "| Merges | 0 |"
expect "$early/report/index.md" "merger-0 never merged"
pass "a run killed early, without an eval folder"

# An empty eval folder, a learner folder without metrics.jsonl, and lines that are JSON but not
# the expected shape (wrong types, nulls, NaN written as null, non-object lines).
odd="$tmp/odd"
mkdir -p "$odd"/{learner-0,learner-1,merger-0,eval}
cat >"$odd/learner-0/metrics.jsonl" <<EOF
[1, 2, 3]
"just a string"
{"event": 5}
{"event":"start","region":7,"config":null,"time_us":"soon"}
{"event":"step","step":"ten","loss":null,"loss_ema":"x","tokens":1024,"tokens_per_s":null,"bytes_sent":[],"time_us":$(at 10)}
{"event":"delta","fragment":0,"wire_bytes":"many","time_us":$(at 11)}
{"event":"eval","eval_loss":null,"tokens":1024,"time_us":$(at 12)}
{"event":"shutdown","undelivered":"none","time_us":$(at 13)}
EOF
cat >"$odd/merger-0/metrics.jsonl" <<EOF
{"event":"merge","fragment":0,"version":1,"inputs":"none","dropped":[5,{"reason":null}],"time_us":$(at 20)}
{"event":"merge","fragment":"x","version":2,"time_us":$(at 21)}
{"event":"merge","fragment":0,"version":2,"inputs":[{"staleness":-1},{"staleness":"x"},7],"time_us":$(at 22)}
{"event":"stop_record","held":"some","time_us":$(at 23)}
EOF
printf 'not json\n' >"$odd/run.json"
"$report" "$odd" >/dev/null 2>"$tmp/stderr" || { cat "$tmp/stderr" >&2; fail "report on malformed events failed"; }
check_pngs "$odd/report"
expect "$odd/report/index.md" "| Merges | 2 |"
expect "$odd/report/index.md" "| Deltas dropped by reason | unknown 2 |"
expect "$odd/report/index.md" "\`eval/metrics.jsonl\` is missing"
pass "malformed events, an empty eval folder, a learner without metrics"

# --- Bad input. --------------------------------------------------------------------------------
bad_input() {  # NAME EXPECTED-MESSAGE ARGS...: exit status 1, the message, no traceback
  local name="$1" message="$2" status=0
  shift 2
  "$report" "$@" >"$tmp/stdout" 2>"$tmp/stderr" || status=$?
  ((status == 1)) || fail "$name: exit status $status, expected 1"
  grep -qF -- "$message" "$tmp/stderr" || fail "$name: stderr lacks '$message': $(cat "$tmp/stderr")"
  if grep -q Traceback "$tmp/stderr"; then fail "$name: a Python traceback: $(cat "$tmp/stderr")"; fi
  pass "$name"
}
bad_input "a missing folder" "error: no such run folder: $tmp/nowhere" "$tmp/nowhere"
mkdir -p "$tmp/empty"
bad_input "a folder that is not a run" "is not a run folder" "$tmp/empty"
bad_input "a file instead of a folder" "not a run folder" "$run/config.toml"
bad_input "no argument" "RUN_DIR"
bad_input "an unknown option" "unrecognized arguments: --bogus" "$run" --bogus
bad_input "--out on a file" "output path exists and is not a folder" "$run" --out "$run/config.toml"
[[ ! -e "$tmp/empty/report" ]] || fail "a report folder was created in a folder that is not a run"

"$report" --help >"$tmp/stdout" || fail "--help exited non-zero"
expect "$tmp/stdout" "RUN_DIR"
expect "$tmp/stdout" "--out DIR"
pass "--help"

echo "report script: $passed passed, 0 failed"
