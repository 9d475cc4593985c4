"""The attention every leaf shares: metadata from the page table, KV stores, masked softmax.

All helpers are traceable (static shapes, no ``.item()``, no ``[]`` indexing), and the
metadata helpers always return NEW tensors (``index_select``), never views of ``shared``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch
from torch import Tensor

from readfence.core import ForwardMode
from readfence.core.internal import Segment, pad_rows, tokens_per_request

Tensors = Mapping[str, Tensor]


def kv_lens(shared: Tensors, batch: Tensors) -> Tensor:
    """``seq_lens`` of the batch's requests ``[B]`` int64 (reads ``seq_lens``)."""
    return shared["seq_lens"].index_select(0, batch["req_pool_indices"]).long()


def kv_indices(shared: Tensors, batch: Tensors) -> Tensor:
    """The page-table rows of the batch's requests ``[B, max_ctx]`` int64 (reads ``req_to_token``)."""
    return shared["req_to_token"].index_select(0, batch["req_pool_indices"]).long()


def page_meta(shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
    """``{"kv_indices", "kv_lens"}``: what a paged kernel needs (reads page table and lengths).

    >>> from readfence.core import ModelConfig
    >>> from readfence.core.internal import example_step
    >>> step = example_step(ModelConfig(), ForwardMode.DECODE, 2)
    >>> {k: tuple(v.shape) for k, v in page_meta(step.shared, step.batch).items()}
    {'kv_indices': (2, 64), 'kv_lens': (2,)}
    """
    return {"kv_indices": kv_indices(shared, batch), "kv_lens": kv_lens(shared, batch)}


def remap(index_map: Tensor, indices: Tensor) -> Tensor:
    """``index_map[indices]`` for any shape of ``indices``, as int64 (e.g. through ``swa_map``)."""
    return index_map.index_select(0, indices.reshape(-1)).long().view(indices.shape)


def store_kv(pools: dict[str, Tensor], layer: int, loc: Tensor, k: Tensor, v: Tensor,
             *, prefix: str = "") -> None:
    """Write the new ``k``/``v`` ``[T, H, D]`` of ``layer`` at slots ``loc`` (in place).

    ``prefix="swa_"`` writes the sliding-window cache instead of the full one.
    """
    pools[prefix + "k_cache"].select(0, layer).index_copy_(0, loc, k)
    pools[prefix + "v_cache"].select(0, layer).index_copy_(0, loc, v)


def gather(cache: Tensor, layer: int, indices: Tensor) -> Tensor:
    """Rows ``indices`` ``[B, C]`` of ``cache[layer]`` -> ``[B, C, H, D]``."""
    rows = cache.select(0, layer).index_select(0, indices.reshape(-1))
    return rows.view(*indices.shape, *rows.shape[1:])


def causal_mask(lens: Tensor, n: int, ctx: int, *, window: int | None = None) -> Tensor:
    """``[B, n, ctx]`` bool: new token ``i`` of a request of length ``L`` (new tokens included)
    sits at position ``L - n + i`` and sees positions ``<=`` its own (the last ``window`` only).

    >>> causal_mask(torch.tensor([3]), 2, 4).int().tolist()
    [[[1, 1, 0, 0], [1, 1, 1, 0]]]
    >>> causal_mask(torch.tensor([3]), 1, 4, window=2).int().tolist()
    [[[0, 1, 1, 0]]]
    """
    q_pos = lens.unsqueeze(1) - n + torch.arange(n, device=lens.device).unsqueeze(0)  # [B, n]
    kv_pos = torch.arange(ctx, device=lens.device).view(1, 1, ctx)
    mask = kv_pos <= q_pos.unsqueeze(-1)
    if window is not None:
        mask = mask & (kv_pos > q_pos.unsqueeze(-1) - window)
    return mask


#: ``select(scores [B, H, n, C], mask [B, H, n, C]) -> mask``: a kernel's own key selection.
Selector = Callable[[Tensor, Tensor], Tensor]


def softmax_attention(
    mode: ForwardMode,
    q: Tensor,
    pools: Mapping[str, Tensor],
    layer: int,
    indices: Tensor,
    lens: Tensor,
    *,
    prefix: str = "",
    window: int | None = None,
    select: Selector | None = None,
) -> Tensor:
    """Softmax attention of ``q`` ``[T, H, D]`` over the cached keys at ``indices`` ``[B, C]``.

    Request-major batch (``T = B * n``, ``n = tokens_per_request(mode)``); causal within the
    new tokens; ``window`` restricts to the last positions; ``select`` further narrows the
    mask (sparse attention). Returns ``[T, H, D]``.

    >>> from readfence.core import ModelConfig
    >>> from readfence.core.internal import example_step
    >>> step = example_step(ModelConfig(), ForwardMode.DECODE, 2)
    >>> meta = page_meta(step.shared, step.batch)
    >>> q = torch.randn(2, 2, 16)
    >>> softmax_attention(ForwardMode.DECODE, q, step.pools, 0, meta["kv_indices"],
    ...                   meta["kv_lens"]).shape
    torch.Size([2, 2, 16])
    """
    n = tokens_per_request(mode)
    batch_size, ctx = indices.shape
    tokens, heads, dim = q.shape
    if tokens != batch_size * n:
        raise ValueError(f"{mode}: {tokens} query tokens for {batch_size} requests x {n} tokens")
    keys = gather(pools[prefix + "k_cache"], layer, indices)  # [B, C, H, D]
    values = gather(pools[prefix + "v_cache"], layer, indices)
    # the math over the gathered rows reads no buffer of the step: one piece of the model,
    # recorded once per shape and spliced after that (``Segment``), in every layer (a selector
    # that is no value keys no record: the math is recorded op by op)
    math = Segment("softmax_attention", lambda q, keys, values, lens: _attention_math(q, keys, values, lens, n, window, select),
                   key=(n, window, select))
    return math(q, keys, values, lens)


def _attention_math(q: Tensor, keys: Tensor, values: Tensor, lens: Tensor, n: int, window: int | None,
                    select: Selector | None) -> Tensor:
    """:func:`softmax_attention` over the gathered ``keys`` and ``values`` ``[B, C, H, D]``."""
    batch_size, ctx, heads, dim = keys.shape
    tokens = q.shape[0]
    qb = q.reshape(batch_size, n, heads, dim)
    # a multiple of ROW_BLOCK requests per batched matmul: a request's scores must not depend on
    # how many requests share the call (readfence.core._invariant)
    scores = torch.einsum("bnhd,bchd->bhnc", pad_rows(qb), pad_rows(keys))
    if scores.shape[0] != batch_size:
        scores = scores.narrow(0, 0, batch_size)
    scores = scores * dim**-0.5
    mask = causal_mask(lens, n, ctx, window=window).unsqueeze(1).expand(batch_size, heads, n, ctx)
    if select is not None:
        mask = select(scores, mask)
    probs = torch.softmax(scores.masked_fill(mask.logical_not(), float("-inf")), dim=-1)
    out = torch.einsum("bhnc,bchd->bnhd", probs, values)
    return out.reshape(tokens, heads, dim)


def top_pages(top_k: int, page_size: int) -> Selector:
    """A selector keeping, per query and head, the ``top_k`` pages with the highest max score.

    >>> sel = top_pages(1, 2)
    >>> scores = torch.tensor([[[[0.0, 5.0, 1.0, 2.0]]]])
    >>> sel(scores, torch.ones(1, 1, 1, 4, dtype=torch.bool)).int().tolist()
    [[[[1, 1, 0, 0]]]]
    """
    return _TopPages(top_k, page_size)


@attrs.frozen
class _TopPages:
    """:func:`top_pages`'s selector: a value, so two selectors of the same pages are one
    segment key."""

    top_k: int
    page_size: int

    def __call__(self, scores: Tensor, mask: Tensor) -> Tensor:
        *lead, ctx = scores.shape
        if ctx % self.page_size:
            raise ValueError(f"context {ctx} is not a multiple of page_size {self.page_size}")
        pages = ctx // self.page_size
        page_scores = scores.masked_fill(mask.logical_not(), float("-inf")).view(*lead, pages, self.page_size).amax(-1)
        chosen = torch.topk(page_scores, min(self.top_k, pages), dim=-1).indices
        keep = torch.zeros_like(page_scores, dtype=torch.bool).scatter(-1, chosen, True)
        return mask & keep.repeat_interleave(self.page_size, dim=-1)


def linear_attention(
    mode: ForwardMode, q: Tensor, k: Tensor, v: Tensor, state: Tensor, *, decay: float
) -> tuple[Tensor, Tensor]:
    """Recurrent linear attention: ``S_i = decay * S_{i-1} + k_i v_i^T``, ``o_i = q_i S_i``.

    ``state`` ``[B, H, D, D]`` is each request's state before the step; returns
    ``(out [T, H, D], new state [B, H, D, D])``.

    >>> q = k = v = torch.ones(1, 1, 2)
    >>> out, s = linear_attention(ForwardMode.DECODE, q, k, v, torch.zeros(1, 1, 2, 2), decay=0.5)
    >>> torch.allclose(out, torch.full((1, 1, 2), 2 ** 0.5)), s.sum().item()
    (True, 4.0)
    """
    n = tokens_per_request(mode)
    # reads no buffer of the step (its state is the rows the caller gathered): a piece of the
    # model, recorded once per shape and spliced after that (``Segment``)
    recurrence = Segment("linear_attention", lambda q, k, v, state: _linear_recurrence(q, k, v, state, n, decay),
                         key=(n, decay))
    return recurrence(q, k, v, state)


def _linear_recurrence(q: Tensor, k: Tensor, v: Tensor, state: Tensor, n: int, decay: float) -> tuple[Tensor, Tensor]:
    """:func:`linear_attention` over ``n`` new tokens a request."""
    batch_size, heads, dim, _ = state.shape
    qb, kb, vb = (x.reshape(batch_size, n, heads, dim) for x in (q * dim**-0.5, k, v))
    outs = []
    for i in range(n):
        kv = torch.einsum("bhd,bhe->bhde", kb.select(1, i), vb.select(1, i))
        state = state * decay + kv
        outs.append(torch.einsum("bhd,bhde->bhe", qb.select(1, i), state))
    out = torch.stack(outs, dim=1) if outs else q.new_zeros(batch_size, 0, heads, dim)
    return out.reshape(batch_size * n, heads, dim), state
