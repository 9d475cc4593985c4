"""The runtime: the overlapped decode loop, its scheduler, and the race sanitizer watching it.

The scheduler writes step i+1's shared state behind step i's fence while the forward stream
replays step i; ``run_serial`` is the reference it is compared with, bit for bit.
"""

from ._loop import DecodeLoop, LoopResult, decode_loop, run_overlapped, run_serial, synthetic_work
from ._sanitizer import Sanitizer, SanitizerError, Violation
from ._scheduler import Scheduler, StepState

__all__ = [
    "DecodeLoop",
    "LoopResult",
    "Sanitizer",
    "SanitizerError",
    "Scheduler",
    "StepState",
    "Violation",
    "decode_loop",
    "run_overlapped",
    "run_serial",
    "synthetic_work",
]
