"""Where the decoupled-diloco repository is.

The tools that start a cluster run the repository's scripts (scripts/broker, scripts/chaos,
scripts/wan-sim), read its configs/ and default to its build (build/bin) and its runs/ and
bench/results/ folders. $DILOCO_ROOT names the repository (the wrappers in scripts/ and bench/ set
it); without it, the repository holding this package's sources is used (python/decoupled_diloco/
tools/ is three levels below its root). An installed package has neither, and says so.
"""
from __future__ import annotations

import functools
import os
import sys

ROOT_VARIABLE = "DILOCO_ROOT"
# Three levels up from python/decoupled_diloco/tools/.
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def is_repository(path: str) -> bool:
    """Whether `path` is a checkout of the repository: it has the broker script every cluster needs."""
    return os.path.isfile(os.path.join(path, "scripts", "broker"))


@functools.lru_cache(maxsize=None)
def _find_root() -> str | None:
    explicit = os.environ.get(ROOT_VARIABLE)
    if explicit:
        return os.path.abspath(explicit) if is_repository(explicit) else None
    return _SOURCE_ROOT if is_repository(_SOURCE_ROOT) else None


def root(exit_status: int = 1) -> str:
    """The repository's root folder. When there is none (an installed package run outside the
    repository, or a $DILOCO_ROOT that is not a checkout), prints what to set and exits with
    `exit_status`."""
    found = _find_root()
    if found is None:
        explicit = os.environ.get(ROOT_VARIABLE)
        if explicit:
            reason = f"{ROOT_VARIABLE}={explicit} is not a decoupled-diloco repository (no scripts/broker there)"
        else:
            reason = f"this package is not in a decoupled-diloco repository (no scripts/broker in {_SOURCE_ROOT})"
        print(f"error: {reason}: set {ROOT_VARIABLE} to the repository's folder (this tool runs its "
              "scripts/broker and reads its configs/), or run the tool through the repository's wrappers "
              "(scripts/run-local, bench/quality, ...)", file=sys.stderr)
        sys.exit(exit_status)
    return found


def default_bin_dir() -> str:
    """Where the diloco binaries are unless --bin-dir says: $DILOCO_BIN_DIR, else build/bin of the
    repository."""
    return os.environ.get("DILOCO_BIN_DIR") or os.path.join(root(), "build", "bin")
