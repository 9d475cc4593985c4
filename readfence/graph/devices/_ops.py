"""The static op items a launch or a graph declares: what it reads, records and writes.

A launch (``stream.launch(fn, ops=[...])``) or a captured graph carries an ordered list of
these items; devices pass the list to their observers (e.g. the :class:`Sanitizer`) at
enqueue time, and use the ``Record`` items to know which events a launched function will
record from inside with ``device.record_here(event)``.

``step`` may be left ``None`` in a static list (a graph is captured once and replayed every
step); ``launch(..., step=i)`` / ``graph.replay(..., step=i)`` binds it.

>>> Read("req_to_token", "attend_0").at(7)
Read(buffer='req_to_token', node='attend_0', step=7)
>>> bind_step([Read("swa_map", "n1"), Write("swa_map", label="sched")], 3)
(Read(buffer='swa_map', node='n1', step=3), Write(buffer='swa_map', step=3, label='sched'))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs


@attrs.frozen
class Read:
    """``node`` reads ``buffer`` on behalf of decode step ``step``."""

    buffer: str
    node: str
    step: int | None = None

    def at(self, step: int) -> Read:
        """This read with its step bound (an explicit step is kept)."""
        return self if self.step is not None else Read(self.buffer, self.node, step)  # evolve costs 3x


@attrs.frozen
class Write:
    """A write of ``buffer`` that produces decode step ``step``'s state."""

    buffer: str
    step: int | None = None
    label: str = ""

    def at(self, step: int) -> Write:
        """This write with its step bound (an explicit step is kept)."""
        return self if self.step is not None else Write(self.buffer, step, self.label)


@attrs.frozen
class Record:
    """The launched function records ``event`` at this point (``device.record_here(event)``)."""

    event: Any

    def at(self, step: int) -> Record:
        return self


#: What a launched function declares it does to memory or events, in order: a :class:`Read`, a
#: :class:`Write` or a :class:`Record`.
Op = Read | Write | Record


def bind_step(ops: Iterable[Op], step: int | None) -> tuple[Op, ...]:
    """The ops with every unbound ``step`` set to ``step`` (unchanged when ``step`` is None)."""
    items = tuple(ops)
    for op in items:
        if not isinstance(op, (Read, Write, Record)):
            raise TypeError(f"ops items must be Read, Write or Record, got {op!r}")
    if step is None:
        return items
    return tuple(op.at(step) for op in items)


def records_in(ops: Iterable[Op]) -> tuple[Any, ...]:
    """The events of the ``Record`` items, in order."""
    return tuple(op.event for op in ops if isinstance(op, Record))
