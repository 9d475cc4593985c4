"""The step program: forward modes, shared state, the tiny model, tracing and audit."""

from ._model import forward, prepare, rms_norm, rotary, run_step
from ._modes import ForwardMode
from ._parallel import TensorParallel, all_reduce
from ._protocol import STAGE_ENDS, BackendLike, cross_into_graph
from ._state import (
    SHARED_BUFFERS,
    ModelConfig,
    StepInputs,
    example_step,
    init_params,
    make_pools,
    make_shared_state,
    split_batch,
    tokens_per_request,
)

__all__ = [
    "SHARED_BUFFERS",
    "STAGE_ENDS",
    "BackendLike",
    "ForwardMode",
    "ModelConfig",
    "StepInputs",
    "TensorParallel",
    "all_reduce",
    "cross_into_graph",
    "example_step",
    "forward",
    "init_params",
    "make_pools",
    "make_shared_state",
    "prepare",
    "rms_norm",
    "rotary",
    "run_step",
    "split_batch",
    "tokens_per_request",
]

# -- tracing and audit ----------------------------------------------------------------------
from ._audit import AuditReport, BufferAudit, Unsound, audit, audit_report, default_batch_sizes
from ._program import Program, StageGraph, flatten_inputs
from ._threads import StageThreadError
from ._trace import CapturedStateError, StageWriteError, bind, clear_trace_cache, trace, trace_cache_size

__all__ += [
    "AuditReport",
    "BufferAudit",
    "CapturedStateError",
    "Program",
    "StageGraph",
    "StageThreadError",
    "StageWriteError",
    "Unsound",
    "audit",
    "audit_report",
    "bind",
    "clear_trace_cache",
    "default_batch_sizes",
    "flatten_inputs",
    "trace",
    "trace_cache_size",
]

# -- the runtime read observer and its cross-check of the trace ---------------------------------
from ._observe import Disagreement, Observation, ReadObserver, cross_check, observe, observe_program  # noqa: E402

__all__ += [
    "Disagreement",
    "Observation",
    "ReadObserver",
    "cross_check",
    "observe",
    "observe_program",
]
