"""The mixed batch of a generated state: new requests beside others deep into their context, the
deepest about the middle, its longest length a power of two the other way than the example's."""

from __future__ import annotations

import torch


def mixed_batch(rows: list[int], batch_size: int, span: int, tokens: int, g: torch.Generator, *,
                longest_power_of_two: bool) -> tuple[list[int], list[int], int]:
    """Rows and prefix lengths of a mixed batch of requests of ``tokens`` new tokens each, and its
    number of padding requests: half its requests (rounded up) new, the others at random depths up
    to about the middle of the context, the first of them there (the batch's longest length is
    then neither the first tokens' nor the longest context's: a bucket between the two is taken),
    in a random order; with 3 or more, the last two are padding (one row, at its first tokens,
    twice). That longest length is a power of two as ``longest_power_of_two`` says: the other way than the
    example's at this batch size, so a test of it (a split-KV bucket's) differs from the example's
    here, whether it asks "a power of two" (the first token and a power-of-two context are) or "a
    power of two strictly between" (neither is)."""
    pad = 2 if batch_size >= 3 else 0
    real = batch_size - pad
    new = (real + 1) // 2 if real > 1 else 0
    middle = max((span - 1) // 2, 1)
    if longest_power_of_two:
        below = 1 << (middle + tokens).bit_length() - 1  # the power of two at or below
        middle = max(below - tokens, 1)
    elif middle > 1 and power_of_two(middle + tokens):
        middle -= 1
    depths = torch.randint(1, middle + 1, (real,), generator=g).tolist()
    depths[new:new + 1] = [middle] * (real > new)
    prefix = [0] * new + depths[new:]
    order = torch.randperm(real, generator=g).tolist()
    prefix = [prefix[i] for i in order]
    reqs = rows[:real]
    return reqs + ([rows[real]] * pad if pad else []), prefix + [0] * pad, pad


def power_of_two(n: int) -> bool:
    """Whether ``n`` is a power of two.

    >>> power_of_two(32), power_of_two(31)
    (True, False)
    """
    return n > 0 and n & (n - 1) == 0
