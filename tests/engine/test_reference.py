"""The reference engine: each backend gets the verdict it deserves, and every one declared soundly
runs bit-identical to serial under the engine's runner, PER_BUFFER and EXACT, poison clean."""

from __future__ import annotations

import pytest

from readfence.core import BODY, ForwardMode
from readfence.effects import ReadEnd
from readfence.engine import RUNNER, audit_engine, verify_engine
from readfence.engine.reference import ENGINES, deepseek_v4_engine, dots_hybrid_engine, tbo_engine, torch_native_engine
from readfence.graph import Policy

from .conftest import CFG

M = ForwardMode
NONE, PRE, IN, POST, UNKNOWN = ReadEnd
CLEAN = "clean"
LATE = ("late read", "observer")
REFUSED = ("unsound declaration", "audit")
SOUND = {Policy.PER_BUFFER.name: CLEAN, Policy.EXACT.name: CLEAN, RUNNER: CLEAN}

#: engine -> ({buffer: (verdict, source, truth)} of the root in DECODE, the unsound paths, per fence what verify finds)
EXPECTED = {
    "trtllm_mha": ({"req_to_token": ("exact", "traced", PRE), "swa_map": ("exact", "traced", PRE),
                    "state_slots": ("conservative", "traced", NONE)}, [], SOUND),
    "triton": ({"req_to_token": ("exact", "traced", IN), "seq_lens": ("exact", "traced", IN),
                "swa_map": ("conservative", "traced", NONE)}, [], SOUND),
    "flashinfer": ({"req_to_token": ("exact", "traced", PRE), "seq_lens": ("exact", "traced", PRE)}, [], SOUND),
    # the run kernel reads the page table it kept: no static analysis sees it, the observer does;
    # the audit counts what it observed, and lower refuses what the audit refuses (the engine's
    # own runner, trusting the declaration, races: poison and the observer catch it)
    "flashinfer_reference": ({"req_to_token": ("unsound", "observed", POST), "seq_lens": ("exact", "traced", PRE)},
                             ["FlashInferReferenceBackend"], {"PER_BUFFER": REFUSED, "EXACT": REFUSED, RUNNER: LATE}),
    # untraceable forward: observed; it runs as Python in the step, so readfence's fences give it
    # every buffer until POST_REPLAY, which it declares: lowered under PER_BUFFER and EXACT
    "torch_native": ({"req_to_token": ("exact", "observed", POST), "seq_lens": ("exact", "observed", POST),
                      "swa_map": ("conservative", "observed", NONE)}, [], SOUND),
    "minimax_sparse": ({"req_to_token": ("unsound", "traced", POST), "seq_lens": ("exact", "traced", IN)},
                       ["MiniMaxSparseBackend"], {"PER_BUFFER": REFUSED, "EXACT": REFUSED, RUNNER: LATE}),
    "linear": ({"state_slots": ("exact", "traced", IN), "req_to_token": ("conservative", "traced", NONE)}, [], SOUND),
    "deepseek_v4": ({"req_to_token": ("exact", "traced", IN), "seq_lens": ("exact", "traced", IN)}, [], SOUND),
    "hybrid": ({"req_to_token": ("exact", "traced", PRE), "swa_map": ("exact", "traced", PRE)}, [], SOUND),
    "tbo": ({"req_to_token": ("exact", "traced", IN)}, [], SOUND),
    # declared IN (the latest of its children) while its page-table reads all end before the replay
    "hybrid_linear": ({"req_to_token": ("conservative", "traced", PRE), "state_slots": ("exact", "traced", IN)},
                      [], SOUND),
    "minimax_hybrid": ({"req_to_token": ("unsound", "traced", POST)},
                       ["MiniMaxHybridAttnBackend/attn_backend_list[0]/MiniMaxSparseBackend", "MiniMaxHybridAttnBackend"],
                       {"PER_BUFFER": REFUSED, "EXACT": REFUSED, RUNNER: LATE}),
    "dots_hybrid": ({"req_to_token": ("exact", "traced", IN), "swa_map": ("conservative", "traced", PRE)}, [], SOUND),
}


def test_every_reference_engine_has_its_expected_verdicts():
    assert set(EXPECTED) == set(ENGINES)


def _check(engine, mode, rows, unsound, fences, dev, batch_size=2):
    audited = audit_engine(engine, mode, batch_sizes=[batch_size], steps=1)
    report = audited.failure().report if unsound else audited.unwrap()  # Success exactly when nothing is unsound
    root = {r.buffer: (r.verdict, r.source, r.truth) for r in report.rows() if r.backend == engine.name}
    assert {b: root[b] for b in rows} == rows, report.table()
    assert [r.backend for r in report.unsound()] == unsound, report.table()
    policies = [Policy[name] for name in fences if name != RUNNER]
    verified = verify_engine(engine, mode, device=dev, policies=policies, steps=2, batch_size=batch_size)
    clean = all(v == CLEAN for v in fences.values())
    result = verified.unwrap() if clean else verified.failure().report  # Success exactly when every fence is clean
    found = {r.name: CLEAN if r.clean else (r.finding.kind, r.finding.evidence) for r in result.rows}
    assert found == fences, str(result)
    late = [r for r in result.rows if not r.clean and r.finding.kind == "late read"]
    assert all(r.finding.buffer == "req_to_token" and r.finding.stage == "body" for r in late)
    return report


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_engine_in_decode(name, dev):
    rows, unsound, fences = EXPECTED[name]
    report = _check(ENGINES[name](CFG), M.DECODE, rows, unsound, fences, dev)
    for r in report.unsound():  # named by method, buffer and op
        assert (r.method, r.buffer) == ("forward", "req_to_token") and "index_select" in r.op


def test_deepseek_re_reads_the_page_table_in_target_verify_unless_dspark(dev):
    _check(deepseek_v4_engine(CFG), M.TARGET_VERIFY, {"req_to_token": ("exact", "traced", POST),
                                               "seq_lens": ("conservative", "traced", IN)}, [], SOUND, dev)
    dspark = deepseek_v4_engine(CFG, dspark=True)
    assert dspark.read_end(M.TARGET_VERIFY) is IN
    _check(dspark, M.TARGET_VERIFY, {"req_to_token": ("exact", "traced", IN)}, [], SOUND, dev)


def test_tbo_joins_its_primarys_target_verify_declaration_though_the_primary_only_prepares(dev):
    report = _check(tbo_engine(CFG), M.TARGET_VERIFY, {"req_to_token": ("conservative", "traced", IN)}, [], SOUND, dev)
    primary = "TboAttnBackend/primary/DeepSeekV4Backend"
    assert {r.buffer: r.verdict for r in report.rows() if r.backend == primary}["req_to_token"] == "exact"


def test_prefill_is_resolved_per_batch_and_each_resolution_audited():
    engine = deepseek_v4_engine(CFG)
    report = audit_engine(engine, M.EXTEND, batch_sizes=[2, 4], steps=1).unwrap()
    rows = {(r.buffer, r.batch_size): (r.declared, r.truth, r.verdict) for r in report.rows() if r.per_batch}
    # at 8 query tokens it snapshots its reads before the forward; past them it cannot, and says so
    assert rows[("req_to_token", 2)] == (PRE, PRE, "exact")
    assert rows[("req_to_token", 4)] == (UNKNOWN, POST, "conservative")
    assert report.find("DeepSeekV4Backend", M.EXTEND).prefill == ((2, PRE), (4, UNKNOWN))


def test_dots_declares_unknown_for_prefill_where_its_padding_path_reads_the_live_tables(dev):
    _check(dots_hybrid_engine(CFG), M.EXTEND, {"req_to_token": ("conservative", "traced", POST)}, [], SOUND, dev)


def test_torch_native_s_host_read_forward_runs_as_python_under_readfence_s_fences_in_both_graphed_modes(dev):
    engine = torch_native_engine(CFG)
    for mode in (M.DECODE, M.TARGET_VERIFY):
        report = _check(engine, mode, {"req_to_token": ("exact", "observed", POST)}, [], SOUND, dev)
        node = report.find("TorchNativeBackend", mode)
        assert node.lowering == ""  # nothing refused: every policy lowers it on the CPU device
        (stage, why, _), = node.untraceable
        assert stage == BODY and "tolist()" in why
        assert "a CUDA graph cannot capture it" in report.table()
