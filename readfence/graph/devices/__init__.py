"""Devices: streams, events and graphs with the semantics of ``torch.cuda``, on CUDA or on the CPU.

The ``Device`` protocol, its two implementations (``CpuDevice``: a worker thread per stream;
``CudaDevice``: ``torch.cuda``), opening one by kind, the op items a launch declares (what it
reads, writes and records), the errors every wait raises instead of hanging, seeded fault
injection, and a timeline of what ran where.

>>> from readfence.graph.devices import CpuDevice
>>> with CpuDevice() as dev:
...     dev.stream("forward").launch(print, "hello from the forward stream", label="hello")
...     dev.synchronize(timeout=5)
hello from the forward stream
"""

from ._context import delay_point, record_here
from ._cpu import CpuDevice
from ._cpu_events import CpuEvent, Generation
from ._cpu_graph import CpuGraph
from ._cpu_stream import CpuStream
from ._cuda import CudaDevice
from ._errors import CaptureError, DeviceClosed, DeviceError, DeviceTimeout, EventNeverRecorded, StreamError
from ._faults import FaultInjector
from ._open import DEVICE_KINDS, default_device, open_device
from ._ops import Op, Read, Record, Write, bind_step, records_in
from ._protocol import DEFAULT_TIMEOUT_S, Device, DeviceObserver, Event, Graph, Launch, Stream
from ._timeline import Span, Timeline

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEVICE_KINDS",
    "CaptureError",
    "CpuDevice",
    "CpuEvent",
    "CpuGraph",
    "CpuStream",
    "CudaDevice",
    "Device",
    "DeviceClosed",
    "DeviceError",
    "DeviceObserver",
    "DeviceTimeout",
    "Event",
    "EventNeverRecorded",
    "FaultInjector",
    "Generation",
    "Graph",
    "Launch",
    "Op",
    "Read",
    "Record",
    "Span",
    "Stream",
    "StreamError",
    "Timeline",
    "Write",
    "bind_step",
    "default_device",
    "delay_point",
    "open_device",
    "record_here",
    "records_in",
]
