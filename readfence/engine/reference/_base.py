"""The reference engine's own base: its declaration enum, the base class its backends share,
and the metadata they keep on ``self`` (what an engine such as SGLang defines for itself).

readfence asks nothing of these: the adapter sees only the contract methods. They exist so
the reference backends read like an engine's (a leaf that overrides nothing inherits the
default declaration, as SGLang's do).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
from torch import Tensor

if TYPE_CHECKING:
    from .._contract import EngineMode
    from .._view import AttentionLayer, ForwardBatch


class SharedReadEnds(enum.Enum):
    """Where a backend finishes reading the scheduler's shared buffers (one value for all of them)."""

    PRE_REPLAY = 1  # after init_forward_metadata_out_graph
    IN_REPLAY = 2  # after init_forward_metadata_in_graph
    POST_REPLAY = 3  # no metadata snapshot: read until the replay ends
    UNKNOWN = 4  # not audited: the scheduler waits for the whole forward

    @staticmethod
    def max_of(items: Iterable[SharedReadEnds]) -> SharedReadEnds:
        """The latest of ``items`` (a wrapper's end covers every child's)."""
        return max(items, key=lambda x: x.value)


@attrs.define
class ForwardMetadata:
    """What a backend's metadata stages compute for its ``forward`` (kept on ``self``)."""

    kv_indices: Tensor | None = None
    kv_lens: Tensor | None = None
    swa_indices: Tensor | None = None
    swa_loc: Tensor | None = None
    state_indices: Tensor | None = None


class AttentionBackend:
    """The engine's base class: no-op metadata stages, the default declaration (IN_REPLAY for
    DECODE and TARGET_VERIFY, UNKNOWN otherwise), ``forward`` dispatching by mode."""

    attn_backend_list: list[Any] | None = None
    forward_metadata: ForwardMetadata | None = None

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Eager metadata work before the replay (host reads allowed). Default: nothing."""

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """The first work inside the graph (static shapes). Default: nothing."""

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        if mode.is_decode() or mode.is_target_verify():
            return SharedReadEnds.IN_REPLAY
        return SharedReadEnds.UNKNOWN

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> Tensor:
        if forward_batch.forward_mode.is_idle():
            return q.new_zeros(q.shape)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)

    def forward_decode(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no forward_decode")

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no forward_extend")
