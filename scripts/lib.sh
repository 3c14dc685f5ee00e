# Shared by the scripts in this folder: paths and the Kafka class path. Source it, don't run it.
# shellcheck shell=bash

DILOCO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DILOCO_CACHE="${DILOCO_CACHE:-$DILOCO_ROOT/.cache}"
# The pinned broker version lives in broker_config/pom.xml only.
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$DILOCO_ROOT/broker_config/pom.xml")"
KAFKA_LIB_DIR="$DILOCO_CACHE/kafka-$KAFKA_VERSION/lib"
# The project's Python (scripts/bootstrap makes it): Debian's python3 in a venv that sees Debian's
# torch, NumPy and matplotlib, with the package python/ on its path.
DILOCO_VENV="${DILOCO_VENV:-$DILOCO_ROOT/.venv}"
DILOCO_PYTHON="$DILOCO_VENV/bin/python"

say() { printf '%s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Before a wrapper in scripts/ or bench/ runs one of the package's tools,
# "$DILOCO_PYTHON" -m decoupled_diloco.tools.<module>: the project's Python must exist, and the
# tool is told where the repository is (it runs scripts/broker and reads configs/ from there).
need_python() {
  [[ -x "$DILOCO_PYTHON" ]] || die "$DILOCO_PYTHON is missing: run scripts/bootstrap"
  export DILOCO_ROOT
}

# What a cluster wrapper (scripts/run-local, chaos, wan-sim) runs first unless DILOCO_BIN_DIR names
# binaries built already: scripts/bootstrap, then the build of the targets before "--" in build/,
# and of the package's native module too when the wrapper's arguments after "--" ask for Python
# learners (they join the run through it).
#   bootstrap_and_build run-local diloco-learner diloco-merger -- "$@"
bootstrap_and_build() {
  local tool="$1" targets=()
  shift
  while [[ $# -gt 0 && "$1" != -- ]]; do targets+=("$1"); shift; done
  shift
  [[ " $* " == *" --python-learners"* ]] && targets+=(_core)
  "$DILOCO_ROOT/scripts/bootstrap"
  say "$tool: building"
  cmake -S "$DILOCO_ROOT" -B "$DILOCO_ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$DILOCO_ROOT/build" -j "$(nproc)" --target "${targets[@]}" >/dev/null
}

# Prints the directory holding the broker's jars: $KAFKA_HOME/libs for an official distribution,
# otherwise the Maven-fetched cache. Fails with a way out when neither exists.
kafka_lib_dir() {
  if [[ -n "${KAFKA_HOME:-}" ]]; then
    compgen -G "$KAFKA_HOME/libs/kafka_2.13-*.jar" >/dev/null ||
      die "KAFKA_HOME=$KAFKA_HOME is not an Apache Kafka distribution (no libs/kafka_2.13-*.jar)"
    printf '%s\n' "$KAFKA_HOME/libs"
    return
  fi
  compgen -G "$KAFKA_LIB_DIR/kafka_2.13-*.jar" >/dev/null ||
    die "the Kafka broker is not fetched yet ($KAFKA_LIB_DIR): run scripts/bootstrap"
  printf '%s\n' "$KAFKA_LIB_DIR"
}

# Reads broker_config/limits.env into the environment.
load_limits() {
  # shellcheck disable=SC1091
  source "$DILOCO_ROOT/broker_config/limits.env"
}
