"""Torch on one intra-op thread while a command runs the tiny model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Torch on one intra-op thread for the block (or the decorated function), then as it was.

    The tiny model's ops are too small to split over threads, and a CPU device's streams are
    the parallelism: on a loaded two-core machine torch's default pool (a thread per core) made
    the demo's eager steps 6x slower (97 against 630 steps/s, the serial reference's more than
    the loop's) and the reference audit take 172 s where one thread took 76 s. One thread also
    keeps a serial reference and its loop on the same matmul kernels (``core._invariant``).

    >>> with one_intra_op_thread():
    ...     torch.get_num_threads()
    1
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
