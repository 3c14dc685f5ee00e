"""What a learner holds while it proposes version 0: a Session of a model of --mib MiB of fp32
(4 tensors) joins a fresh run on tiny's 4 fragments, a diloco-merger commits version 0, and the
process's peak RSS (ru_maxrss) is printed before the session, after the model is made and after
the session started (genesis proposed and committed).

    .venv/bin/python bench/genesis_memory.py [--mib 800] [--bootstrap 127.0.0.1:19092] [--bin-dir build/bin]

PYTHONPATH chooses which build of the package runs (another build's copy of python/ measures it).
Needs a running broker (scripts/broker start).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=800, help="model size in MiB of fp32 (default 800)")
    parser.add_argument("--bootstrap", default=os.environ.get("DILOCO_BOOTSTRAP", "127.0.0.1:19092"))
    parser.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "bin")
    args = parser.parse_args()

    import decoupled_diloco as dd
    from decoupled_diloco import _core

    run_id = f"genesis-memory-{uuid.uuid4().hex[:8]}"
    _core.create_topics(args.bootstrap, run_id, ["eu"], 4)
    config = ROOT / "configs" / "tiny.toml"
    overrides = [f'run.id="{run_id}"']
    folder = Path(tempfile.mkdtemp(prefix="genesis-memory."))
    before = peak_mib()
    rows = args.mib * 1024 * 1024 // 4 // 4 // 1024
    model = {f"w{i}": np.random.default_rng(i).standard_normal((rows, 1024), dtype=np.float32) for i in range(4)}
    made = peak_mib()
    merger = subprocess.Popen([str(args.bin_dir / "diloco-merger"), "-c", str(config), "--set", overrides[0],
                               "--bootstrap", args.bootstrap, "--id", "merger-0", "--run-dir", str(folder / "merger-0")],
                              stdout=open(folder / "merger.log", "w"), stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        session = dd.Session(config, list(model.items()), learner_id="eu-0", region="eu", overrides=overrides,
                             bootstrap=args.bootstrap, run_dir=folder / "eu-0", genesis_timeout=600)
        seconds = time.monotonic() - t0
        started = peak_mib()
        session.close()
    finally:
        merger.terminate()
        merger.wait(60)
    print(json.dumps({"package": dd.__file__, "model_mib": sum(v.nbytes for v in model.values()) / 2**20,
                      "peak_rss_mib": {"start": round(before), "model made": round(made),
                                       "session started (version 0 proposed and committed)": round(started)},
                      "held_beyond_the_model_mib": round(started - made), "start_seconds": round(seconds, 1),
                      "run_id": run_id}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
