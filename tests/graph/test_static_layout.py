"""A capture is validated on the memory it reads when it runs: the static buffers the out-of-graph
stage's outputs are copied into, laid out as the traced step's outputs.

A body that reads its metadata's layout (a stride handed to a kernel) runs right in the lowered loop
whatever layout the out-of-graph stage returns, because the loop copies every step's outputs into
buffers of the traced layout. Validated on the Python's own layout, it was refused.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import PREPARE_OUT_GRAPH, ForwardMode
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import LoopOptions, Policy, Scheduler, lower, make_state, run_overlapped, run_serial
from tests.conftest import SMALL as CFG

M = ForwardMode
PRE = ReadEnd.PRE_REPLAY


def _flips(batch) -> bool:
    pos = batch["positions"]
    return bool(pos[pos == 0].numel())  # a request at its first token (none on the trace's example)


def _out(mode, shared, batch):
    meta = page_meta(shared, batch)
    lens = meta["kv_lens"]
    rows = torch.stack([lens, torch.ones_like(lens)])  # [2, batch]: row-major
    if _flips(batch):  # the same values, column-major
        rows = torch.stack([lens, torch.ones_like(lens)], dim=1).t()
    return {**meta, "rows": rows}


def _attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    rows = meta["rows"]
    lens = torch.as_strided(rows, (rows.shape[1],), (rows.stride(1),))  # row 0, by the stride it has
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)


BACKEND = leaf("reads_its_layout", _attend, prepare_out_graph=_out,
               declare={M.DECODE: ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE})})


@pytest.mark.parametrize("policy", [Policy.COARSE, Policy.EXACT])
def test_a_body_reading_its_metadata_s_layout_is_lowered_and_runs_as_serial(policy, dev) -> None:
    low = lower(BACKEND, M.DECODE, batch_size=2, device=dev, policy=policy, cfg=CFG)
    traced = low.program.stage(PREPARE_OUT_GRAPH).graph.traced_outputs()["meta.rows"]
    assert low.launcher.meta["meta.rows"].stride() == traced.stride() == (2, 1)  # the static buffer: the traced layout
    # the independent check: the loop against the serial run, on traffic that takes both layouts
    scheduler = Scheduler(CFG, M.DECODE, 2, seed=0, finish_prob=0.3)
    assert {_flips(scheduler.next_step().batch) for _ in range(8)} == {True, False}
    reference = run_serial(BACKEND, M.DECODE, steps=8, batch_size=2, cfg=CFG, state=make_state(CFG),
                           options=LoopOptions(finish_prob=0.3))
    run = run_overlapped(BACKEND, M.DECODE, steps=8, policy=policy, device=dev, batch_size=2, cfg=CFG,
                         state=make_state(CFG), options=LoopOptions(finish_prob=0.3))
    assert run.matches(reference) and not run.violations
