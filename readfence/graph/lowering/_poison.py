"""Poison on release: a check mode of the lowered step in which any late read is deterministic.

At every point where a lowered step releases a shared buffer (where its policy placed the
buffer's fence), the forward stream itself, right after recording the release event:

1. checks the buffer still holds what the scheduler wrote (a forward that wrote it is caught,
   with the buffer and the step; a write after the release is caught when the step restores
   the buffer, since it no longer holds the poison; a buffer with no release point inside
   the step, ``UNKNOWN`` or COARSE, is checked at the end of the step);
2. saves it, and overwrites it with *poison*: other in-range values (``buffer_ranges``: a slot
   stays a slot, a length a length), so a late read computes on wrong values but never
   indexes out of bounds.

The rest of the step runs on poison: a read after the release point, through any code
(custom ops, kernels no analysis sees), changes the outputs in every run, without fault
injection or timing luck. Buffers that are never released inside the step (``UNKNOWN``:
after the whole forward) are not poisoned; buffers the plan says are never read (``NONE``)
are poisoned at the start of the step. At the end of the step the buffers are restored, and
in check mode the scheduler waits for the whole step before it writes the next one, so
poison never reaches the scheduler's state.

Poisoning on the forward stream, in program order, rather than from the scheduler's stream
is what makes "every read after the release point sees poison" hold inside captured graphs:
it needs no cross-stream wait whose binding would depend on enqueue order. Two poisons
alternate step by step (different rotations of the range), so no read is value-blind by
chance. Everything is tensor arithmetic on static buffers, so it captures into a graph; a
release point that a graph replays for another phase (speculative steps replay one graph
several times) is *armed* per replay, and an unarmed point changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from readfence.core import SHARED_BUFFERS
from readfence.core._state import ModelConfig, buffer_ranges
from readfence.effects import ReadEnd


class Watcher(Protocol):
    """Told, on the forward stream, what the check does: how the runtime read observer learns
    when each buffer was released (``graph.verify`` implements it).

    On a CpuDevice every replay calls it; on CUDA only the capture does (a replayed graph
    runs no Python).
    """

    def stage(self, name: str) -> AbstractContextManager[Any]:
        """Around the execution of stage ``name`` (the observer watches inside)."""
        ...

    def started(self, step: int) -> None: ...

    def released(self, check: CheckState, buffers: tuple[str, ...]) -> None:
        """A release point of ``buffers`` ran (``check.is_armed`` says which it poisoned)."""
        ...

    def restored(self) -> None: ...


def _quiet() -> AbstractContextManager[Any]:
    # the check's own copies are not the step's reads: hide them from dispatch-mode observers
    return _disable_current_modes()


class CheckState:
    """The static buffers of the poison check, shared by every graph of one step.

    ``live`` are the shared buffers the step reads; ``expected`` holds what the scheduler
    last wrote (it writes both); ``moved`` flags, per buffer, that the forward changed it
    (before its release: it differs from ``expected``; after: from the poison). ``log``
    collects, per step, the buffers flagged.

    >>> from readfence.core import ModelConfig, make_shared_state
    >>> cfg = ModelConfig(max_reqs=4, max_ctx=8)
    >>> live = make_shared_state(cfg)
    >>> check = CheckState(live, cfg)
    >>> lens = live["seq_lens"]; lens.copy_(torch.tensor([3, 1, 8, 2], dtype=torch.int32))
    tensor([3, 1, 8, 2], dtype=torch.int32)
    >>> check.expected["seq_lens"].copy_(lens); check.start(step=0)
    tensor([3, 1, 8, 2], dtype=torch.int32)
    >>> check.arm(["seq_lens"]); check.poisoner(["seq_lens"])()
    >>> lens.tolist()      # rotated within [1, 9): every value changed, all still lengths
    [4, 2, 1, 3]
    >>> check.restorer()(); lens.tolist()
    [3, 1, 8, 2]
    """

    def __init__(self, live: Mapping[str, Tensor], cfg: ModelConfig, *, watcher: Watcher | None = None,
                 only: Iterable[str] | None = None) -> None:
        self.names = tuple(SHARED_BUFFERS)
        self.live = live
        self.index = {b: i for i, b in enumerate(self.names)}
        ranges = buffer_ranges(cfg)
        self.lo = {b: ranges[b][0] for b in self.names}
        self.span = {b: ranges[b][1] - ranges[b][0] for b in self.names}
        dev = next(iter(live.values())).device
        self.backup = {b: live[b].clone() for b in self.names}
        self.expected = {b: live[b].clone() for b in self.names}
        self.poison = {b: live[b].clone() for b in self.names}  # what the release wrote there
        # two rotations per buffer: 1 and about half the range (distinct when the span > 2)
        spans = torch.tensor([self.span[b] for b in self.names], dtype=torch.long)
        self.rotations = torch.stack([torch.ones_like(spans), spans // 2 + 1]).remainder(spans).to(dev)
        n = len(self.names)
        self.shift = torch.zeros(n, dtype=torch.long, device=dev)
        self.armed = torch.zeros(n, dtype=torch.bool, device=dev)
        self.hit = torch.zeros(n, dtype=torch.bool, device=dev)
        self.moved = torch.zeros(n, dtype=torch.bool, device=dev)
        self.log: list[tuple[int, Tensor]] = []
        self.watcher = watcher
        # poison only these buffers (to find which buffer a differing run read late)
        self.only = None if only is None else frozenset(only)

    # -- eager launches, once per step or per replay ------------------------------------------
    def start(self, step: int) -> None:
        """A new step: pick its poison, nothing poisoned yet."""
        self.shift.copy_(self.rotations[step % 2])
        self.hit.zero_()
        self.moved.zero_()
        if self.watcher is not None:
            self.watcher.started(step)

    def arm(self, buffers: Iterable[str]) -> None:
        """The release points of the next replay poison ``buffers`` (and only those)."""
        self.armed.zero_()
        for b in buffers:
            if self.only is None or b in self.only:
                self.armed[self.index[b]] = True

    def finish(self, step: int) -> None:
        """End of a step: keep its guard flags."""
        self.log.append((step, self.moved.clone()))

    # -- actions placed in the stream (captured into graphs) -----------------------------------
    def poisoner(self, buffers: Sequence[str]) -> Callable[[], None]:
        """The action at a release point of ``buffers``: guard, save, poison (when armed)."""
        names = tuple(b for b in self.names if b in set(buffers))
        slots = [(b, self.index[b]) for b in names]

        def poison() -> None:
            with _quiet():
                for b, i in slots:
                    live, arm = self.live[b], self.armed[i]
                    self.moved[i] |= arm & live.ne(self.expected[b]).any()
                    self.backup[b].copy_(torch.where(arm, live, self.backup[b]))
                    rotated = (live.long() - self.lo[b] + self.shift[i] * arm).remainder(self.span[b]) + self.lo[b]
                    live.copy_(torch.where(arm, rotated.to(live.dtype), live))
                    self.poison[b].copy_(live)
                    self.hit[i] |= arm
            if self.watcher is not None:  # host code: runs on CpuDevice replays and at capture
                self.watcher.released(self, names)

        poison.__name__ = "poison_" + "_".join(names)
        return poison

    def restorer(self) -> Callable[[], None]:
        """The action at the end of the step: every poisoned buffer gets its value back, and
        every buffer is guarded: a poisoned one must still hold its poison (else the forward
        wrote it after its release), any other what the scheduler wrote (else the forward
        wrote it; a buffer released only after the whole forward has no release point inside
        the step that would have looked)."""

        def restore() -> None:
            with _quiet():
                for b, i in self.index.items():
                    live, hit = self.live[b], self.hit[i]
                    self.moved[i] |= torch.where(hit, live.ne(self.poison[b]).any(), live.ne(self.expected[b]).any())
                    live.copy_(torch.where(hit, self.backup[b], live))
            if self.watcher is not None:
                self.watcher.restored()

        return restore

    def is_armed(self, buffer: str) -> bool:
        """Whether the current replay poisons ``buffer`` (reads a device flag: host code only)."""
        return bool(self.armed[self.index[buffer]])

    def moved_buffers(self) -> list[tuple[int, str]]:
        """``(step, buffer)`` for every buffer the forward changed: before its release, after
        it, or, released only after the whole forward, during the step."""
        out = []
        for step, flags in self.log:
            out += [(step, b) for b, i in self.index.items() if bool(flags[i])]
        return out


def poison_points(placements: Mapping[str, Any]) -> dict[Any, tuple[str, ...]]:
    """Per placement (fence point), the buffers it releases inside the step.

    ``UNKNOWN`` (after the whole forward) releases nothing the step could still read.
    """
    out: dict[Any, list[str]] = {}
    for b, p in placements.items():
        if p.end is not ReadEnd.UNKNOWN:
            out.setdefault(p, []).append(b)
    return {p: tuple(bs) for p, bs in out.items()}


__all__ = ["CheckState", "Watcher", "poison_points"]
