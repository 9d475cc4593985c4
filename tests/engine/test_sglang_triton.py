"""SGLang 0.5.23's TritonAttnBackend, as shipped, with its real kernels: audited and verified on CPU.

Its kernels run in triton's interpreter (``TRITON_INTERPRET=1``): its page table is read by the
triton kernel ``create_flashinfer_kv_indices_triton`` in ``init_forward_metadata_out_graph``, which
only a launch made an op shows. No shim but the torchvision (and sgl_kernel) import stand-ins:
SGLang's own mode enum, layers, runtime context, ``ModelConfig``, KV index translator, forward-batch
fields and capture mode. Skipped, with the reason, where SGLang or triton is not installed. The
backends run a one-layer model with two kv splits (``sglang_engines.TRITON_CFG``, ``TRITON_ARGS``):
each interpreted program is a whole kernel run. The verify runs are few and the later variants
``slow``; the CLI test audits the class by name as shipped.
"""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode, bind, trace
from readfence.core.internal import launches_unseen
from readfence.effects import ReadEnd
from readfence.engine import RUNNER, audit_engine, verify_engine
from readfence.graph import Policy

from . import sglang_engines as sg


@pytest.fixture(autouse=True, scope="module")
def _sglangs_triton_backend() -> None:
    """Skips where SGLang's Triton backend cannot run: asked here, not at collection, so that only a
    run of these tests imports SGLang."""
    if sg.TRITON_REASON:
        pytest.skip(sg.TRITON_REASON)


M = ForwardMode
PRE, IN, POST, UNKNOWN = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN
KERNEL = "triton_kernel.create_flashinfer_kv_indices_triton.default"


def _audit(engine, mode=M.DECODE):
    return audit_engine(engine, mode, batch_sizes=[2], steps=1)


def _rows(report):
    return [(r.backend, r.mode, r.buffer, r.declared, r.truth, r.source, r.method, r.op) for r in report.rows()]


@pytest.fixture(scope="module")
def fresh_audits():
    """The shipped backend's audit in each mode, each of an object built for it: audited once for the
    tests that read them."""
    return {mode: _audit(sg.triton_attn(), mode).unwrap() for mode in (M.EXTEND, M.TARGET_VERIFY, M.DECODE)}


@pytest.mark.parametrize(("mode", "declared"), [(M.DECODE, IN), (M.TARGET_VERIFY, IN), (M.EXTEND, UNKNOWN)])
def test_the_shipped_backend_reads_its_page_table_in_a_kernel_before_the_replay(mode, declared, fresh_audits):
    report = fresh_audits[mode]
    assert _rows(report) == [("TritonAttnBackend", mode, "req_to_token", declared, PRE, "traced",
                              "init_forward_metadata_out_graph", KERNEL)], report.table()
    assert report.sound and "UNTRACEABLE" not in report.table(), report.table()


def test_an_honest_subclass_is_exact_and_a_late_one_is_refused_naming_the_kernel_and_caught(dev):
    (row,) = _audit(sg.honest_triton()).unwrap().rows()
    assert (row.declared, row.truth, row.verdict) == (PRE, PRE, "exact")
    late = sg.late_triton()
    report = _audit(late).failure().report
    (row,) = report.unsound()
    assert (row.declared, row.truth, row.method, row.op) == (PRE, POST, "forward", KERNEL)
    assert "sglang_engines.py" in row.where and "in forward_decode" in row.where
    # readfence's fences refuse the declaration; the engine's runner trusts it and reads late
    exact, runner = verify_engine(late, device=dev, policies=[Policy.EXACT], steps=2,
                                  batch_size=2).failure().report.rows
    assert (exact.finding.kind, exact.finding.evidence) == ("unsound declaration", "audit")
    assert (runner.finding.kind, runner.finding.buffer, runner.finding.stage) == ("late read", "req_to_token", "body")
    assert "create_flashinfer_kv_indices_triton" in runner.finding.op, str(runner.finding)


@pytest.mark.slow
def test_after_other_modes_the_shipped_backend_verifies_clean_under_joined_exact_and_the_engines_runner(
        dev, fresh_audits):
    engine = sg.triton_attn()
    before = [_rows(_audit(engine, mode).unwrap()) for mode in (M.EXTEND, M.TARGET_VERIFY, M.DECODE)]
    fresh = [_rows(fresh_audits[mode]) for mode in (M.EXTEND, M.TARGET_VERIFY, M.DECODE)]
    assert before == fresh  # the verdicts do not depend on what was audited before on the same object
    # the replayed forward reads what its own mode's capture left on the object, not the last mode's
    # (JOINED is SGLang's fence, EXACT the finest; every policy is verified in EXTEND below)
    result = verify_engine(engine, device=dev, policies=[Policy.JOINED, Policy.EXACT], steps=2, batch_size=2).unwrap()
    assert [r.name for r in result.rows] == [Policy.JOINED.name, Policy.EXACT.name, RUNNER]
    assert result.ok, str(result)


@pytest.mark.slow
def test_target_verify_verifies_clean(dev):
    result = verify_engine(sg.triton_attn(), M.TARGET_VERIFY, device=dev, policies=[Policy.EXACT], steps=2,
                           batch_size=2).unwrap()
    assert result.ok, str(result)


@pytest.mark.parametrize(("make", "children"), [
    pytest.param(sg.tbo_triton, ["primary", "children[0]", "children[1]"], marks=pytest.mark.slow),
    pytest.param(sg.hybrid_linear_triton, ["full_attn_backend", "linear_attn_backend"], marks=pytest.mark.slow),
])
def test_the_wrappers_over_triton_children_delegate_and_verify_clean(make, children, dev):
    engine = make()
    assert [name for name, _ in engine.kids] == children
    report = _audit(engine).unwrap()
    assert report.sound, report.table()
    assert report.find(engine.name, M.DECODE).delegation.startswith("delegates"), report.table()
    assert {r.truth for r in report.rows()} == {PRE}
    result = verify_engine(engine, device=dev, policies=[Policy.EXACT], steps=2, batch_size=2).unwrap()
    assert result.ok, str(result)


def test_a_launch_readfence_does_not_see_makes_the_page_table_unknown_as_the_escape_of_its_pointers():
    with launches_unseen():  # as on a GPU: the launcher takes each argument's pointer in Python
        report = _audit(sg.triton_attn()).failure().report
    (row,) = report.rows()
    assert (row.truth, row.source, row.verdict) == (UNKNOWN, "observed", "unsound")
    assert "escapes the tracer (data_ptr() at" in report.table() and "kv_index_translator.py" in report.table()


@pytest.mark.slow
def test_the_cli_audits_sglangs_triton_backend_by_name():
    from click.testing import CliRunner

    from readfence.cli import main

    result = CliRunner().invoke(main, ["audit", "--engine", "sglang.srt.layers.attention.triton_backend:TritonAttnBackend",
                                       "--mode", "decode", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert "TritonAttnBackend  DECODE  req_to_token  IN_REPLAY  PRE_REPLAY" in result.output, result.output


# -- EXTEND: a mode the engine runs eagerly, every stage its Python ------------------------------
@pytest.mark.slow
def test_extend_runs_every_stage_as_python_and_the_shipped_backend_verifies_clean_under_every_policy(dev):
    engine = sg.triton_attn()
    extend = trace(engine, M.EXTEND, cfg=engine.cfg, batch_size=2)
    decode = trace(engine, M.DECODE, cfg=engine.cfg, batch_size=2)
    assert [s.runs_python for s in extend] == [True, True, True], "EXTEND is not replayed: all Python"
    assert [s.runs_python for s in decode] == [True, False, False], "DECODE replays its in-graph stages"
    # its metadata's shape follows the prefix lengths (kv_indices: their sum), which a graph cannot hold
    result = verify_engine(engine, M.EXTEND, device=dev, policies=list(Policy), steps=2, batch_size=2).unwrap()
    assert [r.name for r in result.rows] == [*(p.name for p in Policy), RUNNER]
    assert result.ok, str(result)


@pytest.mark.slow
def test_in_extend_an_honest_early_declaration_is_poisoned_clean_and_a_late_kernel_read_refused_and_caught(dev):
    # the declaration's fence (JOINED) and the engine's runner release the page table before the forward,
    # poisoning it there: a read in the forward would change the outputs
    honest = verify_engine(sg.honest_triton(), M.EXTEND, device=dev, policies=[Policy.JOINED], steps=2,
                           batch_size=2).unwrap()
    assert honest.ok, str(honest)
    assert [("req_to_token" in r.poisoned) for r in honest.rows] == [True, True], str(honest)
    late = sg.late_triton()
    (row,) = _audit(late, M.EXTEND).failure().report.unsound()
    assert (row.declared, row.truth, row.method, row.op) == (PRE, POST, "forward", KERNEL)
    assert "in forward_extend" in row.where, row.where
    exact, runner = verify_engine(late, M.EXTEND, device=dev, policies=[Policy.EXACT], steps=2,
                                  batch_size=2).failure().report.rows
    assert (exact.finding.kind, exact.finding.evidence) == ("unsound declaration", "audit")
    assert (runner.finding.kind, runner.finding.buffer, runner.finding.stage) == ("late read", "req_to_token", "body")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE])
def test_a_buffer_allocated_on_first_use_is_the_backends_own_and_an_extend_step_verifies_clean(mode, dev):
    engine = sg.lazy_triton()
    program = bind(trace(engine, mode, cfg=engine.cfg, batch_size=2), engine.state)
    # the object's own state, refilled in place: no per-step output, no constant of a trace
    assert not [n for s in program for n in s.graph.outputs if "lazy_indices" in n], [s.graph.outputs for s in program]
    assert all(c.usable for c in program.captured()), program.captured()
    if mode is M.EXTEND:  # run end to end where the warm-up allocates it (in DECODE the capture-time calls do)
        result = verify_engine(engine, mode, device=dev, policies=[Policy.EXACT], steps=2, batch_size=2).unwrap()
        assert result.ok, str(result)


@pytest.mark.slow
def test_a_view_of_the_page_table_kept_on_first_use_is_a_read_of_it_refused_and_caught(dev):
    engine = sg.lazy_view_triton()
    (row,) = _audit(engine, M.EXTEND).failure().report.unsound()
    assert (row.declared, row.truth, row.op) == (PRE, POST, KERNEL)
    exact, runner = verify_engine(engine, M.EXTEND, device=dev, policies=[Policy.EXACT], steps=2,
                                  batch_size=2).failure().report.rows
    assert (exact.finding.kind, exact.finding.evidence) == ("unsound declaration", "audit")
    assert (runner.finding.kind, runner.finding.buffer) == ("late read", "req_to_token"), str(runner.finding)
