"""The main job's launcher (scripts/run-local; installed as diloco-run-local).

Starts a local multi-region cluster on a running broker: M mergers, N learners spread over R
regions (each with its own speed factor; the last of them may be Python learners,
examples/pytorch/train.py, instead of diloco-learner) and one --eval-only learner that measures
the global model; shows a live view (a table refreshed every second on a terminal, one summary
line every few seconds otherwise); stops at the step, token or time budget or on Ctrl-C in an
order that loses nothing (learners, then the mergers' last merges, then the evaluator's final
export, then the mergers); then samples text from the final model and writes the report.
"""

import argparse
import glob
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib

from . import repository


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def say(message):
    print(f"run-local: {message}", file=sys.stderr, flush=True)


# ---- configuration ------------------------------------------------------------------------------

def load_config(bin_dir, path, overrides):
    """The config as the binaries read it, defaults included: `diloco-learner --print-config`
    (a bad file or --set fails here with the binary's message, before anything starts)."""
    learner = os.path.join(bin_dir, "diloco-learner")
    if not os.access(learner, os.X_OK):
        fail(f"diloco-learner is not built in {bin_dir} (scripts/run-local builds it; or set --bin-dir)")
    sets = [x for o in overrides for x in ("--set", o)]
    r = subprocess.run([learner, "-c", path, *sets, "--print-config"], capture_output=True, text=True)
    if r.returncode != 0:
        fail(r.stderr.strip().removeprefix("diloco-learner: error: ") or f"diloco-learner --print-config exited with {r.returncode}")
    return json.loads(r.stdout)


def apply_overrides(text, overrides):
    """`text` (a config file) with each `--set section.key=value` written into its table: the key's
    line replaced, or added under the table's header, or a new table at the end; comments are
    kept. Returns None when an override cannot be written so (a key of another depth, or a value
    spread over several lines): the result is checked by reading it back."""
    for override in overrides:
        key, sep, value = override.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            return None
        section, name = parts
        if (section, name) == ("run", "id"):
            continue  # the run's id is written by write_run_config
        line = f"{name} = {value.strip()}  # --set by scripts/run-local"
        header = re.search(rf"(?m)^\[{re.escape(section)}\][ \t]*(#.*)?$", text)
        if not header:
            text = text.rstrip("\n") + f"\n\n[{section}]\n{line}\n"
            continue
        start = header.end()
        following = re.search(r"(?m)^\[", text[start:])
        end = start + following.start() if following else len(text)
        block = text[start:end]
        existing = re.compile(rf"(?m)^[ \t]*{re.escape(name)}[ \t]*=.*$")
        block = existing.sub(lambda _: line, block, count=1) if existing.search(block) else "\n" + line + block
        text = text[:start] + block + text[end:]
    try:
        parsed = tomllib.loads(text)
        for override in overrides:
            key, _, value = override.partition("=")
            section, name = key.strip().split(".")
            if (section, name) != ("run", "id") and parsed[section][name] != tomllib.loads(f"v = {value}")["v"]:
                return None
    except (tomllib.TOMLDecodeError, KeyError, ValueError):
        return None
    return text


def write_run_config(config_path, overrides, run_id, out_path):
    """The run's config as the processes ran it: the file with run.id set to the run's id and every
    --set override written into it, so that `diloco-replay -c RUN_DIR/config.toml` and
    `diloco-sample` need no more options; the overrides are also listed at the top. An override
    that cannot be written into the file is only listed there, with a warning (pass it again as
    --set)."""
    with open(config_path) as f:
        text = f.read()
    id_line = f'id = "{run_id}"  # set by scripts/run-local'
    if re.search(r"(?m)^\s*id\s*=", text):
        text = re.sub(r"(?m)^\s*id\s*=.*$", lambda _: id_line, text, count=1)
    elif re.search(r"(?m)^\[run\]\s*$", text):
        text = re.sub(r"(?m)^\[run\]\s*$", lambda _: "[run]\n" + id_line, text, count=1)
    else:
        text = f"[run]\n{id_line}\n\n" + text
    header = f"# {os.path.relpath(config_path, repository.root())} of the repository, as run by scripts/run-local"
    if overrides:
        header += " with " + " ".join(f"--set {o}" for o in overrides)
        applied = apply_overrides(text, overrides)
        if applied is None:
            print(f"run-local: could not write {' '.join(overrides)} into {out_path}: pass them to diloco-replay "
                  "again as --set", file=sys.stderr)
        else:
            text = applied
    with open(out_path, "w") as f:
        f.write(header + "\n" + text)


def speed_factor(speed, i):
    """Learner i's slow-down factor: speed[i], 1 where the list stops."""
    return speed[i] if i < len(speed) else 1.0


def schedule_overrides(config, speed, learners):
    """With cluster.schedule_by_speed, each learner's --set of its learning-rate schedule: learner i's
    train.total_steps and train.warmup_steps divided by its speed factor (at least 1 and 0 steps),
    so that every schedule ends at the same wall clock; {} without it or when every factor is 1.
    E.g. total 400, warm-up 50, factors [1, 2] -> learner 1: total 200, warm-up 25."""
    if not config["cluster"].get("schedule_by_speed"):
        return {}
    total, warmup = int(config["train"]["total_steps"]), int(config["train"]["warmup_steps"])
    out = {}
    for i in range(learners):
        f = speed_factor(speed, i)
        if f != 1.0:
            t = max(1, round(total / f))
            out[i] = [f"train.total_steps={t}", f"train.warmup_steps={min(t, round(warmup / f))}"]
    return out


def cluster_shape(config, args):
    """Learners, regions, mergers, speed factors and the evaluation interval: the command line
    over the config's [cluster] (whose defaults are the binaries')."""
    cluster = config["cluster"]
    learners = args.learners or int(cluster["learners"])
    regions = args.regions.split(",") if args.regions else list(cluster["regions"])
    mergers = args.mergers or int(cluster["mergers"])
    speed = [float(s) for s in cluster["speed_factors"]]
    if args.speed_factors:
        speed = [float(s) for s in args.speed_factors.split(",")]
    if learners < 1 or mergers < 1 or not all(regions):
        fail("need at least one learner, one merger and non-empty region names")
    return learners, regions, mergers, speed, float(cluster["eval_interval"])


# The Python learner: a plain PyTorch loop joined to the run through decoupled_diloco.Session.
TRAIN_PY = os.path.join("examples", "pytorch", "train.py")


def check_python_learners(learners, python_learners, python_model):
    """Fails with the reason when the last `python_learners` of `learners` cannot run train.py
    with `python_model` beside diloco-learner."""
    if not 0 <= python_learners <= learners:
        fail(f"--python-learners {python_learners}: the cluster has {learners} learner(s) "
             f"(--python-learners must be between 0 and {learners})")
    if python_model == "conv" and python_learners != learners:
        fewer = f" or --learners {python_learners}" if python_learners else ""
        fail(f"--python-model conv needs every learner in Python (--python-learners {learners}{fewer}, not "
             f"{python_learners} of {learners}): diloco-learner trains the built-in transformer, and all learners "
             "of a run train one model")


# ---- processes ----------------------------------------------------------------------------------

class Child:
    def __init__(self, name, role, argv, log_path):
        self.name, self.role, self.log_path = name, role, log_path
        self.log = open(log_path, "wb")
        # Own process group: Ctrl-C reaches only this launcher, which stops children in order.
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=repository.root(),
                                     start_new_session=True)

    def running(self):
        return self.proc.poll() is None

    def signal(self, sig):
        if self.running():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, seconds):
        try:
            return self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, seconds):
        """SIGTERM, then SIGKILL after `seconds`. Returns the exit code."""
        self.signal(signal.SIGTERM)
        code = self.wait(seconds)
        if code is None:
            say(f"{self.name} did not stop within {seconds:.0f} s: killing it")
            self.signal(signal.SIGKILL)
            code = self.wait(10)
        self.close()
        return code

    def close(self):
        if not self.log.closed:
            self.log.close()

    def tail(self, lines=15):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


# ---- metrics ------------------------------------------------------------------------------------

def read_jsonl(path):
    """The JSON lines of a file that parse (a process killed mid-write leaves a torn last line);
    [] when the file cannot be read."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


class JsonTail:
    """New complete JSON lines of a growing file, read incrementally."""

    def __init__(self, path):
        self.path, self.offset, self.partial = path, 0, b""

    def poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


class View:
    """What the live view shows, folded from the processes' metrics.jsonl files."""

    def __init__(self, run_dir, learner_names, merger_names, fragments, steps_budget):
        self.learners = {n: {"step": 0, "loss": None, "tok_s": 0.0, "adopted": 0, "sent": 0, "received": 0,
                             "region": "", "eval": None, "t0": None, "rate": None}
                         for n in learner_names}
        self.tails = {n: JsonTail(os.path.join(run_dir, n, "metrics.jsonl"))
                      for n in learner_names + merger_names + ["eval"]}
        self.versions = [0] * fragments
        self.owner = ["-"] * fragments
        self.last_merge = [None] * fragments
        self.merged = self.merges = 0
        self.dropped = {}
        self.global_eval = None
        self.steps_budget = steps_budget

    def update(self):
        for name, tail in self.tails.items():
            for e in tail.poll():
                if name in self.learners:
                    self._learner(self.learners[name], e)
                elif name == "eval":
                    if e.get("event") == "global_eval":
                        self.global_eval = e
                else:
                    self._merger(name, e)

    def _learner(self, s, e):
        event = e.get("event")
        if event == "start":
            s["region"] = e.get("region", "")
        elif event == "step":
            if s["t0"] is None:
                s["t0"] = (e.get("t", 0), e.get("step", 0))
            t0, step0 = s["t0"]
            if e.get("t", 0) > t0 and e["step"] > step0:
                s["rate"] = (e["step"] - step0) / (e["t"] - t0)
            s.update(step=e["step"], loss=e.get("loss_ema"), tok_s=e.get("tokens_per_s", 0.0),
                     adopted=e.get("adopted", 0), sent=e.get("bytes_sent", s["sent"]),
                     received=e.get("bytes_received", s["received"]))
        elif event == "eval":
            s["eval"] = e.get("eval_loss")
        elif event == "shutdown":
            s["sent"] = e.get("bytes_sent", s["sent"])
            s["received"] = e.get("bytes_received", s["received"])

    def _merger(self, name, e):
        event = e.get("event")
        if event == "merge":
            p = e.get("fragment", 0)
            if 0 <= p < len(self.versions):
                self.versions[p] = max(self.versions[p], e.get("version", 0))
                self.owner[p] = name
                self.last_merge[p] = e.get("time_us", time.time() * 1e6) / 1e6
            self.merges += 1
            self.merged += len(e.get("inputs", []))
        if event == "merge" or event == "stop_record":
            for d in e.get("dropped", []):
                reason = d.get("reason", "?") if isinstance(d, dict) else str(d)
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
        elif event == "assigned":
            for p in e.get("partitions", []):
                if 0 <= p < len(self.owner):
                    self.owner[p] = name

    def eta_seconds(self):
        etas = []
        for s in self.learners.values():
            if s["rate"]:
                etas.append(max(0, self.steps_budget - s["step"]) / s["rate"])
        return max(etas) if etas else None

    def bytes_sent(self):
        return sum(s["sent"] for s in self.learners.values())

    def bytes_received(self):
        return sum(s["received"] for s in self.learners.values())

    def wire_text(self):
        """Both directions of the learners' traffic: deltas up, parameters down."""
        return f"wire up {megabytes(self.bytes_sent())}, down {megabytes(self.bytes_received())}"

    def dropped_text(self):
        total = sum(self.dropped.values())
        if not total:
            return "dropped 0"
        return f"dropped {total} (" + ", ".join(f"{r} {n}" for r, n in sorted(self.dropped.items())) + ")"

    def global_text(self):
        g = self.global_eval
        if not g:
            return "global held-out: not yet measured"
        return f"global held-out {g['eval_loss']:.3f} at versions {g.get('versions')}"


def duration(seconds):
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def megabytes(n):
    return f"{n / 1e6:.2f} MB"


def render_screen(view, run_id, elapsed, time_left):
    eta = view.eta_seconds()
    if time_left is not None:
        eta = time_left if eta is None else min(eta, time_left)
    lines = [f"diloco run {run_id}   elapsed {duration(elapsed)}   ETA {duration(eta)}   (Ctrl-C stops cleanly)", ""]
    lines.append(f"{'LEARNER':<12}{'REGION':<8}{'STEP':>12}{'LOSS':>8}{'HELD-OUT':>10}{'TOK/S':>9}{'ADOPTED':>9}{'SENT':>11}{'RECEIVED':>11}")
    for name, s in view.learners.items():
        loss = f"{s['loss']:.3f}" if s["loss"] is not None else "-"
        held = f"{s['eval']:.3f}" if s["eval"] is not None else "-"
        lines.append(f"{name:<12}{s['region']:<8}{str(s['step']) + '/' + str(view.steps_budget):>12}{loss:>8}{held:>10}"
                     f"{s['tok_s']:>9.0f}{s['adopted']:>9}{megabytes(s['sent']):>11}{megabytes(s['received']):>11}")
    lines += ["", f"{'FRAGMENT':<10}{'VERSION':>8}  {'OWNER':<12}{'LAST MERGE':>11}"]
    now = time.time()
    for p, v in enumerate(view.versions):
        ago = f"{now - view.last_merge[p]:.0f}s ago" if view.last_merge[p] else "-"
        lines.append(f"{p:<10}{v:>8}  {view.owner[p]:<12}{ago:>11}")
    lines += ["", f"merges {view.merges}, deltas merged {view.merged}, {view.dropped_text()}; "
                  f"learners' {view.wire_text()}",
              view.global_text()]
    return "\x1b[H\x1b[2J" + "\n".join(lines) + "\n"


def summary_line(view, elapsed):
    parts = [f"{duration(elapsed)}"]
    for name, s in view.learners.items():
        loss = f"{s['loss']:.3f}" if s["loss"] is not None else "-"
        parts.append(f"{name} step {s['step']} loss {loss} {s['tok_s']:.0f} tok/s")
    parts.append(f"versions {view.versions}, merged {view.merged}, {view.dropped_text()}, "
                 f"{view.wire_text()}, ETA {duration(view.eta_seconds())}")
    parts.append(view.global_text())
    return "run-local: " + " | ".join(parts)


# ---- the run ------------------------------------------------------------------------------------

SECURE_BROKER_PORT = "19192"  # a secured broker's default client port: beside, not instead of, a plaintext one


def add_secure_args(p):
    """--secure and --secure-dir (scripts/run-local, scripts/chaos, scripts/wan-sim)."""
    p.add_argument("--secure", action="store_true",
                   help="run the cluster secured (docs/security.md): a broker of its own with mutual TLS and "
                        "ACLs (mutual TLS, scripts/broker --secure, port $DILOCO_BROKER_PORT or 19192, data in "
                        "$DILOCO_BROKER_DIR or .run/broker-secure), every process speaking as its own principal, and "
                        "parameters over ZeroMQ CURVE to the allowed learners only; keys and certificates from "
                        "scripts/secure init (made when missing)")
    p.add_argument("--secure-dir", help="the folder of scripts/secure init (default: .run/secure; 0700, secrets 0600)")


def secure_dir_of(args):
    """The secure folder `args` ask for (None: a plaintext run). Points scripts/broker at a secured
    broker of its own (DILOCO_BROKER_SECURE, and a port and data folder apart from the plaintext
    broker's unless DILOCO_BROKER_PORT / DILOCO_BROKER_DIR say otherwise)."""
    if not getattr(args, "secure", False):
        if getattr(args, "secure_dir", None):
            fail("--secure-dir needs --secure")
        return None
    folder = os.path.abspath(args.secure_dir or os.path.join(repository.root(), ".run", "secure"))
    os.environ["DILOCO_BROKER_SECURE"] = folder
    os.environ.setdefault("DILOCO_BROKER_PORT", SECURE_BROKER_PORT)
    os.environ.setdefault("DILOCO_BROKER_DIR", os.path.join(repository.root(), ".run", "broker-secure"))
    return folder


def broker(*args, check=True):
    result = subprocess.run([os.path.join(repository.root(), "scripts", "broker"), *args], cwd=repository.root(),
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        fail(f"scripts/broker {' '.join(args)} failed:\n{result.stderr.strip()}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="scripts/run-local",
        description="Runs a local Decoupled DiLoCo cluster (mergers, learners over regions, one evaluator of the "
                    "global model) on the local Kafka broker, shows its progress, stops at the budget or on "
                    "Ctrl-C, and leaves logs, metrics, the final model, a text sample and a report in the run folder.")
    add_cluster_args(p)
    p.add_argument("--print-config", action="store_true",
                   help="print the cluster as JSON and exit, starting nothing: its shape (learners, regions, "
                        "mergers, which learners run Python and which model), budget and every process's "
                        "command line")
    args = p.parse_args(argv)
    args.bin_dir = args.bin_dir or repository.default_bin_dir()
    return args


def add_cluster_args(p):
    """The options that describe a cluster and its budget (scripts/run-local, scripts/wan-sim)."""
    p.add_argument("config", nargs="?", default="configs/demo.toml", help="run config (default: configs/demo.toml)")
    p.add_argument("--learners", type=int, help="learners (default: cluster.learners of the config, else 3)")
    p.add_argument("--regions", help="regions, comma-separated; learner i goes to region i mod R (default: cluster.regions)")
    p.add_argument("--mergers", type=int, help="merger instances (default: cluster.mergers, else 1)")
    p.add_argument("--speed-factors", help="per-learner slow-down factors, comma-separated, e.g. 1,1,2 "
                                           "(default: cluster.speed_factors; missing ones are 1)")
    p.add_argument("--steps", type=int, help="step budget: inner steps per learner (default: train.total_steps)")
    p.add_argument("--tokens", type=float, help="token budget: total tokens over all learners (sets --steps)")
    p.add_argument("--max-seconds", type=float, default=0, help="time budget in seconds (0: none)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="config override for every process (repeatable), e.g. --set merger.quorum=2")
    p.add_argument("--run-dir", help="run folder (default: runs/<run id>)")
    p.add_argument("--no-report", action="store_true", help="skip the text sample and the report at the end")
    p.add_argument("--bin-dir",
                   help="where diloco-learner and diloco-merger are (default: build/bin or $DILOCO_BIN_DIR)")
    add_python_learner_args(p)
    add_secure_args(p)


def add_python_learner_args(p):
    """The options that make learners Python ones (scripts/run-local, scripts/wan-sim, scripts/chaos)."""
    p.add_argument("--python-learners", type=int, default=0, metavar="N",
                   help=f"the last N learners run {TRAIN_PY} (a PyTorch loop joined through "
                        "decoupled_diloco.Session) with the project's Python instead of diloco-learner, with the "
                        "same id, region, shard, budget, speed factor and run folder (default 0)")
    p.add_argument("--python-model", choices=("builtin", "conv"), default="builtin",
                   help="the Python learners' model: builtin, diloco-learner's transformer in PyTorch (shares a run "
                        "with diloco-learner; the default), or conv, a convolutional model of its own: every learner "
                        "must then be Python (--python-learners = learners), the evaluator is "
                        f"{TRAIN_PY} --eval-only --model conv, and there is no text sample (diloco-sample runs the "
                        "built-in model)")


class Cluster:
    """The processes of one local run: the mergers, the learners, the evaluator, on the local broker.
    start() launches them; restart_*() brings one back with the same id (scripts/chaos); stop()
    stops them in an order that loses nothing; kill() ends every child at once (a failure of the
    launcher itself must leave nothing behind)."""

    def __init__(self, config_path, overrides, learners, regions, mergers, speed, eval_interval, steps,
                 max_seconds, run_dir, bin_dir, run_id, tokens_per_step, fragments, python_learners=0,
                 python_model="builtin", secure_dir=None, learner_overrides=None):
        self.config_path, self.overrides = config_path, overrides
        # {learner index: [K=V, ...]}: --set for that learner only, after the run's (schedule_overrides)
        self.learner_overrides = learner_overrides or {}
        self.learners, self.regions, self.mergers = learners, regions, mergers
        self.speed, self.eval_interval, self.steps, self.max_seconds = speed, eval_interval, steps, max_seconds
        self.run_dir, self.bin_dir, self.run_id = run_dir, bin_dir, run_id
        self.fragments = fragments
        self.python_learners, self.python_model = python_learners, python_model
        self.secure_dir, self.secure_ready = secure_dir, False
        if secure_dir:
            # Written into the run's config.toml: a tool run on it later (diloco-replay -c RUN/config.toml)
            # reads as the `replay` principal, which may read the run's topics and write nothing.
            self.overrides = [*overrides, *self.secure_overrides()]
        self.merger_names = [f"merger-{m}" for m in range(mergers)]
        self.learner_names = [f"learner-{i}" for i in range(learners)]
        self.children = {}  # name -> the Child of its newest process
        self.started_broker = False
        self.start_time = None
        self.servers = None  # the broker's address, from prepare_broker()
        self.final_model = os.path.join(run_dir, "final_model.safetensors")
        self.info = {"run_id": run_id, "config": os.path.relpath(config_path, repository.root()),
                     "overrides": overrides,
                     "learners": learners, "regions": regions, "mergers": mergers,
                     "speed_factors": [self.speed_of(i) for i in range(learners)],
                     "learner_overrides": {self.learner_names[i]: o for i, o in self.learner_overrides.items()},
                     "learner_regions": {self.learner_names[i]: self.region_of(i) for i in range(learners)},
                     "python_learners": [n for i, n in enumerate(self.learner_names) if self.runs_python(i)],
                     "python_model": python_model if python_learners else None,
                     "steps_per_learner": steps, "tokens_per_step": tokens_per_step,
                     "max_seconds": max_seconds, "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def create_folder(self):
        """The run folder, with the run's config.toml."""
        os.makedirs(self.run_dir, exist_ok=True)
        write_run_config(self.config_path, self.overrides, self.run_id, os.path.join(self.run_dir, "config.toml"))

    def runs_python(self, i):
        """Whether learner i is a Python learner (the last python_learners of them are)."""
        return i >= self.learners - self.python_learners

    def python_eval(self):
        """Whether the evaluator is a Python one: diloco-learner evaluates only its own model."""
        return self.python_model == "conv"

    def train_py(self):
        """The start of a Python learner's command line: the Python this tool runs under (the
        project's .venv/bin/python through scripts/run-local), which imports decoupled_diloco."""
        return [sys.executable, os.path.join(repository.root(), TRAIN_PY), "--model", self.python_model]

    def speed_of(self, i):
        return speed_factor(self.speed, i)

    def prepare_broker(self, partitions=None):
        """Starts the broker if none runs (stopped again by finish()) and creates the run's topics."""
        self.prepare_secure()
        if broker("status", check=False).returncode != 0:
            say("starting the Kafka broker")
            broker("start")
            self.started_broker = True
        self.servers = broker("servers").stdout.strip()
        broker("topics", "--run", self.run_id, "--regions", ",".join(self.regions), "--partitions",
               str(partitions or self.fragments))
        self.info["bootstrap"] = self.servers

    def secure_overrides(self, principal=None, role=None):
        """The [security] settings of a secured run (scripts/secure init's files): for every process
        (principal None), or those of process `principal` of `role` (merger, learner, eval): its own
        TLS key and certificate (the broker's ACLs know it by it), and its CURVE key (a merger's secret and the allowed learners' folder, a
        learner's or the evaluator's own pair)."""
        path = lambda *parts: json.dumps(os.path.join(self.secure_dir, *parts))  # a TOML string
        if principal is None:
            return [f"security.kafka_protocol=\"ssl\"", f"security.kafka_ca={path('ca.pem')}",
                    f"security.kafka_certificate={path('tls', 'replay.pem')}",
                    f"security.merger_public_key={path('curve', 'merger.key')}"]
        sets = [f"security.kafka_certificate={path('tls', principal + '.pem')}"]
        if role == "merger":
            sets += [f"security.merger_secret_key={path('curve', 'merger.key_secret')}",
                     f"security.allowed_learners={path('curve', 'learners')}"]
        else:
            sets += [f"security.learner_key={path('curve', 'learners', principal + '.key_secret')}"]
        return sets

    def secure_host(self):
        """The address the secured broker's certificate names (scripts/wan-sim: its service address)."""
        return os.environ.get("DILOCO_BROKER_HOST", "127.0.0.1")

    def prepare_secure(self):
        """scripts/secure init of this run's shape: what is missing of the CA, the broker's
        certificate, every principal's key and certificate and CURVE keys is made; what exists is kept."""
        if not self.secure_dir or self.secure_ready:
            return
        self.secure_ready = True
        result = subprocess.run([os.path.join(repository.root(), "scripts", "secure"), "init", self.secure_dir,
                                 "--learners", str(self.learners), "--mergers", str(self.mergers),
                                 "--regions", ",".join(self.regions), "--host", self.secure_host(),
                                 "--keys-bin", os.path.join(self.bin_dir, "diloco-keys")],
                                cwd=repository.root(), capture_output=True, text=True)
        if result.returncode != 0:
            fail(f"scripts/secure init {self.secure_dir} failed:\n{result.stderr.strip()}")
        say(f"secured run: mutual TLS and ACLs on Kafka, CURVE on parameters (keys in {self.secure_dir})")

    def _common(self, principal=None, role=None, extra=()):
        overrides = self.overrides + [f"run.id=\"{self.run_id}\""] + list(extra)
        if self.secure_dir and principal:
            overrides += self.secure_overrides(principal, role)
        sets = [a for o in overrides for a in ("--set", o)]
        return ["-c", self.config_path, *sets, "--bootstrap", self.servers]

    def command(self, name, role, argv):
        """The command line that runs `argv` for child `name` (scripts/wan-sim runs it in a network
        namespace)."""
        return argv

    def merger_args(self, name):
        """Extra arguments of merger `name` (scripts/wan-sim binds it to a namespace's address)."""
        return []

    def _start(self, name, role, argv):
        old = self.children.get(name)
        if old and old.running():
            raise RuntimeError(f"{name} is still running")
        if old:
            old.close()
        self.children[name] = Child(name, role, self.command(name, role, argv), os.path.join(self.run_dir, f"{name}.log"))
        return self.children[name]

    def merger_argv(self, name):
        return [os.path.join(self.bin_dir, "diloco-merger"), *self._common(name, "merger"), "--id", name,
                "--run-dir", os.path.join(self.run_dir, name), *self.merger_args(name)]

    def start_merger(self, name):
        return self._start(name, "merger", self.merger_argv(name))

    def region_of(self, i):
        """The region of learner i: the regions in turn."""
        return self.regions[i % len(self.regions)]

    def learner_argv(self, i, max_seconds=None):
        """Learner i's command line; max_seconds: its time budget (default the run's)."""
        name = self.learner_names[i]
        max_seconds = self.max_seconds if max_seconds is None else max_seconds
        args = [*self._common(name, "learner", self.learner_overrides.get(i, [])), "--id", name, "--index", str(i),
                "--learners", str(self.learners),
                "--region", self.region_of(i), "--regions", ",".join(self.regions), "--steps", str(self.steps),
                "--run-dir", os.path.join(self.run_dir, name)]
        args += ["--max-seconds", f"{max_seconds:.1f}"] if max_seconds else []
        program = self.train_py() if self.runs_python(i) else [os.path.join(self.bin_dir, "diloco-learner")]
        return [*program, *args, "--speed-factor", str(self.speed_of(i))]

    def start_learner(self, i, max_seconds=None):
        """Learner i (again, under the same id, after a failure); max_seconds: its time budget."""
        return self._start(self.learner_names[i], "learner", self.learner_argv(i, max_seconds))

    def eval_argv(self):
        program = self.train_py() if self.python_eval() else [os.path.join(self.bin_dir, "diloco-learner")]
        return [*program, *self._common("eval", "eval"), "--id", "eval", "--eval-only", "--region", self.regions[0],
                "--regions", ",".join(self.regions), "--eval-interval", str(self.eval_interval),
                "--export", self.final_model, "--run-dir", os.path.join(self.run_dir, "eval")]

    def start_eval(self):
        return self._start("eval", "eval", self.eval_argv())

    def commands(self):
        """Every process start() launches, by name: its command line (before command() wraps it)."""
        return {**{name: self.merger_argv(name) for name in self.merger_names},
                **{self.learner_names[i]: self.learner_argv(i) for i in range(self.learners)},
                "eval": self.eval_argv()}

    def start(self):
        for name in self.merger_names:
            self.start_merger(name)
        for i in range(self.learners):
            self.start_learner(i)
        self.start_eval()
        self.start_time = time.time()
        python = (f" ({self.python_learners} in Python, {self.python_model} model)" if self.python_learners else "")
        say(f"run {self.run_id}: {self.mergers} merger(s), {self.learners} learner(s){python} over "
            f"{','.join(self.regions)}, {self.steps} steps each "
            f"({self.steps * self.info['tokens_per_step'] * self.learners:,} tokens); run folder {self.run_dir}")

    def of_role(self, role):
        return [c for c in self.children.values() if c.role == role]

    def crashed(self, expected=()):
        """The first child that exited with an error code, other than those named in `expected`."""
        for c in self.children.values():
            if c.name not in expected and not c.running() and c.proc.returncode != 0:
                return c
        return None

    def stop(self, view, failure=None):
        """Stops in an order that loses nothing: learners flush their deltas; the mergers merge them;
        the evaluator measures and exports the last versions; the mergers record what they still
        hold. Returns the exit codes."""
        codes = {}
        for c in self.of_role("learner"):
            codes[c.name] = c.stop(20)
        # The mergers' last merges: wait until no merge came for 4 s (at most 60 s).
        drain_start = quiet_since = time.time()
        last_merges = view.merges
        while time.time() - quiet_since < 4 and time.time() - drain_start < 60 and not failure:
            time.sleep(0.5)
            view.update()
            if view.merges != last_merges:
                quiet_since, last_merges = time.time(), view.merges
        for c in self.of_role("eval"):
            codes[c.name] = c.stop(120)
        for c in self.of_role("merger"):
            codes[c.name] = c.stop(60)
        return codes

    def kill(self):
        for c in self.children.values():
            if c.running():
                c.signal(signal.SIGCONT)
                c.signal(signal.SIGKILL)
                c.wait(10)

    def finish(self, reason, codes):
        """Stops the broker if this run started it and writes run.json."""
        if self.started_broker:
            broker("stop", check=False)
            self.started_broker = False
        self.info.update(end_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), stop_reason=reason, exit_codes=codes,
                         wall_seconds=round(time.time() - (self.start_time or time.time()), 1))
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump(self.info, f, indent=2)

    def sample_and_report(self):
        if self.python_eval():
            say(f"no text sample: diloco-sample runs the built-in model, and this run trained the {self.python_model} model")
        elif os.path.exists(self.final_model):
            sample = subprocess.run([os.path.join(self.bin_dir, "diloco-sample"), self.final_model, "--prompt",
                                     "And God said", "--length", "300", "--temperature", "0.8"],
                                    capture_output=True, text=True)
            if sample.returncode == 0:
                with open(os.path.join(self.run_dir, "sample.txt"), "w") as f:
                    f.write(sample.stdout)
                print(f"\nA sample of the final global model (diloco-sample {self.final_model}):\n")
                print(sample.stdout, flush=True)
            else:
                say(f"diloco-sample failed: {sample.stderr.strip()}")
        else:
            say("no final model was exported (the evaluator saw no merged version)")
        report = subprocess.run([sys.executable, "-m", f"{__package__}.report", self.run_dir], capture_output=True,
                                text=True)
        if report.returncode != 0:
            say(f"the report failed: {report.stderr.strip()}")
        else:
            say(f"report: {os.path.join(self.run_dir, 'report', 'index.html')}")


def cluster_from_args(args, make=None, create=True):
    """The Cluster that the command line and the config describe (shared by scripts/chaos and
    scripts/wan-sim, whose `make` builds a subclass from the same arguments); create: make its run
    folder."""
    # A path relative to the working directory, or else to the repository (configs/demo.toml).
    config_path = os.path.abspath(args.config)
    if not os.path.isfile(config_path):
        config_path = os.path.join(repository.root(), args.config)
    if not os.path.isfile(config_path):
        fail(f"no config file '{args.config}' (try configs/demo.toml or configs/tiny.toml)")
    config = load_config(args.bin_dir, config_path, args.overrides)
    learners, regions, mergers, speed, eval_interval = cluster_shape(config, args)
    tokens_per_step = int(config["train"]["batch"]) * int(config["model"]["context"])
    steps = args.steps or int(config["train"]["total_steps"])
    if args.tokens:
        steps = max(1, -(-int(args.tokens) // (learners * tokens_per_step)))
    fragments = int(config["diloco"]["fragments"])
    for tool in ("diloco-learner", "diloco-merger", "diloco-sample"):
        if not os.access(os.path.join(args.bin_dir, tool), os.X_OK):
            fail(f"{tool} is not built in {args.bin_dir} (scripts/run-local builds it; or set --bin-dir)")
    check_python_learners(learners, args.python_learners, args.python_model)
    # Python learners join through the package's native module: without it each would fail at start.
    if args.python_learners and importlib.util.find_spec("decoupled_diloco._core") is None:
        fail(f"--python-learners needs decoupled_diloco's native module, which {sys.executable} cannot import: "
             "build it (scripts/run-local builds it when given --python-learners; or cmake --build build --target _core)")
    run_id = f"{config['run']['id']}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.abspath(args.run_dir or os.path.join(repository.root(), "runs", run_id))
    earlier = [p for p in [os.path.join(run_dir, "run.json")] + glob.glob(os.path.join(run_dir, "*", "metrics.jsonl"))
               if os.path.exists(p)]
    if earlier:  # the processes append to their metrics: two runs would mix in every measurement
        fail(f"the run folder {run_dir} holds an earlier run ({os.path.relpath(earlier[0], run_dir)}): "
             "give another --run-dir, or remove that one")
    cluster = (make or Cluster)(config_path, args.overrides, learners, regions, mergers, speed, eval_interval, steps,
                                args.max_seconds, run_dir, args.bin_dir, run_id, tokens_per_step, fragments,
                                args.python_learners, args.python_model, secure_dir_of(args),
                                schedule_overrides(config, speed, learners))
    if create:
        cluster.create_folder()
    return cluster


def describe(cluster):
    """What --print-config prints: the cluster as run.json will record it, and the command line of
    every process it starts, as a shell would take it (the broker's address as `scripts/broker
    servers` prints it)."""
    cluster.servers = broker("servers", check=False).stdout.strip() or "$(scripts/broker servers)"
    info = {k: v for k, v in cluster.info.items() if k != "start_time"}
    return {**info, "run_dir": cluster.run_dir,
            "processes": {name: shlex.join(argv) for name, argv in cluster.commands().items()}}


def main(argv=None) -> int:
    """scripts/run-local: runs the cluster that the command line describes; the exit status."""
    args = parse_args(argv)
    repository.root()
    cluster = cluster_from_args(args, create=not args.print_config)
    if args.print_config:
        print(json.dumps(describe(cluster), indent=2))
        return 0
    return run(cluster, args)


def run(cluster, args, on_tick=None):
    """Prepares the broker, starts `cluster`, shows its progress until the budget, a failure or
    Ctrl-C, stops it in order, writes run.json and the report (scripts/run-local and
    scripts/wan-sim). on_tick(elapsed) runs every turn of the loop. Returns the exit status: 0 when
    every process exited cleanly; exits with 1 itself when a process failed."""
    stop_requested = []
    signal.signal(signal.SIGINT, lambda *_: stop_requested.append("Ctrl-C"))
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append("SIGTERM"))
    try:
        cluster.prepare_broker()
        cluster.start()
        view = View(cluster.run_dir, cluster.learner_names, cluster.merger_names, cluster.fragments, cluster.steps)
        tty = sys.stdout.isatty()
        last_line = 0.0
        failure = None
        while not stop_requested:
            time.sleep(1.0 if tty else 0.5)
            view.update()
            elapsed = time.time() - cluster.start_time
            time_left = max(0.0, args.max_seconds - elapsed) if args.max_seconds else None
            if tty:
                sys.stdout.write(render_screen(view, cluster.run_id, elapsed, time_left))
                sys.stdout.flush()
            elif time.time() - last_line >= 5:
                last_line = time.time()
                print(summary_line(view, elapsed), flush=True)
            c = cluster.crashed()
            if c:
                failure = f"{c.name} exited with code {c.proc.returncode}; the end of {c.log_path}:\n{c.tail()}"
                break
            if not any(c.running() for c in cluster.of_role("learner")):
                break
            if args.max_seconds and elapsed > args.max_seconds + 30:
                stop_requested.append("time budget")
            if on_tick:
                on_tick(elapsed)

        reason = stop_requested[0] if stop_requested else ("a process failed" if failure else "budget reached")
        say(f"stopping ({reason})")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        codes = cluster.stop(view, failure)
        view.update()
        if tty:
            sys.stdout.write(render_screen(view, cluster.run_id, time.time() - cluster.start_time, None))
        print(summary_line(view, time.time() - cluster.start_time), flush=True)
        cluster.finish(reason, codes)
    except BaseException:
        # Whatever went wrong in this launcher, no child outlives it.
        cluster.kill()
        if cluster.started_broker:
            broker("stop", check=False)
        raise
    if failure:
        fail(failure)
    bad = {n: c for n, c in codes.items() if c not in (0, None)}
    if bad:
        say(f"some processes did not exit cleanly: {bad} (logs in {cluster.run_dir})")
    if not args.no_report:
        cluster.sample_and_report()
    say(f"run folder: {cluster.run_dir}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
