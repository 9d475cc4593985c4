"""Tensor parallelism: ranks launched with torch.distributed, each with its own fences.

Every rank runs its own scheduler, its own copy of the shared buffers and its own lowered step
of its shard of the model (``readfence.core.TensorParallel``); the model body all-reduces after
attention and after the MLP, inside the lowered graph. :func:`launch` starts the ranks and
stops them all, naming the rank, when one fails.
"""

from ._launch import (
    COLLECTIVE_TIMEOUT_S,
    Rank,
    RankFailure,
    TensorParallelError,
    culprits,
    launch,
    resolve_device,
    tp_sizes,
    under_torchrun,
)

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "Rank",
    "RankFailure",
    "TensorParallelError",
    "culprits",
    "launch",
    "resolve_device",
    "tp_sizes",
    "under_torchrun",
]
