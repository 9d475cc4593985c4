"""Batch-invariant kernels: a row's result must not depend on how many rows share the call.

A serving loop replays the graph captured for the smallest batch size that fits and pads the
batch, so a request's logits come from a call over 1, 2, 4 ... 16 rows depending on the traffic,
while the serial reference runs the exact batch. They are compared bit for bit, so every op
of the step must give a row the same bits whatever the number of rows. Elementwise ops and
row-wise reductions do; a float matmul need not: MKL's ``sgemm`` (x86) takes another kernel
for fewer than four rows, splits other row counts unevenly over its threads, and a batched
matmul over two matrices takes another kernel than over four; their sums round differently.
These helpers give such calls a multiple of :data:`ROW_BLOCK` rows by appending zero rows,
and drop those rows from the result. A call with such a count is left as it is (its graph is
unchanged); the padding reads no shared buffer, so what the analysis sees of a step is the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: A matmul is given a multiple of this many rows (see the module docstring);
#: ``tests/core/test_invariant.py`` checks every reference leaf, mode and batch size with it.
ROW_BLOCK = 4


def pad_rows(x: Tensor, block: int = ROW_BLOCK) -> Tensor:
    """``x`` with zero rows appended along dim 0 up to a positive multiple of ``block`` (``x``
    itself when it has one).

    >>> pad_rows(torch.ones(1, 2)).tolist()
    [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    >>> x = torch.ones(8, 2); pad_rows(x) is x, pad_rows(torch.ones(5, 2)).shape[0]
    (True, 8)
    """
    rows = x.shape[0]
    missing = max(block, -(-rows // block) * block) - rows
    if missing <= 0:
        return x
    return torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])


def matmul_rows(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` for ``x`` ``[T, K]``, each row's result the same bits whatever ``T`` is.

    >>> w = torch.randn(32, 96)
    >>> x = torch.randn(16, 32)
    >>> all(torch.equal(matmul_rows(x[:t], w), matmul_rows(x, w)[:t]) for t in range(1, 17))
    True
    """
    rows = x.shape[0]
    out = pad_rows(x) @ w
    return out if out.shape[0] == rows else out.narrow(0, 0, rows)
