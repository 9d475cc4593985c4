"""Host staging buffers: where the scheduler stages a step's shared state for the copy that writes it.

An engine's scheduler fills a host buffer (pinned memory, a UVA buffer) with the next step's
page table and hands it to an asynchronous copy on the device. That copy reads its source when
it runs, not when it is enqueued: the host buffer is shared between the host, which refills it
for a later step, and the device, which still has to read it for an earlier one. Engines keep a
ring of such buffers and bound the steps they keep in flight, so that a buffer comes round
again only after its copy ran: with ``slots`` buffers, the host must have waited for the end of
the step that last used a buffer before it refills it.

A :class:`StagingRing` says how a loop stages: which buffer each step fills (:meth:`slot`) and
the latest step whose end the host waited for before filling it (:meth:`waited`). readfence's
own ring (:class:`Staging`) waits for the step ``in_flight`` back; an engine's class answers
from its own queue (a batch queue whose deferred path launches a step it does not count).
:func:`check_staging` replays the ring's answers step by step and names the first refill of a
buffer whose copy may not have run: the ring's depth against the steps it keeps in flight,
decided from the ring's own code rather than from its parameters.

``decode_loop(..., options=LoopOptions(staging=ring))`` runs the loop through the ring: every copy declares a read
of its host buffer and every refill a host write (the race sanitizer sees a refill racing a
copy), and with ``held=True`` each step's copy waits until the host waits on that step or the
loop ends, the latest its own waits allow: a refill that races a copy then always wins, and
the outputs differ from the serial run deterministically.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from readfence.core.internal import positive_int
from readfence.effects import ReadfenceError

from ..devices import Device, Event


@runtime_checkable
class StagingRing(Protocol):
    """How a loop stages each step's shared state in host buffers (see the module docstring)."""

    @property
    def slots(self) -> int | None:
        """How many host buffers the ring has (``None``: a fresh one for every step)."""
        ...

    @property
    def held(self) -> bool:
        """Whether each step's copy is held until the host waits on that step (a deterministic check)."""
        ...

    def slot(self, step: int) -> int:
        """The host buffer ``step`` is staged in (``step`` itself when there is one per step)."""
        ...

    def waited(self, step: int) -> int | None:
        """The latest step whose end the host has waited for before it fills ``step``'s buffer
        (``None``: none)."""
        ...


class StagingRingError(ReadfenceError, ValueError):
    """A staging ring refills a host buffer before the copy of the step that last used it has
    surely run: fewer buffers than the steps the loop keeps in flight."""

    def __init__(self, message: str, *, step: int, slot: int, reader: int, waited: int | None) -> None:
        super().__init__(message)
        self.step, self.slot, self.reader, self.waited = step, slot, reader, waited


@attrs.frozen
class Staging:
    """readfence's staging ring: ``slots`` host buffers used round robin (``None``: a fresh buffer per
    step); before it fills step ``j``'s, the host waits for step ``j - in_flight`` to end
    (default: ``slots``, the most the ring allows). ``held``: see :class:`StagingRing`.

    >>> Staging(2).slot(5), Staging(2).waited(5), Staging(2, in_flight=3).waited(5)
    (1, 3, 2)
    """

    slots: int | None = attrs.field()
    in_flight: int | None = attrs.field(default=None)
    held: bool = False

    @slots.validator
    def _check_slots(self, _attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            positive_int("Staging.slots", value)

    @in_flight.validator
    def _check_in_flight(self, _attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            positive_int("Staging.in_flight", value)
        elif self.slots is None:
            raise ValueError("Staging(slots=None) stages each step in a fresh buffer: give in_flight, the steps the "
                             "host keeps launched ahead")

    @property
    def depth(self) -> int:
        """The steps the host keeps in flight."""
        return self.in_flight if self.in_flight is not None else self.slots  # type: ignore[return-value]

    def slot(self, step: int) -> int:
        return step if self.slots is None else step % self.slots

    def waited(self, step: int) -> int | None:
        w = step - self.depth
        return w if w >= 0 else None


def check_ring(ring: object) -> StagingRing:
    """``ring`` if it is a :class:`StagingRing`, else a ``TypeError`` naming what it is."""
    if not isinstance(ring, StagingRing):
        raise TypeError(f"staging must be a readfence.graph.runtime.Staging or an object with slots, held, slot(step) "
                        f"and waited(step), got {ring!r} ({type(ring).__name__})")
    return ring


def check_staging(ring: StagingRing, steps: int = 16) -> StagingRingError | None:
    """The first refill of a host buffer whose last copy may not have run over ``steps`` steps, or
    ``None``: each step's buffer is refilled only after the host waited for the end of the step
    that last used it.

    >>> print(check_staging(Staging(2, in_flight=3)))
    step 2 refills host buffer 0, which step 0's copy reads, but the host waited for no step: 2 buffers for 3 steps in flight
    >>> check_staging(Staging(2)) is None, check_staging(Staging(None, in_flight=5)) is None
    (True, True)
    """
    check_ring(ring)
    positive_int("steps", steps)
    last: dict[int, int] = {}
    in_flight = 0
    for step in range(steps):
        slot, waited = ring.slot(step), ring.waited(step)
        in_flight = max(in_flight, step - (-1 if waited is None else waited))
        reader = last.get(slot)
        if reader is not None and (waited is None or waited < reader):
            since = "the host waited for no step" if waited is None else f"the host waited only for step {waited} to end"
            count = "a buffer per step" if ring.slots is None else f"{ring.slots} buffers"
            return StagingRingError(
                f"step {step} refills host buffer {slot}, which step {reader}'s copy reads, but {since}: {count} for "
                f"{in_flight} steps in flight", step=step, slot=slot, reader=reader, waited=waited)
        last[slot] = step
    return None


def staging_name(slot: int) -> str:
    """The name the race sanitizer knows host buffer ``slot`` by.

    >>> staging_name(1)
    'staging[1]'
    """
    return f"staging[{slot}]"


class Holds:
    """Each step's copy held until the host waits on that step or the loop ends (a ring's ``held``).

    One gate per step on a ``hold`` stream: a launch that blocks until the host opens it, then a
    record the copy waits on. Opening step ``i`` opens every earlier one; :meth:`open_all` at the
    end (and on an error: nothing is left blocked).
    """

    def __init__(self, device: Device, steps: int, timeout: float) -> None:
        self._gates = [threading.Event() for _ in range(steps)]
        self.events: list[Event] = []
        stream = device.stream("hold")
        for i, gate in enumerate(self._gates):
            stream.launch(gate.wait, timeout, label=f"hold step {i}")
            event = device.event(f"hold/{i}")
            stream.record(event)
            self.events.append(event)

    def open(self, step: int) -> None:
        for gate in self._gates[: step + 1]:
            gate.set()

    def open_all(self) -> None:
        self.open(len(self._gates) - 1)


def host_write(device: Device, buffer: str, step: int, label: str) -> None:
    """Tell the device's observers (the race sanitizer) that the host wrote ``buffer`` for ``step``."""
    for observer in getattr(device, "observers", ()):
        write = getattr(observer, "host_write", None)
        if callable(write):
            write(buffer, step, label)


def ring_slots(ring: StagingRing, steps: int) -> Sequence[int]:
    """The distinct host buffers ``steps`` steps use, in order of first use."""
    return tuple(dict.fromkeys(ring.slot(i) for i in range(steps)))


__all__ = ["Holds", "Staging", "StagingRing", "StagingRingError", "check_ring", "check_staging", "host_write",
           "ring_slots", "staging_name"]
