"""Forward modes of one engine step."""

from __future__ import annotations

import enum

from readfence.effects.internal import parse_member


class ForwardMode(enum.Enum):
    """What a forward pass does; it decides which stage of a backend reads what.

    >>> ForwardMode.parse("target_verify")
    <ForwardMode.TARGET_VERIFY: 'target_verify'>
    """

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    EXTEND = "extend"
    IDLE = "idle"

    @property
    def uses_graph(self) -> bool:
        """Replayed from a captured graph (decode-like modes); EXTEND runs eagerly."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str) -> ForwardMode:
        """The mode named ``text`` (case-insensitive); ``ValueError`` lists the modes."""
        return parse_member(ForwardMode, text, "forward mode")
