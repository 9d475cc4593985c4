"""The analysis against adversarial backends: every hidden late read is refused by ``audit``
with the backend, mode, buffer and reading op named; genuinely fine backends are accepted.

The backends live in ``tests/adversarial.py`` (shared with the lowering and runtime tests).
"""

from __future__ import annotations

from collections import Counter

import pytest
from returns.result import Failure, Success

from readfence.core import StageWriteError, audit
from readfence.graph import make_state
from tests.adversarial import CASES, Case, blinded
from tests.conftest import SMALL as CFG
from tests.conftest import first_of_each

STATE = make_state(CFG)


def _audit(case: Case):
    backend = case.build(STATE if case.captures else None)
    return backend, audit(backend, case.mode, cfg=CFG, state=STATE if case.captures else None)


@pytest.mark.parametrize("name", first_of_each([n for n, c in CASES.items() if c.verdict == "refused"
                                               and c.klass not in ("writes", "kept_write")],
                                              lambda n: CASES[n].klass))
def test_a_hidden_late_read_is_refused_naming_backend_mode_buffer_and_reader(name) -> None:
    case = CASES[name]
    backend, result = _audit(case)
    assert isinstance(result, Failure), f"{name}: accepted, but it reads {case.buffer} late"
    bad = result.failure()
    message = bad.message
    # the guilty node: the backend, or the node of its tree whose read makes its fence early
    assert bad.path.split("/")[0] == backend.name and f"{bad.path} in mode {case.mode.name}" in message
    assert f"buffer {bad.buffer!r}" in message
    assert bad.observed > bad.declared
    # the reader: a traced node in a stage, an escape at its line, a captured tensor, or an op the
    # audit's observer saw read the live buffer a kernel keeps
    assert ("last read by node" in message and "in stage body" in message) or (
        "stage body" in message and ("escape" in message or "captured tensor" in message)) or (
        "in stage body: a read only the observer sees" in message), message
    if bad.buffer != case.buffer:  # an unfaithful stage reads every buffer: ours is among them
        assert bad.report.observed[case.buffer] > bad.report.declared[case.buffer]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.klass == "writes" and c.verdict == "refused"])
def test_a_write_through_any_view_or_op_is_an_error_naming_stage_buffer_and_op(name) -> None:
    case = CASES[name]
    with pytest.raises(StageWriteError) as info:
        _audit(case)
    e = info.value
    assert e.backend == name and e.stage == "prepare_in_graph"
    assert e.buffer in ("seq_lens", "req_to_token") and e.op
    assert "adversarial.py" in e.source, e.source  # the user's line
    if name == "write_custom_unknown":
        assert "mutates_args='unknown'" in str(e) and "mutates_args=()" in str(e)
    if name == "write_custom_undeclared":
        assert "bytes changed" in str(e)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.klass == "kept_write"])
def test_a_write_by_a_kernel_through_a_reference_it_keeps_is_an_error_naming_the_run_that_saw_it(name) -> None:
    # no trace sees it (no argument is the buffer); the audit's observer runs the kernel under
    # itself, on the live buffers, and sees the write
    case = CASES[name]
    with pytest.raises(StageWriteError) as info:
        _audit(case)
    e = info.value
    assert (e.backend, e.stage, e.buffer) == (name, "body", case.buffer), str(e)
    assert "observer run" in str(e) and "saw it written inside kernel" in str(e) and "adversarial.py" in e.source, str(e)


@pytest.mark.parametrize("name", first_of_each([n for n, c in CASES.items() if c.verdict in ("accepted", "invisible")],
                                              lambda n: CASES[n].klass))
def test_fine_backends_are_accepted(name) -> None:
    # precision: snapshots, copies crossing into the graph and honest declarations pass; a kernel
    # reading memory it kept before anything watched ("invisible") is accepted too: no analysis
    # can see its read
    _, result = _audit(CASES[name])
    assert isinstance(result, Success), result.failure().message


def test_the_adversarial_set_covers_every_class_with_several_variants() -> None:
    per_class = Counter(c.klass for c in CASES.values())
    assert per_class["views"] >= 10 and per_class["captured"] >= 6 and per_class["writes"] >= 5
    assert {"baked", "unfaithful", "conditional", "shape", "custom_op", "crossing", "fine"} <= set(per_class)
    verdicts = Counter(c.verdict for c in CASES.values())
    assert verdicts["refused"] >= 37 and verdicts["accepted"] >= 12 and verdicts["invisible"] == 1


def test_a_captured_live_buffer_is_unknown_without_the_live_state() -> None:
    # without the state it captured, its memory could be any shared buffer: every buffer UNKNOWN
    backend = CASES["closure_declared_post"].build(STATE)
    bad = audit(backend, CASES["closure"].mode, cfg=CFG).failure()
    assert bad.observed.name == "UNKNOWN" and "captured tensor" in bad.message


def test_a_hole_in_the_static_analysis_is_caught_by_the_observer_and_reported_as_a_bug(monkeypatch) -> None:
    # Break the analysis on purpose: the schema oracle forgets that split pieces alias their
    # source and the memory probe sees nothing. The trace then misses the body read of
    # seq_lens; the runtime observer, which trusts neither, still sees it.
    import readfence.core.tracing._alias as alias
    from readfence.core import ForwardMode, clear_trace_cache

    real = alias.op_aliasing

    class Blind:  # a view whose pieces alias nothing
        name, writes, outputs, opaque, is_view, metadata_args = "split", (), ((),), False, True, ()

    def forgetful(op):
        return Blind() if "split" in str(op) else real(op)

    monkeypatch.setattr(alias, "op_aliasing", forgetful)
    blinded(monkeypatch)  # the memory probe sees nothing
    clear_trace_cache()
    try:
        backend = CASES["split"].build(None)
        blind = audit(backend, ForwardMode.DECODE, cfg=CFG, batch_sizes=[2], observe_steps=0)
        assert isinstance(blind, Success)  # the broken analysis alone accepts the early fence
        result = audit(backend, ForwardMode.DECODE, cfg=CFG, batch_sizes=[2])
        assert isinstance(result, Failure) and result.failure().buffer == "seq_lens"
        (bug,) = [d for d in result.failure().report.disagreements if d.buffer == "seq_lens"]
        assert "static analysis missed a read (a bug in the analysis)" in bug.message
        assert bug.stage == "body" and bug.op == "aten.cat.default"
    finally:
        clear_trace_cache()
