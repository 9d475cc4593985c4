"""Host-to-device copies that never make the host wait."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def copy_from_host(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)``, without making the host wait when ``src`` is on the host and ``dst``
    is not: the copy reads page-locked memory (``src`` pinned, or a pinned copy of it) with
    ``non_blocking=True``. From pageable memory CUDA stages the copy through the host, which
    then waits for the stream inside a C call that has no timeout. Host to host, a plain copy.

    The pinned copy needs no keeping alive: torch's pinned-memory allocator does not reuse it
    before the copy that reads it has run.

    >>> import torch
    >>> copy_from_host(torch.zeros(2), torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    if src.device.type != "cpu" or dst.device.type == "cpu":
        return dst.copy_(src)
    return dst.copy_(src if src.is_pinned() else src.pin_memory(), non_blocking=True)


def copy_all_from_host(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """:func:`copy_from_host` of each pair; host to host, one ``torch._foreach_copy_`` call.

    On a CPU device every torch call a stream thread makes gives the GIL away and must win it
    back from the other streams' threads: one call for a scheduler's group of writes instead of
    one per buffer.

    >>> import torch
    >>> a, b = torch.zeros(2), torch.zeros(3, dtype=torch.int32)
    >>> copy_all_from_host([a, b], [torch.ones(2), torch.arange(3, dtype=torch.int32)])
    >>> a.tolist(), b.tolist()
    ([1.0, 1.0], [0, 1, 2])
    """
    if all(d.device.type == "cpu" and s.device.type == "cpu" for d, s in zip(dsts, srcs, strict=True)):
        torch._foreach_copy_(list(dsts), list(srcs))
        return
    for d, s in zip(dsts, srcs, strict=True):
        copy_from_host(d, s)
