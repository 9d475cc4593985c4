"""The ``Device`` protocol (mirrors ``torch.cuda``), the observer hook, and shared plumbing.

A device has named streams and events and can capture work issued on a stream into a graph
that is replayed as one unit. The vocabulary follows ``torch.cuda``:

* ``stream.launch(fn, *args, label=..., ops=..., step=...)`` enqueues ``fn(*args)``;
* ``stream.record(event)`` / ``stream.wait(event)`` order work across streams. A wait binds
  to the event's latest record *enqueued at the time of the wait call* (CUDA semantics);
* ``event.synchronize(timeout)`` / ``stream.synchronize(timeout)`` /
  ``device.synchronize(timeout)`` are host waits; each has a timeout and raises
  :class:`DeviceTimeout` naming what was waited on rather than hanging;
* ``with device.capture(stream) as graph:`` records launches and event records issued on
  ``stream`` into ``graph`` instead of running them; ``graph.replay(stream)`` enqueues them
  as one unit;
* ``device.record_here(event)``, called from *inside* a launched (or captured) function,
  records ``event`` at exactly that point. Every such event must be declared as a
  ``Record(event)`` item, in order, in the ``ops`` of the launch (so the device and its
  observers know about it at enqueue time). This is how one lowered graph fires several
  events at different points of one replay.

Observers (see :class:`DeviceObserver`, e.g. the :class:`~readfence.graph.Sanitizer`) are
told about every launch, record, wait and host synchronize at enqueue time, in enqueue order,
under the device's enqueue lock.

>>> from readfence.graph import CpuDevice, Read, Record
>>> with CpuDevice() as dev:
...     fwd, done = dev.stream("forward"), dev.event("done")
...     out = []
...     def body():
...         out.append("first half")
...         dev.record_here(done)      # fires mid-launch
...         out.append("second half")
...     fwd.launch(body, label="body", ops=[Read("req_to_token", "attend"), Record(done)], step=0)
...     done.synchronize(timeout=5)
...     fwd.synchronize(timeout=5)
>>> out
['first half', 'second half']
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from readfence.effects import Capabilities

from ._errors import CaptureError
from ._ops import Op

DEFAULT_TIMEOUT_S = 30.0
"""Default timeout of every host wait (and of device-side waits on ``CpuDevice``)."""


@runtime_checkable
class Event(Protocol):
    """A named device event. ``generation`` counts the records enqueued so far."""

    name: str

    @property
    def generation(self) -> int: ...

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait for the latest record enqueued so far; raises on timeout or stream error."""

    def query(self) -> bool:
        """Whether the latest record enqueued so far has fired."""


@runtime_checkable
class Graph(Protocol):
    """Work captured on one stream; replayed as one unit."""

    label: str

    @property
    def ops(self) -> tuple[Op, ...]:
        """The static op sequence of the graph (concatenated launch ops and records)."""

    def replay(self, stream: Stream | None = None, *, step: int | None = None) -> None:
        """Enqueue the whole graph on ``stream`` (default: the capture stream)."""


@runtime_checkable
class Stream(Protocol):
    """A FIFO of device work."""

    name: str

    def launch(
        self,
        fn: Callable[..., Any],
        *args: Any,
        label: str = "",
        ops: Sequence[Op] = (),
        step: int | None = None,
    ) -> None:
        """Enqueue ``fn(*args)``; ``ops`` declares its reads/writes/in-launch records."""

    def record(self, event: Event) -> None:
        """Enqueue a record of ``event`` (a new generation)."""

    def wait(self, event: Event) -> None:
        """Later work on this stream waits for ``event``'s latest record enqueued so far."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait until every op enqueued so far on this stream has run."""

    def batch(self) -> AbstractContextManager[None]:
        """Hand what is issued on this stream inside the ``with`` block over as one unit when it
        ends (``CpuStream``: one work item; nothing to do on CUDA). Ops, bindings and observer
        calls are as if issued one by one."""
        ...

    def keep(self, tensor: Tensor) -> None:
        """Do not let ``tensor``'s memory be reused before the work enqueued on this stream so
        far has run (for a tensor allocated on the host's stream and written by this one)."""


@runtime_checkable
class Device(Protocol):
    """Streams, events and graphs; see the module docstring."""

    name: str
    caps: Capabilities
    timeout: float

    def stream(self, name: str) -> Stream:
        """The stream called ``name`` (created on first use)."""

    def event(self, name: str) -> Event:
        """A new event (names are for messages; each call returns a distinct event)."""

    def capture(self, stream: Stream, *, label: str = "graph") -> AbstractContextManager[Graph]:
        """Capture work issued on ``stream`` inside the ``with`` into the yielded graph."""

    def record_here(self, event: Event) -> None:
        """Record ``event`` now, from inside a launched or captured function."""

    def stall(self, seconds: float) -> None:
        """From inside a launched function: hold the running stream for about ``seconds``
        without using compute (stands for a copy engine or a network wait)."""
        ...

    def delay_point(self, label: str) -> None:
        """A point where the fault injector (if any) may delay the running stream."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Host wait for every stream."""

    def add_observer(self, observer: DeviceObserver) -> None:
        """Report every later enqueue to ``observer``."""

    def close(self) -> None:
        """Stop the device; pending waits fail instead of hanging."""


class DeviceObserver:
    """Receives every device action at enqueue time. Subclass and override what you need.

    Streams are passed by name; events as the device's event objects (compare by identity).
    ``ops`` have their steps bound already.
    """

    def on_launch(self, stream: str, label: str, ops: Sequence[Op]) -> None:
        """A launch or a graph replay was enqueued on ``stream``."""

    def on_record(self, stream: str, event: Any) -> None:
        """``stream.record(event)`` was enqueued."""

    def on_wait(self, stream: str, event: Any) -> None:
        """``stream.wait(event)`` was enqueued (bound to the latest record)."""

    def on_event_synchronize(self, event: Any) -> None:
        """The host returned from ``event.synchronize()``."""

    def on_stream_synchronize(self, stream: str) -> None:
        """The host returned from ``stream.synchronize()``."""

    def on_device_synchronize(self) -> None:
        """The host returned from ``device.synchronize()``."""


class _OpContext:
    """What the current thread is running: a launched function and its declared records."""

    __slots__ = ("device", "stream", "label", "pending")

    def __init__(self, device: Any, stream: str, label: str, pending: Sequence[tuple[Any, Any]]) -> None:
        self.device = device
        self.stream = stream
        self.label = label
        # (event, token) pairs in declared order; the token is device specific.
        self.pending: deque[tuple[Any, Any]] = deque(pending)


class _OpContextStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[_OpContext] = []


_CONTEXT = _OpContextStack()


def _current_context() -> _OpContext | None:
    return _CONTEXT.stack[-1] if _CONTEXT.stack else None


class _running:
    """Context manager: run a launched function with its declared records pending."""

    def __init__(self, ctx: _OpContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> _OpContext:
        _CONTEXT.stack.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _CONTEXT.stack.pop()


def _take_pending(event: Any) -> tuple[_OpContext, Any]:
    """Pop the next declared record of the running launch; it must be ``event``."""
    ctx = _current_context()
    name = getattr(event, "name", repr(event))
    if ctx is None:
        raise CaptureError(
            f"record_here({name!r}) called outside a launched function: record_here is for "
            "code running on a stream (use stream.record(event) from the host)"
        )
    if not ctx.pending:
        raise CaptureError(
            f"record_here({name!r}) in op {ctx.label!r} on stream {ctx.stream!r} was not "
            "declared: add Record(event) to the ops of the launch"
        )
    expected, token = ctx.pending[0]
    if expected is not event:
        raise CaptureError(
            f"record_here({name!r}) in op {ctx.label!r} on stream {ctx.stream!r} is out of "
            f"the declared order: the next declared Record is {expected.name!r}"
        )
    ctx.pending.popleft()
    return ctx, token


def _check_all_recorded(ctx: _OpContext) -> None:
    if ctx.pending:
        names = [ev.name for ev, _ in ctx.pending]
        raise CaptureError(
            f"op {ctx.label!r} on stream {ctx.stream!r} declared Record items it never "
            f"recorded with record_here: {names}"
        )


def _run_launched(device: Any, stream: str, label: str, fn: Callable[..., Any], args: Sequence[Any],
                  pending: Sequence[tuple[Any, Any]]) -> None:
    """Run a launched ``fn(*args)`` with its declared records ``pending`` (``(event, token)``
    pairs, for ``record_here``); each of them must be recorded by the time it returns."""
    ctx = _OpContext(device, stream, label, pending)
    with _running(ctx):
        fn(*args)
    _check_all_recorded(ctx)


def record_here(event: Event) -> None:
    """Record ``event`` at this point of the running launch: ``event.device.record_here(event)``.

    A plain module-level function, convenient as the target of an FX ``call_function`` node.
    """
    event.device.record_here(event)  # type: ignore[attr-defined]


def delay_point(label: str) -> None:
    """A fault-injection point inside the running launch (no-op outside one or without faults).

    A plain module-level function, convenient as the target of an FX ``call_function`` node.
    """
    ctx = _current_context()
    if ctx is not None:
        ctx.device.delay_point(label)


def copy_from_host(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)``, without making the host wait when ``src`` is on the host and ``dst``
    is not: the copy reads page-locked memory (``src`` pinned, or a pinned copy of it) with
    ``non_blocking=True``. From pageable memory CUDA stages the copy through the host, which
    then waits for the stream inside a C call that has no timeout. Host to host, a plain copy.

    The pinned copy needs no keeping alive: torch's pinned-memory allocator does not reuse it
    before the copy that reads it has run.

    >>> import torch
    >>> copy_from_host(torch.zeros(2), torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    if src.device.type != "cpu" or dst.device.type == "cpu":
        return dst.copy_(src)
    return dst.copy_(src if src.is_pinned() else src.pin_memory(), non_blocking=True)


def _label_of(fn: Callable[..., Any], label: str) -> str:
    return label or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class _Observers:
    """A list of observers, called in order."""

    def __init__(self, observers: Sequence[DeviceObserver] = ()) -> None:
        self.items: list[DeviceObserver] = list(observers)

    def __iter__(self) -> Iterator[DeviceObserver]:
        return iter(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def check_device(device: Any, name: str = "device") -> Any:
    """``device`` if it is a readfence device (streams, events, ``caps``); else a ``TypeError``
    naming ``name`` that says how to make one.

    >>> check_device("cpu")
    Traceback (most recent call last):
    ...
    TypeError: device must be a readfence device object such as CpuDevice() or open_device('cpu') (from readfence.graph), got 'cpu' (str)
    """
    if isinstance(getattr(device, "caps", None), Capabilities) and callable(getattr(device, "stream", None)):
        return device
    kind = f"{device.strip().lower()!r}" if isinstance(device, str) and device.strip().lower() in DEVICE_KINDS else "'cpu'"
    raise TypeError(f"{name} must be a readfence device object such as CpuDevice() or open_device({kind}) "
                    f"(from readfence.graph), got {device!r} ({type(device).__name__})")


def default_device(**kwargs: Any) -> Device:
    """``CudaDevice`` when ``torch.cuda.is_available()``, else ``CpuDevice`` (kwargs passed on).

    >>> import torch
    >>> dev = default_device()
    >>> dev.name.split(":")[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    True
    >>> dev.close()
    """
    return open_device("auto", **kwargs)


DEVICE_KINDS = ("auto", "cpu", "cuda")


def open_device(kind: str = "auto", *, notice: Callable[[str], None] | None = None, **kwargs: Any) -> Device:
    """A fresh device of ``kind``: ``cpu``, ``cuda``, or ``auto`` (CUDA when available and it
    passes the start-up self-check, ``readfence.graph._cuda.self_check``, run once per process).

    ``cuda`` raises the self-check's error; ``auto`` falls back to the CPU device and says so in
    one line to ``notice`` (default: standard error). Close the device, or use it as a context
    manager; kwargs go to the device's constructor.

    >>> with open_device("cpu", timeout=5) as dev:
    ...     dev.name, dev.timeout
    ('cpu', 5.0)
    >>> open_device("tpu")
    Traceback (most recent call last):
    ...
    ValueError: unknown device kind 'tpu'; allowed: auto, cpu, cuda
    """
    import torch

    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device kind {kind!r}; allowed: {', '.join(DEVICE_KINDS)}")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        from . import _cuda

        error = _cuda.self_check_error(kwargs.get("index", 0))
        if error is None:
            return _cuda.CudaDevice(**kwargs)
        if kind == "cuda":
            raise error
        message = " ".join(str(error).split())
        (notice or _stderr)(f"readfence: CUDA failed its start-up self-check, using the CPU device ({message})")
        kwargs.pop("index", None)
    from ._cpu import CpuDevice

    return CpuDevice(**kwargs)


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)
