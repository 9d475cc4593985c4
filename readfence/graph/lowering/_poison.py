"""Poison on release: a check mode of the lowered step in which any late read is deterministic.

At every point where a lowered step releases a shared buffer (where its policy placed the
buffer's fence), the forward stream itself, right after recording the release event:

1. checks the buffer still holds what the scheduler wrote (a forward that wrote it is caught,
   with the buffer and the step; a write after the release is caught when the step restores
   the buffer, since it no longer holds the poison; a buffer with no release point inside
   the step, ``UNKNOWN`` or COARSE, is checked at the end of the step);
2. overwrites it with *poison*: other in-range values (``buffer_ranges``: a slot
   stays a slot, a length a length), so a late read computes on wrong values but never
   indexes out of bounds.

The rest of the step runs on poison: a read after the release point, through any code
(custom ops, kernels no analysis sees), changes the outputs in every run, without fault
injection or timing luck. Buffers that are never released inside the step (``UNKNOWN``:
after the whole forward) are not poisoned; buffers the plan says are never read (``NONE``)
are poisoned at the start of the step. At the end of the step the buffers get back what the
scheduler wrote, and
in check mode the scheduler waits for the whole step before it writes the next one, so
poison never reaches the scheduler's state.

The poisons (:data:`POISONS`; step ``s`` takes ``POISONS[s % 4]``, see :func:`poison_family`)
break the relations between a buffer's values, not only the values: a bijection of the range
(a rotation, say) keeps every equality, and a reader that uses a late value only through
equalities would compute the serial result on it. Two are constant (the lowest and the highest
value of the range: every pair becomes equal, and every value moves down, or up, as far as it
can), two are distinct-valued and reverse the order (the largest value becomes the lowest;
tied values are ordered by position, one way in one poison and the other way in the other).

Poisoning on the forward stream, in program order, rather than from the scheduler's stream
is what makes "every read after the release point sees poison" hold inside captured graphs:
it needs no cross-stream wait whose binding would depend on enqueue order. The step's poison
is made when the step starts, eagerly, from what the scheduler wrote (every buffer holds it
until its release point, or the guard reports the write); a release point only copies it, a
tensor operation on static buffers that captures into a graph. A release point that a graph
replays for another phase (speculative steps replay one graph several times) is *armed* per
replay, and an unarmed point changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from readfence.core import SHARED_BUFFERS, ModelConfig
from readfence.core.internal import Ledger, buffer_ranges
from readfence.effects import ReadEnd

from ._plan import Placement

#: The poisons, in the order the steps take them: step ``s`` is poisoned with
#: ``POISONS[s % len(POISONS)]`` (see :func:`poison_family`).
POISONS: tuple[str, ...] = ("reversed", "highest", "reversed, ties swapped", "lowest")


class _Reversal(NamedTuple):
    """What the reversed poisons of one buffer need, made once: the position of each element
    counted both ways (to order ties) and, per value rank, the value it becomes."""

    ties: tuple[Tensor, Tensor]  # int64 positions 0..n-1, and n-1..0 (ties swapped)
    spread: Tensor  # for rank k (0: the least key) the value lo + (n-1-k) * span // n, buffer's dtype

    @staticmethod
    def of(buffer: Tensor, lo: int, span: int) -> _Reversal:
        n = buffer.numel()
        up = torch.arange(n, device=buffer.device)
        # strictly decreasing in the rank when span >= n: distinct values; else non-increasing
        spread = (lo + (n - 1 - up) * span // n).to(buffer.dtype)
        return _Reversal((up, n - 1 - up), spread)


def _poison_into(out: Tensor, values: Tensor, reversal: _Reversal, lo: int, span: int, which: int) -> None:
    """Write poison ``POISONS[which]`` of ``values`` into ``out`` (contiguous, same shape and dtype)."""
    if which in (1, 3):  # highest, lowest
        out.fill_(lo + span - 1 if which == 1 else lo)
        return
    # a total order, by value then position (one way or the other): each element's rank in it
    # picks its value in ``spread``, the largest key getting the lowest value
    key = torch.add(reversal.ties[which == 2], values.reshape(-1), alpha=values.numel())  # computed in int64
    out.view(-1).scatter_(0, torch.sort(key).indices, reversal.spread)  # keys are distinct: any sort


def poison_family(values: Tensor, lo: int, hi: int) -> list[Tensor]:
    """The poisons of ``values``, a buffer whose values may lie in ``[lo, hi)``, in the order of
    :data:`POISONS`; each is of ``values``' shape and dtype and lies in ``[lo, hi)``.

    * ``reversed``: ``x_i < x_j`` gives ``p_i > p_j``, ties by position (``i < j``, ``x_i ==
      x_j`` gives ``p_i > p_j``), values spread over the range: all distinct when the range
      holds at least as many values as the buffer has elements;
    * ``highest``: every element ``hi - 1``;
    * ``reversed, ties swapped``: as ``reversed``, but ``i < j``, ``x_i == x_j`` gives
      ``p_i < p_j``;
    * ``lowest``: every element ``lo``.

    Why a reader of ``x`` cannot compute the same on all four: every comparison between two
    elements (``<``, ``<=``; ``==`` too when the reversed values are distinct) is false under one
    poison and true under another, and any function of values in ``[lo, hi)`` that is monotone
    in each of them (a sum, a maximum, a minimum, a count above a threshold) takes its least
    value under ``lowest`` and its greatest under ``highest``: unless it is the same for both, one
    of them changes it. A ``torch.unique``, an ``argsort``, the first element equal to a given
    one are functions of those comparisons.

    >>> lens = torch.tensor([3, 1, 3, 8], dtype=torch.int32)
    >>> [p.tolist() for p in poison_family(lens, 1, 9)]
    [[5, 7, 3, 1], [8, 8, 8, 8], [3, 7, 5, 1], [1, 1, 1, 1]]
    """
    if not lo < hi:
        raise ValueError(f"poison_family needs a range lo < hi, got [{lo}, {hi})")
    reversal = _Reversal.of(values, lo, hi - lo)
    out = []
    for which in range(len(POISONS)):
        out.append(torch.empty_like(values, memory_format=torch.contiguous_format))
        _poison_into(out[-1], values, reversal, lo, hi - lo, which)
    return out


class Watcher(Protocol):
    """Told, on the forward stream, what the check does: how the runtime read observer learns
    when each buffer was released (``graph.verify`` implements it).

    On a CpuDevice every replay calls it; on CUDA only the capture does (a replayed graph
    runs no Python).
    """

    def stage(self, name: str, ledger: Ledger | None = None) -> AbstractContextManager[object]:
        """Around the execution of stage ``name`` (the observer watches inside; what it sees is a run
        of the lowered step's ``ledger``, through ``Ledger.watch``)."""
        ...

    def started(self, step: int) -> None: ...

    def released(self, check: CheckState, buffers: tuple[str, ...]) -> None:
        """A release point of ``buffers`` ran (``check.is_armed`` says which it released)."""
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

    ``poison=False`` or ``guard=False`` switch the overwriting or the write guard off (each
    check on its own); ``only`` poisons only those buffers: every other one is *held*, at its
    release point and after it, with what the scheduler wrote (still guarded), as if released
    only after the whole forward.

    >>> from readfence.core import ModelConfig, make_shared_state
    >>> cfg = ModelConfig(max_reqs=4, max_ctx=8)
    >>> live = make_shared_state(cfg)
    >>> check = CheckState(live, cfg)
    >>> lens = live["seq_lens"]; lens.copy_(torch.tensor([3, 1, 8, 3], dtype=torch.int32))
    tensor([3, 1, 8, 3], dtype=torch.int32)
    >>> check.expected["seq_lens"].copy_(lens); seen = []
    tensor([3, 1, 8, 3], dtype=torch.int32)
    >>> for step in range(4):     # the lengths within [1, 9) that the body reads after the release
    ...     check.start(step); check.arm(["seq_lens"]); check.poisoner(["seq_lens"])()
    ...     seen.append(lens.tolist()); check.restorer()()
    >>> seen
    [[5, 7, 1, 3], [8, 8, 8, 8], [3, 7, 1, 5], [1, 1, 1, 1]]
    >>> lens.tolist(), check.moved_buffers()
    ([3, 1, 8, 3], [])
    """

    def __init__(self, live: Mapping[str, Tensor], cfg: ModelConfig, *, watcher: Watcher | None = None,
                 only: Iterable[str] | None = None, poison: bool = True, guard: bool = True) -> None:
        self.names = tuple(SHARED_BUFFERS)
        self.live = live
        self.index = {b: i for i, b in enumerate(self.names)}
        ranges = buffer_ranges(cfg)
        self.lo = {b: ranges[b][0] for b in self.names}
        self.span = {b: ranges[b][1] - ranges[b][0] for b in self.names}
        dev = next(iter(live.values())).device
        self.expected = {b: live[b].clone() for b in self.names}
        self.poison = {b: live[b].clone() for b in self.names}  # what the step's release points write
        self.reversal = {b: _Reversal.of(live[b], self.lo[b], self.span[b]) for b in self.names}
        n = len(self.names)
        self.armed = torch.zeros(n, dtype=torch.bool, device=dev)
        self.hit = torch.zeros(n, dtype=torch.bool, device=dev)
        self.moved = torch.zeros(n, dtype=torch.bool, device=dev)
        self.log: list[tuple[int, Tensor]] = []
        self.watcher = watcher
        self.guard = bool(guard)
        chosen = None if only is None else tuple(only)
        unknown = sorted(set(chosen or ()) - set(self.names))
        if unknown:
            raise ValueError(f"CheckState(only=...) names no shared buffer {unknown}; they are {list(self.names)}")
        # the buffers a release point overwrites; the others are held (to find which buffer a
        # differing run read late, every buffer but one is held)
        self.poisoned = frozenset(self.names if chosen is None else chosen) if poison else frozenset()

    # -- eager launches, once per step or per replay ------------------------------------------
    def start(self, step: int) -> None:
        """A new step: nothing poisoned yet; make its poison (``POISONS[step % 4]``) of what the
        scheduler wrote, which every buffer holds until its release point (the guard sees to it).

        Made here, once per step and outside any captured graph, the release points only copy it.
        """
        which = step % len(POISONS)
        with _quiet():
            for b in self.poisoned:
                _poison_into(self.poison[b], self.expected[b], self.reversal[b], self.lo[b], self.span[b], which)
        self.hit.zero_()
        self.moved.zero_()
        if self.watcher is not None:
            self.watcher.started(step)

    def arm(self, buffers: Iterable[str]) -> None:
        """The release points of the next replay release ``buffers`` (and only those)."""
        self.armed.zero_()
        for b in buffers:
            self.armed[self.index[b]] = True

    def finish(self, step: int) -> None:
        """End of a step: keep its guard flags."""
        self.log.append((step, self.moved.clone()))

    # -- actions placed in the stream (captured into graphs) -----------------------------------
    def poisoner(self, buffers: Sequence[str]) -> Callable[[], None]:
        """The action at a release point of ``buffers``: guard, poison (when armed)."""
        names = tuple(b for b in self.names if b in set(buffers))
        slots = [(b, self.index[b], b in self.poisoned) for b in names]
        guard = self.guard

        def poison() -> None:
            with _quiet():
                for b, i, poisoned in slots:
                    live, arm = self.live[b], self.armed[i]
                    if guard:
                        self.moved[i] |= arm & live.ne(self.expected[b]).any()
                    if poisoned:
                        live.copy_(torch.where(arm, self.poison[b], live))
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
        slots = [(b, i, b in self.poisoned) for b, i in self.index.items()]
        guard = self.guard

        def restore() -> None:
            with _quiet():
                for b, i, poisoned in slots:
                    live = self.live[b]
                    if not poisoned:
                        if guard:
                            self.moved[i] |= live.ne(self.expected[b]).any()
                        continue
                    hit = self.hit[i]
                    if guard:
                        self.moved[i] |= torch.where(hit, live.ne(self.poison[b]).any(),
                                                     live.ne(self.expected[b]).any())
                    live.copy_(torch.where(hit, self.expected[b], live))
            if self.watcher is not None:
                self.watcher.restored()

        return restore

    def is_armed(self, buffer: str) -> bool:
        """Whether the current replay releases ``buffer`` (reads a device flag: host code only)."""
        return bool(self.armed[self.index[buffer]])

    def moved_buffers(self) -> list[tuple[int, str]]:
        """``(step, buffer)`` for every buffer the forward changed: before its release, after
        it, or, released only after the whole forward, during the step."""
        out = []
        for step, flags in self.log:
            out += [(step, b) for b, i in self.index.items() if bool(flags[i])]
        return out


def poison_points(placements: Mapping[str, Placement]) -> dict[Placement, tuple[str, ...]]:
    """Per placement (fence point), the buffers it releases inside the step.

    ``UNKNOWN`` (after the whole forward) releases nothing the step could still read.
    """
    out: dict[Placement, list[str]] = {}
    for b, p in placements.items():
        if p.end is not ReadEnd.UNKNOWN:
            out.setdefault(p, []).append(b)
    return {p: tuple(bs) for p, bs in out.items()}


__all__ = ["POISONS", "CheckState", "Watcher", "poison_family", "poison_points"]
