#!/usr/bin/env bash
# The merger, replay and the Python package's native module link no libtorch: the learner runtime
# is torch-free, and a Python process must be free to load whatever torch its user has. The
# built-in model's learner does link it, which shows the check can see a libtorch dependency.
#   tests/no_torch_test.sh BIN_DIR MODULE_DIR
set -euo pipefail
bin_dir=$1 module_dir=$2
fail() { echo "FAIL: $*" >&2; exit 1; }
# ldd's output is read whole first: with pipefail, `ldd | grep -q` fails when grep stops reading early.
links_torch() { local deps; deps=$(ldd "$1"); grep -qi 'libtorch\|libc10' <<<"$deps"; }

links_torch "$bin_dir/diloco-learner" || fail "diloco-learner shows no libtorch in ldd: the check cannot see one"
for binary in diloco-merger diloco-replay diloco-status; do
  [[ -x "$bin_dir/$binary" ]] || fail "$bin_dir/$binary is not built"
  if links_torch "$bin_dir/$binary"; then fail "$binary links libtorch: $(ldd "$bin_dir/$binary" | grep -i 'torch\|c10')"; fi
done
modules=("$module_dir"/_core*.so)
[[ -e "${modules[0]}" ]] || fail "the native module is not built in $module_dir"
if links_torch "${modules[0]}"; then fail "${modules[0]} links libtorch"; fi
echo "ok: diloco-merger, diloco-replay, diloco-status and $(basename "${modules[0]}") link no libtorch"
