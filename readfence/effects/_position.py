"""Read positions across the phases of a multi-phase step: ``(phase, end)``, lexicographic.

A speculative step runs several phases (draft decode k times, target verify, draft extend),
each a lowered graph with its own read ends. A buffer's last read is then a *position*;
positions form a chain (so the join still decides), and the phase holding the maximum is
the one that publishes the buffer's fence: ownership is derived, never configured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from ._read_effect import ReadEffect
from ._read_end import ReadEnd


@attrs.frozen(order=True)
class Position:
    """Phase index and read end of a read; ``Position.bottom()`` is "not read in this step".

    >>> Position(0, ReadEnd.POST_REPLAY) < Position(1, ReadEnd.PRE_REPLAY)
    True
    >>> Position.of(2, ReadEnd.NONE) == Position.bottom()
    True
    """

    phase: int
    end: ReadEnd = attrs.field(order=lambda e: e.value)

    @staticmethod
    def bottom() -> Position:
        return Position(-1, ReadEnd.NONE)

    @staticmethod
    def of(phase: int, end: ReadEnd) -> Position:
        """The position of a read ending at ``end`` in ``phase``; unread is bottom."""
        return Position.bottom() if end is ReadEnd.NONE else Position(phase, end)

    def __or__(self, other: Position) -> Position:
        if not isinstance(other, Position):
            return NotImplemented
        return max(self, other)

    @staticmethod
    def join_all(positions: Iterable[Position]) -> Position:
        return max(positions, default=Position.bottom())


def publish_positions(effects: Sequence[ReadEffect], buffers: Iterable[str]) -> dict[str, Position]:
    """Per buffer, the position of its last read over the phases (``effects[i]`` = phase i).

    The publishing phase of ``b`` is ``result[b].phase`` (``-1``: no phase reads it).

    >>> verify = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY})
    >>> extend = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY})
    >>> publish_positions([verify, extend], ["req_to_token", "seq_lens"])["req_to_token"]
    Position(phase=1, end=<ReadEnd.PRE_REPLAY: 1>)
    """
    return {
        b: Position.join_all(Position.of(i, e[b]) for i, e in enumerate(effects)) for b in buffers
    }
