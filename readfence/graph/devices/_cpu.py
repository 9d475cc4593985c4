"""``CpuDevice``: streams as worker threads, events as timestamped generations, graphs as
captured op lists replayed as one unit.

torch ops release the GIL, so two streams really overlap on two cores.

Events have *generations*: every enqueued record (``stream.record``, or a ``Record`` item of a
launch or graph replay) creates a new generation at enqueue time; a wait binds to the
generation that is latest when the wait is called, exactly like ``cudaStreamWaitEvent``. A
graph replay creates the generations of its in-graph records when the replay is enqueued, so
a wait enqueued after ``replay()`` binds to that replay's records.

``CpuDevice(cuda_events=True)`` keeps those semantics but hides what CUDA cannot offer: an
event is only its latest record (``event.latest`` stays ``None``: no per-record handle, no
timestamp), and a host wait or query while any stream of the device is capturing is an error
(on CUDA it would invalidate the capture). Code that runs under it makes no promise a
``CudaDevice`` cannot keep.

>>> import torch
>>> with CpuDevice() as dev:
...     sched, fwd = dev.stream("schedule"), dev.stream("forward")
...     ready = dev.event("ready")
...     x = torch.zeros(3)
...     sched.launch(x.fill_, 1.0, label="write x")
...     sched.record(ready)
...     fwd.wait(ready)                       # forward runs after the write
...     out = []
...     fwd.launch(lambda: out.append(x.sum().item()), label="read x")
...     dev.synchronize(timeout=5)
>>> out
[3.0]
"""

from __future__ import annotations

import queue
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVarTuple

import attrs

from readfence.effects import Capabilities

from ._base import DeviceBase, GraphBase, _caps, _check_seconds
from ._context import _run_launched, _take_pending
from ._errors import CaptureError, DeviceClosed, DeviceTimeout, EventNeverRecorded, StreamError
from ._faults import FaultInjector
from ._ops import Op, Record, records_in
from ._protocol import DEFAULT_TIMEOUT_S, Device, DeviceObserver, Event, Graph, Stream

if TYPE_CHECKING:
    from torch import Tensor

_Ts = TypeVarTuple("_Ts")


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

    def __init__(self, device: CpuDevice, name: str) -> None:
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


# ----------------------------------------------------------------------------------- queue items


class _Item:
    label: str

    def run(self, stream: CpuStream) -> None:
        raise NotImplementedError

    def skip(self, error: BaseException) -> None:
        """The stream failed or closed before this item ran: fail what it would signal."""


class _Stop(_Item):
    label = "<stop>"


class _Batch:
    """Ops issued in one ``stream.batch()``: one queue item; the worker runs each as its own."""

    __slots__ = ("items",)

    def __init__(self, items: list[_Item]) -> None:
        self.items = items


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


_STOP = _Stop()


class _LaunchItem(_Item):
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], label: str, tokens: list) -> None:
        self.fn, self.args, self.label, self.tokens = fn, args, label, tokens

    def run(self, stream: CpuStream) -> None:
        stream.device._delay(stream.name, self.label)
        _run_launched(stream.device, stream.name, self.label, self.fn, self.args, self.tokens)

    def skip(self, error: BaseException) -> None:
        for _, gen in self.tokens:
            gen._fail(error)


class _RecordItem(_Item):
    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.label = gen.label

    def run(self, stream: CpuStream) -> None:
        if self.gen.event is not None:
            stream.device._delay(stream.name, self.label)
        self.gen._fire()

    def skip(self, error: BaseException) -> None:
        self.gen._fail(error)


class _WaitItem(_Item):
    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        assert gen.event is not None
        self.label = gen.event._wait_label

    def run(self, stream: CpuStream) -> None:
        timeout = stream.device.timeout
        if not self.gen._wait(timeout):
            raise DeviceTimeout(
                f"{self.gen._what()} (device-side wait on stream {stream.name!r})",
                stream=self.gen.stream,
                timeout=timeout,
                detail=f"op {self.gen.label!r} has not run",
            )
        if self.gen.error is not None:
            raise self.gen.error


class _ReplayItem(_Item):
    def __init__(self, graph: CpuGraph, tokens: list[list]) -> None:
        self.graph = graph
        self.tokens = tokens
        self.label = graph.label

    def run(self, stream: CpuStream) -> None:
        dev = stream.device
        for entry, tokens in zip(self.graph._entries, self.tokens, strict=True):
            label = entry.full_label
            try:
                dev._delay(stream.name, label)
                if entry.fn is None:  # an in-graph record
                    tokens[0][1]._fire()
                else:
                    _run_launched(dev, stream.name, label, entry.fn, entry.args, tokens)
            except BaseException as exc:
                raise StreamError(stream.name, label, exc) from exc

    def skip(self, error: BaseException) -> None:
        for tokens in self.tokens:
            for _, gen in tokens:
                gen._fail(error)


# ---------------------------------------------------------------------------------------- graph


@attrs.frozen(eq=False)
class _GraphEntry:
    """A captured launch (``fn(*args)``), or an in-graph record (``fn`` is None). Everything a
    replay needs is computed at capture: a replay is on the host's hot path."""

    fn: Callable[..., Any] | None
    args: tuple[Any, ...]
    label: str
    ops: tuple[Op, ...]
    full_label: str  # graph label / entry label, for errors and fault injection
    records: tuple[Any, ...]  # the events it records, in order

    @classmethod
    def launch(cls, graph: str, fn: Callable[..., Any], args: tuple[Any, ...], label: str,
               ops: tuple[Op, ...]) -> _GraphEntry:
        return cls(fn, args, label, ops, f"{graph}/{label}", records_in(ops))

    @classmethod
    def record(cls, graph: str, event: CpuEvent) -> _GraphEntry:
        label = f"record({event.name})"
        return cls(None, (), label, (Record(event),), f"{graph}/{label}", (event,))


class CpuGraph(GraphBase):
    """Launches and records captured on one stream, replayed as one unit.

    Obtain one from ``with device.capture(stream) as graph:``.
    """

    def __init__(self, device: CpuDevice, stream: CpuStream, label: str) -> None:
        super().__init__(device, stream, label)
        self._entries: list[_GraphEntry] = []
        self._ops: tuple[Op, ...] | None = None  # cached once sealed

    @property
    def ops(self) -> tuple[Op, ...]:
        """The static op sequence of the graph: its launches' ops and its records, in order."""
        if self._ops is not None:
            return self._ops
        ops = tuple(op for entry in self._entries for op in entry.ops)
        if self._sealed:
            self._ops = ops
        return ops

    def _add(self, entry: _GraphEntry) -> None:
        self._refuse_records(entry.ops, entry.label)
        self._entries.append(entry)

    def replay(self, stream: Stream | None = None, *, step: int | None = None) -> None:
        """Enqueue the whole graph on ``stream`` (default: the capture stream) as one op.

        The generations of the graph's in-graph records are created now, so a wait enqueued
        after this call binds to this replay. ``step`` binds unbound steps of the graph's ops
        for observers.
        """
        target, ops = self._replay_ops(stream, step)
        with self.device._lock:
            self._announce_locked(target, ops)
            name = target.name
            tokens = [[(ev, ev._new_generation(name, entry.full_label)) for ev in entry.records]
                      for entry in self._entries]
            target._put(_ReplayItem(self, tokens))

    def __repr__(self) -> str:
        return f"<CpuGraph {self.label!r}: {len(self._entries)} ops captured on {self.stream.name!r}>"


# --------------------------------------------------------------------------------------- stream


class CpuStream:
    """A FIFO of work run by its own daemon thread (create with ``device.stream(name)``)."""

    def __init__(self, device: CpuDevice, name: str) -> None:
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
                    item.run(self)
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

    def launch(
        self,
        fn: Callable[[*_Ts], object],
        *args: *_Ts,
        label: str = "",
        ops: Sequence[Op] = (),
        step: int | None = None,
    ) -> None:
        """Enqueue ``fn(*args)``; inside a capture of this stream, add it to the graph instead.

        ``ops`` declares, in order, what ``fn`` reads (``Read``), writes (``Write``) and which
        events it records from inside with ``device.record_here(event)`` (``Record``); the
        generations of those records are created now. ``step`` binds unbound op steps.
        Exceptions raised by ``fn`` fail the stream and surface at the next wait.
        """
        dev = self.device
        with dev._lock:
            dev._check_open()
            capture = self._capture
            label, ops, records = dev._launch_ops(fn, label, ops, step, bind=capture is not None or bool(dev.observers))
            if capture is not None:
                capture._add(_GraphEntry.launch(capture.label, fn, args, label, ops))
                return
            dev._notify_locked("on_launch", self.name, label, ops)
            self._put(_LaunchItem(fn, args, label, [(ev, ev._new_generation(self.name, label)) for ev in records]))

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
                raise CaptureError(
                    f"stream {self.name!r} cannot wait on event {ev.name!r} inside a capture; "
                    "wait before the replay instead"
                )
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


# --------------------------------------------------------------------------------------- device


class CpuDevice(DeviceBase):
    """The embedded device: one worker thread per stream.

    ``caps`` (or the shortcuts ``in_graph_events=`` / ``graphs=``) emulates a platform:
    ``CpuDevice(in_graph_events=False)`` refuses event records inside a capture, like a
    platform without in-graph events. ``timeout`` (seconds, finite and > 0) is the default of
    every host wait and bounds device-side waits. ``faults`` delays ops; ``observers`` see every
    enqueue. ``cuda_events=True`` gives events CUDA's semantics (see the module docstring):
    the CPU tests run lowering, fences and the decode loop under it to catch code that leans
    on per-record handles. Use as a context manager, or call :meth:`close`.

    >>> with CpuDevice(cuda_events=True) as dev:
    ...     s, ev = dev.stream("forward"), dev.event("done")
    ...     s.record(ev); s.record(ev)
    ...     ev.synchronize(timeout=5)
    ...     ev.generation, ev.latest, ev.single_stream
    (2, None, 'forward')

    >>> dev = CpuDevice(in_graph_events=False)
    >>> dev.caps
    Capabilities(in_graph_events=False, graphs=True)
    >>> s = dev.stream("forward")
    >>> with dev.capture(s) as g:  # doctest: +NORMALIZE_WHITESPACE
    ...     s.record(dev.event("fence"))
    Traceback (most recent call last):
    ...
    readfence.graph.devices._errors.CaptureError: device 'cpu' cannot record events inside a graph
    (Capabilities.in_graph_events=False): 'record(fence)' in graph 'graph' records 'fence';
    record after the replay instead
    >>> dev.close()

    Capture records launches instead of running them; ``graph.replay()`` runs them as one unit:

    >>> with CpuDevice() as dev:
    ...     s, ev = dev.stream("forward"), dev.event("mid")
    ...     trace = []
    ...     with dev.capture(s, label="step") as g:
    ...         s.launch(trace.append, "a", label="a")
    ...         s.record(ev)
    ...         s.launch(trace.append, "b", label="b")
    ...     assert trace == []            # captured, not run
    ...     g.replay(step=0); g.replay(step=1)
    ...     s.synchronize(timeout=5)
    >>> trace, ev.generation
    (['a', 'b', 'a', 'b'], 2)
    """

    _stream_type = CpuStream
    _event_type = CpuEvent
    _graph_type = CpuGraph

    def __init__(
        self,
        *,
        caps: Capabilities | None = None,
        in_graph_events: bool | None = None,
        graphs: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        faults: FaultInjector | None = None,
        observers: Sequence[DeviceObserver] = (),
        name: str = "cpu",
        cuda_events: bool = False,
    ) -> None:
        super().__init__(name, _caps(caps, in_graph_events, graphs), timeout, faults, observers)
        self.cuda_events = bool(cuda_events)
        self._batches = 0  # streams with an open batch()

    def _flush_batches(self) -> None:
        """Before a host wait: hand every open batch's ops to its worker, or the wait could not end."""
        if self._batches:
            with self._lock:
                for s in self._streams.values():
                    if s._pending:
                        s._flush_locked()

    def _refuse_host_wait_while_capturing(self, action: str) -> None:
        if self.cuda_events:
            super()._refuse_host_wait_while_capturing(action)

    # -- inside launched code
    def record_here(self, event: Event) -> None:
        """Record ``event`` at this point of the running launch or graph replay.

        Must be called on the stream's worker thread, from a launched function whose ``ops``
        declare ``Record(event)`` next in order; fires the generation created when the
        launch (or replay) was enqueued.
        """
        _, gen = _take_pending(self._own_event(event))
        gen._fire()

    def stall(self, seconds: float) -> None:
        """From inside a launched function: hold the running stream for about ``seconds``
        without using the CPU (the stream's worker thread sleeps).

        >>> import time
        >>> with CpuDevice() as dev:
        ...     s = dev.stream("copy engine")
        ...     t0 = time.perf_counter()
        ...     s.launch(dev.stall, 0.05, label="copy"); s.synchronize(timeout=5)
        >>> time.perf_counter() - t0 >= 0.05
        True
        """
        time.sleep(_check_seconds(seconds))

    def close(self) -> None:
        """Stop the worker threads. Queued ops are skipped, their events fail with
        :class:`DeviceClosed`, so nothing waits forever. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams.values())
            for s in streams:  # an open batch's ops are skipped like the rest: their events fail
                s._flush_locked()
        for s in streams:
            s._queue.put(_STOP)
        deadline = time.monotonic() + 2.0
        for s in streams:
            s._thread.join(max(0.0, deadline - time.monotonic()))

    def _delay(self, stream: str, label: str) -> None:
        if self.faults is not None:
            self.faults.maybe_delay(stream, label)


# CpuDevice and its parts implement the protocol: mypy checks these (a method that narrows a
# parameter type, as record_here(event: CpuEvent) once did, fails here)
_IMPLEMENTS: tuple[type[Device], type[Stream], type[Event], type[Graph]] = (CpuDevice, CpuStream, CpuEvent, CpuGraph)
