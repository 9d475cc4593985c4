"""The graph layer, in pipeline order: each subpackage imports only those before it.

* ``devices``: the ``Device`` protocol, ``CpuDevice`` and ``CudaDevice``, opening one by kind,
  op items, errors, fault injection, timelines;
* ``lowering``: fence policies and plans, the FX pass that inserts event records, fences and
  event rings, the poison-on-release check state, ``lower``;
* ``steps``: steps of several graphs: speculative step shapes, per-stream groups, ``lower_step``;
* ``runtime``: the scheduler, the race sanitizer, the overlapped decode loop and its serial
  reference;
* ``verification``: ``verify`` (poison, guard and read observer against the serial run); the
  differential fuzzer that uses it is ``readfence.graph.fuzz``.

This package's ``__init__`` names what a user of the whole path needs (devices, ``lower``, the
loops, ``verify``, step shapes); each subpackage's ``__init__`` lists its own public names, the
finer pieces (events and streams, fence plans, phases, serving internals) among them.

>>> import readfence.graph as graph
>>> graph.CpuDevice is graph.devices.CpuDevice, graph.lower is graph.lowering.lower
(True, True)
"""

# in pipeline order, not alphabetical: each subpackage imports only those above it
# isort: off
from . import devices as devices
from . import lowering as lowering
from . import steps as steps
from . import runtime as runtime
from . import verification as verification
from .devices import DEVICE_KINDS as DEVICE_KINDS
from .devices import CpuDevice as CpuDevice
from .devices import CudaDevice as CudaDevice
from .devices import Device as Device
from .devices import DeviceError as DeviceError
from .devices import DeviceTimeout as DeviceTimeout
from .devices import FaultInjector as FaultInjector
from .devices import Timeline as Timeline
from .devices import default_device as default_device
from .devices import open_device as open_device
from .lowering import CheckState as CheckState
from .lowering import Fence as Fence
from .lowering import LowerOptions as LowerOptions
from .lowering import Lowered as Lowered
from .lowering import Policy as Policy
from .lowering import ReplayAliasError as ReplayAliasError
from .lowering import StepRun as StepRun
from .lowering import UncapturableStage as UncapturableStage
from .lowering import UnsoundLowering as UnsoundLowering
from .lowering import lower as lower
from .lowering import make_state as make_state
from .steps import CaptureList as CaptureList
from .steps import StepShape as StepShape
from .steps import eagle as eagle
from .steps import lower_capture_list as lower_capture_list
from .steps import lower_step as lower_step
from .steps import multi_eagle as multi_eagle
from .steps import ngram as ngram
from .steps import parse_step as parse_step
from .steps import parse_target as parse_target
from .runtime import DecodeLoop as DecodeLoop
from .runtime import LoopOptions as LoopOptions
from .runtime import LoopResult as LoopResult
from .runtime import Sanitizer as Sanitizer
from .runtime import SanitizerError as SanitizerError
from .runtime import Scheduler as Scheduler
from .runtime import ServeOptions as ServeOptions
from .runtime import ServeResult as ServeResult
from .runtime import Traffic as Traffic
from .runtime import Violation as Violation
from .runtime import decode_loop as decode_loop
from .runtime import run_overlapped as run_overlapped
from .runtime import run_serial as run_serial
from .runtime import run_serve as run_serve
from .runtime import run_serve_serial as run_serve_serial
from .runtime import serve_loop as serve_loop
from .runtime import plot_timelines as plot_timelines
from .runtime import run_traced as run_traced
from .runtime import write_trace as write_trace
from .verification import LateRead as LateRead
from .verification import VerifyReport as VerifyReport
from .verification import verify as verify
from .verification import verify_serve as verify_serve
# isort: on

__all__ = [
    "Policy",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceError",
    "DeviceTimeout",
    "default_device",
    "open_device",
    "DEVICE_KINDS",
    "Timeline",
    "FaultInjector",
    "lower",
    "Lowered",
    "LowerOptions",
    "StepRun",
    "Fence",
    "CheckState",
    "UnsoundLowering",
    "UncapturableStage",
    "ReplayAliasError",
    "make_state",
    "StepShape",
    "parse_step",
    "parse_target",
    "eagle",
    "multi_eagle",
    "ngram",
    "lower_step",
    "lower_capture_list",
    "CaptureList",
    "decode_loop",
    "DecodeLoop",
    "LoopOptions",
    "run_overlapped",
    "run_serial",
    "LoopResult",
    "Scheduler",
    "Sanitizer",
    "SanitizerError",
    "Violation",
    "run_serve",
    "run_serve_serial",
    "serve_loop",
    "ServeOptions",
    "ServeResult",
    "Traffic",
    "run_traced",
    "write_trace",
    "plot_timelines",
    "verify",
    "verify_serve",
    "VerifyReport",
    "LateRead",
]
