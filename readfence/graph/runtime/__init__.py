"""The runtime: the overlapped decode loop, the serving loop, their schedulers, and the race
sanitizer watching them.

The scheduler writes step i+1's shared state behind step i's fence while the forward stream
replays step i; ``run_serial`` is the reference it is compared with, bit for bit. The serving
loop (``run_serve``) does the same as an engine does it: seeded arrivals, changing batches, a
graph per captured batch size, prefill steps between decode steps; ``run_serve_serial`` is its
reference. A loop may stage each step's state in host buffers (``Staging``, or an engine's
ring), checked against the steps it keeps in flight (``check_staging``). Each loop's options
are one record (``LoopOptions``, ``ServeOptions``) that the loop, the helpers that run it and its
serial reference take whole.
"""

from ._arrivals import Request, Traffic
from ._loop import DecodeLoop, decode_loop, run_overlapped, synthetic_work
from ._options import LoopOptions, ServeOptions
from ._plot import plot_timelines
from ._result import LoopResult
from ._sanitizer import Sanitizer, SanitizerError, Violation
from ._scheduler import Scheduler, StepState
from ._serial import run_serial
from ._serve import (
    DEFAULT_CAPTURE_SIZES,
    SerialServe,
    ServeLoop,
    ServeResult,
    StepRecord,
    prefill_target,
    run_serve,
    run_serve_serial,
    serve_loop,
    serve_scheduler,
)
from ._serve_scheduler import ServeScheduler, ServeStep
from ._staging import Staging, StagingRing, StagingRingError, check_staging
from ._traces import CappedTimeline, TracedRun, run_traced, write_trace

__all__ = [
    "CappedTimeline",
    "DEFAULT_CAPTURE_SIZES",
    "DecodeLoop",
    "LoopOptions",
    "LoopResult",
    "Sanitizer",
    "SanitizerError",
    "Request",
    "Scheduler",
    "SerialServe",
    "ServeLoop",
    "ServeOptions",
    "ServeResult",
    "ServeScheduler",
    "ServeStep",
    "Staging",
    "StagingRing",
    "StagingRingError",
    "StepRecord",
    "StepState",
    "TracedRun",
    "Traffic",
    "Violation",
    "decode_loop",
    "prefill_target",
    "run_overlapped",
    "run_serial",
    "run_serve",
    "run_serve_serial",
    "check_staging",
    "serve_loop",
    "serve_scheduler",
    "synthetic_work",
    "plot_timelines",
    "run_traced",
    "write_trace",
]
