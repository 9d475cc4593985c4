"""Fences: what one lowered step publishes, per shared buffer, for the scheduler to wait on."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from ..devices import DeviceError, Event, Generation, Stream

NO_PROBES: Mapping[str, Bound] = MappingProxyType({})


class RingWrapError(DeviceError):
    """A fence's event was recorded again before this wait was bound: by a later step (the
    event ring is too small for the steps in flight), or by anyone but its graph's runs."""


class ForeignEventError(DeviceError):
    """A wait was to be bound to an event of a graph other than the one the step replayed (or
    to an event two graphs record): refused, naming both graphs."""


#: Per event, the lowered graphs (labels) that record it: each should have exactly one.
_OWNERS: weakref.WeakKeyDictionary[Event, list[str]] = weakref.WeakKeyDictionary()


def claim_events(owner: str, events: Iterable[Event]) -> None:
    """Note that the lowered graph ``owner`` records ``events`` (lowering calls this for every
    event a ring slot is given). An event claimed twice is shared: :func:`check_owned` refuses
    a wait bound to it.

    >>> class Ev:
    ...     name = "e"
    >>> e = Ev()
    >>> claim_events("graph A", [e]); claim_events("graph B", [e])
    >>> event_owners(e)
    ('graph A', 'graph B')
    """
    for event in events:
        _OWNERS.setdefault(event, []).append(owner)


def event_owners(event: Event) -> tuple[str, ...]:
    """The lowered graphs that claimed ``event`` (:func:`claim_events`), in claim order."""
    return tuple(_OWNERS.get(event, ()))


def check_owned(fence: Fence, graphs: Iterable[str], what: str) -> None:
    """Refuse (:class:`ForeignEventError`) a wait on ``fence`` unless each of its events is
    recorded by exactly one lowered graph, one of ``graphs`` (the graphs the step replayed).

    The error names the graph the step replayed and the other graph: an event shared by two
    graphs (one reusable event for every batch size), or a fence kept from another step.
    """
    mine = tuple(graphs)
    for event in fence.events:
        owners = event_owners(event)
        name = getattr(event, "name", repr(event))
        others = [o for o in owners if o not in mine]
        if others:
            raise ForeignEventError(
                f"{what}: the step replayed graph {mine[0]!r}, but its wait would bind event {name!r}, which graph "
                f"{others[0]!r} records; each captured graph keeps its own event ring: lower every graph with events "
                f"of its own")
        if len(owners) > 1:
            raise ForeignEventError(
                f"{what}: event {name!r} of graph {owners[0]!r} is recorded at {len(owners)} points of it; each point "
                f"and ring slot needs an event of its own")
        if not owners:
            raise ForeignEventError(
                f"{what}: the step replayed graph {mine[0]!r}, but its wait would bind event {name!r}, which no "
                f"lowered graph records")


class Bound(tuple):
    """One event generation: the record a wait must bind to.

    An immutable tuple ``(event, generation, handle)``: a :class:`Fence` builds one when asked
    about an event (``per_buffer``, ``done``, a host wait), not per step. ``handle`` is the
    CpuDevice ``Generation`` (for timestamps), ``None`` elsewhere; equality and hash are over
    ``(event, generation)``.

    >>> class Ev:
    ...     name, generation = "e", 3
    >>> ev = Ev()
    >>> b = Bound.latest(ev)
    >>> (b.generation, b == Bound(ev, 3), b.handle is None)
    (3, True, True)
    """

    __slots__ = ()

    def __new__(cls, event: Event, generation: int, handle: Generation | None = None) -> Bound:
        return tuple.__new__(cls, (event, generation, handle))

    event = property(operator.itemgetter(0))
    generation = property(operator.itemgetter(1))
    handle = property(operator.itemgetter(2))

    @classmethod
    def latest(cls, event: Event) -> Bound:
        """The event's latest enqueued record (what a wait called now would bind to)."""
        return tuple.__new__(cls, (event, event.generation, getattr(event, "latest", None)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bound):
            return NotImplemented
        return self[0] is other[0] and self[1] == other[1]

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((id(self[0]), self[1]))

    def __repr__(self) -> str:
        return f"Bound(event={getattr(self.event, 'name', self.event)!r}, generation={self.generation})"

    def synchronize(self, what: str, timeout: float | None = None) -> None:
        """Host wait until this generation has fired.

        With a per-record handle (CpuDevice), that record. Without one (CUDA: an event is only
        its latest record) the event's latest record, when it is this one or a later record
        enqueued on the same single stream: a stream runs in order, so the later record fires
        after this one and waiting for it is sound (at worst later). A later record on another
        stream cannot stand for this one: :class:`RingWrapError`.
        """
        if self.handle is not None:
            self.handle.synchronize(self.event.device._timeout(timeout))
            return
        event = self.event
        if event.generation != self.generation and getattr(event, "single_stream", None) is None:
            self.check(what)
        event.synchronize(timeout)

    def check(self, what: str) -> Event:
        current = self.event.generation
        if current != self.generation:
            raise RingWrapError(
                f"{what}: event {self.event.name!r} was recorded again (generation {current}, "
                f"this fence is generation {self.generation}) before the wait was bound; the "
                "event ring is too small for the steps in flight (lower with a larger ring_size), "
                "or something else records the event (each lowered graph needs events of its own)"
            )
        return self.event


def covering_all(events: Sequence[Event]) -> range:
    """The index of the latest of a lowered step's events before ``done`` (none if it has none)."""
    return range(len(events) - 1)[-1:]


class SlotHead(NamedTuple):
    """What the fences of every run of one ring slot share (:func:`slot_head` makes it).

    A run's :class:`Fence` is this head, its step, its done handle and its ticket, so
    ``Lowered.run`` builds one small object per step over a head made once per slot (again
    only when a stopped step resyncs the slot).
    """

    owner: str  # the label of the lowered graph (or composite step)
    points: Mapping[str, int | None]  # buffer -> index of its event in ``events`` (None: no wait)
    events: Sequence[Event]  # the slot's events in plan order, then ``done``
    base: tuple[int, ...]  # per event, its generation before the slot's first run
    handles: Sequence[Generation | None] | None  # per event, its CpuDevice record (explicit generations only)
    probes: Mapping[str, Bound]  # per buffer, the probe after its last read (measured runs)
    covering: Sequence[int]  # the events a wait for every buffer binds
    waits: tuple[tuple[Event, int], ...]  # (event, base generation) of ``covering``, for ``Fence.wait``


def slot_head(owner: str, points: Mapping[str, int | None], events: Sequence[Event], base: tuple[int, ...],
              handles: Sequence[Generation | None] | None = None, probes: Mapping[str, Bound] = NO_PROBES,
              covering: Sequence[int] | None = None) -> SlotHead:
    """The :class:`SlotHead` of a ring slot. ``covering``: the events a wait for every buffer
    binds (default: the latest, see :func:`covering_all`).

    >>> head = slot_head("demo", {"seq_lens": 0}, ("pre", "done"), (4, 4))
    >>> head.covering, head.waits
    (range(0, 1), (('pre', 4),))
    """
    covering = covering_all(events) if covering is None else covering
    return SlotHead(owner, points, events, base, handles, probes, covering, tuple((events[i], base[i]) for i in covering))


class RunClock:
    """The runs of one event-ring slot of a lowered graph: a fence's ticket is one of them.

    Every run of a slot records each of its events exactly once, so run ``ticket`` of the slot
    recorded event ``i`` as generation ``base[i] + ticket``: a fence holds the slot's ``base``
    and its ticket instead of a tuple of generations read each step, and a wait that finds another generation
    knows the event was recorded again, by a later run (the ring wrapped) or by anyone else
    (an event shared with another graph).

    >>> clock = RunClock((0, 0, 0))
    >>> clock.runs += 1
    >>> clock
    RunClock(base=(0, 0, 0), runs=1)
    """

    __slots__ = ("base", "runs")

    def __init__(self, base: tuple[int, ...]) -> None:
        self.base, self.runs = base, 0

    def __repr__(self) -> str:
        return f"RunClock(base={self.base}, runs={self.runs})"


class Fence:
    """Per buffer, the event generation after which the scheduler may overwrite it.

    A buffer mapped to ``None`` is not read by the step: no wait is needed. ``done`` fires
    when the whole forward (outputs included) has finished. A read-only value, cheap to
    build: ``Lowered.run`` makes one per step on the host's hot path, so it holds the
    generations as a tuple of ints shared by every step of a ring slot plus this step's
    offset into it (a :class:`RunClock` ticket; 0 for explicit generations), and builds
    :class:`Bound` values only when asked. Its four private slots are the head
    (:func:`slot_head`: what a ring slot's runs share), the step, the done event's per-record
    handle and the ticket; the step issuer (``_issue``) fills them inline, as
    :func:`fence_of` does (a slots object costs 40% less to make and free than a tuple
    subclass, about 1% of a lowered step's host time in ``bench_overhead``).

    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     ev = dev.event("pre"); s = dev.stream("forward"); s.record(ev)
    ...     f = Fence("demo", 0, {"seq_lens": Bound(ev, ev.generation), "swa_map": None},
    ...               Bound(ev, ev.generation))
    ...     f.synchronize(["seq_lens", "swa_map"], timeout=5)
    ...     f.released("seq_lens")
    True
    """

    __slots__ = ("_head", "_step", "_done_handle", "_ticket")
    _head: SlotHead
    _step: int
    _done_handle: Generation | None
    _ticket: int

    def __init__(self, owner: str, step: int, per_buffer: Mapping[str, Bound | None], done: Bound,
                 probes: Mapping[str, Bound] | None = None) -> None:
        distinct: dict[int, int] = {}
        bounds: list[Bound] = []
        points: dict[str, int | None] = {}
        for buffer, bound in per_buffer.items():
            if bound is None:
                points[buffer] = None
                continue
            index = distinct.setdefault(id(bound.event), len(bounds))
            if index == len(bounds):
                bounds.append(bound)
            points[buffer] = index
        bounds.append(done)
        handles = tuple(b.handle for b in bounds)
        built = Fence.from_generations(
            owner, step, MappingProxyType(points), tuple(b.event for b in bounds), tuple(b.generation for b in bounds),
            None if all(h is None for h in handles[:-1]) else handles, {} if probes is None else probes,
            done.handle,
        )
        self._head, self._step, self._done_handle, self._ticket = built._head, built._step, built._done_handle, built._ticket

    @classmethod
    def from_generations(cls, owner: str, step: int, points: Mapping[str, int | None],
                         events: Sequence[Event], generations: Sequence[int], handles: Sequence[Generation | None] | None,
                         probes: Mapping[str, Bound], done_handle: Generation | None = None) -> Fence:
        """Buffer ``b`` is released by ``events[points[b]]`` at ``generations[points[b]]``.

        ``points[b]`` None: not read. The last event is the whole forward's (``done``). ``points`` and
        ``events`` are static per lowered graph and shared between steps: nothing is copied.
        ``handles`` (CpuDevice ``Generation`` records, for timestamps) may be ``None``;
        ``done_handle`` alone keeps the outputs waitable after the event ring wraps.
        """
        head = slot_head(owner, points, events, tuple(generations), handles, probes, range(len(events) - 1))
        return fence_of(head, step, done_handle, 0)

    @classmethod
    def from_ticket(cls, owner: str, step: int, points: Mapping[str, int | None], events: Sequence[Event],
                    clock: RunClock, ticket: int, handles: Sequence[Generation | None] | None = None,
                    probes: Mapping[str, Bound] = NO_PROBES, done_handle: Generation | None = None) -> Fence:
        """Like :meth:`from_generations`, for run ``ticket`` of the slot whose runs ``clock`` counts.

        The events are recorded on one stream in this order, so a wait for every buffer binds the
        latest alone (``covering``, static per slot). ``Lowered.run`` builds this fence inline on
        its hot path (the call is measurable there).
        """
        return fence_of(slot_head(owner, points, events, clock.base, handles, probes), step, done_handle, ticket)

    step = property(operator.attrgetter("_step"))

    @property
    def owner(self) -> str:
        """The label of the lowered graph (or composite step) that publishes this fence."""
        return self._head.owner

    @property
    def events(self) -> Sequence[Event]:
        """The events this fence's waits bind: one per release point, then ``done``."""
        return self._head.events

    @property
    def probes(self) -> Mapping[str, Bound]:
        """Per buffer, the probe recorded right after its last read (``measure=True`` only)."""
        return self._head.probes

    def _bound(self, i: int) -> Bound:
        head = self._head
        events, generations, handles = head.events, head.base, head.handles
        if handles is not None:
            handle = handles[i]
        else:
            handle = self._done_handle if i == len(events) - 1 else None
        return Bound(events[i], generations[i] + self._ticket, handle)

    @property
    def done(self) -> Bound:
        """The generation of the whole forward's end (outputs included)."""
        return self._bound(len(self._head.events) - 1)

    @property
    def distinct(self) -> tuple[Bound, ...]:
        """The distinct bounds (one per event), in execution order."""
        return tuple(self._bound(i) for i in range(len(self._head.events) - 1))

    @property
    def per_buffer(self) -> dict[str, Bound | None]:
        """Per published buffer, its bound generation (``None``: not read, no wait)."""
        return {b: None if i is None else self._bound(i) for b, i in self._head.points.items()}

    def __repr__(self) -> str:
        return f"Fence(owner={self.owner!r}, step={self.step}, per_buffer={self.per_buffer!r})"

    def last_read_time(self, buffer: str) -> float | None:
        """When the step's last read of ``buffer`` finished (CpuDevice, ``measure=True``)."""
        bound = self.probes.get(buffer)
        return None if bound is None else _timestamp(bound)

    def slack(self, buffer: str) -> float | None:
        """Seconds from the last read of ``buffer`` to its release (None when unmeasured)."""
        read, release = self.last_read_time(buffer), self.release_time(buffer)
        return None if read is None or release is None else release - read

    def _indices(self, buffers: Iterable[str] | None) -> Sequence[int]:
        """Indices of the distinct events guarding ``buffers`` (default: every buffer), in order."""
        if buffers is None:
            return range(len(self._head.events) - 1)
        index = self._head.points
        names = list(buffers)
        unknown = [b for b in names if b not in index]
        if unknown:
            raise KeyError(
                f"fence of {self.owner} (step {self.step}) publishes no buffer {unknown}; "
                f"it publishes {sorted(index)}"
            )
        return sorted({i for n in names if (i := index[n]) is not None})

    def _covering(self, buffers: Iterable[str] | None) -> Sequence[int]:
        """The events a wait for ``buffers`` must bind: a lowered step records its events on one
        stream in index order, so the latest covers the others (one wake-up of a waiting
        CpuDevice stream, not one per event); a fence built from bounds needs each of them."""
        if buffers is None:
            return self._head.covering
        indices = self._indices(buffers)
        return indices[-1:] if self._ticket else indices

    def wait(self, stream: Stream, buffers: Iterable[str] | None = None) -> None:
        """Device-side: later work on ``stream`` waits until ``buffers`` (default: all) are free."""
        ticket = self._ticket
        if buffers is None:
            for event, base in self._head.waits:
                if event.generation != base + ticket:
                    Bound(event, base + ticket).check(f"fence of {self.owner} step {self.step}")  # RingWrapError
                stream.wait(event)
            return
        for i in self._covering(buffers):
            stream.wait(self._bound(i).check(f"fence of {self.owner} step {self.step}"))

    def synchronize(self, buffers: Iterable[str] | None = None, *, timeout: float | None = None) -> None:
        """Host wait (with timeout) until ``buffers`` (default: all) may be overwritten."""
        what = f"fence of {self.owner} step {self.step}"
        for i in self._covering(buffers):
            bound = self._bound(i)
            bound.check(what)
            bound.synchronize(what, timeout)

    def wait_done(self, timeout: float | None = None) -> None:
        """Host wait (with timeout) for the whole forward of this step, outputs included."""
        self.done.synchronize(f"outputs of {self.owner} step {self.step}", timeout)

    def wait_end(self, stream: Stream) -> None:
        """Device-side: later work on ``stream`` waits for the whole forward of this step."""
        stream.wait(self.done.check(f"fence of {self.owner} step {self.step}"))

    def done_time(self) -> float | None:
        """When the whole forward finished (``time.perf_counter``; CpuDevice only), else None."""
        return _timestamp(self.done)

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


def fence_of(head: SlotHead, step: int, done_handle: Generation | None, ticket: int) -> Fence:
    """The fence of run ``ticket`` of the ring slot whose :func:`slot_head` is ``head``."""
    fence = object.__new__(Fence)
    fence._head = head
    fence._step = step
    fence._done_handle = done_handle
    fence._ticket = ticket
    return fence


def _timestamp(bound: Bound) -> float | None:
    return None if bound.handle is None else bound.handle.timestamp
