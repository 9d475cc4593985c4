"""The reference engine's kernels: paged attention over its KV pool, and a plan/run wrapper.

``PagedWrapper`` is FlashInfer's pattern: ``plan()`` runs before the replay and prepares what
``run()`` (a kernel, here a ``torch.library`` custom op) reads; the kernel's arguments are the
queries and the caches, never the plan, so what it reads through the plan is invisible to any
static analysis. Planning by *copy* reads the page table at the plan; planning by *reference*
reads it when the kernel runs.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from readfence.backends import softmax_attention
from readfence.core import ForwardMode
from readfence.core.internal import tokens_per_request

if TYPE_CHECKING:
    from .._view import AttentionLayer, ForwardBatch

#: ``select(scores, mask) -> mask``: a kernel's own key selection (``readfence.backends.top_pages``).
Selector = Callable[[Tensor, Tensor], Tensor]


def page_rows(req_to_token: Tensor, forward_batch: ForwardBatch) -> Tensor:
    """The page-table rows of the batch's requests ``[B, max_ctx]`` int64 (a read of the table)."""
    return req_to_token.index_select(0, forward_batch.req_pool_indices).long()


def save_kv(forward_batch: ForwardBatch, layer: AttentionLayer, k: Tensor, v: Tensor, *, swa_loc: Tensor | None = None) -> None:
    """Write this step's keys and values of ``layer`` (the sliding window's at ``swa_loc``)."""
    pool = forward_batch.token_to_kv_pool
    if swa_loc is None:
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
    else:
        pool.set_swa_kv_buffer(layer.layer_id, swa_loc, k, v)


def paged_attention(forward_batch: ForwardBatch, layer: AttentionLayer, q: Tensor, indices: Tensor, lens: Tensor, *,
                    swa: bool = False, window: int | None = None, select: Selector | None = None) -> Tensor:
    """Attention of ``q`` ``[T, H, D]`` over the KV slots ``indices`` ``[B, C]`` of the batch."""
    pool = forward_batch.token_to_kv_pool
    caches = ({"k_cache": pool.swa_k_buffer, "v_cache": pool.swa_v_buffer} if swa else
              {"k_cache": pool.k_buffer, "v_cache": pool.v_buffer})
    return softmax_attention(forward_batch.forward_mode.readfence, q, caches, layer.layer_id, indices, lens,
                             window=window, select=select)


_WRAPPERS: weakref.WeakValueDictionary[int, PagedWrapper] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class PagedWrapper:
    """A FlashInfer-like decode wrapper: ``plan`` fills its buffers, ``run`` is the kernel.

    ``keep_reference`` plans by keeping the page table itself (read when ``run`` runs) instead
    of copying the batch's rows into the wrapper's own buffer (read at the plan).
    """

    def __init__(self, max_reqs: int, max_ctx: int, device: torch.device, *, keep_reference: bool = False) -> None:
        self.keep_reference = keep_reference
        self.kv_indices = torch.zeros(max_reqs, max_ctx, dtype=torch.long, device=device)
        self.kv_lens = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.rows = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.table: Tensor | None = None
        self.handle = next(_HANDLES)
        _WRAPPERS[self.handle] = self

    def plan(self, req_to_token: Tensor, rows: Tensor, lens: Tensor) -> None:
        b = rows.shape[0]
        self.kv_lens.narrow(0, 0, b).copy_(lens)
        if self.keep_reference:
            self.table = req_to_token
            self.rows.narrow(0, 0, b).copy_(rows)
        else:
            self.kv_indices.narrow(0, 0, b).copy_(req_to_token.index_select(0, rows))

    def run(self, forward_batch: ForwardBatch, layer: AttentionLayer, q: Tensor) -> Tensor:
        pool = forward_batch.token_to_kv_pool
        return paged_run(q, pool.k_buffer, pool.v_buffer, layer.layer_id, forward_batch.forward_mode.value,
                         self.handle)


@torch.library.custom_op("readfence_engine::paged_run", mutates_args=())
def paged_run(q: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int, mode: str, handle: int) -> Tensor:
    """The run kernel: attention over what the wrapper ``handle`` planned (not an argument)."""
    wrapper = _WRAPPERS[handle]
    fm = ForwardMode(mode)
    b = q.shape[0] // tokens_per_request(fm)
    lens = wrapper.kv_lens.narrow(0, 0, b)
    if wrapper.keep_reference:
        assert wrapper.table is not None, "plan before run"
        indices = wrapper.table.index_select(0, wrapper.rows.narrow(0, 0, b)).long()
    else:
        indices = wrapper.kv_indices.narrow(0, 0, b)
    return softmax_attention(fm, q, {"k_cache": k_cache, "v_cache": v_cache}, layer, indices, lens)


@paged_run.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int, mode: str, handle: int) -> Tensor:
    return torch.empty_like(q)
