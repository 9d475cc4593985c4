"""The read-end chain: when, within one forward step, a buffer is last read."""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable

from ._names import parse_member


@functools.total_ordering
class ReadEnd(enum.Enum):
    """The stage of a step at which a shared buffer's last read happens.

    A chain, ordered ``NONE < PRE_REPLAY < IN_REPLAY < POST_REPLAY < UNKNOWN``; ``|`` is the
    join (the later end). Deliberately not an ``IntEnum``: ``IN_REPLAY | PRE_REPLAY`` must be
    ``IN_REPLAY``, not the bitwise-or ``POST_REPLAY``.

    >>> ReadEnd.IN_REPLAY | ReadEnd.PRE_REPLAY
    <ReadEnd.IN_REPLAY: 2>
    >>> ReadEnd.join_all([])
    <ReadEnd.NONE: 0>
    """

    NONE = 0
    PRE_REPLAY = 1
    IN_REPLAY = 2
    POST_REPLAY = 3
    UNKNOWN = 4

    @property
    def rank(self) -> int:
        return self.value

    def __lt__(self, other: ReadEnd) -> bool:
        if not isinstance(other, ReadEnd):
            return NotImplemented
        return self.value < other.value

    def __or__(self, other: ReadEnd) -> ReadEnd:
        if not isinstance(other, ReadEnd):
            return NotImplemented
        return self if self.value >= other.value else other

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def join(a: ReadEnd, b: ReadEnd) -> ReadEnd:
        """The later of two ends (least upper bound in the chain).

        >>> ReadEnd.join(ReadEnd.POST_REPLAY, ReadEnd.IN_REPLAY)
        <ReadEnd.POST_REPLAY: 3>
        """
        return ReadEnd._check(a) | ReadEnd._check(b)

    @staticmethod
    def join_all(ends: Iterable[ReadEnd]) -> ReadEnd:
        """Join of any number of ends; the empty join is the bottom ``NONE``.

        >>> ReadEnd.join_all([ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY])
        <ReadEnd.IN_REPLAY: 2>
        """
        out = ReadEnd.NONE
        for end in ends:
            out = out | ReadEnd._check(end)
        return out

    @staticmethod
    def parse(text: str) -> ReadEnd:
        """The end named ``text`` (case-insensitive), or a ``ValueError`` listing the names.

        >>> ReadEnd.parse("in_replay")
        <ReadEnd.IN_REPLAY: 2>
        """
        return parse_member(ReadEnd, text, "read end")

    @staticmethod
    def _check(value: object) -> ReadEnd:
        if not isinstance(value, ReadEnd):
            raise TypeError(f"expected a ReadEnd, got {value!r} ({type(value).__name__})")
        return value
