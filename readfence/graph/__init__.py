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

Each subpackage's ``__init__`` lists its public names; all of them are re-exported here, by name.

>>> import readfence.graph as graph
>>> graph.CpuDevice is graph.devices.CpuDevice, graph.lower is graph.lowering.lower
(True, True)
"""

# in pipeline order, not alphabetical: each subpackage imports only those above it
# isort: off
from . import devices, lowering, steps, runtime, verification
from .devices import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from .devices import DEVICE_KINDS as DEVICE_KINDS
from .devices import CaptureError as CaptureError
from .devices import CpuDevice as CpuDevice
from .devices import CpuEvent as CpuEvent
from .devices import CpuGraph as CpuGraph
from .devices import CpuStream as CpuStream
from .devices import CudaDevice as CudaDevice
from .devices import Device as Device
from .devices import DeviceClosed as DeviceClosed
from .devices import DeviceError as DeviceError
from .devices import DeviceObserver as DeviceObserver
from .devices import DeviceTimeout as DeviceTimeout
from .devices import Event as Event
from .devices import EventNeverRecorded as EventNeverRecorded
from .devices import FaultInjector as FaultInjector
from .devices import Generation as Generation
from .devices import Graph as Graph
from .devices import Op as Op
from .devices import Read as Read
from .devices import Record as Record
from .devices import Span as Span
from .devices import Stream as Stream
from .devices import StreamError as StreamError
from .devices import Timeline as Timeline
from .devices import Write as Write
from .devices import bind_step as bind_step
from .devices import default_device as default_device
from .devices import delay_point as delay_point
from .devices import open_device as open_device
from .devices import record_here as record_here
from .devices import records_in as records_in
from .lowering import POISONS as POISONS
from .lowering import Bound as Bound
from .lowering import CheckState as CheckState
from .lowering import Fence as Fence
from .lowering import ForeignEventError as ForeignEventError
from .lowering import FencePlan as FencePlan
from .lowering import LowerOptions as LowerOptions
from .lowering import Lowered as Lowered
from .lowering import Placement as Placement
from .lowering import Policy as Policy
from .lowering import ReplayAliasError as ReplayAliasError
from .lowering import RingWrapError as RingWrapError
from .lowering import StepRun as StepRun
from .lowering import UncapturableStage as UncapturableStage
from .lowering import UnsoundLowering as UnsoundLowering
from .lowering import last_reads as last_reads
from .lowering import lower as lower
from .lowering import make_state as make_state
from .lowering import plan_fences as plan_fences
from .lowering import poison_family as poison_family
from .lowering import torch_device as torch_device
from .steps import STEP_SHAPES as STEP_SHAPES
from .steps import CaptureList as CaptureList
from .steps import JoinedFence as JoinedFence
from .steps import LoweredStep as LoweredStep
from .steps import Phase as Phase
from .steps import PhasedStep as PhasedStep
from .steps import StepShape as StepShape
from .steps import StreamGroup as StreamGroup
from .steps import Target as Target
from .steps import capture_list as capture_list
from .steps import eagle as eagle
from .steps import lower_capture_list as lower_capture_list
from .steps import lower_step as lower_step
from .steps import multi_eagle as multi_eagle
from .steps import ngram as ngram
from .steps import parse_step as parse_step
from .steps import parse_target as parse_target
from .runtime import DEFAULT_CAPTURE_SIZES as DEFAULT_CAPTURE_SIZES
from .runtime import DecodeLoop as DecodeLoop
from .runtime import LoopResult as LoopResult
from .runtime import Sanitizer as Sanitizer
from .runtime import SanitizerError as SanitizerError
from .runtime import Request as Request
from .runtime import Scheduler as Scheduler
from .runtime import SerialServe as SerialServe
from .runtime import ServeLoop as ServeLoop
from .runtime import ServeResult as ServeResult
from .runtime import ServeScheduler as ServeScheduler
from .runtime import ServeStep as ServeStep
from .runtime import StepRecord as StepRecord
from .runtime import StepState as StepState
from .runtime import Traffic as Traffic
from .runtime import Violation as Violation
from .runtime import decode_loop as decode_loop
from .runtime import prefill_target as prefill_target
from .runtime import run_overlapped as run_overlapped
from .runtime import run_serial as run_serial
from .runtime import run_serve as run_serve
from .runtime import run_serve_serial as run_serve_serial
from .runtime import serve_loop as serve_loop
from .runtime import serve_scheduler as serve_scheduler
from .runtime import synthetic_work as synthetic_work
from .runtime import TracedRun as TracedRun
from .runtime import plot_timelines as plot_timelines
from .runtime import run_traced as run_traced
from .runtime import write_trace as write_trace
from .verification import CHECKS as CHECKS
from .verification import LateRead as LateRead
from .verification import LateReadWatch as LateReadWatch
from .verification import PolicyCheck as PolicyCheck
from .verification import VerifyReport as VerifyReport
from .verification import phase_modes as phase_modes
from .verification import verify as verify
# isort: on

__all__ = [*devices.__all__, *lowering.__all__, *steps.__all__, *runtime.__all__, *verification.__all__]  # (a test holds the two lists equal)
