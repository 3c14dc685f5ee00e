"""Bad input to a Session gets a typed error whose message names the problem (ARCHITECTURE.md
section 8, invariant 5: bad input never crashes a process and never changes state). Each test
runs against a live run whose version 0 is committed, and ends by checking that the merger still
runs and that the run's logs (the audit: deltas, merges, every fragment's versions and checksums)
are what they were before the bad input.
"""
from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import decoupled_diloco as dd
from decoupled_diloco.errors import InvalidInputError, SessionClosedError, UnavailableError


@pytest.fixture
def before(run, merger, layout) -> dict[str, Any]:
    """The run's audit once version 0 is committed (from the model of `layout(0)`)."""
    with run.session(layout(0), learner_id="genesis"):
        pass
    return run.audit()


def assert_run_unchanged(run, merger, before: dict[str, Any]) -> None:
    assert merger.alive, "the merger ended"
    assert run.audit() == before


@contextlib.contextmanager
def live(session) -> Iterator[None]:
    """Keeps `session` announcing itself during the block, as a training loop's calls do."""
    stop = threading.Event()

    def announce() -> None:
        while not stop.is_set():
            session.poll()
            time.sleep(0.2)

    thread = threading.Thread(target=announce)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(w1=np.zeros((4, 8), np.float32)), "tensor 'w1' is [8,8] in the run, [4,8] here"),
    (lambda p: p.update(w3=p.pop("w2")), "tensor 'w2' [8,8] of the run is missing here (6 tensors in the run, 6 here)"),
    (lambda p: p.pop("b2"), "tensor 'b2' [8] of the run is missing here (6 tensors in the run, 5 here)"),
    (lambda p: p.update(extra=np.zeros(3, np.float32)), "tensor 'extra' [3] is not in the run (6 tensors in the run, 7 here)"),
], ids=["shape", "name", "missing", "extra"])
def test_a_model_that_differs_from_the_run_is_refused_naming_the_tensor(run, merger, before, layout, change, message):
    """A learner with another model would send deltas no merger can apply: it must not join."""
    parameters = layout(1)
    change(parameters)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        run.session(parameters, learner_id="other")
    assert_run_unchanged(run, merger, before)


@pytest.mark.parametrize("tensor, dtype", [
    (np.zeros((8, 8), np.float64), "float64"),
    (torch.zeros(8, 8, dtype=torch.float16), "float16"),
], ids=["numpy-float64", "torch-float16"])
def test_a_tensor_that_is_not_float32_is_refused_naming_it_and_its_dtype(run, merger, before, layout, tensor, dtype):
    """The runtime reads and writes fp32 buffers in place: another dtype cannot be registered."""
    parameters = layout(1)
    parameters["w1"] = tensor
    with pytest.raises(InvalidInputError, match=f"tensor 'w1' is {dtype}"):
        run.session(parameters, learner_id="other")
    assert_run_unchanged(run, merger, before)


@pytest.mark.parametrize("tensor", [np.asfortranarray(np.zeros((8, 8), np.float32)), torch.zeros(8, 8).t()],
                         ids=["numpy-fortran-order", "torch-transposed"])
def test_a_tensor_that_is_not_contiguous_is_refused_naming_it(run, merger, before, layout, tensor):
    """Versions are written into the registered memory in wire order: a strided view would get them scrambled."""
    parameters = layout(1)
    parameters["w1"] = tensor
    with pytest.raises(InvalidInputError, match="tensor 'w1' is not contiguous"):
        run.session(parameters, learner_id="other")
    assert_run_unchanged(run, merger, before)


def test_a_config_with_another_fragment_count_is_refused_naming_both_counts(run, merger, before, layout):
    """The same tensors split another way make fragments the run's mergers do not hold."""
    with pytest.raises(InvalidInputError, match=re.escape("splits its tensors into 4 fragments, this learner into 2 "
                                                          "(diloco.fragments)")):
        run.session(layout(1), learner_id="other", overrides=["diloco.fragments=2"])
    assert_run_unchanged(run, merger, before)


def test_a_learner_id_held_by_a_live_session_is_refused_naming_it(run, merger, before, layout):
    """Two processes under one id would interleave their deltas' sequence numbers and resume points."""
    holder = run.session(layout(1), learner_id="us-0", region="us")
    with live(holder):
        run.wait_for_announcement("us-0")
        with pytest.raises(InvalidInputError, match="learner id 'us-0' is held by a live process"):
            run.session(layout(2), learner_id="us-0", region="us")
    holder.close()
    assert_run_unchanged(run, merger, before)


def test_a_learner_id_is_refused_as_soon_as_the_session_holding_it_has_started(run, merger, before, layout):
    """A launcher that starts one id twice by mistake starts both at once: the claim must hold then too."""
    holder = run.session(layout(1), learner_id="us-0", region="us")
    with live(holder), pytest.raises(InvalidInputError, match="learner id 'us-0' is held by a live process"):
        run.session(layout(2), learner_id="us-0", region="us")


def test_no_broker_is_unavailable_naming_the_address_and_the_way_out(run, merger, before, layout):
    """A wrong address must not hang a training script: the error comes after connect_timeout."""
    address = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(UnavailableError) as error:
        run.session(layout(1), learner_id="other", bootstrap=address, connect_timeout=1)
    assert time.monotonic() - started < 10
    assert f"no Kafka broker answered at {address}" in str(error.value)
    assert "scripts/broker start" in str(error.value) and "DILOCO_BOOTSTRAP" in str(error.value)
    assert_run_unchanged(run, merger, before)


def test_step_after_close_raises_session_closed(run, merger, before, layout):
    """A closed session has left the run (its id is free): a step would send deltas nobody expects."""
    session = run.session(layout(1), learner_id="other")
    session.close()
    with pytest.raises(SessionClosedError, match=re.escape("Session.step() after close()")):
        session.step(tokens=1)
    assert_run_unchanged(run, merger, before)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=4), "batch=4 and context=None: give both"),
    (dict(batch=0, context=8), "batch must be a positive int"),
    (dict(batch=4, context=2.5), "context must be a positive int"),
    (dict(batch=True, context=8), "batch must be a positive int"),
], ids=["batch-alone", "zero", "float", "bool"])
def test_a_bad_batch_or_context_is_refused_naming_it(run, merger, before, layout, kwargs, message):
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        run.session(layout(1), learner_id="other", **kwargs)
    assert_run_unchanged(run, merger, before)


def test_a_spill_dir_that_is_not_a_directory_is_refused_naming_it(run, merger, before, layout, tmp_path):
    for where in (tmp_path / "missing", tmp_path / "a-file"):
        if where.name == "a-file":
            where.write_text("")
        with pytest.raises(InvalidInputError, match=re.escape(f"the spill directory '{where}' is not a directory")):
            run.session(layout(1), learner_id="other", spill_dir=where)
    assert_run_unchanged(run, merger, before)


def test_a_step_of_more_tokens_than_the_declared_batch_x_context_is_refused_and_counts_nothing(run, merger, before,
                                                                                                 layout):
    """The mergers would refuse every delta of a learner whose steps claim more tokens than it
    declared: the session says so at the step that does, and counts nothing of it."""
    with run.session(layout(1), learner_id="other", batch=2, context=8) as session:
        session.step(tokens=16)
        with pytest.raises(InvalidInputError, match=re.escape(
                "a step of 17 tokens, more than the 2 sequences x 8 tokens this learner declared")):
            session.step(tokens=17)
        assert session.step_count == 1
        session.step(tokens=10)  # fewer is fine: shorter sequences
        assert session.step_count == 2


@pytest.mark.parametrize("state, message", [
    ("a string", "not a Session.state_dict()"),
    ({"format": "decoupled_diloco.session/1"}, "not a Session.state_dict()"),
    ({"format": "decoupled_diloco.session/1", "state": "not bytes"}, "not a Session.state_dict()"),
    ({"format": "decoupled_diloco.session/1", "state": b"\x00garbage"}, "not a saved state of this learner's run and model"),
], ids=["not-a-mapping", "no-state", "state-not-bytes", "corrupt-bytes"])
def test_load_state_dict_of_garbage_is_refused_and_changes_nothing(run, merger, before, layout, state, message):
    """A corrupt checkpoint must be refused before any of it is applied: the session goes on unchanged."""
    parameters = layout(1)
    session = run.session(parameters, learner_id="other")
    kept = {name: value.copy() for name, value in parameters.items()}
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        session.load_state_dict(state)
    assert session.step_count == 0 and session.versions == [0, 0, 0, 0]
    for name, value in parameters.items():
        np.testing.assert_array_equal(value, kept[name], err_msg=name)
    session.close()
    assert_run_unchanged(run, merger, before)


def test_load_state_dict_of_another_learner_is_refused_naming_both(run, merger, before, layout):
    """Another learner's progress would be sent twice, once by each."""
    first = run.session(layout(1), learner_id="eu-0")
    state = first.state_dict()
    first.close()
    second = run.session(layout(1), learner_id="eu-1")
    with pytest.raises(InvalidInputError, match="the saved state belongs to learner 'eu-0'") as error:
        second.load_state_dict(state)
    assert "this learner is 'eu-1'" in str(error.value)
    second.close()
    assert_run_unchanged(run, merger, before)


def test_load_version_into_another_model_is_refused_naming_the_tensor(run, merger, before, layout):
    """A model that cannot hold the run's tensors is left as it was."""
    parameters = layout(1)
    parameters["head"] = np.zeros((16, 8), np.float32)
    with pytest.raises(InvalidInputError, match=re.escape("tensor 'head' is [8,16] in the run, [16,8] here")):
        dd.load_version(run.config, parameters, bootstrap=run.bootstrap, overrides=run.overrides)
    for name, value in layout(1).items():
        if name != "head":
            np.testing.assert_array_equal(parameters[name], value, err_msg=name)
    assert not parameters["head"].any()
    assert_run_unchanged(run, merger, before)
