"""Engine classes that read on the host before the replay, as SGLang's FlashAttention backend does,
are accepted where their reads end; each broken twin is refused.

The class keeps its metadata on ``self``: the batch's page-table rows and lengths (copies), and
``max_seq_len_k`` read on the host from the copy of the lengths, with a ``nan`` soft-cap sentinel,
both kept for the host. It declares PRE_REPLAY over the page table and the lengths (``reads=``):
the sliding-window and state-slot maps are declared NONE. The host read counts for the lengths it
was computed from, not for every buffer, so readfence's own audit and ``lower`` take the class
(``tests/graph/test_precision.py`` has the same backends as leaves).
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from readfence.core import ForwardMode, audit
from readfence.effects import ReadEnd
from readfence.engine import adapt, audit_engine, verify_engine
from readfence.graph import Policy, UnsoundLowering, lower, run_overlapped, run_serial

from .classes import Ends, attention
from .conftest import CFG

M = ForwardMode
NONE, PRE = ReadEnd.NONE, ReadEnd.PRE_REPLAY
READS = ["req_to_token", "seq_lens"]


@attrs.define
class Metadata:
    cache_seqlens: torch.Tensor
    page_table: torch.Tensor
    max_seq_len_k: int  # for the host
    softcap: float  # nan: no cap


class FlashAttentionLike:
    """Before the replay: the batch's rows of the live page table and its lengths (copies), and the
    longest length read on the host from that copy. ``forward`` attends over them, capped when the
    sentinel is not ``nan``."""

    def __init__(self, runner):
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.swa_map = runner.token_to_kv_pool.full_to_swa_index_mapping
        self.context_len = runner.model_config.context_len
        self.forward_metadata: Metadata | None = None

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        cache_seqlens = forward_batch.seq_lens.long()  # a copy of the batch's lengths
        page_table = self.req_to_token.index_select(0, forward_batch.req_pool_indices).long()
        self.forward_metadata = Metadata(cache_seqlens, page_table, int(cache_seqlens.max()), float("nan"))

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def shared_read_ends(self, mode):
        return Ends.PRE_REPLAY if mode.is_decode() or mode.is_target_verify() else Ends.UNKNOWN

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        md = self.forward_metadata
        out = attention(forward_batch, layer, q, k, v, md.page_table, md.cache_seqlens)
        return out if math.isnan(md.softcap) else md.softcap * torch.tanh(out / md.softcap)


class LateMap(FlashAttentionLike):
    """Broken: after the host read, it goes on to read the sliding-window map, declared NONE."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        md = self.forward_metadata
        md.page_table = self.swa_map.index_select(0, md.page_table.reshape(-1)).long().view(md.page_table.shape)


class MapAtTheLongestContext(FlashAttentionLike):
    """Broken where it branches: it reads the sliding-window map only when every request is at the
    longest context (never on the trace's example; on the oldest varied state)."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        md = self.forward_metadata
        if int(md.cache_seqlens.min()) >= self.context_len:
            md.page_table = self.swa_map.index_select(0, md.page_table.reshape(-1)).long().view(md.page_table.shape)


@pytest.mark.slow
def test_a_class_that_reads_a_bound_on_the_host_from_a_copy_is_accepted_verified_and_matches_serial(dev) -> None:
    engine = adapt(FlashAttentionLike, cfg=CFG, reads=READS)
    report = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).unwrap()
    node = report.find("FlashAttentionLike", M.DECODE)
    assert node.lowering == "" and {r.buffer for r in report.rows()} == set(READS), report.table()
    # readfence's own audit, which lower asks: the host read counts for the lengths, not the maps
    core = audit(engine, M.DECODE, cfg=CFG, batch_sizes=[2], state=engine.state).unwrap()
    assert core.sound and (core.observed["swa_map"], core.observed["state_slots"]) == (NONE, NONE), core.table()
    result = verify_engine(engine, device=dev, steps=3, batch_size=2).unwrap()
    assert all(r.clean for r in result.rows) and len(result.rows) == len(Policy) + 1, str(result)
    serial = run_serial(engine, steps=4, batch_size=2, cfg=CFG, state=engine.state)
    run = run_overlapped(engine, steps=4, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, state=engine.state)
    assert run.matches(serial) and run.violations == ()


def test_a_read_after_the_host_read_is_refused(dev) -> None:
    engine = adapt(LateMap, cfg=CFG, reads=READS)
    bad = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).failure()
    assert (bad.row.buffer, bad.row.declared, bad.row.truth) == ("swa_map", NONE, PRE), bad.message
    with pytest.raises(UnsoundLowering, match="'swa_map' ends at NONE"):
        lower(engine, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=engine.state)


def test_a_read_on_a_branch_the_example_does_not_take_is_seen_on_a_varied_state_and_refused(dev) -> None:
    engine = adapt(MapAtTheLongestContext, cfg=CFG, reads=READS)
    bad = audit_engine(engine, M.DECODE, batch_sizes=[2], steps=1).failure()
    assert (bad.row.buffer, bad.row.declared, bad.row.truth) == ("swa_map", NONE, PRE), bad.message
    assert "init_forward_metadata_out_graph runs its Python every step" in bad.row.why, bad.row.why
    core = audit(engine, M.DECODE, cfg=CFG, batch_sizes=[2], state=engine.state).failure()
    assert "stage prepare_out_graph's Python read it on a varied state" in core.message, core.message
    with pytest.raises(UnsoundLowering, match="'swa_map' ends at NONE"):
        lower(engine, M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG, state=engine.state)

