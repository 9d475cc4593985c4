"""A live state's values, kept and given back in place: the same memory, its earlier bytes.

A live state (``make_state``) is memory the step's code and the backend's own references point at:
a check that runs a loop on it several times, and must start each from the same values, writes
them back into that memory rather than making a new state. One rule for every such user (``verify``,
the engine checks, a run on generated states written into the live buffers, tests that share a
state across loops).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import Tensor

#: A state: groups (``shared``, ``pools``, ``params``...) of named tensors.
State = Mapping[str, Mapping[str, Tensor]]


def snapshot(state: State) -> dict[str, dict[str, Tensor]]:
    """A copy of every tensor of ``state``, by group and name.

    >>> import torch
    >>> state = {"shared": {"seq_lens": torch.zeros(2)}}
    >>> kept = snapshot(state)
    >>> state["shared"]["seq_lens"].fill_(5)[0].item(), kept["shared"]["seq_lens"][0].item()
    (5.0, 0.0)
    """
    return {group: {name: t.clone() for name, t in tensors.items()} for group, tensors in state.items()}


def restore(state: State, kept: State) -> None:
    """Write ``kept``'s values (a :func:`snapshot`) back into ``state``'s tensors, in place.

    >>> import torch
    >>> state = {"shared": {"seq_lens": torch.zeros(2)}}
    >>> kept, memory = snapshot(state), state["shared"]["seq_lens"].data_ptr()
    >>> state["shared"]["seq_lens"].fill_(5)
    tensor([5., 5.])
    >>> restore(state, kept)
    >>> state["shared"]["seq_lens"].tolist(), state["shared"]["seq_lens"].data_ptr() == memory
    ([0.0, 0.0], True)
    """
    for group, tensors in kept.items():
        for name, value in tensors.items():
            state[group][name].copy_(value)


@contextlib.contextmanager
def preserved(state: State) -> Iterator[None]:
    """Every tensor of ``state`` holds its values again when the block ends, however it ends.

    >>> import torch
    >>> state = {"shared": {"seq_lens": torch.zeros(2)}}
    >>> with preserved(state):
    ...     _ = state["shared"]["seq_lens"].fill_(5)
    >>> state["shared"]["seq_lens"].tolist()
    [0.0, 0.0]
    """
    kept = snapshot(state)
    try:
        yield
    finally:
        restore(state, kept)


__all__ = ["State", "preserved", "restore", "snapshot"]
