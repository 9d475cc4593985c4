"""The ``Device`` protocol (mirrors ``torch.cuda``) and the observer hook.

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

>>> from readfence.graph import CpuDevice
>>> from readfence.graph.devices import Read, Record
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

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, Self, TypeVarTuple, runtime_checkable

import attrs
from torch import Tensor

from readfence.effects import Capabilities

from ._ops import Op

_Ts = TypeVarTuple("_Ts")

DEFAULT_TIMEOUT_S = 30.0
"""Default timeout of every host wait (and of device-side waits on ``CpuDevice``)."""


@attrs.frozen(eq=False)  # holds a function and its arguments: compared by identity
class Launch:
    """One launch as a stream receives it: ``fn(*args)``, its label (``""``: the function's
    name), the op items it declares and the step that binds them (see ``Stream.launch``).

    >>> Launch(print, ("hello",), label="greet").label
    'greet'
    """

    fn: Callable[..., object]
    args: tuple[Any, ...] = ()
    label: str = ""
    ops: Sequence[Op] = ()
    step: int | None = None


@runtime_checkable
class Event(Protocol):
    """A named device event. ``generation`` counts the records enqueued so far."""

    name: str

    @property
    def device(self) -> Device:
        """The device whose streams record it."""
        ...

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

        The one spelling of a launch's arguments: every device inherits it and implements
        :meth:`submit`, which takes them as one :class:`Launch`.
        """
        self.submit(Launch(fn, args, label, ops, step))

    def submit(self, launch: Launch) -> None:
        """Enqueue ``launch`` (what :meth:`launch` makes of its arguments)."""

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

    def settle(self, timeout: float | None = None) -> tuple[Exception, ...]:
        """Host wait for every stream, past a failed one: the errors met, not raised."""

    def add_observer(self, observer: DeviceObserver) -> None:
        """Report every later enqueue to ``observer``."""

    def remove_observer(self, observer: DeviceObserver) -> None:
        """Stop reporting to ``observer``."""

    def close(self) -> None:
        """Stop the device; pending waits fail instead of hanging."""

    def __enter__(self) -> Self:
        """``with device:`` closes the device on the way out."""
        ...

    def __exit__(self, *exc: object) -> None: ...


class DeviceObserver:
    """Receives every device action at enqueue time. Subclass and override what you need.

    Streams are passed by name; events as the device's event objects (compare by identity).
    ``ops`` have their steps bound already.
    """

    def on_launch(self, stream: str, label: str, ops: Sequence[Op]) -> None:
        """A launch or a graph replay was enqueued on ``stream``."""

    def on_record(self, stream: str, event: Event) -> None:
        """``stream.record(event)`` was enqueued."""

    def on_wait(self, stream: str, event: Event) -> None:
        """``stream.wait(event)`` was enqueued (bound to the latest record)."""

    def on_event_synchronize(self, event: Event) -> None:
        """The host returned from ``event.synchronize()``."""

    def on_stream_synchronize(self, stream: str) -> None:
        """The host returned from ``stream.synchronize()``."""

    def on_device_synchronize(self) -> None:
        """The host returned from ``device.synchronize()``."""
