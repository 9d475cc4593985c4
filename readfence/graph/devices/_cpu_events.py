"""The events of a :class:`~readfence.graph.devices.CpuDevice`: a :class:`CpuEvent` counts its
records, each a :class:`Generation` (a one-shot, timestamped signal that waits bind to).

>>> from readfence.graph.devices import CpuDevice
>>> with CpuDevice() as dev:
...     s, ev = dev.stream("forward"), dev.event("done")
...     s.record(ev); ev.synchronize(timeout=5)
...     ev.generation, ev.latest.fired
(1, True)
"""

from __future__ import annotations

import time
from _thread import allocate_lock as _allocate_lock
from typing import TYPE_CHECKING

from ._errors import DeviceTimeout, EventNeverRecorded

if TYPE_CHECKING:
    from ._cpu_base import CpuDeviceBase


class Generation:
    """One enqueued record of an event: a one-shot, timestamped signal.

    ``index`` counts from 1 per event; ``stream`` and ``label`` say which op fires it;
    ``timestamp`` is ``time.perf_counter()`` when it fired (``None`` until then).
    """

    # The signal is a raw lock held from creation until the record runs: a waiter blocks in
    # one C call, with the GIL released, and passes the lock on. threading.Event (a Condition
    # and a waiter lock per wait) cost 4.6 us per record against 2.9 us for a launch
    # (bench_overhead); a step makes up to seven.
    __slots__ = ("event", "index", "stream", "label", "_signal", "_done", "timestamp", "error")

    def __init__(self, event: CpuEvent | None, index: int, stream: str, label: str) -> None:
        self.event = event
        self.index = index
        self.stream = stream
        self.label = label
        self._signal = _allocate_lock()
        self._signal.acquire()
        self._done = False
        self.timestamp: float | None = None
        self.error: BaseException | None = None

    @property
    def fired(self) -> bool:
        """Whether the record ran (``False`` if it failed or has not run yet)."""
        return self._done and self.error is None

    @property
    def done(self) -> bool:
        """Whether the record ran or failed."""
        return self._done

    def _fire(self) -> None:
        # Only the stream that owns the record fires or fails it: no race between the two.
        if not self._done:
            self.timestamp = time.perf_counter()
            self._done = True
            self._signal.release()

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self.error = error
            self._done = True
            self._signal.release()

    def _wait(self, timeout: float) -> bool:
        """Block until the record ran or failed, at most ``timeout`` seconds; whether it did."""
        if self._done:
            return True
        if not self._signal.acquire(timeout=timeout):
            return self._done
        self._signal.release()  # wake the next waiter, if any
        return True

    def _what(self) -> str:
        ev = f"event {self.event.name!r}" if self.event is not None else "marker"
        return f"{ev} (generation {self.index})"

    def synchronize(self, timeout: float) -> None:
        """Host wait for this generation; raises ``DeviceTimeout`` or the stream's error."""
        if self.event is not None:
            self.event.device._flush_batches()
        if not self._wait(timeout):
            raise DeviceTimeout(
                self._what(), stream=self.stream, timeout=timeout, detail=f"op {self.label!r} has not run"
            )
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else "fired" if self._done else "pending"
        return f"<Generation {self._what()} on {self.stream!r} via {self.label!r}: {state}>"


class CpuEvent:
    """A named event of a :class:`CpuDevice` (create with ``device.event(name)``).

    ``generation`` counts the records enqueued so far and ``latest`` is the latest of them
    (a :class:`Generation`, ``None`` before the first, and always ``None`` on a device with
    ``cuda_events``); ``single_stream`` is the stream every record so far was enqueued on
    (``None`` before the first, or once two streams recorded it). Read them, never set them
    (plain attributes: fences read them on the host's hot path).
    """

    def __init__(self, device: CpuDeviceBase, name: str) -> None:
        self.device = device
        self.name = name
        self.latest: Generation | None = None  # the per-record handle, where the device exposes one
        self._latest: Generation | None = None  # what a wait called now binds to
        self._handles = not device.cuda_events
        self.generation = 0
        self.single_stream: str | None = None
        self._wait_label = f"wait({name})"  # made once: a wait is on the host's hot path

    @property
    def timestamp(self) -> float | None:
        """When the latest enqueued record fired (``time.perf_counter()``), ``None`` if not yet
        (or on a device with ``cuda_events``, which keeps no timestamps)."""
        gen = self.latest
        return None if gen is None else gen.timestamp

    def _new_generation(self, stream: str, label: str) -> Generation:
        # Called under the device lock.
        self.generation += 1
        gen = Generation(self, self.generation, stream, label)
        self._latest = gen
        if self._handles:
            self.latest = gen
        if self.generation == 1:
            self.single_stream = stream
        elif self.single_stream != stream:
            self.single_stream = None
        return gen

    def _bind(self, action: str) -> Generation:
        gen = self._latest
        if gen is None:
            raise EventNeverRecorded(self.name, action)
        return gen

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait for the latest record enqueued so far.

        Raises :class:`DeviceTimeout` (naming the event, its generation and stream) after
        ``timeout`` seconds (default ``device.timeout``), :class:`StreamError` if the op that
        should record it failed, :class:`EventNeverRecorded` if it was never recorded.
        """
        self.device._refuse_host_wait_while_capturing(f"synchronize event {self.name!r}")
        self.device._flush_batches()
        gen = self._bind("host synchronize")
        gen.synchronize(self.device._timeout(timeout))
        self.device._notify("on_event_synchronize", self)

    def query(self) -> bool:
        """Whether the latest enqueued record has fired; raises its stream's error if it failed."""
        self.device._refuse_host_wait_while_capturing(f"query event {self.name!r}")
        self.device._flush_batches()
        gen = self._bind("query")
        if gen.error is not None:
            raise gen.error
        return gen.done

    def __repr__(self) -> str:
        return f"<CpuEvent {self.name!r} generation={self.generation}>"
