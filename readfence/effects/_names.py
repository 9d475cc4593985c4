"""Parsing enum members by name, with an error that lists what is allowed."""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def parse_member(cls: type[E], text: str, what: str) -> E:
    """The member of ``cls`` named ``text`` (case-insensitive, ``-`` as ``_``).

    >>> from readfence.effects import ReadEnd
    >>> parse_member(ReadEnd, "in-replay", "read end")
    <ReadEnd.IN_REPLAY: 2>
    >>> parse_member(ReadEnd, "later", "read end")
    Traceback (most recent call last):
    ...
    ValueError: unknown read end 'later'; expected one of NONE, PRE_REPLAY, IN_REPLAY, POST_REPLAY, UNKNOWN
    """
    key = str(text).strip().upper().replace("-", "_")
    if key in cls.__members__:
        return cls[key]
    names = ", ".join(m.name for m in cls)
    raise ValueError(f"unknown {what} {text!r}; expected one of {names}")
