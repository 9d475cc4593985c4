"""Tensors of the dtypes torch has no kernels for, handled as the integer words they are.

A stage may return any dtype (the step protocol copies what crosses into the graph, and the
validation compares a replay with the Python bit for bit). torch compares, and under a fixed fill
of new memory allocates, most dtypes but not all: ``bits8``, the sub-byte integers, ``float4_e2m1fn_x2``
(NVFP4 metadata) and ``complex32`` have no such kernels. Their bytes are viewed as integers of the
dtype's size, copied and compared as those: bit for bit, which is what a comparison asks anyway.
"""

from __future__ import annotations

import functools

import torch

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.cache  # by dtype: a finite set
def _has_kernels(dtype: torch.dtype) -> bool:
    # whether torch compares tensors of ``dtype`` (those it cannot compare, it cannot fill either,
    # complex32 aside, which it fills)
    from torch.utils._python_dispatch import _disable_current_modes

    # (asked inside a stage, under readfence's own modes: the probe is none of the stage's ops)
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        words = [torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype) for _ in range(2)]
        try:
            torch.equal(*words)
            return True
        except (NotImplementedError, RuntimeError):
            return False


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or where torch has no kernels for its dtype, a view of its bytes as integers of
    its dtype's size.

    >>> as_words(torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)).dtype
    torch.uint8
    >>> as_words(torch.ones(2)).dtype
    torch.float32
    """
    words = words_dtype(t.dtype)
    return t if words is t.dtype or t.layout is not torch.strided or t.device.type == "meta" else t.view(words)


def words_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or the integer of its size where torch has no kernels for it: what to allocate a
    tensor of ``dtype`` as (then viewed as ``dtype``), where new memory is filled.

    >>> words_dtype(torch.bits8), words_dtype(torch.float32)
    (torch.uint8, torch.float32)
    """
    return dtype if dtype.itemsize not in _WORDS or _has_kernels(dtype) else _WORDS[dtype.itemsize]


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()``, for every dtype (one torch has no kernels for is copied as its words).

    >>> copy_of(torch.zeros(2, dtype=torch.uint8).view(torch.bits8)).dtype
    torch.bits8
    """
    words = as_words(t)
    return t.clone() if words is t else words.clone().view(t.dtype)
