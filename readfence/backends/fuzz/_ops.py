"""The custom ops generated backends call: a pure kernel, one that claims to write everything, a
list-returning copy whose schema reads as a view, and a plan/run pair whose run reads a buffer no
argument names."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor


@torch.library.custom_op("readfence_fuzz::gather_rows", mutates_args=())
def gather_rows(buf: Tensor, rows: Tensor) -> Tensor:
    """A pure custom kernel: rows ``rows`` of ``buf`` as int64 (reads ``buf``)."""
    return buf.index_select(0, rows).long()


@gather_rows.register_fake
def _(buf: Tensor, rows: Tensor) -> Tensor:
    return buf.new_empty((rows.shape[0], *buf.shape[1:]), dtype=torch.long)


@torch.library.custom_op("readfence_fuzz::gather_rows_unknown", mutates_args="unknown")
def gather_rows_unknown(buf: Tensor, rows: Tensor) -> Tensor:
    """The same kernel registered without saying what it mutates (so it claims to write all)."""
    return buf.index_select(0, rows).long()


@torch.library.custom_op("readfence_fuzz::copy_pieces", mutates_args=())
def copy_pieces(buf: Tensor) -> list[Tensor]:
    """A list-returning kernel registered as the README recommends (``mutates_args=()``): its
    schema, ``Tensor[]`` with no alias annotation, lets torch's alias oracle take it for a
    view, while it copies (custom ops may not return views of their inputs)."""
    return [buf.clone(), buf.clone()]


@copy_pieces.register_fake
def _(buf: Tensor) -> list[Tensor]:
    return [torch.empty_like(buf), torch.empty_like(buf)]


_KEPT: dict[int, Tensor] = {}
_HANDLES = itertools.count()


def keep(buf: Tensor) -> int:
    """Plan: keep a reference to ``buf`` for :func:`planned_gather`; returns its handle.

    Like an engine's plan keeping its persistent buffers, the reference lives as long as the
    process (a reference costs no copy of the buffer).

    >>> lens = torch.tensor([5, 7, 9], dtype=torch.int32)
    >>> planned_gather(torch.tensor([2, 0]), keep(lens)).tolist()
    [9, 5]
    """
    handle = next(_HANDLES)
    _KEPT[handle] = buf
    return handle


@torch.library.custom_op("readfence_fuzz::plan_run", mutates_args=())
def planned_gather(rows: Tensor, handle: int) -> Tensor:
    """Run: rows ``rows`` of the buffer planned under ``handle``, read by reference (FlashInfer's
    plan/run keeping a tensor on the wrapper): none of its arguments is the buffer, so no static
    analysis sees the read."""
    return _KEPT[handle].index_select(0, rows).long()


@planned_gather.register_fake
def _(rows: Tensor, handle: int) -> Tensor:
    buf = _KEPT[handle]
    return rows.new_empty((rows.shape[0], *buf.shape[1:]), dtype=torch.long)
