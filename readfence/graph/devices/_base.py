"""What CpuDevice and CudaDevice share: streams by name, observers, capture bookkeeping, waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar, Self

import attrs

from readfence.core.internal import positive_seconds
from readfence.effects import Capabilities

from ._context import _current_context, _label_of
from ._errors import CaptureError, DeviceClosed, DeviceError
from ._faults import FaultInjector
from ._ops import Op, bind_step, records_in
from ._protocol import DEFAULT_TIMEOUT_S, DeviceObserver, Event, Graph, Launch, Stream


def _caps(caps: Capabilities | None, in_graph_events: bool | None, graphs: bool | None) -> Capabilities:
    base = Capabilities() if caps is None else caps
    changes: dict[str, bool] = {}
    if in_graph_events is not None:
        changes["in_graph_events"] = in_graph_events
    if graphs is not None:
        changes["graphs"] = graphs
    return attrs.evolve(base, **changes) if changes else base


def _check_seconds(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"stall needs a number of seconds >= 0, got {seconds!r}")
    return float(seconds)


class DeviceBase:
    """Common machinery; subclasses set the stream/event/graph types and the device specifics."""

    _stream_type: ClassVar[type[Any]]
    _event_type: ClassVar[type[Any]]
    _graph_type: ClassVar[type[Any]]

    def __init__(
        self,
        name: str,
        caps: Capabilities,
        timeout: float = DEFAULT_TIMEOUT_S,
        faults: FaultInjector | None = None,
        observers: Sequence[DeviceObserver] = (),
    ) -> None:
        self.name = name
        self.caps = caps
        self.timeout = positive_seconds("timeout", timeout)
        self.faults = faults
        self.observers: list[DeviceObserver] = list(observers)
        self._lock = threading.RLock()
        self._streams: dict[str, Any] = {}
        self._closed = False

    # -- construction
    def stream(self, name: str) -> Stream:
        """The stream called ``name``, created on first use."""
        with self._lock:
            self._check_open()
            s = self._streams.get(name)
            if s is None:
                s = self._streams[name] = self._stream_type(self, name)
            return s

    @property
    def streams(self) -> tuple[Stream, ...]:
        """Every stream created so far."""
        with self._lock:
            return tuple(self._streams.values())

    def event(self, name: str) -> Event:
        """A new event; ``name`` is used in messages (each call returns a distinct event)."""
        return self._event_type(self, name)

    def add_observer(self, observer: DeviceObserver) -> None:
        """Report every later launch, record, wait and host synchronize to ``observer``."""
        with self._lock:
            self.observers.append(observer)

    def remove_observer(self, observer: DeviceObserver) -> None:
        """Stop reporting to ``observer`` (``ValueError`` if it was not added)."""
        with self._lock:
            self.observers.remove(observer)

    # -- graphs
    def _capture_context(self, graph: Any, stream: Any) -> AbstractContextManager[Any]:
        """Device-specific context around a capture (CUDA: ``torch.cuda.graph``)."""
        return nullcontext()

    @contextmanager
    def capture(self, stream: Stream, *, label: str = "graph") -> Iterator[Graph]:
        """Capture launches and records issued on ``stream`` inside the ``with`` into a graph."""
        own = self._own_stream(stream)
        if not self.caps.graphs:
            raise CaptureError(
                f"device {self.name!r} cannot capture graphs (Capabilities.graphs=False): launch eagerly"
            )
        with self._lock:
            self._check_open()
            if own._capture is not None:
                raise CaptureError(f"stream {own.name!r} is already capturing graph {own._capture.label!r}")
            graph = self._graph_type(self, own, label)
            own._capture = graph
        try:
            with self._capture_context(graph, own):
                yield graph
        except BaseException as exc:
            graph._broken = exc
            raise
        finally:
            with self._lock:
                own._capture = None
                graph._sealed = True

    def delay_point(self, label: str) -> None:
        """Let the fault injector delay the running stream here (no-op without one)."""
        ctx = _current_context()
        if ctx is not None:
            self._delay(ctx.stream, label)

    # -- host waits
    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait for every stream; the timeout covers all of them together."""
        deadline = time.monotonic() + self._timeout(timeout)
        for s in self.streams:
            s.synchronize(max(0.0, deadline - time.monotonic()))
        self._notify("on_device_synchronize")

    def settle(self, timeout: float | None = None) -> tuple[Exception, ...]:
        """Host wait for every stream to run what it was given, going on past a failed one
        (unlike :meth:`synchronize`); returns the errors met (a stream's failure, a timeout)
        instead of raising them. A caller that is failing for its own reason settles the device
        first, so that nothing it enqueued still runs on state it shares with whoever handles
        its error; the timeout covers all the streams together.

        >>> from readfence.graph import CpuDevice
        >>> with CpuDevice() as dev:
        ...     dev.stream("forward").launch(lambda: 1 / 0, label="broken")
        ...     [type(e).__name__ for e in dev.settle()]
        ['StreamError']
        """
        deadline = time.monotonic() + self._timeout(timeout)
        errors: list[Exception] = []
        for s in self.streams:
            try:
                s.synchronize(max(0.0, deadline - time.monotonic()))
            except Exception as e:  # each stream is waited for, whatever the one before did
                errors.append(e)
        return tuple(errors)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _delay(self, stream: str, label: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- helpers
    def _launch_ops(self, launch: Launch, bind: bool = True) -> tuple[str, tuple[Op, ...], tuple[Any, ...]]:
        """A launch's label, its ops (with its step bound, unless ``bind`` is false: only observers
        and captures read the steps) and the events it records, which must be ours."""
        if not callable(launch.fn):
            raise TypeError(f"launch needs a callable, got {launch.fn!r}")
        ops = bind_step(launch.ops, launch.step if bind else None)
        records = records_in(ops)
        for ev in records:
            self._own_event(ev)
        return _label_of(launch.fn, launch.label), ops, records

    def _timeout(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if t < 0:
            raise ValueError(f"timeout must be >= 0, got {t}")
        return t

    def _refuse_host_wait_while_capturing(self, action: str) -> None:
        """A host wait or query while a stream captures: on CUDA it invalidates the capture."""
        capturing = [s for s in tuple(self._streams.values()) if s._capture is not None]
        if capturing:
            s = capturing[0]
            raise CaptureError(
                f"cannot {action} while stream {s.name!r} is capturing graph {s._capture.label!r}: "
                "a host wait or query during a capture invalidates it; wait before or after the capture"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceClosed(f"device {self.name!r} is closed")

    def _own_stream(self, stream: Any) -> Any:
        if not isinstance(stream, self._stream_type) or stream.device is not self:
            raise DeviceError(f"{stream!r} is not a stream of device {self.name!r}")
        return stream

    def _own_event(self, event: Any) -> Any:
        if not isinstance(event, self._event_type) or event.device is not self:
            raise DeviceError(f"{event!r} is not an event of device {self.name!r}")
        return event

    def _notify_locked(self, method: str, *args: Any) -> None:
        for obs in self.observers:
            getattr(obs, method)(*args)

    def _notify(self, method: str, *args: Any) -> None:
        with self._lock:
            self._notify_locked(method, *args)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.caps} streams={sorted(self._streams)}>"


class GraphBase:
    """What CpuGraph and CudaGraph share: their capture state and the replay preconditions."""

    def __init__(self, device: DeviceBase, stream: Stream, label: str) -> None:
        self.device = device
        self.stream = stream
        self.label = label
        self._sealed = False
        self._broken: BaseException | None = None

    @property
    def ops(self) -> tuple[Op, ...]:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def records(self) -> tuple[Event, ...]:
        """The events the graph records on each replay, in order."""
        return records_in(self.ops)

    def _refuse_records(self, ops: Sequence[Op], label: str) -> None:
        events = records_in(ops)
        if events and not self.device.caps.in_graph_events:
            raise CaptureError(
                f"device {self.device.name!r} cannot record events inside a graph "
                f"(Capabilities.in_graph_events=False): {label!r} in graph {self.label!r} records "
                + ", ".join(repr(e.name) for e in events) + "; record after the replay instead"
            )

    def _replay_ops(self, stream: Any, step: int | None) -> tuple[Any, tuple[Op, ...]]:
        """The stream to replay on and the graph's ops with ``step`` bound (for observers: with
        none, the static ops), after the checks."""
        stream = self.stream if stream is None else self.device._own_stream(stream)
        if self._broken is not None:
            raise CaptureError(f"graph {self.label!r} cannot be replayed: its capture failed") from self._broken
        if not self._sealed:
            raise CaptureError(f"graph {self.label!r} is replayed inside its own capture")
        return stream, bind_step(self.ops, step) if self.device.observers else self.ops

    def _announce_locked(self, stream: Any, ops: tuple[Op, ...]) -> None:
        """Under the device lock: the device is open, the stream free; observers are told."""
        dev = self.device
        dev._check_open()
        if stream._capture is not None:
            raise CaptureError(f"cannot replay graph {self.label!r} while stream {stream.name!r} is capturing")
        dev._notify_locked("on_launch", stream.name, self.label, ops)
