"""Fence policies: how finely a lowered step publishes the release of shared buffers."""

from __future__ import annotations

import enum

from readfence.effects.internal import parse_member


class Policy(enum.Enum):
    """Where a lowered step records the events the scheduler waits on.

    * ``COARSE``: one event after the whole forward (no read-end information used).
    * ``JOINED``: one event at the join of all buffers' ends (what SGLang does).
    * ``PER_BUFFER``: one event per distinct declared end; each buffer released on its own.
    * ``EXACT``: per buffer, right after the traced node that last reads it.

    >>> Policy.parse("per_buffer")
    <Policy.PER_BUFFER: 'per_buffer'>
    """

    COARSE = "coarse"
    JOINED = "joined"
    PER_BUFFER = "per_buffer"
    EXACT = "exact"

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str) -> Policy:
        """The policy named ``text`` (case-insensitive); ``ValueError`` lists the policies."""
        return parse_member(Policy, text, "policy")
