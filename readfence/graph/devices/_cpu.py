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

import time
from collections.abc import Sequence

from readfence.effects import Capabilities

from ._base import _caps
from ._cpu_base import CpuDeviceBase
from ._cpu_events import CpuEvent
from ._cpu_graph import CpuGraph
from ._cpu_items import _STOP
from ._cpu_stream import CpuStream
from ._faults import FaultInjector
from ._protocol import DEFAULT_TIMEOUT_S, Device, DeviceObserver, Event, Graph, Stream


class CpuDevice(CpuDeviceBase):
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


# CpuDevice and its parts implement the protocol: mypy checks these (a method that narrows a
# parameter type, as record_here(event: CpuEvent) once did, fails here)
_IMPLEMENTS: tuple[type[Device], type[Stream], type[Event], type[Graph]] = (CpuDevice, CpuStream, CpuEvent, CpuGraph)
