"""A step's batch split into micro-batches of consecutive requests (two-batch overlap, a
``per_stream`` group's shares)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ._modes import ForwardMode
from ._state import tokens_per_request


def split_batch(batch: Mapping[str, Tensor], mode: ForwardMode, parts: int) -> list[dict[str, Tensor]]:
    """Split a batch into ``parts`` micro-batches of consecutive requests (some may be empty).

    Sizes follow ``torch.tensor_split``; slicing uses ``narrow`` (traceable, no ``[]``).

    >>> from readfence.core import ModelConfig
    >>> from readfence.core.internal import example_step
    >>> step = example_step(ModelConfig(), ForwardMode.TARGET_VERIFY, 3)
    >>> [mb["input_ids"].shape[0] for mb in split_batch(step.batch, ForwardMode.TARGET_VERIFY, 2)]
    [6, 3]
    """
    sizes = request_ranges(int(batch["req_pool_indices"].shape[0]), parts)
    return [_narrow_batch(batch, mode, lo, hi) for lo, hi in sizes]


def request_ranges(batch_size: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` request ranges of ``parts`` micro-batches (``torch.tensor_split`` sizes).

    >>> request_ranges(5, 2)
    [(0, 3), (3, 5)]
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(batch_size, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _narrow_batch(batch: Mapping[str, Tensor], mode: ForwardMode, lo: int, hi: int) -> dict[str, Tensor]:
    n = tokens_per_request(mode)
    out = {}
    for key, t in batch.items():
        per = 1 if key == "req_pool_indices" else n
        out[key] = t.narrow(0, lo * per, (hi - lo) * per)
    return out


__all__ = ["request_ranges", "split_batch"]
