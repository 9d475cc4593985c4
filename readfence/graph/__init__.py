"""The graph layer: devices (CPU and CUDA), fault injection and the sanitizer.

>>> from readfence.graph import CpuDevice
>>> with CpuDevice() as dev:
...     dev.stream("forward").launch(print, "hello from the forward stream", label="hello")
...     dev.synchronize(timeout=5)
hello from the forward stream
"""

from ._cpu import CpuDevice, CpuEvent, CpuGraph, CpuStream, Generation
from ._cuda import CudaDevice
from ._device import (
    DEFAULT_TIMEOUT_S,
    DEVICE_KINDS,
    Device,
    DeviceObserver,
    Event,
    Graph,
    Stream,
    default_device,
    delay_point,
    open_device,
    record_here,
)
from ._errors import CaptureError, DeviceClosed, DeviceError, DeviceTimeout, EventNeverRecorded, StreamError
from ._faults import FaultInjector
from ._ops import Op, Read, Record, Write, bind_step, records_in
from ._policy import Policy
from ._sanitizer import Sanitizer, SanitizerError, Violation

__all__ = [
    "DEFAULT_TIMEOUT_S",
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
    "Op",
    "Policy",
    "Read",
    "Record",
    "Sanitizer",
    "SanitizerError",
    "Stream",
    "StreamError",
    "Violation",
    "Write",
    "bind_step",
    "DEVICE_KINDS",
    "default_device",
    "delay_point",
    "open_device",
    "record_here",
    "records_in",
]

from ._fence import Bound, Fence, RingWrapError
from ._lower import Lowered, StepRun, UncapturableStage, UnsoundLowering, last_reads, lower, make_state, torch_device
from ._plan import FencePlan, Placement, plan_fences

__all__ += ["Bound", "Fence", "FencePlan", "Lowered", "Placement", "RingWrapError", "StepRun",
            "UncapturableStage", "UnsoundLowering", "last_reads", "lower", "make_state", "plan_fences", "torch_device"]
from ._runtime import DecodeLoop, LoopResult, decode_loop, run_overlapped, run_serial, synthetic_work  # noqa: E402
from ._scheduler import Scheduler, StepState  # noqa: E402
from ._timeline import Timeline  # noqa: E402

__all__ += ["DecodeLoop", "LoopResult", "Scheduler", "StepState", "Timeline", "decode_loop",
            "run_overlapped", "run_serial", "synthetic_work"]
from ._composite import JoinedFence, PhasedStep, StreamGroup  # noqa: E402
from ._runtime import lower_step  # noqa: E402
from ._shapes import STEP_SHAPES, Phase, StepShape, eagle, multi_eagle, ngram, parse_step  # noqa: E402

__all__ += ["JoinedFence", "Phase", "PhasedStep", "STEP_SHAPES", "StepShape", "StreamGroup", "eagle",
            "lower_step", "multi_eagle", "ngram", "parse_step"]

from ._check import CheckState  # noqa: E402
from ._verify import LateRead, LateReadWatch, PolicyCheck, VerifyReport, phase_modes, verify  # noqa: E402

__all__ += ["CheckState", "LateRead", "LateReadWatch", "PolicyCheck", "VerifyReport", "phase_modes", "verify"]
