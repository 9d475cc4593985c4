"""The adapter on objects it has never seen (classes written here against the contract alone),
through readfence's own audit, lower, run loop and verify, and through the engine layer's."""

from __future__ import annotations

import pytest
import torch
from returns.pipeline import is_successful

from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, CapturedStateError, ForwardMode, audit
from readfence.effects import ReadEnd
from readfence.engine import RUNNER, adapt, audit_engine, verify_engine
from readfence.graph import LoopOptions, Policy, make_state, run_overlapped, run_serial

from .classes import (
    ByMode,
    ByModeKeepsAView,
    ForgetfulWrapper,
    HostBounds,
    KeepsAView,
    KeptCopies,
    RenamedSlots,
    StaticBuffers,
    StaticBuffersInGraph,
)
from .conftest import CFG

M = ForwardMode
PRE, IN, POST = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY


def _verdicts(report, path=None):
    return {(r.buffer): (r.verdict, r.source, r.truth) for r in report.rows() if path is None or r.backend == path}


def test_state_kept_in_init_is_read_where_the_code_reads_it_and_lowered_on_that_state(dev):
    engine = adapt(KeptCopies, cfg=CFG)
    # readfence's own audit takes it (the object's kept references matched against its state)
    assert audit(engine, M.DECODE, cfg=CFG, batch_sizes=[2], state=engine.state).map(lambda r: r.sound).unwrap()
    serial = run_serial(engine, steps=4, batch_size=2, cfg=CFG, state=engine.state)
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        run = run_overlapped(engine, steps=4, policy=policy, device=dev, batch_size=2, cfg=CFG, state=engine.state)
        assert run.matches(serial) and run.violations == (), policy
    # another state: the object still reads the one it was built over, and lowering says so
    with pytest.raises(CapturedStateError, match="pass the state the backend keeps references to") as refused:
        run_overlapped(engine, steps=1, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG)
    # what to pass, not a change to the object's class (it keeps its references as the engine's contract does)
    assert "state=engine.state" in str(refused.value)
    assert "through its arguments" not in str(refused.value)
    other = make_state(CFG)
    rebound = engine.bind(other)
    assert rebound.state is other and rebound.object is not engine.object
    assert rebound.object.table is other["shared"]["req_to_token"]
    serial = run_serial(rebound, steps=4, batch_size=2, cfg=CFG, state=other)
    run = run_overlapped(rebound, steps=4, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, state=other)
    assert run.matches(serial) and run.violations == ()


def test_a_view_kept_across_the_boundary_is_a_late_read_named_by_method_and_op(dev):
    engine = adapt(KeepsAView, cfg=CFG)
    failure = audit(engine, M.DECODE, cfg=CFG, batch_sizes=[2], state=engine.state).failure()
    assert (failure.buffer, failure.declared, failure.observed) == ("req_to_token", PRE, POST)
    report = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).failure().report
    (row,) = report.unsound()
    assert (row.buffer, row.method, row.op, row.source) == ("req_to_token", "forward", "aten.index_select.default",
                                                            "traced")
    assert "classes.py" in row.where and "indices_now" in row.where
    result = verify_engine(engine, device=dev, policies=[Policy.PER_BUFFER], steps=3, batch_size=2).failure().report
    per_buffer, runner = result.rows
    assert (per_buffer.finding.kind, per_buffer.finding.evidence) == ("unsound declaration", "audit")
    # the engine's runner trusts the declaration: the read after its fence is caught at run time
    assert (runner.name, runner.finding.kind, runner.finding.buffer, runner.finding.stage) == (
        RUNNER, "late read", "req_to_token", "body")


def test_data_dependent_shapes_are_audited_by_observation_and_run_under_the_runner(dev):
    engine = adapt(HostBounds, cfg=CFG)
    report = audit_engine(engine, M.DECODE, batch_sizes=[1, 2], steps=2).unwrap()
    assert _verdicts(report)["req_to_token"] == ("exact", "observed", POST)
    assert _verdicts(report)["seq_lens"] == ("exact", "observed", POST)
    node = report.find("HostBounds", M.DECODE)
    assert {stage for stage, _, _ in node.untraceable} == {PREPARE_OUT_GRAPH, BODY}
    # both stages run as Python in the step: every buffer until POST_REPLAY, which it declares
    assert node.lowering == ""
    assert "cover only the paths that ran" in report.table()
    result = verify_engine(engine, device=dev, steps=3, batch_size=2).unwrap()
    assert [r.name for r in result.rows if r.clean] == [*(p.name for p in Policy), RUNNER], str(result)
    # declared before the replay's end, the same class is refused by readfence's lowering
    early = engine.redeclared(M.DECODE, ReadEnd.IN_REPLAY)
    refused = audit_engine(early, M.DECODE, batch_sizes=[2], steps=1).failure().report.find("HostBounds", M.DECODE)
    assert "COARSE only" in refused.lowering and "POST_REPLAY in it" in refused.lowering


def test_a_buffer_the_engine_keeps_under_its_own_name_is_found_through_the_layout(dev):
    engine = adapt(RenamedSlots, cfg=CFG, buffers={"state_slots": "mamba.indices"})
    assert engine.object.indices_of is engine.state["shared"]["state_slots"]
    report = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).unwrap()
    assert _verdicts(report)["state_slots"] == ("exact", "traced", IN)
    assert _verdicts(report)["swa_map"] == ("conservative", "traced", ReadEnd.NONE)
    result = verify_engine(engine, device=dev, policies=[Policy.EXACT], steps=3, batch_size=2).unwrap()
    assert result.ok, str(result)


def test_a_wrapper_that_does_not_delegate_is_unsound_while_its_children_are_sound(dev):
    engine = adapt(ForgetfulWrapper, cfg=CFG)
    report = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).failure().report
    assert [(r.backend, r.buffer) for r in report.unsound()] == [("ForgetfulWrapper", "req_to_token")]
    child = "ForgetfulWrapper/attn_backend_list[1]/KeepsAView"
    assert _verdicts(report, child)["req_to_token"] == ("exact", "traced", POST)
    result = verify_engine(engine, device=dev, policies=[], steps=3, batch_size=2).failure().report
    assert result.row(RUNNER).finding.kind == "late read"


def test_a_host_read_in_forward_is_an_escape_lowered_coarse_only(dev):
    class Branches(KeptCopies):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if torch.equal(q, q):  # data-dependent control flow: the stage runs as Python
                return super().forward(q, k, v, layer, forward_batch, save_kv_cache)
            return q

    engine = adapt(Branches, cfg=CFG)
    report = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).unwrap()
    assert _verdicts(report)["req_to_token"][::2] == ("exact", PRE)
    node = report.find("Branches", M.DECODE)
    assert any("host read by aten.equal" in why for _, why, _ in node.untraceable), node.untraceable
    assert "fences it COARSE only" in node.lowering
    result = verify_engine(engine, device=dev, policies=[Policy.COARSE], steps=2, batch_size=2).unwrap()
    assert result.ok, str(result)


def test_readfence_lowering_and_the_runner_see_the_very_tensors_the_object_reads(dev):
    # poison lands in the engine's own buffers: an early fence changes what the object computes
    engine = adapt(KeepsAView, cfg=CFG)
    early = engine.redeclared(M.DECODE, PRE)
    result = verify_engine(engine, device=dev, policies=[], steps=2, batch_size=2).failure().report
    assert result.row(RUNNER).finding.evidence == "observer"
    from readfence.graph import verify

    caught = verify(early, M.DECODE, policy=Policy.PER_BUFFER, steps=2, batch_size=2, device=dev, cfg=CFG,
                    state=engine.state,
                    options=LoopOptions(checks={"poison", "guard"}, UNSAFE_skip_soundness_check=True))
    assert not is_successful(caught) and caught.failure().evidence == "poison"


def test_a_buffer_outside_reads_is_a_row_only_where_it_is_read_and_then_undeclared():
    from readfence.engine.reference import TritonBackend

    engine = adapt(TritonBackend, cfg=CFG, reads=["req_to_token"])
    rows = {r.buffer: r for r in audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).failure().report.rows()}
    assert set(rows) == {"req_to_token", "seq_lens"}  # swa_map and state_slots: neither declared nor read
    assert rows["req_to_token"].verdict == "exact"
    lens = rows["seq_lens"]  # the class reads it, the declaration does not cover it
    assert (lens.declared, lens.truth, lens.verdict, lens.method) == (ReadEnd.NONE, IN, "unsound",
                                                                     "init_forward_metadata_in_graph")


def test_a_buffer_the_engine_lacks_is_the_runners_copy_and_no_row(dev):
    from readfence.engine.reference import TritonBackend

    engine = adapt(TritonBackend, cfg=CFG, buffers={"seq_lens": None, "swa_map": None})
    assert not hasattr(engine.runner.req_to_token_pool, "seq_lens")
    # the runner copies the batch's lengths before the replay; they are released with the rest
    assert engine.read_effect(M.DECODE)["seq_lens"] is IN
    report = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).unwrap()
    assert {r.buffer for r in report.rows()} == {"req_to_token", "state_slots"} and report.sound
    result = verify_engine(engine, device=dev, policies=[Policy.EXACT], steps=3, batch_size=2).unwrap()
    assert result.ok, str(result)
    with pytest.raises(ValueError, match="req_to_token'\\] cannot be None"):
        adapt(TritonBackend, cfg=CFG, buffers={"req_to_token": None})


def _tracing() -> bool:
    """Whether readfence's tracer is running the code: recording it op by op, or make_fx."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from readfence.core.tracing._record import GraphRecorder

    return get_proxy_mode() is not None or any(isinstance(m, GraphRecorder) for m in _get_current_dispatch_mode_stack())


def test_the_engines_own_exception_only_under_tracing_is_raised_not_observed():
    from readfence.engine import EngineError

    class TraceOnlyBug(KeptCopies):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if _tracing():
                raise KeyError("plan")  # a contract bug that shows only when traced
            return super().forward(q, k, v, layer, forward_batch, save_kv_cache)

    with pytest.raises(EngineError, match=r"TraceOnlyBug.forward raised KeyError in DECODE: 'plan'") as caught:
        audit_engine(adapt(TraceOnlyBug, cfg=CFG), M.DECODE, batch_sizes=[2], steps=1)
    assert caught.value.method == "forward" and "test_adapter.py" in caught.value.where


def test_torch_refusing_to_trace_names_the_stage_and_line_with_its_whole_message():
    from torch.fx.proxy import TraceError

    message = "this kernel cannot be traced: " + "x" * 300 + " (end of message)"

    class Refused(KeptCopies):
        def init_forward_metadata_in_graph(self, forward_batch):
            if _tracing():
                raise TraceError(message)
            super().init_forward_metadata_in_graph(forward_batch)

    report = audit_engine(adapt(Refused, cfg=CFG), M.DECODE, batch_sizes=[2], steps=1).unwrap()
    node = report.find("Refused", M.DECODE)
    ((stage, why, source),) = node.untraceable
    assert stage == PREPARE_IN_GRAPH and why.endswith("(end of message)") and "test_adapter.py" in source
    assert node.lowering.startswith("readfence cannot lower it with any policy: init_forward_metadata_in_graph")
    assert {r.source for r in node.rows} == {"observed"}


@pytest.mark.parametrize("cls", [StaticBuffers, ByMode], ids=lambda c: c.__name__)
def test_engine_state_as_engines_keep_it_is_lifted_and_runs_bit_identical_to_serial(dev, cls):
    # static buffers allocated on first use and refilled in place; metadata under the mode enum
    engine = adapt(cls, cfg=CFG)
    assert audit(engine, M.DECODE, cfg=CFG, state=engine.state).map(lambda r: r.sound).unwrap()
    report = audit_engine(engine, M.DECODE, batch_sizes=[1, 2], steps=2).unwrap()
    assert {b: v[:2] for b, v in _verdicts(report).items()} == {
        "req_to_token": ("exact", "traced"), "seq_lens": ("exact", "traced"), "swa_map": ("conservative", "traced"),
        "state_slots": ("conservative", "traced")}, report.table()
    serial = run_serial(engine, steps=4, batch_size=2, cfg=CFG, state=engine.state)
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        run = run_overlapped(engine, steps=4, policy=policy, device=dev, batch_size=2, cfg=CFG, state=engine.state)
        assert run.matches(serial) and run.violations == (), policy
    result = verify_engine(engine, device=dev, policies=[Policy.EXACT], steps=3, batch_size=2).unwrap()
    assert result.ok, str(result)


@pytest.mark.parametrize(("cls", "truth"), [(StaticBuffersInGraph, IN), (ByModeKeepsAView, POST)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_same_state_read_after_its_declared_end_is_refused(cls, truth):
    engine = adapt(cls, cfg=CFG)
    failure = audit(engine, M.DECODE, cfg=CFG, batch_sizes=[2], state=engine.state).failure()
    assert (failure.path, failure.buffer, failure.declared, failure.observed) == (
        cls.__name__, "req_to_token", PRE, truth), failure.message
    rows = {r.buffer: r.truth for r in audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).failure().rows}
    assert rows["req_to_token"] is truth, rows
