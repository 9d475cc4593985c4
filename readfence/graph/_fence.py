"""Fences: what one lowered step publishes, per shared buffer, for the scheduler to wait on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ._errors import DeviceError


class RingWrapError(DeviceError):
    """A fence's event was re-recorded by a later step before this wait was bound."""


class Bound:
    """One event generation: the record a wait must bind to (immutable).

    A plain slotted class rather than attrs: ``Lowered.run`` makes one per fence point per
    step, on the host's hot path. Equality and hash are over ``(event, generation)``.

    >>> class Ev:
    ...     name, generation = "e", 3
    >>> ev = Ev()
    >>> b = Bound.latest(ev)
    >>> (b.generation, b == Bound(ev, 3), b.handle is None)
    (3, True, True)
    """

    __slots__ = ("event", "generation", "handle")

    event: Any
    generation: int
    handle: Any  # CpuDevice: the Generation (timestamps); None elsewhere

    def __init__(self, event: Any, generation: int, handle: Any = None) -> None:
        _set = object.__setattr__
        _set(self, "event", event)
        _set(self, "generation", generation)
        _set(self, "handle", handle)

    @classmethod
    def latest(cls, event: Any) -> Bound:
        """The event's latest enqueued record (what a wait called now would bind to)."""
        return cls(event, event.generation, getattr(event, "latest", None))

    def __setattr__(self, name: str, value: Any) -> None:
        raise attrs.exceptions.FrozenInstanceError()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bound):
            return NotImplemented
        return self.event is other.event and self.generation == other.generation

    def __hash__(self) -> int:
        return hash((id(self.event), self.generation))

    def __repr__(self) -> str:
        return f"Bound(event={getattr(self.event, 'name', self.event)!r}, generation={self.generation})"

    def synchronize(self, what: str, timeout: float | None = None) -> None:
        """Host wait for this very generation (where the device can tell generations apart)."""
        if self.handle is not None:
            self.handle.synchronize(self.event.device._timeout(timeout))
        else:
            self.check(what).synchronize(timeout)

    def check(self, what: str) -> Any:
        current = self.event.generation
        if current != self.generation:
            raise RingWrapError(
                f"{what}: event {self.event.name!r} was recorded again (generation {current}, "
                f"this fence is generation {self.generation}) before the wait was bound; the "
                "event ring is too small for the steps in flight: lower with a larger ring_size"
            )
        return self.event


@attrs.frozen
class Fence:
    """Per buffer, the event generation after which the scheduler may overwrite it.

    A buffer mapped to ``None`` is not read by the step: no wait is needed. ``done`` fires
    when the whole forward (outputs included) has finished.

    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     ev = dev.event("pre"); s = dev.stream("forward"); s.record(ev)
    ...     f = Fence("demo", 0, {"seq_lens": Bound(ev, ev.generation), "swa_map": None},
    ...               Bound(ev, ev.generation))
    ...     f.synchronize(["seq_lens", "swa_map"], timeout=5)
    ...     f.released("seq_lens")
    True
    """

    owner: str
    step: int
    per_buffer: Mapping[str, Bound | None]
    done: Bound
    probes: Mapping[str, Bound] = attrs.field(factory=dict, eq=False)  # last reads (measure=True)
    # the distinct bounds of per_buffer, when the maker knows them (a wait on every buffer)
    distinct: tuple[Bound, ...] | None = attrs.field(default=None, eq=False, repr=False)

    def last_read_time(self, buffer: str) -> float | None:
        """When the step's last read of ``buffer`` finished (CpuDevice, ``measure=True``)."""
        bound = self.probes.get(buffer)
        return None if bound is None else _timestamp(bound)

    def slack(self, buffer: str) -> float | None:
        """Seconds from the last read of ``buffer`` to its release (None when unmeasured)."""
        read, release = self.last_read_time(buffer), self.release_time(buffer)
        return None if read is None or release is None else release - read

    def _bounds(self, buffers: Iterable[str] | None) -> list[Bound]:
        if buffers is None:  # every buffer: no name to check
            if self.distinct is not None:
                return self.distinct
            return list({id(b.event): b for b in self.per_buffer.values() if b is not None}.values())
        names = list(buffers)
        unknown = [b for b in names if b not in self.per_buffer]
        if unknown:
            raise KeyError(
                f"fence of {self.owner} (step {self.step}) publishes no buffer {unknown}; "
                f"it publishes {sorted(self.per_buffer)}"
            )
        bounds = {id(b.event): b for n in names if (b := self.per_buffer[n]) is not None}
        return list(bounds.values())

    def wait(self, stream: Any, buffers: Iterable[str] | None = None) -> None:
        """Device-side: later work on ``stream`` waits until ``buffers`` (default: all) are free."""
        for bound in self.distinct if buffers is None and self.distinct is not None else self._bounds(buffers):
            event = bound.event
            if event.generation != bound.generation:
                bound.check(f"fence of {self.owner} step {self.step}")  # raises RingWrapError
            stream.wait(event)

    def synchronize(self, buffers: Iterable[str] | None = None, *, timeout: float | None = None) -> None:
        """Host wait (with timeout) until ``buffers`` (default: all) may be overwritten."""
        for bound in self._bounds(buffers):
            what = f"fence of {self.owner} step {self.step}"
            bound.check(what)
            bound.synchronize(what, timeout)

    def wait_done(self, timeout: float | None = None) -> None:
        """Host wait (with timeout) for the whole forward of this step, outputs included."""
        self.done.synchronize(f"outputs of {self.owner} step {self.step}", timeout)

    def released(self, buffer: str) -> bool:
        """Whether ``buffer`` may be overwritten now (its event fired, or it is not read)."""
        bound = self.per_buffer[buffer]
        return bound is None or bound.event.query()

    def release_time(self, buffer: str) -> float | None:
        """When ``buffer``'s event fired (``time.perf_counter``; CpuDevice only), else None."""
        bound = self.per_buffer[buffer]
        if bound is None:
            return None
        return _timestamp(bound)


def _timestamp(bound: Bound) -> float | None:
    return None if bound.handle is None else bound.handle.timestamp
