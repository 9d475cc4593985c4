"""What core needs of a backend: stage functions and a declared effect (structural typing).

The concrete ``Backend`` value and its combinators live in ``readfence.backends``; core only
depends on this protocol, so the layering effects <- core <- backends holds.

Stage functions are pure over named tensors:

* ``prepare_out_graph(mode, shared, batch) -> meta``: eager, host-launched before replay;
  its reads of ``shared`` end at ``PRE_REPLAY``.
* ``prepare_in_graph(mode, shared, batch, meta) -> meta``: the first nodes of the captured
  graph; reads end at ``IN_REPLAY``. ``meta`` holds what ``prepare_out_graph`` returned.
* ``attend(mode, layer, q, k, v, pools, shared, batch, meta) -> out``: per layer, inside the
  model body; reads of ``shared`` here end at ``POST_REPLAY``. ``pools`` (KV caches, linear
  state) are model-owned and may be written; ``shared`` must never be written by any stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor

from readfence.effects import ReadEffect, ReadEnd

from ._modes import ForwardMode

Tensors = Mapping[str, Tensor]

#: The stages of one step, in execution order, and the read end of a read in each.
STAGE_ENDS: dict[str, ReadEnd] = {
    "prepare_out_graph": ReadEnd.PRE_REPLAY,
    "prepare_in_graph": ReadEnd.IN_REPLAY,
    "body": ReadEnd.POST_REPLAY,
}


@runtime_checkable
class BackendLike(Protocol):
    """An attention backend as core sees it."""

    @property
    def name(self) -> str: ...

    def read_effect(self, mode: ForwardMode) -> ReadEffect: ...

    def read_end(self, mode: ForwardMode) -> ReadEnd: ...

    def children(self) -> tuple[tuple[str, BackendLike], ...]:
        """``(label, child)`` pairs, e.g. ``("children[0]", paged)``; ``()`` for a leaf."""
        ...

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]: ...

    def prepare_in_graph(
        self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors
    ) -> dict[str, Tensor]: ...

    def attend(
        self,
        mode: ForwardMode,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pools: dict[str, Tensor],
        shared: Tensors,
        batch: Tensors,
        meta: Tensors,
    ) -> Tensor: ...
