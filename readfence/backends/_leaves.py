"""The reference leaves: real attention kernels whose declarations match what they read.

Each kernel reads shared buffers in exactly the stage its declaration names (a read in
``prepare_out_graph`` ends at ``PRE_REPLAY``, in ``prepare_in_graph`` at ``IN_REPLAY``, in
``attend`` at ``POST_REPLAY``); modes a leaf does not declare get the default declaration,
which is sound for what the code reads there. ``core.audit`` checks all of it.

=============  ===============================  ===============================  ===============================  =========================  =======
leaf           DECODE                           TARGET_VERIFY                    DRAFT_EXTEND                     EXTEND                     IDLE
=============  ===============================  ===============================  ===============================  =========================  =======
paged          r2t, lens: IN                    r2t, lens: IN                    UNKNOWN                          UNKNOWN                    UNKNOWN
trtllm_mha     r2t, lens, swa: PRE              r2t, lens, swa: IN               r2t: POST; lens, swa: PRE        UNKNOWN                    UNKNOWN
deepseek_v4    r2t, lens: IN                    r2t: POST, lens: IN (dspark: IN) UNKNOWN                          r2t, lens: PRE             UNKNOWN
linear         state_slots: IN                  state_slots: IN                  UNKNOWN                          UNKNOWN                    UNKNOWN
sparse         r2t: POST, lens: IN              r2t: POST, lens: IN              UNKNOWN                          UNKNOWN                    UNKNOWN
dense          r2t, lens: PRE                   r2t, lens: PRE                   r2t, lens: PRE                   r2t, lens: PRE             UNKNOWN
=============  ===============================  ===============================  ===============================  =========================  =======
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import attrs
from torch import Tensor

from readfence.core import ForwardMode
from readfence.core.internal import positive_int
from readfence.effects import ReadEffect, ReadEnd

from ._attention import (
    Selector,
    kv_indices,
    kv_lens,
    linear_attention,
    page_meta,
    remap,
    softmax_attention,
    store_kv,
    top_pages,
)
from ._backend import Leaf, declaration_table

Tensors = Mapping[str, Tensor]
M = ForwardMode
PRE, IN, POST = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY
R2T, LENS, SWA, SLOTS = "req_to_token", "seq_lens", "swa_map", "state_slots"


def _effect(**ends: ReadEnd) -> ReadEffect:
    names = {"r2t": R2T, "lens": LENS, "swa": SWA, "slots": SLOTS}
    return ReadEffect.of({names[k]: v for k, v in ends.items()})


def _memo(ctor: Callable[..., Leaf]) -> Callable[..., Leaf]:
    """Reference leaves are immutable values: build each distinct one once (bounded).

    ``typed`` keys each argument by its type too, so ``deepseek_v4(dspark=1)`` is still
    rejected rather than served the ``dspark=True`` leaf; an unhashable argument goes to the
    constructor, which says what is wrong with it.
    """
    cached = functools.lru_cache(maxsize=256, typed=True)(ctor)

    @functools.wraps(ctor)
    def build(*args: object, **kwargs: object) -> Leaf:
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:
            return ctor(*args, **kwargs)
        return cached(*args, **kwargs)

    return build


class _Kernel:
    """Stages a kernel does not override return ``{}`` (they read nothing)."""

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        return {}

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return {}


def _paged_attend(mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
                  batch: Tensors, indices: Tensor, lens: Tensor, *, select: Selector | None = None) -> Tensor:
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, indices, lens, select=select)


# -- paged ---------------------------------------------------------------------------------


@attrs.frozen
class _Paged(_Kernel):
    """FlashInfer-like: KV indices and lengths built from the page table inside the graph."""

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return page_meta(shared, batch)

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        return _paged_attend(mode, layer, q, k, v, pools, batch, meta["kv_indices"], meta["kv_lens"])


@_memo
def paged() -> Leaf:
    """FlashInfer-like paged attention; metadata built in graph (IN_REPLAY for DECODE/VERIFY).

    >>> paged().read_effect(ForwardMode.DECODE)
    ReadEffect({'req_to_token': IN_REPLAY, 'seq_lens': IN_REPLAY}, default=NONE)
    """
    return Leaf("paged", _Paged(), declaration_table("paged", None, (R2T, LENS)))


# -- trtllm_mha ----------------------------------------------------------------------------


def _positive_int(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    positive_int(attribute.name, value)


@attrs.frozen
class _TrtllmMha(_Kernel):
    """TRT-LLM MHA: full layers plus sliding-window layers (odd layers) through ``swa_map``.

    DECODE snapshots all metadata out of graph; TARGET_VERIFY (and the rest) build it in
    graph; DRAFT_EXTEND snapshots lengths and the whole ``swa_map`` out of graph but re-reads
    the page table in every layer.
    """

    window: int = attrs.field(default=8, validator=_positive_int)

    def _meta(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        meta = page_meta(shared, batch)
        meta["swa_indices"] = remap(shared[SWA], meta["kv_indices"])
        meta["swa_loc"] = remap(shared[SWA], batch["out_cache_loc"])
        return meta

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        if mode is M.DECODE:
            return self._meta(mode, shared, batch)
        if mode is M.DRAFT_EXTEND:
            return {"kv_lens": kv_lens(shared, batch), "swa_map": shared[SWA].clone(),
                    "swa_loc": remap(shared[SWA], batch["out_cache_loc"])}
        return {}

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        if mode in (M.DECODE, M.DRAFT_EXTEND):
            return {}
        return self._meta(mode, shared, batch)

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        if mode is M.DRAFT_EXTEND:
            indices = kv_indices(shared, batch)  # re-read of the page table: POST_REPLAY
            swa_indices = remap(meta["swa_map"], indices)
        else:
            indices, swa_indices = meta["kv_indices"], meta["swa_indices"]
        if layer % 2 == 0:
            return _paged_attend(mode, layer, q, k, v, pools, batch, indices, meta["kv_lens"])
        store_kv(pools, layer, meta["swa_loc"], k, v, prefix="swa_")
        return softmax_attention(mode, q, pools, layer, swa_indices, meta["kv_lens"],
                                 prefix="swa_", window=self.window)


@_memo
def trtllm_mha(window: int = 8) -> Leaf:
    """TRT-LLM MHA with sliding-window layers; decode metadata snapshotted out of graph.

    >>> trtllm_mha().read_end(ForwardMode.DECODE), trtllm_mha().read_end(ForwardMode.DRAFT_EXTEND)
    (<ReadEnd.PRE_REPLAY: 1>, <ReadEnd.POST_REPLAY: 3>)
    """
    kernel = _TrtllmMha(window)
    declare = {
        M.DECODE: _effect(r2t=PRE, lens=PRE, swa=PRE),
        M.DRAFT_EXTEND: _effect(r2t=POST, lens=PRE, swa=PRE),
    }
    options = () if window == 8 else (("window", window),)
    return Leaf("trtllm_mha", kernel, declaration_table("trtllm_mha", declare, (R2T, LENS, SWA)), options)


# -- deepseek_v4 ---------------------------------------------------------------------------


def _strict_bool(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false, got {value!r}")


@attrs.frozen
class _DeepseekV4(_Kernel):
    """DeepSeek-V4-like: EXTEND snapshots a prefill plan out of graph; TARGET_VERIFY re-reads
    the page table in every layer (one graph segment per layer) unless ``dspark``."""

    dspark: bool = attrs.field(default=False, validator=_strict_bool)

    def _rereads(self, mode: M) -> bool:
        return mode is M.TARGET_VERIFY and not self.dspark

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        return page_meta(shared, batch) if mode is M.EXTEND else {}

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        if mode is M.EXTEND:
            return {}
        if self._rereads(mode):
            return {"kv_lens": kv_lens(shared, batch)}
        return page_meta(shared, batch)

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        indices = kv_indices(shared, batch) if self._rereads(mode) else meta["kv_indices"]
        return _paged_attend(mode, layer, q, k, v, pools, batch, indices, meta["kv_lens"])


@_memo
def deepseek_v4(dspark: bool = False) -> Leaf:
    """DeepSeek-V4-like attention; TARGET_VERIFY is POST_REPLAY unless ``dspark=True``.

    >>> deepseek_v4().read_end(ForwardMode.TARGET_VERIFY), deepseek_v4(dspark=True).read_end(
    ...     ForwardMode.TARGET_VERIFY), deepseek_v4().read_end(ForwardMode.EXTEND)
    (<ReadEnd.POST_REPLAY: 3>, <ReadEnd.IN_REPLAY: 2>, <ReadEnd.PRE_REPLAY: 1>)
    """
    kernel = _DeepseekV4(dspark)
    declare = {
        M.TARGET_VERIFY: _effect(r2t=IN, lens=IN) if dspark else _effect(r2t=POST, lens=IN),
        M.EXTEND: _effect(r2t=PRE, lens=PRE),
    }
    options = (("dspark", True),) if dspark else ()
    return Leaf("deepseek_v4", kernel, declaration_table("deepseek_v4", declare, (R2T, LENS)), options)


# -- linear --------------------------------------------------------------------------------


def _decay(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, float) or not 0.0 < value <= 1.0:
        raise ValueError(f"decay must be a float in (0, 1], got {value!r}")


@attrs.frozen
class _Linear(_Kernel):
    """Linear attention / state-space layer: a recurrent state per request, found through
    ``state_slots`` (looked up in graph) in the model-owned ``state`` pool."""

    decay: float = attrs.field(default=0.9, validator=_decay)

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return {"state_slots": remap(shared[SLOTS], batch["req_pool_indices"])}

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        slots = meta["state_slots"]
        pool = pools["state"].select(0, layer)
        out, state = linear_attention(mode, q, k, v, pool.index_select(0, slots), decay=self.decay)
        pool.index_copy_(0, slots, state)
        return out


@_memo
def linear(decay: float = 0.9) -> Leaf:
    """Linear-attention (state-space) layer reading ``state_slots`` in graph.

    >>> linear().read_effect(ForwardMode.TARGET_VERIFY)
    ReadEffect({'state_slots': IN_REPLAY}, default=NONE)
    """
    options = () if decay == 0.9 else (("decay", decay),)
    return Leaf("linear", _Linear(decay), declaration_table("linear", None, (SLOTS,)), options)


# -- sparse / dense (MiniMax-style pair) ---------------------------------------------------


@attrs.frozen
class _Sparse(_Kernel):
    """Block-sparse attention: lengths in graph; each layer reads the page table and keeps,
    per query and head, the ``top_k`` pages of ``page_size`` positions with the best score."""

    top_k: int = attrs.field(default=2, validator=_positive_int)
    page_size: int = attrs.field(default=8, validator=_positive_int)

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return {"kv_lens": kv_lens(shared, batch)}

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        indices = kv_indices(shared, batch)  # per-layer page selection: POST_REPLAY
        return _paged_attend(mode, layer, q, k, v, pools, batch, indices, meta["kv_lens"],
                             select=top_pages(self.top_k, self.page_size))


@_memo
def sparse(top_k: int = 2, page_size: int = 8) -> Leaf:
    """MiniMax-style sparse attention: selects pages per layer from the page table.

    >>> sparse().read_effect(ForwardMode.DECODE)
    ReadEffect({'req_to_token': POST_REPLAY, 'seq_lens': IN_REPLAY}, default=NONE)
    """
    declare = {m: _effect(r2t=POST, lens=IN) for m in (M.DECODE, M.TARGET_VERIFY)}
    options = tuple((k, v) for k, v, d in (("top_k", top_k, 2), ("page_size", page_size, 8)) if v != d)
    return Leaf("sparse", _Sparse(top_k, page_size), declaration_table("sparse", declare, (R2T, LENS)),
                options)


@attrs.frozen
class _Dense(_Kernel):
    """Dense attention whose metadata is planned out of graph in every mode."""

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        return page_meta(shared, batch)

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        return _paged_attend(mode, layer, q, k, v, pools, batch, meta["kv_indices"], meta["kv_lens"])


@_memo
def dense() -> Leaf:
    """MiniMax-style dense attention; metadata planned out of graph (PRE_REPLAY).

    >>> dense().read_end(ForwardMode.EXTEND)
    <ReadEnd.PRE_REPLAY: 1>
    """
    declare: dict[ForwardMode, ReadEffect] = {m: _effect(r2t=PRE, lens=PRE) for m in M if m is not M.IDLE}
    return Leaf("dense", _Dense(), declaration_table("dense", declare, (R2T, LENS)))


#: Name -> constructor of every reference leaf (what ``parse`` knows by default).
REFERENCE_LEAVES: dict[str, Callable[..., Leaf]] = {
    "paged": paged,
    "trtllm_mha": trtllm_mha,
    "deepseek_v4": deepseek_v4,
    "linear": linear,
    "sparse": sparse,
    "dense": dense,
}
