"""The reference engine's wrapper backends: backends built from backends (``attn_backend_list``).

Each computes its declaration from its children by its own rule, as an engine's wrappers do
(readfence's audit checks the rule's result like any other declaration):

=====================  =====================================================================
wrapper                declaration
=====================  =====================================================================
HybridAttnBackend      the backend selected for the mode (prefill for EXTEND, decode otherwise)
TboAttnBackend         the latest of the primary (prepares the whole batch) and the children
                       (each prepares and attends one micro-batch)
HybridLinearAttn...    the latest of the full-attention and the linear-attention backend
MiniMaxHybridAttn...   the latest of the sparse and the dense backend
DotsHybridAttnBackend  UNKNOWN for non-speculative EXTEND (its eager padding path rebuilds the
                       children's metadata from the live tables in the forward); otherwise
                       the latest of its children
=====================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._base import AttentionBackend, SharedReadEnds

if TYPE_CHECKING:
    from .._contract import EngineMode
    from .._view import AttentionLayer, ForwardBatch

_PREFILL = "resolve_prefill_shared_read_ends"


class _Wrapper(AttentionBackend):
    """Runs every child's metadata stages; ``forward`` is the wrapper's own routing."""

    def __init__(self, *children: Any) -> None:
        self.attn_backend_list = list(children)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        for child in self.attn_backend_list or ():
            child.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        for child in self.attn_backend_list or ():
            child.init_forward_metadata_in_graph(forward_batch)

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        return SharedReadEnds.max_of(child.shared_read_ends(mode) for child in self.attn_backend_list or ())


class _ByLayer(_Wrapper):
    """Layer ``i`` is attended by ``attn_backend_list[route(i)]``."""

    def route(self, layer_id: int) -> int:
        raise NotImplementedError

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> Tensor:
        child = (self.attn_backend_list or [])[self.route(layer.layer_id)]
        return child.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)


class HybridAttnBackend(AttentionBackend):
    """One backend for prefill (EXTEND), another for the graph modes; every method goes to the
    one selected for the mode, so its declaration is exactly the selected backend's."""

    def __init__(self, prefill_backend: Any, decode_backend: Any) -> None:
        self.prefill_backend, self.decode_backend = prefill_backend, decode_backend
        self.attn_backend_list = [prefill_backend, decode_backend]

    def _select(self, mode: EngineMode) -> Any:
        return self.prefill_backend if mode.name == "EXTEND" else self.decode_backend

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        self._select(forward_batch.forward_mode).init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self._select(forward_batch.forward_mode).init_forward_metadata_in_graph(forward_batch)

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        return self._select(mode).shared_read_ends(mode)

    def resolve_prefill_shared_read_ends(self, forward_batch: ForwardBatch, *, num_qo_tokens: int,
                                         build_snapshot: bool = True) -> SharedReadEnds:
        chosen = self._select(forward_batch.forward_mode)
        if hasattr(chosen, _PREFILL):
            return chosen.resolve_prefill_shared_read_ends(forward_batch, num_qo_tokens=num_qo_tokens,
                                                           build_snapshot=build_snapshot)
        return chosen.shared_read_ends(forward_batch.forward_mode)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> Tensor:
        chosen = self._select(forward_batch.forward_mode)
        return chosen.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)


class TboAttnBackend(_Wrapper):
    """Two-batch overlap: the primary prepares the whole batch; the batch is split into one
    micro-batch of consecutive requests per child, which prepares and attends it. Declares
    the latest of the primary and the children."""

    def __init__(self, primary: Any, children: Sequence[Any]) -> None:
        super().__init__(primary, *children)
        self.primary, self.children = primary, list(children)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        self.primary.init_forward_metadata_out_graph(forward_batch, in_capture)
        for child, part in zip(self.children, forward_batch.split(len(self.children))):
            child.init_forward_metadata_out_graph(part, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.primary.init_forward_metadata_in_graph(forward_batch)
        for child, part in zip(self.children, forward_batch.split(len(self.children))):
            child.init_forward_metadata_in_graph(part)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> Tensor:
        outs, start = [], 0
        for child, part in zip(self.children, forward_batch.split(len(self.children))):
            n = part.num_tokens
            cut = [x.narrow(0, start, n) for x in (q, k, v)]
            outs.append(child.forward(*cut, layer, part, save_kv_cache=save_kv_cache).reshape(n, *q.shape[1:]))
            start += n
        return torch.cat(outs)


class HybridLinearAttnBackend(_ByLayer):
    """Full attention on ``full_attn_layers``, linear attention on the others; declares the
    latest of both."""

    def __init__(self, full_attn_backend: Any, linear_attn_backend: Any, full_attn_layers: Sequence[int] = (0,)) -> None:
        super().__init__(full_attn_backend, linear_attn_backend)
        self.full_attn_layers = frozenset(full_attn_layers)

    def route(self, layer_id: int) -> int:
        return 0 if layer_id in self.full_attn_layers else 1


class MiniMaxHybridAttnBackend(_ByLayer):
    """Sparse attention on even layers, dense on odd ones; declares the latest of both."""

    def __init__(self, sparse: Any, dense: Any) -> None:
        super().__init__(sparse, dense)

    def route(self, layer_id: int) -> int:
        return layer_id % 2


class DotsHybridAttnBackend(_ByLayer):
    """Layers alternate between its two children. In non-speculative EXTEND its eager padding
    path rebuilds the children's metadata from the live tables in every forward, so it
    declares UNKNOWN there; in every other mode the latest of its children."""

    def __init__(self, first: Any, second: Any, *, speculative: bool = False) -> None:
        super().__init__(first, second)
        self.speculative = speculative

    def route(self, layer_id: int) -> int:
        return layer_id % 2

    def _pads(self, mode: EngineMode) -> bool:
        return mode.name == "EXTEND" and not self.speculative

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        return SharedReadEnds.UNKNOWN if self._pads(mode) else super().shared_read_ends(mode)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> Tensor:
        if self._pads(forward_batch.forward_mode):
            child = (self.attn_backend_list or [])[self.route(layer.layer_id)]
            child.init_forward_metadata_out_graph(forward_batch)  # rebuilt from the live tables
            child.init_forward_metadata_in_graph(forward_batch)
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
