"""SGLang 0.5.23's own attention backends, as shipped, audited and verified on CPU with no shim.

Their own classes, built by SGLang's profile (its ForwardMode, RadixAttention layers, its runtime
context published from ServerArgs): torch-native, and the wrappers TBO, Hybrid, HybridLinear,
MiniMaxHybrid and DotsHybrid over children CPU can run. Skipped only where SGLang's modules
cannot be imported.
"""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode
from readfence.effects import ReadEnd
from readfence.engine import RUNNER, EngineError, audit_engine, sglang_profile, verify_engine
from readfence.graph import Policy

from . import sglang_engines as sg


@pytest.fixture(autouse=True, scope="module")
def _sglang() -> None:
    """Skips where SGLang cannot be imported: asked here, not at collection, so that only a run of
    these tests imports SGLang."""
    if not sg.MODULES:
        pytest.skip(sg.REASON or "SGLang is not installed")


M = ForwardMode
PRE, IN, POST, UNKNOWN = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN


def _audit(engine, mode=M.DECODE):
    return audit_engine(engine, mode, batch_sizes=[2], steps=1)


@pytest.fixture(scope="module")
def native():
    return sg.torch_native()


def test_the_object_is_handed_sglangs_own_modes_with_every_predicate(native):
    sglang_modes = sg.MODULES["base_attn_backend"].ForwardMode
    modes = native.binding.modes
    assert modes.cls is sglang_modes
    assert modes.engine(M.DRAFT_EXTEND) is sglang_modes.DRAFT_EXTEND_V2
    assert modes.engine(M.TARGET_VERIFY).is_extend() and not modes.engine(M.DRAFT_EXTEND).is_extend()
    assert modes.engine(M.EXTEND).is_extend_without_speculative()
    # the base class's prefill resolution compares with SGLang's enum: it reaches the declaration
    late = sg.late_native()
    assert late.declared_end(M.EXTEND) is POST
    early = sg.early_prefill()
    assert early.declared_end(M.EXTEND) is PRE and early.declared_end(M.DECODE) is POST


def test_torch_native_as_shipped_traces_with_its_tensor_slice_bound_and_its_unused_declaration_is_said(native, dev):
    report = _audit(native).unwrap()  # unsound, but unused: not a failure
    (row,) = report.rows()  # only the page table: SGLang's pools share nothing else with the backend
    assert (row.buffer, row.declared, row.truth, row.op, row.used) == ("req_to_token", IN, POST,
                                                                      "aten.index.Tensor", False)
    assert report.sound and [r.buffer for r in report.unused()] == ["req_to_token"]
    node = report.find("TorchNativeAttnBackend", M.DECODE)
    assert "never graph-replays" in node.unused and "COARSE only" in node.lowering
    assert any("torch_native_backend.py" in source for _, _, source in node.untraceable)
    # lowered end to end: COARSE runs clean, readfence's other fences are refused, and the engine's
    # runner (eager decode: the coarse barrier) publishes nothing early
    result = verify_engine(native, device=dev, policies=[Policy.COARSE, Policy.EXACT], steps=2,
                           batch_size=2).failure().report
    coarse, exact, runner = result.rows
    assert coarse.clean and runner.clean and runner.name == RUNNER
    assert (exact.finding.kind, exact.finding.buffer, exact.finding.evidence) == (
        "unsound declaration", "req_to_token", "audit")


def test_torch_native_prefill_runs_its_eager_entry_point_and_resolves_per_batch(native, dev):
    report = _audit(native, M.EXTEND).unwrap()
    node = report.find("TorchNativeAttnBackend", M.EXTEND)
    assert node.prefill == ((2, UNKNOWN),) and node.unused == ""
    (row,) = node.rows
    assert (row.per_batch, row.declared, row.truth, row.verdict) == (True, UNKNOWN, POST, "conservative")
    result = verify_engine(native, M.EXTEND, device=dev, policies=[Policy.EXACT], steps=2, batch_size=2).unwrap()
    assert result.ok, str(result)


def test_an_early_prefill_declaration_on_a_real_subclass_is_unsound():
    report = _audit(sg.early_prefill(), M.EXTEND).failure().report
    (row,) = report.unsound()
    assert (row.per_batch, row.declared, row.truth, row.buffer, row.method) == (
        True, PRE, POST, "req_to_token", "forward")


def test_the_seeds_bug_on_the_real_tbo_backend(dev):
    shipped = _audit(sg.tbo()).unwrap()
    assert shipped.sound and shipped.find("tbo", M.DECODE).delegation.startswith("delegates: declares POST_REPLAY")
    assert [p for p, _ in sg.tbo().walk()] == ["tbo", "tbo/primary/LateNative", "tbo/children[0]/LateNative",
                                               "tbo/children[1]/LateNative"]
    forgetful = sg.forgetful_tbo()
    report = _audit(forgetful).failure().report
    (row,) = report.unsound()
    assert (row.backend, row.buffer, row.declared, row.truth, row.method, row.op) == (
        "forgetful_tbo", "req_to_token", IN, POST, "forward", "aten.index.Tensor")
    assert report.find("forgetful_tbo", M.DECODE).delegation.startswith("does not delegate: declares IN_REPLAY")
    assert "UNSOUND: forgetful_tbo in DECODE: req_to_token declared IN_REPLAY" in report.table()
    # the engine's runner trusts the declaration: the late read is caught where it happens
    result = verify_engine(forgetful, device=dev, policies=[Policy.EXACT], steps=2, batch_size=2).failure().report
    exact, runner = result.rows
    assert (exact.finding.kind, exact.finding.evidence) == ("unsound declaration", "audit")
    assert (runner.finding.kind, runner.finding.buffer, runner.finding.stage) == ("late read", "req_to_token", "body")


@pytest.mark.parametrize(("make", "children"), [
    (sg.hybrid, ["prefill_backend", "decode_backend"]),
    (sg.hybrid_linear, ["full_attn_backend", "linear_attn_backend"]),
    (sg.minimax, ["dense", "sparse"]),
])
def test_each_wrapper_finds_its_children_where_it_keeps_them_and_delegates(make, children):
    engine = make()
    assert [name for name, _ in engine.kids] == children
    report = _audit(engine).unwrap()
    assert report.sound, report.table()
    assert report.find(engine.name, M.DECODE).delegation.startswith(("delegates", "selects")), report.table()


def test_dots_hybrid_does_not_delegate_its_declaration():
    report = _audit(sg.dots()).failure().report
    node = report.find("dots", M.DECODE)
    assert node.delegation.startswith("does not delegate: declares IN_REPLAY, earlier than its children")
    assert [(r.backend, r.buffer) for r in report.unsound()] == [("dots", "req_to_token")]


def test_the_engines_own_exception_while_tracing_is_raised_not_observed():
    with pytest.raises(EngineError, match=r"BrokenNative.forward raised KeyError in DECODE: 'decode_plan'") as caught:
        _audit(sg.broken())
    assert caught.value.method == "forward" and "sglang_engines.py" in caught.value.where


NATIVE = "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend"


def _cli(*args: str):
    from click.testing import CliRunner

    from readfence.cli import main

    return CliRunner().invoke(main, list(args))


def test_the_cli_audits_and_verifies_sglangs_class_by_name_with_sglangs_profile():
    result = _cli("audit", "--engine", NATIVE, "--mode", "decode", "--batch-size", "2")
    assert result.exit_code == 0, result.output  # unsound, but a declaration SGLang never uses
    assert "UNSOUND, UNUSED: TorchNativeAttnBackend in DECODE: req_to_token declared IN_REPLAY" in result.output
    assert "UNUSED: TorchNativeAttnBackend in DECODE: the engine never graph-replays this backend" in result.output
    result = _cli("verify", "--engine", NATIVE, "--mode", "decode", "--batch-size", "2", "--steps", "2",
                  "--policy", "coarse")
    assert result.exit_code == 0, result.output
    assert "ENGINE RUNNER  clean" in result.output


def test_the_cli_says_an_engines_own_exception_in_one_line():
    result = _cli("audit", "--engine", "tests.engine.sglang_engines:broken", "--mode", "decode", "--batch-size", "2")
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: BrokenNative.forward raised KeyError in DECODE: 'decode_plan' (at ")
    assert "sglang_engines.py" in line and "Traceback" not in result.output


def test_tbo_splits_a_real_verify_input_between_its_children_in_target_verify():
    # TBO's replay path reads spec_info.draft_token_num and splits the verify input per child: without
    # SGLang's EagleVerifyInput on the batch its own code raises before anything is read
    engine = sg.forgetful_tbo()
    report = _audit(engine, M.TARGET_VERIFY).failure().report
    (row,) = report.unsound()
    assert (row.backend, row.mode, row.declared, row.truth, row.op) == (
        "forgetful_tbo", M.TARGET_VERIFY, IN, POST, "aten.index.Tensor")
    assert sglang_profile().spec_for(M.TARGET_VERIFY) is not None and sglang_profile().spec_for(M.DECODE) is None


def test_readfences_own_mode_values_answer_every_predicate_as_sglangs_do():
    from readfence.engine import EngineMode

    sglang_modes = sg.MODULES["base_attn_backend"].ForwardMode
    names = [n for n in vars(sglang_modes) if n.startswith("is_")]
    assert len(names) >= 15
    for mode in M:
        ours = EngineMode.of(mode)
        theirs = sglang_modes["DRAFT_EXTEND_V2" if mode is M.DRAFT_EXTEND else mode.name]
        for name in names:
            assert getattr(ours, name)() == getattr(theirs, name)(), (mode, name)
