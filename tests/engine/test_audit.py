"""``audit_engine``'s arguments: a mode given as a string is one (wrong) mode, not its letters;
``errors="report"`` audits every other (node, mode) when the engine's own code raises in one; its
result is a failure exactly when a declaration the engine uses is unsound."""

from __future__ import annotations

import pytest
from returns.pipeline import is_successful

from readfence.core import ForwardMode
from readfence.engine import EngineError, adapt, audit_engine

from .classes import Ends, KeepsAView, KeptCopies
from .conftest import CFG


class RaisesInExtend(KeptCopies):
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if forward_batch.forward_mode.name == "EXTEND":
            raise KeyError("no prefill plan")
        super().init_forward_metadata_out_graph(forward_batch, in_capture)


def test_a_mode_given_as_a_string_is_refused_as_one_mode_not_iterated():
    engine = adapt(KeptCopies, cfg=CFG)
    with pytest.raises(TypeError, match=r"^mode must be a ForwardMode, got 'decode' \(str\); did you mean "
                                        r"ForwardMode\.DECODE\?$"):
        audit_engine(engine, "decode", batch_sizes=[2], steps=1)
    with pytest.raises(ValueError, match="errors must be one of 'raise', 'report', got 'ignore'"):
        audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1, errors="ignore")


def test_the_engines_class_not_adapted_is_refused_naming_its_type_and_the_fix():
    with pytest.raises(TypeError, match=r"^engine must be an adapted backend, got <class '.*KeptCopies'> \(type\); "
                                        r"adapt the engine's backend class first: readfence\.engine\.adapt\(KeptCopies\)$"):
        audit_engine(KeptCopies, ForwardMode.DECODE, batch_sizes=[2], steps=1)  # type: ignore[arg-type]


def test_errors_report_audits_the_other_modes_and_names_what_raised():
    engine = adapt(RaisesInExtend, cfg=CFG)
    modes = [ForwardMode.DECODE, ForwardMode.EXTEND]
    with pytest.raises(EngineError, match="RaisesInExtend.init_forward_metadata_out_graph raised KeyError in EXTEND"):
        audit_engine(engine, modes, batch_sizes=[2], steps=1)
    report = audit_engine(engine, modes, batch_sizes=[2], steps=1, errors="report").unwrap()  # raised: not a failure
    (failed,) = report.errors()
    assert failed.mode is ForwardMode.EXTEND and failed.rows == ()
    assert failed.error.startswith("RaisesInExtend.init_forward_metadata_out_graph raised KeyError in EXTEND: "
                                   "'no prefill plan' (at ") and "test_audit.py" in failed.error
    assert report.sound and {r.mode for r in report.rows()} == {ForwardMode.DECODE}
    assert "ERROR: RaisesInExtend in EXTEND: " in report.table()


# -- verdicts where the engine places its fence ------------------------------------------------


class _CoveringMiniMax:
    """MiniMax's pair under a wrapper that declares POST_REPLAY: its fence covers the sparse
    child's late page-table read, which the child itself declares IN_REPLAY."""

    def __new__(cls, runner):
        from readfence.engine.reference import FlashInferBackend, MiniMaxHybridAttnBackend, MiniMaxSparseBackend
        from readfence.engine.reference._base import SharedReadEnds

        class CoveringMiniMax(MiniMaxHybridAttnBackend):
            def shared_read_ends(self, mode):
                return SharedReadEnds.POST_REPLAY

        return CoveringMiniMax(MiniMaxSparseBackend(runner), FlashInferBackend(runner))


def test_a_child_below_its_truth_under_a_root_that_covers_it_is_latent_and_runs_clean():
    from readfence.engine import verify_engine
    from readfence.engine.reference import minimax_hybrid_engine
    from readfence.graph import CpuDevice

    engine = adapt(_CoveringMiniMax, cfg=CFG, name="CoveringMiniMax")
    report = audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1).unwrap()  # latent: not a failure
    assert report.sound and report.unsound() == [], report.table()
    found = report.latent()
    assert found and {x.path for x in found} == {"CoveringMiniMax/attn_backend_list[0]/MiniMaxSparseBackend"}
    x = next(x for x in found if x.buffer == "req_to_token")
    assert (x.fence, x.fence_declared.name, x.entry.declared.name, x.entry.observed.name) == (
        "CoveringMiniMax", "POST_REPLAY", "IN_REPLAY", "POST_REPLAY")
    table = report.table()
    assert f"LATENT: {x.message.removeprefix('latent: ')}" in table and " latent; " in table
    (row,) = [r for r in report.rows() if r.backend == x.path and r.buffer == "req_to_token"]
    assert row.verdict == "latent" and row.text().startswith("latent (")
    assert row.as_json()["latent"]["fence"] == "CoveringMiniMax" and row.as_json()["verdict"] == "latent"
    with CpuDevice(timeout=30.0) as dev:
        verified = verify_engine(engine, ForwardMode.DECODE, device=dev, steps=3, batch_size=2).unwrap()
    assert verified.ok, str(verified)
    # the same child under its own wrapper's delegated declaration: the root's fence is early, refused
    racing = audit_engine(minimax_hybrid_engine(CFG), ForwardMode.DECODE, batch_sizes=[2], steps=1).failure().report
    assert not racing.sound and racing.latent() == []
    assert {r.backend.rsplit("/", 1)[-1] for r in racing.unsound()} == {"MiniMaxSparseBackend", "MiniMaxHybridAttnBackend"}


def test_a_two_batch_overlap_child_is_audited_at_its_micro_batch_sizes():
    from readfence.engine.reference import tbo_engine

    report = audit_engine(tbo_engine(CFG), ForwardMode.DECODE, batch_sizes=[2, CFG.max_reqs], steps=1).unwrap()
    half = CFG.max_reqs // 2
    assert report.find("TboAttnBackend", ForwardMode.DECODE).batch_sizes == (2, CFG.max_reqs)
    assert report.find("TboAttnBackend/primary/DeepSeekV4Backend", ForwardMode.DECODE).batch_sizes == (2, CFG.max_reqs)
    for i in (0, 1):
        child = report.find(f"TboAttnBackend/children[{i}]/TritonBackend", ForwardMode.DECODE)
        assert child.batch_sizes == (1, half) and {r.batch_size for r in child.rows} <= {1, half}


# -- the result: a failure exactly when a declaration the engine uses is unsound ----------------


def test_an_unsound_used_declaration_is_a_failure_carrying_the_whole_audit():
    from readfence.effects import UnwrapError
    from readfence.engine import EngineAudit, EngineUnsound
    from readfence.engine.reference import minimax_hybrid_engine

    engine = minimax_hybrid_engine(CFG)
    result = audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1)
    assert not is_successful(result)
    failed = result.failure()
    assert isinstance(failed, EngineUnsound) and isinstance(failed.report, EngineAudit)
    report = failed.report
    # the whole audit: every node of the tree, the sound dense child's rows with the unsound ones
    assert {n.path for n in report.nodes} == {path for path, _ in engine.walk()}
    dense = "MiniMaxHybridAttnBackend/attn_backend_list[1]/FlashInferBackend"
    assert report.find(dense, ForwardMode.DECODE).rows and not report.sound
    assert failed.rows == tuple(report.unsound()) and len(failed.rows) == 2
    sparse = "MiniMaxHybridAttnBackend/attn_backend_list[0]/MiniMaxSparseBackend"
    assert (failed.row.backend, failed.row.buffer) == (sparse, "req_to_token")  # the deepest guilty node
    assert failed.message.startswith(f"unsound declaration: {sparse} in mode DECODE declares buffer 'req_to_token' "
                                     "ends at IN_REPLAY but it is read until POST_REPLAY: forward reads it "
                                     "(aten.index_select.default) at "), failed.message
    assert ("(a traced read, batch size 2); 1 more unsound row(s) in the report; fix: declare 'req_to_token' ending at "
            "POST_REPLAY (or later)") in failed.message
    assert str(failed) == failed.message
    with pytest.raises(UnwrapError, match="unwrap\\(\\) of a failure: unsound declaration: "):
        result.unwrap()
    with pytest.raises(ValueError, match="must have an unsound row"):
        EngineUnsound(audit_engine(adapt(KeptCopies, cfg=CFG), ForwardMode.DECODE, batch_sizes=[2], steps=1).unwrap())


def test_a_sound_audit_and_an_unsound_declaration_the_engine_never_uses_are_successes():
    from readfence.engine import EngineProfile
    from readfence.engine.reference import trtllm_mha_engine

    sound = audit_engine(trtllm_mha_engine(CFG), ForwardMode.DECODE, batch_sizes=[2], steps=1)
    assert is_successful(sound) and sound.unwrap().sound and sound.unwrap().rows()
    # KeepsAView reads its page table after its declared end; an engine that never graph-replays
    # it publishes no fence from that declaration: shown, not a failure
    racing = audit_engine(adapt(KeepsAView, cfg=CFG), ForwardMode.DECODE, batch_sizes=[2], steps=1)
    assert not is_successful(racing) and [r.buffer for r in racing.failure().rows] == ["req_to_token"]
    eager = adapt(KeepsAView, cfg=CFG, profile=EngineProfile(replays=lambda obj: False))
    unused = audit_engine(eager, ForwardMode.DECODE, batch_sizes=[2], steps=1)
    assert is_successful(unused), unused.failure().message
    report = unused.unwrap()
    assert report.unsound() == [] and [r.buffer for r in report.unused()] == ["req_to_token"], report.table()


# -- a step the engine does not replay: its Python on the varied states ------------------------


class LongestReadsLate(KeptCopies):
    """KeptCopies whose ``forward`` also reads the live page table, but only when its out-of-graph
    stage found a request at the longest context (a Python value kept on ``self``): a path the
    example does not take at batch size 2. Declares PRE_REPLAY (``late``: POST_REPLAY, honest)."""

    late = False

    def __init__(self, runner):
        super().__init__(runner)
        self.longest = runner.model_config.context_len

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self.at_longest = int(forward_batch.seq_lens_cpu.max()) >= self.longest

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward(q, k, v, layer, forward_batch, save_kv_cache)
        if self.at_longest:
            out = out + self.table.index_select(0, forward_batch.req_pool_indices).sum() * 0
        return out

    def shared_read_ends(self, mode):
        return Ends.POST_REPLAY if self.late else super().shared_read_ends(mode)


class LongestReadsLateDeclared(LongestReadsLate):
    late = True


def test_in_extend_a_read_on_a_varied_state_is_one_verdict_of_audit_engine_core_audit_and_lower():
    from readfence.core import audit
    from readfence.effects import ReadEnd
    from readfence.graph import CpuDevice, Policy, UnsoundLowering, lower

    extend = ForwardMode.EXTEND
    engine = adapt(LongestReadsLate, cfg=CFG)
    failed = audit_engine(engine, extend, batch_sizes=[2], steps=1).failure()
    assert (failed.row.buffer, failed.row.truth, failed.row.method, failed.row.source) == (
        "req_to_token", ReadEnd.POST_REPLAY, "forward", "observed"), failed.message
    assert "forward reads it (its Python, on a varied state)" in failed.message, failed.message
    core = audit(engine, extend, cfg=engine.cfg, batch_sizes=[2], state=engine.state).failure()
    assert (core.buffer, core.observed, str(core.reader[0])) == ("req_to_token", ReadEnd.POST_REPLAY, "body"), core.message
    with CpuDevice(timeout=20.0) as dev, pytest.raises(UnsoundLowering) as e:
        lower(engine, extend, batch_size=2, device=dev, policy=Policy.EXACT, cfg=engine.cfg, state=engine.state)
    assert e.value.failure is not None and e.value.failure.message == core.message, str(e.value)
    honest = adapt(LongestReadsLateDeclared, cfg=CFG)
    assert audit_engine(honest, extend, batch_sizes=[2], steps=1).unwrap().sound
    with CpuDevice(timeout=20.0) as dev:
        lower(honest, extend, batch_size=2, device=dev, policy=Policy.EXACT, cfg=honest.cfg, state=honest.state)
