"""The streams of a :class:`~readfence.graph.devices.CpuDevice`: a FIFO of work items run by a daemon
thread of its own, which a launch, record or wait enqueues and a host wait follows."""

from __future__ import annotations

import queue
import threading
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from ._cpu_events import CpuEvent, Generation
from ._cpu_graph import CpuGraph, _GraphEntry
from ._cpu_items import _STOP, _Batch, _Item, _LaunchItem, _RecordItem, _WaitItem
from ._errors import CaptureError, DeviceClosed, DeviceTimeout, StreamError
from ._protocol import Event, Launch, Stream

if TYPE_CHECKING:
    from torch import Tensor

    from ._cpu_base import CpuDeviceBase


class _Batching:
    """``stream.batch()``: a reusable, reentrant context manager (a generator one costs more)."""

    __slots__ = ("stream", "depth")

    def __init__(self, stream: CpuStream) -> None:
        self.stream, self.depth = stream, 0

    def __enter__(self) -> None:
        s = self.stream
        with s.device._lock:
            self.depth += 1
            if self.depth == 1:
                s._pending = []
                s.device._batches += 1

    def __exit__(self, *exc: object) -> None:
        s = self.stream
        with s.device._lock:
            self.depth -= 1
            if self.depth == 0:
                s._flush_locked()
                s._pending = None
                s.device._batches -= 1


class CpuStream(Stream):
    """A FIFO of work run by its own daemon thread (create with ``device.stream(name)``)."""

    def __init__(self, device: CpuDeviceBase, name: str) -> None:
        self.device = device
        self.name = name
        self._queue: queue.SimpleQueue[_Item | _Batch] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._capture: CpuGraph | None = None
        self._running_label: str | None = None
        self._pending: list[_Item] | None = None  # the ops of the open batch, if any
        self._batching = _Batching(self)
        self._thread = threading.Thread(target=self._work, name=f"readfence:{device.name}:{name}", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The sticky error of this stream, if an op on it failed."""
        return self._error

    def _put(self, item: _Item) -> None:
        if self._pending is None:
            self._queue.put(item)
        else:
            self._pending.append(item)

    def batch(self) -> AbstractContextManager[None]:
        """Hand the work issued on this stream inside the ``with`` block to the worker as one
        unit, when the block ends: one queue item and one wake-up instead of one per op.

        Nothing else changes: ops run in order, each with its own label, fault-injection point,
        error and skip; generations and waits bind when each op is issued, and observers see
        each op then. A host wait inside the block hands over what was issued so far first.
        ``Lowered.run`` issues a step this way (a step's seven launches and records were seven
        queue items, each a wake-up of the worker that contends with the host for the GIL).

        >>> from readfence.graph.devices import CpuDevice
        >>> with CpuDevice() as dev:
        ...     s, out = dev.stream("forward"), []
        ...     with s.batch():
        ...         s.launch(out.append, 1); s.launch(out.append, 2)
        ...         queued_before_the_end = out[:]
        ...     s.synchronize(timeout=5)
        >>> queued_before_the_end, out
        ([], [1, 2])
        """
        return self._batching

    def _flush_locked(self) -> None:
        """Under the device lock: hand the open batch's ops to the worker (the batch stays open)."""
        pending = self._pending
        if pending:
            self._queue.put(pending[0] if len(pending) == 1 else _Batch(pending))
            self._pending = []

    def _run(self, item: _Item) -> None:
        dev = self.device
        self._running_label = item.label
        try:
            if self._error is not None:
                item.skip(self._error)
            elif dev._closed:
                item.skip(DeviceClosed(f"device {dev.name!r} closed before op {item.label!r} ran on stream {self.name!r}"))
            else:
                try:
                    item.run(dev, self.name)
                except BaseException as exc:
                    if isinstance(exc, StreamError) and exc.stream == self.name:
                        err = exc
                    else:
                        err = StreamError(self.name, item.label, exc)
                    self._error = err
                    item.skip(err)
        finally:
            self._running_label = None

    def _work(self) -> None:
        run, get = self._run, self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            if isinstance(item, _Batch):
                for op in item.items:
                    run(op)
            else:
                run(item)

    def submit(self, launch: Launch) -> None:
        """Enqueue ``launch`` for the worker; inside a capture of this stream, add it to the graph."""
        dev = self.device
        with dev._lock:
            dev._check_open()
            capture = self._capture
            label, ops, records = dev._launch_ops(launch, bind=capture is not None or bool(dev.observers))
            if capture is not None:
                capture._add(_GraphEntry.launch(capture.label, launch.fn, launch.args, label, ops))
                return
            dev._notify_locked("on_launch", self.name, label, ops)
            self._put(_LaunchItem(launch.fn, launch.args, label,
                                  [(ev, ev._new_generation(self.name, label)) for ev in records]))

    def record(self, event: Event) -> None:
        """Enqueue a record of ``event``: a new generation, fired when the stream reaches it.

        Inside a capture, the record becomes part of the graph (needs
        ``caps.in_graph_events``).
        """
        dev = self.device
        ev: CpuEvent = dev._own_event(event)
        with dev._lock:
            dev._check_open()
            if self._capture is not None:
                self._capture._add(_GraphEntry.record(self._capture.label, ev))
                return
            dev._notify_locked("on_record", self.name, ev)
            self._put(_RecordItem(ev._new_generation(self.name, f"record({ev.name})")))

    def wait(self, event: Event) -> None:
        """Later work on this stream waits for ``event``'s latest record enqueued so far.

        Raises :class:`EventNeverRecorded` now if the event was never recorded. If the op
        that records it fails, this stream fails too (with the original as the cause).
        """
        dev = self.device
        ev: CpuEvent = dev._own_event(event)
        with dev._lock:
            dev._check_open()
            if self._capture is not None:
                raise CaptureError.wait_in_capture(self.name, ev.name)
            gen = ev._bind(f"stream {self.name!r} wait")
            dev._notify_locked("on_wait", self.name, ev)
            self._put(_WaitItem(gen))

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait until every op enqueued so far on this stream has run.

        Raises :class:`DeviceTimeout` naming the stream and the op it is stuck in, or the
        stream's :class:`StreamError`.
        """
        dev = self.device
        with dev._lock:
            if self._capture is not None:
                raise CaptureError(f"cannot synchronize stream {self.name!r} while it is capturing")
            dev._refuse_host_wait_while_capturing(f"synchronize stream {self.name!r}")
            if dev._closed:
                raise self._error or DeviceClosed(f"device {dev.name!r} is closed: cannot synchronize stream {self.name!r}")
            marker = Generation(None, 0, self.name, "synchronize")
            self._put(_RecordItem(marker))
            dev._flush_batches()
        t = dev._timeout(timeout)
        if not marker._wait(t):
            running = self._running_label
            raise DeviceTimeout(
                f"stream {self.name!r}",
                stream=None,
                timeout=t,
                detail=f"it is still running op {running!r}" if running else "",
            )
        if marker.error is not None:
            raise marker.error
        dev._notify("on_stream_synchronize", self.name)

    def keep(self, tensor: Tensor) -> None:
        """Nothing to do: host memory is not handed out per stream (see ``Stream.keep``)."""

    def __repr__(self) -> str:
        state = " failed" if self._error is not None else ""
        return f"<CpuStream {self.name!r}{state}>"
