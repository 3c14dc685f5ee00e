"""Fixtures for the tests of decoupled_diloco.Session against the real Kafka broker and the real
binaries: a fresh run (its own id and topics) per test, a diloco-merger started for it and stopped
with SIGTERM, and every process a test starts killed at teardown whatever happened, its log shown
when the test fails.

The broker is $DILOCO_BOOTSTRAP (scripts/test exports it; default the package's 127.0.0.1:19092);
the binaries are in $DILOCO_BIN_DIR (default build/bin of this repository).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

import decoupled_diloco as dd
from decoupled_diloco import _core

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny.toml"
TRAIN_PY = REPO / "examples" / "pytorch" / "train.py"
REGIONS = ("eu", "us")
PARTITIONS = 4


@pytest.fixture
def layout() -> Callable[[int], dict[str, np.ndarray]]:
    """The model of the in-process sessions, by seed: six fp32 tensors (enough for tiny's four
    fragments), seeded values."""
    shapes = {"embed": (16, 8), "w1": (8, 8), "b1": (8,), "w2": (8, 8), "b2": (8,), "head": (8, 16)}

    def tensors(seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    return tensors


def read_events(run_dir: Path, kind: Optional[str] = None) -> list[dict[str, Any]]:
    """The events of a metrics.jsonl (of `kind` when given); a line a killed process left torn is
    left out."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or event.get("event") == kind:
            out.append(event)
    return out


def wait_until(condition: Callable[[], Any], timeout: float, what: str, alive: Callable[[], bool] = lambda: True) -> Any:
    """Polls `condition` until it returns something true and returns it; fails naming `what` after
    `timeout` seconds, or as soon as `alive` says the process it waits on has gone."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if not alive():
            pytest.fail(f"gave up waiting for {what}: the process ended first")
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {timeout} s")
        time.sleep(0.2)


def accounted(merges: list[dict[str, Any]]) -> int:
    """The deltas a merger's merge events account for: merged, or dropped with a reason."""
    return sum(len(m["inputs"]) + len(m["dropped"]) for m in merges)


class Process:
    """A child process of a test: its output in `log`, its metrics.jsonl in `run_dir`."""

    def __init__(self, name: str, argv: list[str], log: Path, run_dir: Path):
        self.name, self.log, self.run_dir = name, log, run_dir
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def events(self, kind: Optional[str] = None) -> list[dict[str, Any]]:
        return read_events(self.run_dir, kind)

    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        return wait_until(condition, timeout, f"{self.name}: {what}", lambda: self.alive)

    def wait(self, timeout: float) -> int:
        """Waits for the process to end by itself; its exit status."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still runs after {timeout} s")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, the clean stop every process of a run has; its exit status."""
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.alive:
            self.popen.kill()
        self.popen.wait()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


PROCESSES = pytest.StashKey[list]()


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[list[Process]]:
    """The processes a test starts (Run.start): killed at teardown."""
    started: list[Process] = []
    request.node.stash[PROCESSES] = started
    yield started
    for process in started:
        process.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test shows the end of every log of the processes it started."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for process in item.stash.get(PROCESSES, []):
            state = "running" if process.alive else f"exit status {process.popen.returncode}"
            report.sections.append((f"{process.name} ({state}), end of {process.log}", process.tail()))


@pytest.fixture(scope="session")
def bootstrap() -> str:
    """The broker's address; fails (does not skip) when no broker answers there."""
    servers = os.environ.get("DILOCO_BOOTSTRAP", "127.0.0.1:19092")
    for server in servers.split(","):
        host, _, port = server.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            continue
        except (OSError, ValueError) as e:
            why = str(e)
        pytest.fail(f"no Kafka broker answers at {server} (DILOCO_BOOTSTRAP={os.environ.get('DILOCO_BOOTSTRAP')}): "
                    f"{why}. Start one with scripts/broker start and set DILOCO_BOOTSTRAP to its address "
                    "(scripts/broker servers), or run the tests with scripts/test", pytrace=False)
    return servers


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """The binaries: $DILOCO_BIN_DIR, default build/bin."""
    path = Path(os.environ.get("DILOCO_BIN_DIR", REPO / "build" / "bin"))
    for binary in ("diloco-merger", "diloco-learner", "diloco-replay", "diloco-status"):
        if not os.access(path / binary, os.X_OK):
            pytest.fail(f"{path / binary} is missing: build the project (scripts/test) or set DILOCO_BIN_DIR",
                        pytrace=False)
    return path


class Run:
    """A run of its own on the broker: an id, its topics, a folder for its processes' logs and
    metrics, and the commands of its processes."""

    def __init__(self, run_id: str, bootstrap: str, bin_dir: Path, folder: Path, processes: list[Process]):
        self.id, self.bootstrap, self.bin_dir, self.folder = run_id, bootstrap, bin_dir, folder
        self.processes = processes
        self.config = TINY
        self.sessions: list[dd.Session] = []
        self.overrides = [f"run.id={run_id}"]

    def options(self) -> list[str]:
        """The options every binary and train.py take: the config, the run id, the broker."""
        return ["-c", str(self.config), "--set", self.overrides[0], "--bootstrap", self.bootstrap]

    def start(self, name: str, argv: list[str]) -> Process:
        """Starts a process whose --run-dir is folder/name (the command must say so)."""
        process = Process(name, argv, self.folder / f"{name}.log", self.folder / name)
        self.processes.append(process)
        return process

    def merger(self, *options: str, name: str = "merger-0") -> Process:
        return self.start(name, [str(self.bin_dir / "diloco-merger"), *self.options(), "--id", name,
                                 "--run-dir", str(self.folder / name), "--connect-timeout", "10", *options])

    def python_learner(self, learner_id: str, region: str, *options: str, name: Optional[str] = None) -> Process:
        """examples/pytorch/train.py as a learner (or, with --eval-only, an evaluator) of this run;
        `name` (default the id) names its log and run folder."""
        return self._learner([sys.executable, str(TRAIN_PY)], learner_id, region, options, name or learner_id)

    def cpp_learner(self, learner_id: str, region: str, *options: str) -> Process:
        return self._learner([str(self.bin_dir / "diloco-learner")], learner_id, region, options, learner_id)

    def _learner(self, program: list[str], learner_id: str, region: str, options: tuple[str, ...], name: str) -> Process:
        return self.start(name, [*program, *self.options(), "--id", learner_id, "--region", region,
                                 "--regions", ",".join(REGIONS), "--run-dir", str(self.folder / name), *options])

    def session(self, parameters: Any, learner_id: str, region: str = "eu", **options: Any) -> dd.Session:
        """A Session of this run in this process, closed at teardown if the test did not."""
        options.setdefault("bootstrap", self.bootstrap)
        options.setdefault("connect_timeout", 10)
        options.setdefault("genesis_timeout", 60)
        session = dd.Session(self.config, parameters, learner_id=learner_id, region=region,
                             overrides=[*self.overrides, *options.pop("overrides", [])], **options)
        self.sessions.append(session)
        return session

    def poll_until_version(self, session: dd.Session, version: int, timeout: float = 30) -> list[int]:
        """Polls `session` until every fragment holds `version` or a later one; its versions."""
        def reached() -> bool:
            session.poll()
            return min(session.versions) >= version
        wait_until(reached, timeout, f"learner {session.learner_id} at version {version} of every fragment")
        return session.versions

    def events(self, name: str, kind: Optional[str] = None) -> list[dict[str, Any]]:
        """The events of the metrics.jsonl in folder/name (a session's run_dir, a process's run dir)."""
        return read_events(self.folder / name, kind)

    def read_version(self, version: Optional[int] = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return dd.read_version(self.config, version=version, bootstrap=self.bootstrap, overrides=self.overrides,
                               connect_timeout=10, timeout=30)

    def replay(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / "diloco-replay"), *self.options(), "--timeout", "30", *command],
                              cwd=REPO, capture_output=True, text=True, timeout=120)

    def members(self) -> dict[str, dict[str, Any]]:
        """What the run's processes announced last in its members topic (diloco-status), by id."""
        result = subprocess.run([str(self.bin_dir / "diloco-status"), "--run", self.id, "--bootstrap", self.bootstrap,
                                 "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"diloco-status could not run:\n{result.stderr}"
        return {member["id"]: member for member in json.loads(result.stdout)["members"]}

    def wait_for_announcement(self, member_id: str, timeout: float = 30) -> dict[str, Any]:
        """Waits until `member_id` has announced itself in the run's members topic; its record."""
        return wait_until(lambda: self.members().get(member_id), timeout, f"an announcement of {member_id}")

    def audit(self) -> dict[str, Any]:
        """`diloco-replay audit --json`: every delta, merge and version of the run, from its logs."""
        result = self.replay("audit", "--json")
        assert result.returncode in (0, 1), f"diloco-replay audit could not run:\n{result.stderr}"
        return json.loads(result.stdout)

    def finish(self, learners: list[Process], merger: Process, evaluator: Process,
               timeout: float = 120) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stops a run in the order that loses nothing: the learners end at their budget (exit 0,
        their deltas flushed), the merger merges every delta they delivered, the evaluator measures
        the versions those merges made and stops, then the merger stops. Returns the evaluator's
        first global_eval (of version 0) and its last (of those final versions, every one past 0)."""
        for learner in learners:
            assert learner.wait(timeout) == 0, f"{learner.name} failed"
        delivered = sum(learner.events("shutdown")[-1]["delivered"] for learner in learners)
        merger.wait_for(lambda: accounted(merger.events("merge")) == delivered, 30,
                        f"the {delivered} deltas the learners delivered merged or dropped")
        newest: dict[int, int] = {}
        for merge in merger.events("merge"):
            newest[merge["fragment"]] = max(newest.get(merge["fragment"], 0), merge["version"])
        versions = [newest.get(p, 0) for p in range(evaluator.events("start")[0]["fragments"])]
        evaluator.wait_for(lambda: [e["versions"] for e in evaluator.events("global_eval")][-1:] == [versions], 30,
                           f"an evaluation of versions {versions}")
        assert evaluator.stop() == 0
        assert merger.stop() == 0
        evals = evaluator.events("global_eval")
        first, last = evals[0], evals[-1]
        print(f"global held-out loss {first['eval_loss']:.4f} at versions {first['versions']}, "
              f"{last['eval_loss']:.4f} at {last['versions']}")
        assert first["versions"] == [0] * len(versions) and min(versions) > 0
        return first, last

    def assert_audit_and_verify_pass(self) -> dict[str, Any]:
        """Every delta merged once or dropped with a reason (or pending at a clean stop), and every
        version rebuilt bit for bit. Returns the audit."""
        audit = self.audit()
        assert audit["ok"] and not audit["problems"], f"audit of run {self.id}: {audit['problems']}"
        verify = self.replay("verify")
        assert verify.returncode == 0, f"verify of run {self.id}:\n{verify.stdout}\n{verify.stderr}"
        return audit


@pytest.fixture
def run(request: pytest.FixtureRequest, bootstrap: str, bin_dir: Path, processes: list[Process],
        tmp_path: Path) -> Iterator[Run]:
    """A fresh run: a new id, its topics created (regions eu and us)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:60]
    run_id = f"pytest-{slug}-{uuid.uuid4().hex[:8]}"
    _core.create_topics(bootstrap, run_id, list(REGIONS), PARTITIONS)
    created = Run(run_id, bootstrap, bin_dir, tmp_path, processes)
    yield created
    for session in created.sessions:
        session.close()


@pytest.fixture
def merger(run: Run) -> Iterator[Process]:
    """The run's diloco-merger, stopped with SIGTERM at teardown if the test did not stop it."""
    process = run.merger()
    yield process
    if process.alive:
        process.stop()
