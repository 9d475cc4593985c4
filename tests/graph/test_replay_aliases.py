"""Aliasing checked where it happens: an opaque op's outputs, at every replay on the CPU device.

A kernel registered with ``torch.library.Library`` and no alias annotation returns a copy of the
batch's lengths, except on a fast path (three rows or more, all even: a batch the scheduler
packed) where it returns a strided view of the live buffer. No example the analysis runs takes the
fast path; the decode loop's batch does. Every replay checks
the op's outputs against the shared buffers' address ranges, and a hit refuses the step naming
the op, before a consumer reads the live buffer after its release.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, audit
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, DeviceError, Policy, ReplayAliasError, decode_loop, run_serial, verify
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode.DECODE
STEPS, BATCH = 4, 3

_LIB = torch.library.Library("rf_replay_alias", "FRAGMENT")
_LIB.define("rows_of(Tensor lens, Tensor rows) -> Tensor")  # no alias annotation: taken to copy


def _rows_of(lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] >= 3 and all(r % 2 == 0 for r in rows.tolist()):  # the fast path: a strided view
        return lens.as_strided((rows.shape[0],), (2,), 0)
    return lens.index_select(0, rows)


_LIB.impl("rows_of", _rows_of, "CPU")


def _fast_path(name: str = "fast_path") -> object:
    def prep(mode, shared, batch, meta):
        return {**page_meta(shared, batch), "lens": torch.ops.rf_replay_alias.rows_of(shared["seq_lens"],
                                                                                       batch["req_pool_indices"])}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["lens"].long().clamp(min=1))

    declared = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf(name, attend, prepare_in_graph=prep, declare={M: declared})


def test_the_fast_path_is_taken_in_the_run_and_by_no_example_the_analysis_ran() -> None:
    # not vacuous: the audit, from the trace's example, takes the op for a copy
    assert audit(_fast_path(), M, cfg=CFG).map(lambda r: r.sound).value_or(None)
    lens = torch.arange(8)
    assert _rows_of(lens, torch.tensor([0, 6, 2])).untyped_storage().data_ptr() == lens.untyped_storage().data_ptr()
    from readfence.graph import Scheduler

    assert Scheduler(CFG, M, BATCH).next_step().batch["req_pool_indices"].tolist() == [0, 6, 2]


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT, Policy.JOINED], ids=str)
def test_a_view_an_opaque_op_returns_at_a_replay_refuses_the_step_naming_the_op(policy: Policy) -> None:
    with CpuDevice(timeout=30.0) as dev:
        loop = decode_loop(_fast_path(), M, policy=policy, device=dev, batch_size=BATCH, cfg=CFG)
        with pytest.raises(DeviceError) as info:
            loop.run(STEPS)
    cause = info.value.__cause__
    assert isinstance(cause, ReplayAliasError), repr(info.value)
    assert (cause.stage, cause.op, cause.buffers) == ("prepare_in_graph", "rf_replay_alias.rows_of.default",
                                                      frozenset({"seq_lens"}))


def test_verify_reports_it_as_a_refused_step() -> None:
    with CpuDevice(timeout=30.0) as dev:
        finding = verify(_fast_path(), M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                         policy=Policy.PER_BUFFER).failure()
    assert (finding.kind, finding.evidence, finding.buffer, finding.op) == (
        "refused", "run", "seq_lens", "rf_replay_alias.rows_of.default"), str(finding)


def test_without_the_check_the_late_read_is_caught_by_poison_and_by_the_observer(monkeypatch) -> None:
    # broken on purpose: no alias check at the replays. The body reads the live lengths through
    # the view after their IN_REPLAY release: poison on release and the read observer, each on
    # its own, catch it
    import readfence.graph.lowering._slot as slot

    monkeypatch.setattr(slot, "insert_alias_checks", lambda gm, live, **kw: gm)
    with CpuDevice(timeout=30.0) as dev:
        for check in ("poison", "observer"):
            finding = verify(_fast_path("unchecked"), M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                             policy=Policy.PER_BUFFER, checks={check}).failure()
            assert (finding.kind, finding.buffer, finding.evidence) == ("late read", "seq_lens", check), str(finding)


def test_the_copy_path_alone_runs_clean_and_bit_identical() -> None:
    # the same op on rows that are never all even: no alias at any replay, nothing refused
    def prep(mode, shared, batch, meta):
        rows = (batch["req_pool_indices"] + 1) % shared["seq_lens"].shape[0]  # odd rows: the copy path
        lens = torch.ops.rf_replay_alias.rows_of(shared["seq_lens"], rows)
        return {**page_meta(shared, batch), "lens": lens}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["lens"].long().clamp(min=1))

    declared = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    backend = leaf("copy_path", attend, prepare_in_graph=prep, declare={M: declared})
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        loop = decode_loop(backend, M, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=CFG)
        runs, _ = loop.run(STEPS)
    assert all(torch.equal(r.logits, s) for r, s in zip(runs, serial.logits))
