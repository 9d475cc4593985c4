"""``CudaDevice``: the :class:`~readfence.graph.Device` protocol over ``torch.cuda``.

Streams are ``torch.cuda.Stream``; launches run the Python function *now* under
``torch.cuda.stream(s)`` (its kernels are enqueued on ``s``); graphs are
``torch.cuda.CUDAGraph`` captured with ``torch.cuda.graph(g, stream=s)``; events are
``torch.cuda.Event(external=True)``, so a record issued while the capture stream is current
(``stream.record(event)`` or ``device.record_here(event)`` inside a captured function)
becomes an event-record node that fires at that point of every replay (torch >= 2.8).

Host waits poll ``event.query()`` until their deadline, so they time out with
:class:`DeviceTimeout` instead of hanging. Python exceptions raised by a launched function
fail the stream (sticky, like CUDA errors) and surface as :class:`StreamError` at the next
wait or synchronize, as on :class:`CpuDevice`.

On the CPU-only torch build ``torch.cuda`` classes raise when constructed; ``CudaDevice()``
raises :class:`DeviceError` when ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from readfence.effects import Capabilities

from ._base import DeviceBase, GraphBase, _caps, _check_seconds
from ._context import _run_launched, _take_pending
from ._errors import CaptureError, DeviceError, DeviceTimeout, EventNeverRecorded, StreamError
from ._faults import FaultInjector
from ._ops import Op, Record, records_in
from ._protocol import DEFAULT_TIMEOUT_S, Device, DeviceObserver, Event, Graph, Launch, Stream


def _in_graph_events_supported() -> bool:
    """Whether this torch can record an event inside a graph capture: its ``torch.cuda.Event``
    takes ``external=True`` (the feature itself, not a version number; builds differ). The
    start-up self-check (:func:`self_check`) then shows that such a record really fires
    mid-graph on this machine."""
    try:
        torch.cuda.Event(external=True)
    except TypeError:
        return False
    return True


_SLEEP_SAMPLES = 10
_SLEEP_CYCLES = 1_000_000


def _sleep_cycles_per_second(index: int) -> float:
    """GPU clock cycles per second of ``torch.cuda._sleep`` on device ``index``, measured once
    (eagerly, outside any capture) with timing events: the mean of several samples without the
    two fastest and two slowest (clocks ramp up and the host may stall a launch), as torch's own
    test helper does."""
    with torch.cuda.device(index):
        torch.cuda._sleep(1_000)  # load the kernel
        rates = []
        for _ in range(_SLEEP_SAMPLES):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(_SLEEP_CYCLES)
            end.record()
            end.synchronize()
            rates.append(_SLEEP_CYCLES / max(start.elapsed_time(end) / 1e3, 1e-9))
        rates.sort()
        return statistics.fmean(rates[2:-2])


def _poll(query: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not query():
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 1e-3)
    return True


class CudaEvent:
    """A named ``torch.cuda.Event(external=True)`` (create with ``device.event(name)``).

    ``generation`` counts the records enqueued so far (replays included); ``single_stream`` is
    the stream every record so far was enqueued on (``None`` before the first, or once two
    streams recorded it). Read them, never set them (plain attributes: fences read them on the
    host's hot path). There is no per-record handle: a CUDA event is only its latest record.
    """

    def __init__(self, device: CudaDevice, name: str) -> None:
        self.device = device
        self.name = name
        self.torch = torch.cuda.Event(external=True)
        self.generation = 0
        self.single_stream: str | None = None
        self._stream: str | None = None  # stream of the latest enqueued record

    def _enqueued(self, stream: str) -> None:
        self.generation += 1
        if self.generation == 1:
            self.single_stream = stream
        elif self.single_stream != stream:
            self.single_stream = None
        self._stream = stream

    def _check(self, action: str) -> None:
        if self.generation == 0:
            raise EventNeverRecorded(self.name, action)
        err = self.device._streams[self._stream]._error if self._stream in self.device._streams else None
        if err is not None:
            raise err

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait (polling) for the latest enqueued record; see ``CpuEvent.synchronize``.
        Refused while a stream captures (a query there invalidates the capture)."""
        self.device._refuse_host_wait_while_capturing(f"synchronize event {self.name!r}")
        self._check("host synchronize")
        t = self.device._timeout(timeout)
        if not _poll(self.torch.query, t):
            raise DeviceTimeout(f"event {self.name!r} (generation {self.generation})", stream=self._stream, timeout=t)
        self.device._notify("on_event_synchronize", self)

    def query(self) -> bool:
        """Whether the latest enqueued record has completed (refused while a stream captures)."""
        self.device._refuse_host_wait_while_capturing(f"query event {self.name!r}")
        self._check("query")
        return bool(self.torch.query())

    def __repr__(self) -> str:
        return f"<CudaEvent {self.name!r} generation={self.generation}>"


class CudaGraph(GraphBase):
    """A captured ``torch.cuda.CUDAGraph`` and its static op list."""

    def __init__(self, device: CudaDevice, stream: CudaStream, label: str) -> None:
        super().__init__(device, stream, label)
        self.torch = torch.cuda.CUDAGraph()
        self._ops: list[Op] = []

    @property
    def ops(self) -> tuple[Op, ...]:
        """The static op sequence of the graph: its launches' ops and its records, in order."""
        return tuple(self._ops)

    def _add(self, ops: Sequence[Op], label: str) -> None:
        self._refuse_records(ops, label)
        self._ops.extend(ops)

    def replay(self, stream: Stream | None = None, *, step: int | None = None) -> None:
        """Launch the graph on ``stream`` (default: the capture stream); its in-graph records
        count as new generations of their events from now on."""
        target, ops = self._replay_ops(stream, step)
        with self.device._lock:
            self._announce_locked(target, ops)
            if target._error is not None:
                for ev in records_in(ops):
                    ev._enqueued(target.name)
                return
            with torch.cuda.stream(target.torch):
                self.torch.replay()
            for ev in records_in(ops):
                ev._enqueued(target.name)


class CudaStream(Stream):
    """A ``torch.cuda.Stream`` (create with ``device.stream(name)``)."""

    def __init__(self, device: CudaDevice, name: str) -> None:
        self.device = device
        self.name = name
        self.torch = torch.cuda.Stream(device=device.index)
        self._error: BaseException | None = None
        self._capture: CudaGraph | None = None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def batch(self) -> AbstractContextManager[None]:
        """Nothing to group: a CUDA launch is already asynchronous (see ``Stream.batch``)."""
        return nullcontext()

    def submit(self, launch: Launch) -> None:
        """Run ``launch`` now with this stream current (inside a capture: captured);
        ``device.record_here(event)`` inside its function records ``event`` on the current
        stream at that point."""
        dev = self.device
        fn, args = launch.fn, launch.args
        label, ops, _ = dev._launch_ops(launch)
        records = records_in(ops)
        pending = [(ev, None) for ev in records]
        with dev._lock:
            dev._check_open()
            capture = self._capture
            if capture is not None:
                capture._add(ops, label)
                # the capture context already made this stream current
                _run_launched(dev, self.name, label, fn, args, pending)
                return
            dev._notify_locked("on_launch", self.name, label, ops)
            for ev in records:
                ev._enqueued(self.name)
            if self._error is not None:
                return
            try:
                with torch.cuda.stream(self.torch):
                    dev._delay(self.name, label)
                    _run_launched(dev, self.name, label, fn, args, pending)
            except Exception as exc:
                self._error = StreamError(self.name, label, exc)

    def record(self, event: Event) -> None:
        """Record ``event`` on this stream (inside a capture: an in-graph record node)."""
        dev = self.device
        ev: CudaEvent = dev._own_event(event)
        with dev._lock:
            dev._check_open()
            if self._capture is not None:
                self._capture._add((Record(ev),), f"record({ev.name})")
                ev.torch.record(self.torch)
                return
            dev._notify_locked("on_record", self.name, ev)
            ev._enqueued(self.name)
            if self._error is None:
                with torch.cuda.stream(self.torch):  # the named stream is current, capture or not
                    ev.torch.record(self.torch)

    def wait(self, event: Event) -> None:
        """Later work on this stream waits for ``event``'s latest record (``wait_event``)."""
        dev = self.device
        ev: CudaEvent = dev._own_event(event)
        with dev._lock:
            dev._check_open()
            if self._capture is not None:
                raise CaptureError.wait_in_capture(self.name, ev.name)
            if ev.generation == 0:
                raise EventNeverRecorded(ev.name, f"stream {self.name!r} wait")
            dev._notify_locked("on_wait", self.name, ev)
            src = dev._streams.get(ev._stream or "")
            if src is not None and src._error is not None and self._error is None:
                self._error = StreamError(self.name, f"wait({ev.name})", src._error)
            with torch.cuda.stream(self.torch):
                self.torch.wait_event(ev.torch)

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait (polling) for everything enqueued on this stream so far."""
        dev = self.device
        if self._capture is not None:
            raise CaptureError(f"cannot synchronize stream {self.name!r} while it is capturing")
        dev._refuse_host_wait_while_capturing(f"synchronize stream {self.name!r}")
        marker = torch.cuda.Event()
        marker.record(self.torch)
        t = dev._timeout(timeout)
        if not _poll(marker.query, t):
            raise DeviceTimeout(f"stream {self.name!r}", stream=None, timeout=t)
        if self._error is not None:
            raise self._error
        dev._notify("on_stream_synchronize", self.name)

    def keep(self, tensor: torch.Tensor) -> None:
        """``tensor.record_stream``: the caching allocator hands a block to the stream that
        allocated it, and would reuse it there while this stream still writes it."""
        tensor.record_stream(self.torch)

    def __repr__(self) -> str:
        return f"<CudaStream {self.name!r} on {self.device.name}>"


class CudaDevice(DeviceBase):
    """The CUDA device (see the module docstring). Same constructor options as ``CpuDevice``,
    plus ``index``; ``caps.in_graph_events`` defaults to ``torch >= 2.8``.

    ``faults`` delays eager launches with ``torch.cuda._sleep`` on the stream; a delay drawn
    inside a capture is baked into the graph (the same on every replay).
    """

    _stream_type = CudaStream
    _event_type = CudaEvent
    _graph_type = CudaGraph

    def __init__(
        self,
        *,
        index: int = 0,
        caps: Capabilities | None = None,
        in_graph_events: bool | None = None,
        graphs: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        faults: FaultInjector | None = None,
        observers: Sequence[DeviceObserver] = (),
    ) -> None:
        if not torch.cuda.is_available():
            raise DeviceError("CudaDevice needs CUDA, but torch.cuda.is_available() is False; use CpuDevice")
        base = Capabilities(in_graph_events=_in_graph_events_supported(), graphs=True) if caps is None else caps
        super().__init__(f"cuda:{index}", _caps(base, in_graph_events, graphs), timeout, faults, observers)
        self.index = index
        self._cycles_per_s = _sleep_cycles_per_second(index)

    @contextmanager
    def _capture_context(self, graph: CudaGraph, stream: CudaStream) -> Iterator[None]:
        # Launched functions run now; their kernels and in-graph records are captured.
        # When code inside the capture invalidates it (a host sync: .item(), synchronize),
        # ending the capture raises a bare "previous error during capture" and torch.cuda.graph
        # leaves the capture stream current on this thread: the outer stream context restores
        # the host's stream, and the error names the graph, the stream and the first failure.
        first: BaseException | None = None
        try:
            with torch.cuda.stream(stream.torch), torch.cuda.graph(
                graph.torch, stream=stream.torch, capture_error_mode="thread_local"
            ):
                try:
                    yield
                except BaseException as exc:
                    first = exc
                    raise
        except DeviceError:
            raise
        except Exception as exc:
            cause = first if isinstance(first, Exception) else exc
            hint = "" if cause is exc else (
                "; it invalidated the capture: code inside a capture must not wait for the device or "
                "read device values on the host (.item(), .tolist(), synchronize)"
            )
            raise CaptureError(
                f"capture of graph {graph.label!r} on stream {stream.name!r} failed: "
                f"{type(cause).__name__}: {cause}{hint}"
            ) from exc

    def record_here(self, event: Event) -> None:
        """Record ``event`` on the current stream, from inside a launched/captured function
        that declared ``Record(event)`` next in its ops."""
        ev: CudaEvent = self._own_event(event)
        _take_pending(ev)
        ev.torch.record(torch.cuda.current_stream())

    def stall(self, seconds: float) -> None:
        """From inside a launched function: hold the current stream for about ``seconds``
        (a ``torch.cuda._sleep`` kernel; the host does not wait). Inside a capture, the stall
        becomes part of the graph."""
        torch.cuda._sleep(int(_check_seconds(seconds) * self._cycles_per_s))

    def close(self) -> None:
        """Mark the device closed (later enqueues raise). Pending GPU work is not cancelled."""
        with self._lock:
            self._closed = True

    def _delay(self, stream: str, label: str) -> None:
        if self.faults is not None:
            delay = self.faults.delay_for(stream, label)
            if delay > 0.0:
                self.stall(delay)


# CudaDevice and its parts implement the protocol (checked by mypy, as for CpuDevice)
_IMPLEMENTS: tuple[type[Device], type[Stream], type[Event], type[Graph]] = (CudaDevice, CudaStream, CudaEvent, CudaGraph)


class SelfCheckFailed(DeviceError):
    """The CUDA start-up self-check found this machine's graphs or events unlike what readfence
    relies on; use the CPU device."""


def self_check(index: int = 0, *, timeout: float = 10.0) -> None:
    """Check on GPU ``index`` what the CUDA device relies on; raise :class:`SelfCheckFailed`.

    A graph captured on one stream: a short spin, ``x += 1``, an in-graph external event
    record, a long spin, ``x += 1``. It is replayed twice; after each replay a side stream
    waits on the event and copies ``x``. The copies must read 1 then 3: the value written
    before the record (the side stream waited), not the one written after it (it started
    before the graph ended), and 3 rather than 2 the second time (the wait bound to the latest
    replay). Every host wait has a timeout.
    """
    dev = CudaDevice(index=index, timeout=timeout)
    try:
        if not dev.caps.in_graph_events:
            raise SelfCheckFailed(f"torch {torch.__version__} cannot record events inside a CUDA graph "
                                  "(torch.cuda.Event takes no external=True)")
        where = f"cuda:{index}"
        x = torch.zeros(1, device=where)
        seen = torch.full((2,), -1.0, device=where)
        fwd, side = dev.stream("self-check"), dev.stream("self-check/side")
        mid = dev.event("self-check/mid-graph")
        fwd.launch(x.add_, 0.0, label="warm up")  # kernels load outside the capture
        fwd.launch(dev.stall, 0.001, label="warm up")
        fwd.synchronize(timeout)
        with dev.capture(fwd, label="self-check") as graph:
            fwd.launch(dev.stall, 0.005, label="short spin")
            fwd.launch(x.add_, 1.0, label="x += 1")
            fwd.record(mid)
            fwd.launch(dev.stall, 0.05, label="long spin")
            fwd.launch(x.add_, 1.0, label="x += 1")
        for i in range(2):
            graph.replay(fwd)
            side.wait(mid)
            side.launch(seen[i : i + 1].copy_, x, label="copy x")
            mid.synchronize(timeout)
        dev.synchronize(timeout)
        got = [float(v) for v in seen.tolist()]
    except SelfCheckFailed:
        raise
    except Exception as exc:
        raise SelfCheckFailed(f"CUDA self-check on cuda:{index} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        dev.close()
    if got != [1.0, 3.0]:
        why = {0.0: "the side stream did not wait for the in-graph record",
               2.0: "the side stream ran after the graph ended (the record did not fire mid-graph)"}
        reasons = [why.get(got[0], "")] + (["the second wait did not bind to the latest replay"] if got[1] != 3.0 else [])
        raise SelfCheckFailed(f"CUDA self-check on cuda:{index}: a side stream waiting on an in-graph event read "
                              f"{got}, expected [1.0, 3.0]: " + "; ".join(r for r in reasons if r))


@functools.cache
def self_check_error(index: int = 0) -> SelfCheckFailed | None:
    """:func:`self_check`'s failure on GPU ``index``, or ``None``; run once per process."""
    try:
        self_check(index)
    except SelfCheckFailed as exc:
        return exc
    return None
