# Shared by the benchmark scripts in this folder: the processes and runs a script started, and how
# they are stopped and cleaned up. Source it after setting ROOT, BOOTSTRAP, OUT, keep and
# keep_topics; add the pids of started processes to PIDS and the run ids to RUNS.
# shellcheck shell=bash

PIDS=()
RUNS=()

forget() { local rest=() p; for p in "${PIDS[@]}"; do [[ "$p" == "$1" ]] || rest+=("$p"); done; PIDS=("${rest[@]}"); }

stop_pid() {  # pid: SIGTERM, up to 30 s, then SIGKILL
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
  forget "$1"
}

delete_topics() {  # the topics of this script's runs, nothing else (unless --keep-topics)
  if ((keep_topics || ${#RUNS[@]} == 0)); then return 0; fi
  source "$ROOT/scripts/lib.sh"
  local lib pattern
  lib="$(kafka_lib_dir)"
  pattern="diloco\\.($(IFS='|'; echo "${RUNS[*]}"))\\..*"
  java -Xmx256m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile="$ROOT/broker_config/log4j2-tools.yaml" \
    -cp "$lib/*" org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP" --delete --topic "$pattern" \
    >/dev/null 2>&1 || echo "could not delete the topics of runs ${RUNS[*]}" >&2
}

bench_cleanup() {  # every started process (SIGTERM, then SIGKILL after 10 s), the topics, $OUT
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
  delete_topics
  if ((keep)); then echo "kept $OUT" >&2; else rm -rf "$OUT"; fi
}

count_events() {  # file event -> how many lines of that event the metrics file has
  [[ -f "$1" ]] || { echo 0; return; }
  grep -c "\"event\":\"$2\"" "$1" || true
}
