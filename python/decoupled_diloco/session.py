"""Join a training loop to a Decoupled DiLoCo run: :class:`Session`, :func:`load_version`.

A session registers the model's parameters (name, shape, float32) with the native learner runtime,
which splits them into the run's fragments, proposes them as the run's version 0 when the run has
none, and from then on, at every :meth:`Session.step`, sends the fragments that are due as deltas
(outer gradients) to the run's Kafka topics and writes the global versions the mergers publish
back into the parameters. The package links and imports no torch: tensors cross as DLPack / buffer
protocol arrays, so any PyTorch (or NumPy) version works.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Optional, Union

from .errors import InvalidInputError, SessionClosedError

__all__ = ["Session", "load_version", "read_version", "Mode"]

Mode = Literal["train", "eval"]
Tensor = Any  # a torch.Tensor (any device) or a numpy.ndarray
Parameters = Union[Iterable[tuple[str, Tensor]], Mapping[str, Tensor]]
PathLike = Union[str, "os.PathLike[str]"]

_STATE_FORMAT = "decoupled_diloco.session/1"


def _native():
    try:
        from . import _core
    except ImportError as e:  # not built: a checkout without the build, or a broken install
        raise ImportError(
            "decoupled_diloco's native module is not built: in the repository run scripts/test (or "
            "`cmake --build build`), elsewhere `pip install ./python`") from e
    return _core


def _bootstrap(bootstrap: Optional[str]) -> str:
    return bootstrap or os.environ.get("DILOCO_BOOTSTRAP") or "127.0.0.1:19092"


def _is_numpy(t: Tensor) -> bool:
    return type(t).__module__ == "numpy" and hasattr(t, "flags")


class _Registered:
    """One parameter: the user's tensor, and the float32 CPU array the runtime reads and writes
    (the tensor itself when it is a contiguous CPU tensor, else a host copy)."""

    def __init__(self, name: str, tensor: Tensor):
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"a parameter name must be a non-empty string, not {name!r}")
        self.name = name
        self.tensor = tensor
        if _is_numpy(tensor):
            dtype, device, contiguous = tensor.dtype.name, "cpu", bool(tensor.flags["C_CONTIGUOUS"])
            if not tensor.flags["WRITEABLE"]:
                raise InvalidInputError(f"tensor '{name}' is a read-only NumPy array: the session writes the "
                                        "global versions into it")
        elif hasattr(tensor, "is_contiguous") and hasattr(tensor, "device"):
            dtype, device, contiguous = str(tensor.dtype).replace("torch.", ""), tensor.device.type, tensor.is_contiguous()
            if getattr(tensor, "is_sparse", False):
                raise InvalidInputError(f"tensor '{name}' is sparse: register dense tensors")
        else:
            raise InvalidInputError(f"tensor '{name}' is a {type(tensor).__name__}: register torch tensors or "
                                    "NumPy arrays (float32, contiguous)")
        if dtype != "float32":
            raise InvalidInputError(
                f"tensor '{name}' is {dtype}: a session exchanges float32 tensors (with mixed precision, "
                "register the float32 master parameters)")
        if not contiguous:
            raise InvalidInputError(f"tensor '{name}' is not contiguous: make it so (.contiguous()) before "
                                    "registering, the session writes versions into its memory in place")
        self.shape = [int(d) for d in tensor.shape]
        self.on_device = device != "cpu"
        self._device = device
        if _is_numpy(tensor):
            self.host = tensor
        elif self.on_device:
            self.host = None  # attach_host(): only a tensor of a fragment this learner trains needs one
        else:
            self.host = tensor.detach()  # the same memory: adoption writes the parameter in place

    def attach_host(self) -> None:
        """A host copy of a device tensor: only the fragment being cut or adopted crosses, through
        pinned memory where the device has it (a CUDA tensor)."""
        if self.host is None:
            host = self.tensor.detach().to("cpu", copy=True)
            self.host = host.pin_memory() if self._device == "cuda" else host

    def to_host(self) -> None:
        self.host.copy_(self.tensor.detach())

    def from_host(self) -> None:
        self.tensor.detach().copy_(self.host)


def _registered(parameters: Parameters) -> list[_Registered]:
    items = parameters.items() if isinstance(parameters, Mapping) else parameters
    out = [_Registered(name, tensor) for name, tensor in items]
    if not out:
        raise InvalidInputError("no parameters to register (pass model.named_parameters())")
    return out


class Session:
    """One learner of a Decoupled DiLoCo run, around any training loop.

    ::

        import decoupled_diloco as dd
        with dd.Session("run.toml", model.named_parameters(), learner_id="us-0", region="us") as session:
            for batch in loader:
                loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
                session.step(tokens=batch.numel(), loss=loss.item())

    The constructor joins the run: it waits for the Kafka broker, refuses a ``learner_id`` that a
    live process holds, and reads the run's newest version of every fragment; when the run has
    none yet it proposes these parameters as version 0 (the run's mergers commit the first
    proposal of each fragment) and waits until version 0 is committed. Then it writes the run's
    parameters into the model, so every learner starts from the same values. A learner id that
    ran before continues where it stopped: :attr:`step_count` is its step (resume the learning
    rate schedule and data from it).

    Parameters may live on any device; only the fragment being cut or adopted is copied to host
    (through pinned memory for CUDA). They must be float32 and contiguous. Only parameters are
    exchanged: buffers that are not parameters (BatchNorm running statistics, say) stay local to
    each learner. The optimizer's state stays local too, as in DiLoCo.

    Args:
        config: the run config (TOML), the same file every process of the run uses.
        parameters: ``model.named_parameters()``, or a mapping of names to tensors. The names,
            shapes and order make the run's layout: every learner of a run registers the same.
        learner_id: unique in the run; a restart under the same id continues its progress.
        region: this learner's region: its deltas go to ``diloco.<run>.deltas.<region>``.
        bootstrap: Kafka bootstrap servers (default ``$DILOCO_BOOTSTRAP`` or 127.0.0.1:19092).
        overrides: config overrides, ``"section.key=value"`` each (as ``--set`` of the binaries).
        mode: ``"train"``, or ``"eval"``: never trains or publishes, adopts every version
            (:meth:`poll`), for evaluating the global model with the user's own code.
        run_dir: folder for ``metrics.jsonl`` (the same events as diloco-learner writes).
        metrics_port: serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off).
        index, learners: this learner's index among ``learners`` (with ``diloco.stagger``).
        total_steps: the step budget when known: a synchronous mode skips the wait after it.
        batch, context: the shape of one inner step, sequences per step and tokens per sequence
            (give both or neither). Announced to the run: the mergers weigh each delta by the
            tokens it claims and refuse one that claims more than its steps x batch x context;
            :meth:`step` refuses a step of more tokens. Learners with different batch sizes share
            a run this way. Without them the tokens a delta claims are not bounded by the mergers.
        connect_timeout: seconds to wait for the broker before :class:`UnavailableError`.
        genesis_timeout: seconds to wait for version 0 before :class:`UnavailableError`.
        log_every: steps between ``step`` lines in ``metrics.jsonl``.
        merger_endpoints: extra merger ZeroMQ endpoints (normally announced in the run's topics).
        fragments: train these fragments only (numbers into :attr:`fragments`; default all): the
            session proposes, cuts, adopts, announces and saves them alone, and a device tensor
            that none of them holds gets no host copy. The other fragments' values in the model
            are never read or written (their :attr:`versions` stay 0): a run trains every fragment
            only if every fragment has a learner. A saved state loads only into a session of the
            same fragments.
        spill_dir: an existing directory where the error-feedback residuals and the values at
            each fragment's last cut are kept (8 bytes per parameter, in files unlinked at once)
            instead of host memory, read and written a range at a time: for a model whose host
            state does not fit (docs/operations.md, "Memory per process"). Default: in memory.

    Raises:
        InvalidInputError: a tensor that is not float32 or not contiguous, a model that differs
            from the run's (the message names the tensor, the run's shape and this one), a config
            that does not parse, a learner id another live process holds, a proposal a merger
            rejected (with its reason).
        UnavailableError: no broker, or no version 0 within ``genesis_timeout``.
        KeyboardInterrupt: Ctrl-C (or a signal handler's exception) while it waits.
    """

    def __init__(self, config: PathLike, parameters: Parameters, *, learner_id: str, region: str,
                 bootstrap: Optional[str] = None, overrides: Sequence[str] = (), mode: Mode = "train",
                 run_dir: Optional[PathLike] = None, metrics_port: int = 0, index: int = 0, learners: int = 1,
                 total_steps: Optional[int] = None, connect_timeout: float = 30.0, genesis_timeout: float = 600.0,
                 log_every: int = 10, merger_endpoints: Sequence[str] = (), batch: Optional[int] = None,
                 context: Optional[int] = None, fragments: Optional[Sequence[int]] = None,
                 spill_dir: Optional[PathLike] = None):
        if mode not in ("train", "eval"):
            raise InvalidInputError(f"mode must be 'train' or 'eval', not {mode!r}")
        for name, value in (("batch", batch), ("context", context)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or
                                      not 1 <= value < 2**32):
                raise InvalidInputError(f"{name} must be a positive int (sequences per step, tokens per sequence), "
                                        f"not {value!r}")
        if (batch is None) != (context is None):
            raise InvalidInputError(f"batch={batch!r} and context={context!r}: give both (sequences per step and "
                                    f"tokens per sequence) or neither")
        if fragments is not None:
            fragments = list(fragments)
            if not fragments or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 2**32
                                        for p in fragments):
                raise InvalidInputError(f"fragments must be a non-empty list of fragment numbers (ints from 0), "
                                        f"not {fragments!r}")
        self._closed = False
        self._runtime = None
        self._tensors = _registered(parameters)
        # Host copies of device tensors: of every tensor, or of those the given fragments hold.
        needed = range(len(self._tensors)) if fragments is None else _native().tensors_of_fragments(
            os.fspath(config), [str(o) for o in overrides], [t.name for t in self._tensors],
            [t.shape for t in self._tensors], fragments)
        for i in needed:
            self._tensors[i].attach_host()
        self._mode = mode
        self._learner_id = learner_id
        device = [t for t in self._tensors if t.on_device]
        options = {
            "mode": mode, "learner_id": learner_id, "region": region, "bootstrap": _bootstrap(bootstrap),
            "connect_timeout": float(connect_timeout), "run_dir": os.fspath(run_dir) if run_dir else None,
            "metrics_port": int(metrics_port), "index": int(index), "learners": int(learners),
            "total_steps": int(total_steps or 0), "genesis_timeout": float(genesis_timeout),
            "log_every": int(log_every), "merger_endpoints": list(merger_endpoints), "client": "python",
            "batch": batch, "context": context, "fragments": fragments,
            "spill_dir": os.fspath(spill_dir) if spill_dir else None,
        }
        self._runtime = _native().Runtime(
            os.fspath(config), [str(o) for o in overrides], [t.name for t in self._tensors],
            [t.shape for t in self._tensors], [t.host for t in self._tensors],
            self._to_host if device else None, self._from_host if device else None, options)
        if not self._runtime.start():  # only a stop check ends start() early, and it raises
            self.close("signal")
            raise KeyboardInterrupt

    def _to_host(self, indices: list[int]) -> None:
        for i in indices:
            if self._tensors[i].on_device:
                self._tensors[i].to_host()

    def _from_host(self, indices: list[int]) -> None:
        for i in indices:
            if self._tensors[i].on_device:
                self._tensors[i].from_host()

    def _live(self, call: str):
        if self._closed:
            raise SessionClosedError(f"Session.{call}() after close(): open a new Session to rejoin the run")
        return self._runtime

    def step(self, tokens: int, loss: Optional[float] = None) -> None:
        """Tells the session that one inner step (one optimizer step) is done.

        Counts it; cuts the fragments that are due on the run's streaming schedule (their deltas
        are encoded here and sent in the background: this call never waits for the network);
        writes the global versions that arrived into the parameters (``diloco.adopt``: rebase
        keeps the progress not yet sent); sends a heartbeat when one is due. In a synchronous mode
        (``diloco.wait_steps >= 0``) it waits for the merges due, as synchronous DiLoCo does.

        Args:
            tokens: tokens (or samples) this step trained on, at least 1 and at most batch x
                context when the session declared them: a delta's weight counts them, so learners
                with bigger batches weigh more.
            loss: the step's training loss, for metrics and heartbeats (a float; a tensor is
                converted with ``float()``, which waits for the device).
        """
        runtime = self._live("step")
        if self._mode != "train":
            raise InvalidInputError("step() on an eval session: call poll() to follow the global versions")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise InvalidInputError(f"tokens must be a positive int (the tokens or samples the step trained on), "
                                    f"not {tokens!r}")
        runtime.step(tokens, None if loss is None else float(loss), None)

    def poll(self) -> int:
        """Writes the global versions that arrived into the parameters and sends a heartbeat when
        one is due; returns how many fragments took a new version. An eval session calls it in a
        loop; a training session may call it between steps."""
        return self._live("poll").poll()

    def record_eval(self, loss: float) -> None:
        """Records a held-out evaluation: an ``eval`` line in ``metrics.jsonl`` (in eval mode
        ``global_eval``, with the versions evaluated) and the ``eval_loss`` gauge."""
        self._live("record_eval").record_eval(float(loss))

    def close(self, reason: str = "budget") -> None:
        """Leaves the run: a ``stop`` line, the last heartbeat (the step reached; the learner
        counts as gone at once, and its id is free), then waits up to 10 s for the deltas still in
        flight. ``reason`` goes into the ``stop`` line ("budget", "signal", "error", ...).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._runtime is not None:
            self._runtime.close(reason)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close("budget")
        else:
            self.close("signal" if issubclass(kind, KeyboardInterrupt) else "error")

    def state_dict(self) -> dict[str, Any]:
        """What a restart needs to keep this learner's local progress: every fragment's base
        version, anchor, error-feedback residuals and counters, the step and the delta sequence
        numbers. Save it beside the model's and the optimizer's state (``torch.save`` takes it)."""
        runtime = self._live("state_dict")
        return {"format": _STATE_FORMAT, "run_id": runtime.run_id, "learner_id": self._learner_id,
                "fingerprint": runtime.fingerprint, "step": runtime.step_count, "state": runtime.save_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes back a :meth:`state_dict` of this learner, after the model's own parameters were
        restored from the same checkpoint. Versions the run made since are rebased onto the
        restored progress. Raises :class:`InvalidInputError` for a state of another run, model or
        learner."""
        runtime = self._live("load_state_dict")
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise InvalidInputError(f"not a Session.state_dict() (format {state.get('format') if isinstance(state, Mapping) else type(state).__name__!r}, "
                                    f"expected {_STATE_FORMAT!r})")
        saved = state.get("state")
        if not isinstance(saved, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"not a Session.state_dict(): its 'state' is {type(saved).__name__}, not bytes")
        runtime.load_state(bytes(saved))

    @contextlib.contextmanager
    def wrap_optimizer(self, optimizer: Any, tokens_per_step: int) -> Iterator[Any]:
        """Calls :meth:`step` after every ``optimizer.step()`` inside the ``with`` block, so the
        training loop needs no new line::

            with session.wrap_optimizer(opt, tokens_per_step=batch * context):
                for batch in loader: ...; opt.step(); opt.zero_grad()
        """
        original = optimizer.step

        def step(*args, **kwargs):
            result = original(*args, **kwargs)
            self.step(tokens=tokens_per_step)
            return result

        optimizer.step = step
        try:
            yield optimizer
        finally:
            del optimizer.step  # back to the class's method

    @property
    def step_count(self) -> int:
        """Inner steps done: a restarted learner continues from its last announced step."""
        return self._runtime.step_count

    @property
    def tokens(self) -> int:
        """Tokens counted by :meth:`step` in this process."""
        return self._runtime.tokens

    @property
    def versions(self) -> list[int]:
        """The global version each fragment's parameters come from."""
        return list(self._runtime.versions)

    @property
    def fingerprint(self) -> int:
        """The layout's fingerprint (names, shapes and order of the tensors, and the fragments)."""
        return self._runtime.fingerprint

    @property
    def run_id(self) -> str:
        return self._runtime.run_id

    @property
    def learner_id(self) -> str:
        return self._learner_id

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def fragments(self) -> list[list[str]]:
        """The tensors of each fragment, in wire order: a tensor's name, or ``"name[r0:r1]"`` for
        rows r0 to r1 - 1 of a tensor larger than a fragment should be, which several fragments share."""
        return self._runtime.fragments

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step {self.step_count}, versions {self.versions}"
        return f"Session(run={self.run_id!r}, learner={self._learner_id!r}, {len(self._tensors)} tensors, {state})"


def read_version(config: PathLike, *, version: Optional[int] = None, bootstrap: Optional[str] = None,
                 overrides: Sequence[str] = (), connect_timeout: float = 30.0,
                 timeout: float = 120.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rebuilds the global model at ``version`` (each fragment at min(version, its newest); None:
    the newest) from the run's logs, as ``diloco-replay rebuild`` does, bit for bit what the
    mergers published. Returns ``({name: float32 numpy array}, info)`` where info holds the
    run id, fingerprint, and per fragment the version and checksum."""
    tensors, info = _native().rebuild(os.fspath(config), [str(o) for o in overrides], _bootstrap(bootstrap),
                                      version, float(connect_timeout), float(timeout))
    return tensors, info


def load_version(config: PathLike, parameters: Parameters, *, version: Optional[int] = None,
                 bootstrap: Optional[str] = None, overrides: Sequence[str] = (), connect_timeout: float = 30.0,
                 timeout: float = 120.0) -> dict[str, Any]:
    """Writes a version of the global model (see :func:`read_version`) into ``parameters``
    (``model.named_parameters()`` or a mapping), which must be the run's tensors by name and
    shape. Returns the info of :func:`read_version`. Raises :class:`InvalidInputError` naming the
    first tensor that is missing, extra or of another shape."""
    values, info = read_version(config, version=version, bootstrap=bootstrap, overrides=overrides,
                                connect_timeout=connect_timeout, timeout=timeout)
    items = dict(parameters.items() if isinstance(parameters, Mapping) else parameters)

    def shape(t: Any) -> str:  # as the runtime's messages write a shape: [8,16]
        return "[" + ",".join(str(int(d)) for d in t.shape) + "]"

    for name, value in values.items():
        if name not in items:
            raise InvalidInputError(f"tensor '{name}' {shape(value)} of the run is not among the parameters given")
        if shape(items[name]) != shape(value):
            raise InvalidInputError(f"tensor '{name}' is {shape(value)} in the run, {shape(items[name])} here")
    for name in items:
        if name not in values:
            raise InvalidInputError(f"tensor '{name}' is not in the run (it has {len(values)} tensors)")
    for name, value in values.items():
        target = items[name]
        if _is_numpy(target):
            target[...] = value
        else:
            target.detach().copy_(target.new_tensor(value))
    return info
