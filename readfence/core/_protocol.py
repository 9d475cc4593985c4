"""What core needs of a backend: stage functions and a declared effect (structural typing).

The concrete ``Backend`` value and its combinators live in ``readfence.backends``; core only
depends on this protocol, so the layering effects <- core <- backends holds.

Stage functions are pure over named tensors:

* ``prepare_out_graph(mode, shared, batch) -> meta``: eager, host-launched before replay;
  its reads of ``shared`` end at ``PRE_REPLAY``. What it returns crosses into the graph as a
  *copy* (see :func:`cross_into_graph`).
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


def cross_into_graph(meta: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What the graph sees of ``prepare_out_graph``'s outputs: copies made when it returns.

    The one rule for metadata crossing into the graph. A captured graph reads static input
    buffers, so the out-of-graph stage's outputs are copied into them before the replay, at
    the end of that stage: a view of a shared buffer returned from ``prepare_out_graph`` is
    read by that copy (its read ends at ``PRE_REPLAY``), and reading it inside the graph reads
    the copy, never the shared buffer. ``prepare_in_graph`` runs inside the graph and its
    outputs are not copied: a view it returns is read wherever the body consumes it
    (``POST_REPLAY``). The tracer, the eager reference, the runtime observer and the lowering
    all follow this rule.

    >>> import torch
    >>> lens = torch.arange(4)
    >>> meta = cross_into_graph({"lens": lens[:2]})
    >>> meta["lens"].untyped_storage().data_ptr() != lens.untyped_storage().data_ptr()
    True
    """
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in meta.items()}


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
