#!/usr/bin/env python3
"""Trains a PyTorch model on the King James Bible as one learner of a Decoupled DiLoCo run.

The loop is a plain PyTorch loop; joining the run adds a Session around it and one call,
session.step(), after each optimizer step. --standalone leaves the session out (the plain loop:
the single-learner baseline, and the baseline of the session's overhead). --eval-only trains
nothing: it follows the global model, measures its held-out loss and exports it.

    examples/pytorch/train.py -c configs/tiny.toml --model conv --standalone --steps 300
    examples/pytorch/train.py -c configs/tiny.toml --model builtin --id us-0 --region us \\
        --regions eu,us --index 1 --learners 2 --run-dir runs/x/us-0

Options mirror diloco-learner's; the run config is the same file (see run_config.py).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from builtin_transformer import BuiltinTransformer
from conv_lm import ConvLM
from inner_optimizer import InnerOptimizer
from kjv import VOCAB_SIZE, BatchStream, Corpus, ShardSpec, heldout_batches, load_corpus, training_batches
from run_config import load_run_config

if TYPE_CHECKING:  # imported at run time only when a session is used: --standalone needs no package
    import decoupled_diloco as dd

MODELS = {"builtin": BuiltinTransformer.from_config, "conv": ConvLM.from_config}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", required=True, help="run config (TOML), e.g. configs/tiny.toml")
    p.add_argument("-s", "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set train.lr=1e-3")
    p.add_argument("--model", choices=MODELS, default="builtin",
                   help="builtin: the C++ learner's transformer (shares a run with diloco-learner); "
                        "conv: gated dilated causal convolutions (conv_lm.py)")
    p.add_argument("--id", default="learner-0", help="learner id, unique in the run")
    p.add_argument("--region", default="region0", help="this learner's region")
    p.add_argument("--regions", default="region0", help="every region of the run, comma-separated "
                                                        "(data.split=region gives each its own books)")
    p.add_argument("--index", type=int, default=0, help="this learner's index in [0, --learners): its data shard")
    p.add_argument("--learners", type=int, default=1, help="number of learners sharing the training data")
    p.add_argument("--bootstrap", default=os.environ.get("DILOCO_BOOTSTRAP", "127.0.0.1:19092"),
                   help="Kafka bootstrap servers (default: $DILOCO_BOOTSTRAP or %(default)s)")
    p.add_argument("--steps", type=int, default=0,
                   help="stop after this many inner steps, counted from the run's start (default: train.total_steps)")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--run-dir", default="", help="folder for metrics.jsonl (created if missing)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", help="no session: train alone (the plain loop)")
    mode.add_argument("--eval-only", action="store_true",
                      help="never train: follow the global model and report its held-out loss")
    p.add_argument("--eval-interval", type=float, default=10,
                   help="--eval-only: seconds between looks for new versions (default %(default)s)")
    p.add_argument("--export", default="", help="write the model as safetensors at stop (--eval-only: "
                                                "the global model, refreshed after every evaluation)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s)")
    p.add_argument("--speed-factor", type=float, default=1.0,
                   help="slow every step by this factor (2 = half speed) to emulate older hardware (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="inner steps between held-out evaluations (default: train.eval_every; 0: none)")
    p.add_argument("--log-every", type=int, default=100, help="inner steps between progress lines (default %(default)s)")
    args = p.parse_args(argv)
    if not 1.0 <= args.speed_factor <= 1000.0:
        p.error(f"--speed-factor {args.speed_factor} must be in [1, 1000]")
    if not 0 <= args.index < args.learners:
        p.error(f"--index {args.index} must be in [0, --learners {args.learners})")
    args.deadline = time.monotonic() + args.max_seconds if args.max_seconds > 0 else math.inf
    args.regions = [r for r in args.regions.split(",") if r]
    if args.region not in args.regions:
        p.error(f"--region {args.region} is not in --regions {','.join(args.regions)}")
    return args


def set_threads(threads: int) -> None:
    """torch's intra-op threads, and OpenBLAS's: Debian's torch computes matrix products with
    OpenBLAS, whose own thread pool torch.set_num_threads does not size (two learners on two cores
    would each run a second BLAS thread)."""
    torch.set_num_threads(threads)
    try:
        with open("/proc/self/maps") as maps:  # the libraries loaded (Linux)
            libraries = {line.split()[-1] for line in maps if "openblas" in line}
    except OSError:
        return
    for path in sorted(libraries):
        setter = getattr(ctypes.CDLL(path), "openblas_set_num_threads", None)
        if setter:
            setter(threads)
            return


def out_of_time(args: argparse.Namespace) -> bool:
    return time.monotonic() >= args.deadline


class StopRequest:
    """SIGTERM and Ctrl-C set it; the loops stop at the next step boundary, flush and exit 0."""

    def __init__(self) -> None:
        self.requested = False
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


class MetricsLog:
    """metrics.jsonl of a --standalone run, in the learner's event shapes (start, step, eval, stop).
    With a session the session writes it."""

    def __init__(self, run_dir: str, learner_id: str):
        self.learner_id = learner_id
        self.start = time.monotonic()
        self.file = None
        if run_dir:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)

    def write(self, event: str, **fields: object) -> None:
        if self.file:
            record = {"event": event, **fields, "t": time.monotonic() - self.start,
                      "time_us": time.time_ns() // 1000, "learner": self.learner_id}
            self.file.write(json.dumps(record) + "\n")


def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next character, in nats per character."""
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


@torch.no_grad()
def heldout_loss(model: nn.Module, heldout: BatchStream, batches: int) -> float:
    """Mean held-out loss over `batches` batches; the stream is rewound first, so every evaluation
    (of every learner, C++ or Python) sees the same text."""
    model.eval()
    heldout.sequences = 0
    total = sum(next_token_loss(model, *heldout.next()).item() for _ in range(batches))
    model.train()
    return total / batches


def export(args: argparse.Namespace, config: dict, model: nn.Module, mode: str, **facts: object) -> None:
    """The model's parameters by name, F32, in a safetensors file (written atomically), with the
    metadata of the C++ learner's model files: "info", JSON facts about where it came from, and for
    the built-in model "model", its architecture, so diloco-sample reads it too."""
    from decoupled_diloco.safetensors import save_file

    info = {"run_id": config["run"]["id"], "learner": args.id, "model": args.model, "mode": mode, **facts,
            "config": config["source"], "time_us": time.time_ns() // 1000}
    metadata = {"info": json.dumps(info)}
    if args.model == "builtin":
        m = config["model"]
        metadata["model"] = json.dumps({"vocab": VOCAB_SIZE, "layers": m["layers"], "width": m["width"],
                                        "heads": m["heads"], "context": m["context"]})
    tensors = {name: p.detach().cpu().float().numpy() for name, p in model.named_parameters()}
    save_file(tensors, args.export, metadata=metadata)


def train(args: argparse.Namespace, config: dict, model: nn.Module, corpus: Corpus,
          session: dd.Session | None) -> int:
    """The training loop; `session` is None with --standalone."""
    stop = StopRequest()
    t = config["train"]
    steps = args.steps or t["total_steps"]
    eval_every = t["eval_every"] if args.eval_every is None else args.eval_every
    shard = ShardSpec(args.index, args.learners, args.regions.index(args.region), len(args.regions))
    batches = training_batches(corpus, config["data"], shard, t["batch"], config["model"]["context"],
                               config["run"]["seed"])
    heldout = heldout_batches(corpus, config["data"], t["batch"], config["model"]["context"])
    optimizer = InnerOptimizer(model.parameters(), t)
    log = MetricsLog("" if session else args.run_dir, args.id)
    log.write("start", mode="standalone", model=args.model, config=config["source"],
              parameters=sum(p.numel() for p in model.parameters()))

    # A learner restarted under the same id goes on where it stood: its schedule, its budget and
    # its data stream.
    step = session.step_count if session else 0
    batches.sequences = step * t["batch"]
    tokens = 0
    loss_ema = step_time = tokens_per_s = 0.0

    def evaluate() -> None:
        loss = heldout_loss(model, heldout, t["eval_batches"])
        if session:
            session.record_eval(loss)
        log.write("eval", step=step, eval_loss=loss, tokens=tokens)
        print(f"learner {args.id}: step {step} loss {loss_ema:.6g} held-out {loss:.6g} "
              f"({tokens_per_s:.0f} tokens/s)", file=sys.stderr)

    if eval_every > 0:
        evaluate()  # the starting point of every loss curve
    while not stop.requested and step < steps and not out_of_time(args):
        started = time.perf_counter()
        inputs, targets = batches.next()
        loss = next_token_loss(model, inputs, targets)
        loss.backward()
        optimizer.step(step)
        optimizer.zero_grad()
        step += 1
        loss_value = loss.item()
        if args.speed_factor > 1:
            time.sleep((time.perf_counter() - started) * (args.speed_factor - 1))
        if session:
            session.step(tokens=inputs.numel(), loss=loss_value)

        tokens += inputs.numel()
        elapsed = time.perf_counter() - started
        step_time = 0.9 * step_time + 0.1 * elapsed if step_time else elapsed
        tokens_per_s = inputs.numel() / step_time
        loss_ema = 0.95 * loss_ema + 0.05 * loss_value if loss_ema else loss_value
        evaluating = eval_every > 0 and step % eval_every == 0
        if args.log_every > 0 and step % args.log_every == 0:
            log.write("step", step=step, loss=loss_value, loss_ema=loss_ema, step_time=step_time,
                      tokens=tokens, tokens_per_s=tokens_per_s)
            if not evaluating:  # the evaluation's line says the same and more
                print(f"learner {args.id}: step {step} loss {loss_ema:.6g} ({tokens_per_s:.0f} tokens/s)",
                      file=sys.stderr)
        if evaluating:
            evaluate()

    reason = "signal" if stop.requested else "budget"
    log.write("stop", step=step, tokens=tokens, reason=reason)
    print(f"learner {args.id}: stopped at step {step} ({reason})", file=sys.stderr)
    if args.export:
        export(args, config, model, "train" if session else "standalone", step=step, tokens=tokens)
    return 0


def evaluate_global(args: argparse.Namespace, config: dict, model: nn.Module, corpus: Corpus,
                    session: dd.Session) -> int:
    """--eval-only: measures the global model whenever new versions arrived, and exports it."""
    stop = StopRequest()
    t = config["train"]
    heldout = heldout_batches(corpus, config["data"], t["batch"], config["model"]["context"])

    def evaluate() -> None:
        loss = heldout_loss(model, heldout, t["eval_batches"])
        session.record_eval(loss)
        print(f"eval: global held-out loss {loss:.6g} at versions {session.versions}", file=sys.stderr)
        if args.export:
            export(args, config, model, "eval-only", versions=session.versions, heldout_loss=loss)

    evaluate()  # the versions the session started from
    while not stop.requested and not out_of_time(args):
        next_look = time.monotonic() + args.eval_interval
        while not stop.requested and not out_of_time(args) and time.monotonic() < next_look:
            time.sleep(0.1)
        # After a stop too: the last versions published before it are measured and exported.
        if session.poll():
            evaluate()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    try:
        config = load_run_config(args.config, args.set)
        corpus = load_corpus(config["data"]["path"])
        model = MODELS[args.model](config, VOCAB_SIZE)
    except (OSError, ValueError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    print(f"learner {args.id}: {args.model} model, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"config {config['source']}", file=sys.stderr)
    if args.standalone:
        return train(args, config, model, corpus, session=None)

    import decoupled_diloco as dd

    # Until the loops install their stop flag (the session waits for the run's version 0 first),
    # SIGTERM interrupts like Ctrl-C: nothing has been trained, nothing is lost.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with dd.Session(args.config, model.named_parameters(), learner_id=args.id, region=args.region,
                        bootstrap=args.bootstrap, overrides=args.set, run_dir=args.run_dir or None,
                        mode="eval" if args.eval_only else "train", index=args.index, learners=args.learners,
                        total_steps=None if args.eval_only else args.steps or config["train"]["total_steps"],
                        batch=config["train"]["batch"], context=config["model"]["context"]) as session:
            run = evaluate_global if args.eval_only else train
            return run(args, config, model, corpus, session)
    except KeyboardInterrupt:
        print(f"learner {args.id}: stopped before the run began", file=sys.stderr)
        return 0
    except dd.DilocoError as e:  # another model in the run, a learner id in use, no broker, ...
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
