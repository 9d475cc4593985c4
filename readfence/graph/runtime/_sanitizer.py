"""A graph-aware race sanitizer: vector clocks per stream plus a host agent.

It is driven *logically*, at enqueue time, by a device's observer calls (or by hand), so it
is deterministic and identical on CPU and CUDA, and it sees inside graph replays because each
launch and replay carries its static ``ops`` list (``Read``/``Record``/``Write``), which
PyTorch's CUDA sanitizer cannot.

Clock rules (agents: each stream by name, and the host ``"<host>"``):

* every op enqueued on a stream first merges the host clock (everything the host did or
  learned before enqueueing happens before the op), then ticks the stream's component; each
  ``Read``/``Record``/``Write`` item of a launch ticks it again, in order;
* a record snapshots the stream's clock into the event (the generation a later wait binds to);
* a wait merges the event's latest snapshot into the waiting stream;
* a host synchronize (event, stream or device) merges into the host clock; a host write
  ticks the host's component.

Host enqueueing alone orders nothing across streams: only waits and host synchronizes do.

A write of buffer ``b`` for step ``s`` is a race if some read of ``b`` by an earlier step is
not ordered before it (``write-after-read``); a read of ``b`` for step ``s`` is a race if the
latest write of ``b`` for a step ``<= s`` is not ordered before it (``read-before-write``).

>>> san = Sanitizer()
>>> san.on_launch("forward", "replay", [Read("req_to_token", "attend", 0)])
>>> san.on_launch("schedule", "write", [Write("req_to_token", 1, "sched")])   # no wait!
>>> print(san.violations[0])  # doctest: +NORMALIZE_WHITESPACE
write-after-read race on 'req_to_token': the write for step 1 ('sched' on 'schedule') is not
ordered after node 'attend' of step 0 reading it on 'forward'
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from readfence.effects import ReadfenceError

from ..devices import DeviceObserver, Event, Op, Read, Record, Write

HOST = "<host>"
"""The host agent's name in vector clocks and violations."""

Clock = dict[str, int]


@attrs.frozen
class Violation:
    """A race found by the :class:`Sanitizer` (``str()`` is a one-line explanation)."""

    kind: str  # "write-after-read" or "read-before-write"
    buffer: str
    reading_node: str
    read_step: int
    reader: str  # the reading stream
    write_step: int
    writer: str  # the writing stream, or "<host>"
    write_label: str

    def __str__(self) -> str:
        write = f"{self.write_label!r} on {self.writer!r}"
        if self.kind == "write-after-read":
            return (
                f"write-after-read race on {self.buffer!r}: the write for step {self.write_step} "
                f"({write}) is not ordered after node {self.reading_node!r} of step "
                f"{self.read_step} reading it on {self.reader!r}"
            )
        return (
            f"read-before-write race on {self.buffer!r}: node {self.reading_node!r} of step "
            f"{self.read_step} on {self.reader!r} is not ordered after the write for step "
            f"{self.write_step} ({write})"
        )


class SanitizerError(ReadfenceError, AssertionError):
    """Raised by :meth:`Sanitizer.assert_clean` (or at once with ``raise_on_violation``)."""


class _ReadLog:
    """The reads of one buffer by one stream that can still matter.

    Reads by one stream are totally ordered, so among the reads of steps below the buffer's
    write watermark only the latest can decide a later check: ``older`` keeps just that one.
    ``recent`` keeps the latest read per step at or above the watermark.
    """

    __slots__ = ("older", "recent")

    def __init__(self) -> None:
        self.older: tuple[int, str, int] | None = None  # (clock, node, step)
        self.recent: dict[int, tuple[int, str]] = {}  # step -> (clock, node)

    def add(self, c: int, node: str, step: int, watermark: int | None) -> None:
        if watermark is not None and step < watermark:
            if self.older is None or c > self.older[0]:
                self.older = (c, node, step)
        else:
            self.recent[step] = (c, node)

    def last_before(self, step: int) -> tuple[int, str, int] | None:
        best = self.older
        for s, (c, node) in self.recent.items():
            if s < step and (best is None or c > best[0]):
                best = (c, node, s)
        return best

    def collapse(self, watermark: int) -> None:
        for s in [s for s in self.recent if s < watermark]:
            c, node = self.recent.pop(s)
            if self.older is None or c > self.older[0]:
                self.older = (c, node, s)

    def __len__(self) -> int:
        return len(self.recent) + (self.older is not None)


class Sanitizer(DeviceObserver):
    """Vector-clock race detector for shared buffers; attach with ``device.add_observer``.

    Host-side writes are reported with :meth:`host_write`. ``violations`` keeps the first
    ``max_violations`` races (``count`` counts all); ``raise_on_violation=True`` raises
    :class:`SanitizerError` from the call that causes the race instead. ``check_reads=False``
    disables the read-before-write check. Memory stays bounded over any number of steps:
    per buffer and stream only the reads that a later write can still be checked against,
    and per buffer and writer the last ``write_history`` writes.

    A correctly fenced write is clean:

    >>> san = Sanitizer()
    >>> fence = object()                  # any hashable identity works as an event
    >>> san.on_launch("forward", "replay", [Read("swa_map", "prep", 0), Record(fence)])
    >>> san.on_wait("schedule", fence)
    >>> san.on_launch("schedule", "write", [Write("swa_map", 1, "sched")])
    >>> san.violations
    []
    """

    def __init__(
        self,
        *,
        check_reads: bool = True,
        raise_on_violation: bool = False,
        max_violations: int = 1000,
        write_history: int = 16,
    ) -> None:
        self.check_reads = check_reads
        self.raise_on_violation = raise_on_violation
        self.max_violations = max_violations
        self.write_history = write_history
        self.violations: list[Violation] = []
        self.count = 0
        self._lock = threading.RLock()
        self._clocks: dict[str, Clock] = {HOST: {}}
        self._events: dict[Any, Clock] = {}
        self._reads: dict[str, dict[str, _ReadLog]] = {}
        self._watermark: dict[str, int] = {}
        self._writes: dict[str, dict[str, deque[tuple[int, int, str]]]] = {}

    # ------------------------------------------------------------------ observer interface
    def on_launch(self, stream: str, label: str, ops: Sequence[Op]) -> None:
        """A launch (or graph replay) on ``stream`` with its ordered ``ops``."""
        with self._lock:
            clock = self._enter(stream)
            for op in ops:
                c = self._tick(stream)
                if isinstance(op, Read):
                    self._read(op, stream, c, clock)
                elif isinstance(op, Record):
                    self._events[op.event] = dict(clock)
                elif isinstance(op, Write):
                    self._write(op.buffer, _step_of(op), stream, op.label or label, clock)
                else:
                    raise TypeError(f"unknown op {op!r} in launch {label!r} on {stream!r}")

    def on_record(self, stream: str, event: Event) -> None:
        with self._lock:
            clock = self._enter(stream)
            self._events[event] = dict(clock)

    def on_wait(self, stream: str, event: Event) -> None:
        with self._lock:
            snap = self._events.get(event)
            if snap is None:
                name = getattr(event, "name", repr(event))
                raise ValueError(f"sanitizer: stream {stream!r} waits on event {name!r}, which was never recorded")
            _merge(self._enter(stream), snap)

    def on_event_synchronize(self, event: Event) -> None:
        with self._lock:
            snap = self._events.get(event)
            if snap is not None:
                _merge(self._clocks[HOST], snap)

    def on_stream_synchronize(self, stream: str) -> None:
        with self._lock:
            _merge(self._clocks[HOST], self._clocks.get(stream, {}))

    def on_device_synchronize(self) -> None:
        with self._lock:
            host = self._clocks[HOST]
            for agent, clock in self._clocks.items():
                if agent != HOST:
                    _merge(host, clock)

    # ---------------------------------------------------------------------------- host side
    def host_write(self, buffer: str, step: int, label: str = "host") -> None:
        """The host wrote ``buffer`` for ``step`` (e.g. a CPU-side copy into a shared buffer)."""
        with self._lock:
            self._tick(HOST)
            self._write(buffer, step, HOST, label, self._clocks[HOST])

    # -------------------------------------------------------------------------------- query
    def clock(self, agent: str) -> dict[str, int]:
        """A copy of ``agent``'s vector clock (``"<host>"`` for the host)."""
        with self._lock:
            return dict(self._clocks.get(agent, {}))

    @property
    def tracked_reads(self) -> int:
        """How many reads are remembered (bounded over any number of steps)."""
        with self._lock:
            return sum(len(log) for logs in self._reads.values() for log in logs.values())

    def assert_clean(self) -> None:
        """Raise :class:`SanitizerError` listing the races found, if any."""
        with self._lock:
            if self.count:
                shown = "\n  ".join(str(v) for v in self.violations[:10])
                more = f"\n  ... and {self.count - 10} more" if self.count > 10 else ""
                raise SanitizerError(f"sanitizer found {self.count} race(s):\n  {shown}{more}")

    # ---------------------------------------------------------------------------- internals
    def _enter(self, stream: str) -> Clock:
        if stream == HOST:
            raise ValueError(f"{HOST!r} is reserved for the host agent")
        clock = self._clocks.setdefault(stream, {})
        _merge(clock, self._clocks[HOST])
        self._tick(stream)
        return clock

    def _tick(self, agent: str) -> int:
        clock = self._clocks.setdefault(agent, {})
        clock[agent] = c = clock.get(agent, 0) + 1
        return c

    def _report(self, v: Violation) -> None:
        self.count += 1
        if len(self.violations) < self.max_violations:
            self.violations.append(v)
        if self.raise_on_violation:
            raise SanitizerError(str(v))

    def _read(self, op: Read, stream: str, c: int, clock: Clock) -> None:
        step = _step_of(op)
        log = self._reads.setdefault(op.buffer, {}).setdefault(stream, _ReadLog())
        log.add(c, op.node, step, self._watermark.get(op.buffer))
        if not self.check_reads:
            return
        for writer, history in self._writes.get(op.buffer, {}).items():
            for wstep, wc, wlabel in reversed(history):
                if wstep <= step:
                    if wc > clock.get(writer, 0):
                        self._report(
                            Violation("read-before-write", op.buffer, op.node, step, stream, wstep, writer, wlabel)
                        )
                    break

    def _write(self, buffer: str, step: int, writer: str, label: str, clock: Clock) -> None:
        mark = self._watermark.get(buffer)
        if mark is not None and step < mark:
            raise ValueError(
                f"sanitizer: writes of {buffer!r} must come in nondecreasing step order "
                f"(step {step} after step {mark}, by {label!r} on {writer!r})"
            )
        for reader, log in self._reads.get(buffer, {}).items():
            last = log.last_before(step)
            if last is not None and last[0] > clock.get(reader, 0):
                c, node, rstep = last
                self._report(Violation("write-after-read", buffer, node, rstep, reader, step, writer, label))
            log.collapse(step)
        self._watermark[buffer] = step
        history = self._writes.setdefault(buffer, {}).setdefault(writer, deque(maxlen=self.write_history))
        history.append((step, clock.get(writer, 0), label))


def _merge(into: Clock, other: Clock) -> None:
    for agent, c in other.items():
        if c > into.get(agent, 0):
            into[agent] = c


def _step_of(op: Read | Write) -> int:
    if op.step is None:
        raise ValueError(f"{op!r} has no step: pass step= to launch() or replay(), or set it in the op")
    return op.step
