"""The step program: forward modes, shared state, the step and its interpreters, tracing, audit.

Read ``_step`` first: a step is three :class:`Stage` values and one function,
:func:`eval_step`, that runs them through an interpreter. The serial reference
(:func:`run_step`), the tracer (:func:`trace`, giving a :class:`Program`), the runtime read
observer (:func:`observe`) and the graph layer's rehearsal and fuzzer are interpreters of it;
a traced :class:`Program` runs on an environment of names (:func:`run_program`), as
``jax.core.eval_jaxpr`` runs a jaxpr.
"""

from ._audit import AuditReport as AuditReport
from ._audit import BufferAudit as BufferAudit
from ._audit import Latent as Latent
from ._audit import Unsound as Unsound
from ._audit import Verdict as Verdict
from ._audit import audit as audit
from ._audit import audit_report as audit_report
from ._audit import default_batch_sizes as default_batch_sizes
from ._model import forward as forward
from ._model import prepare as prepare
from ._model import rms_norm as rms_norm
from ._model import rotary as rotary
from ._model import run_step as run_step
from ._model import step_functions as step_functions
from ._modes import ForwardMode as ForwardMode
from ._observe import Disagreement as Disagreement
from ._observe import Observation as Observation
from ._observe import ReadObserver as ReadObserver
from ._observe import Watched as Watched
from ._observe import cross_check as cross_check
from ._observe import observe as observe
from ._observe import observe_program as observe_program
from ._observe import observe_step as observe_step
from ._parallel import TensorParallel as TensorParallel
from ._parallel import all_reduce as all_reduce
from ._program import Program as Program
from ._program import StageGraph as StageGraph
from ._program import flatten_inputs as flatten_inputs
from ._program import run_program as run_program
from ._protocol import BackendLike as BackendLike
from ._protocol import ChildRun as ChildRun
from ._scan import LayerScan as LayerScan
from ._scan import run_scan as run_scan
from ._state import SHARED_BUFFERS as SHARED_BUFFERS
from ._state import ModelConfig as ModelConfig
from ._state import StepInputs as StepInputs
from ._state import example_step as example_step
from ._state import init_params as init_params
from ._state import make_pools as make_pools
from ._state import make_shared_state as make_shared_state
from ._state import split_batch as split_batch
from ._state import tokens_per_request as tokens_per_request
from ._state import varied_step as varied_step
from ._step import BODY as BODY
from ._step import EAGER as EAGER
from ._step import PREPARE_IN_GRAPH as PREPARE_IN_GRAPH
from ._step import PREPARE_OUT_GRAPH as PREPARE_OUT_GRAPH
from ._step import STAGE_ENDS as STAGE_ENDS
from ._step import STAGES as STAGES
from ._step import Interpreter as Interpreter
from ._step import OutputGuard as OutputGuard
from ._step import Stage as Stage
from ._step import StageCall as StageCall
from ._step import StageOutputError as StageOutputError
from ._step import StepFunctions as StepFunctions
from ._step import check_stage_output as check_stage_output
from ._step import cross_into_graph as cross_into_graph
from ._step import eval_step as eval_step
from ._step import flatten_group as flatten_group
from ._step import stage_named as stage_named
from ._threads import StageThreadError as StageThreadError
from ._validate import NotGraphSafe as NotGraphSafe
from ._validate import validate_replay as validate_replay
from .tracing._analysis import StageWriteError as StageWriteError
from .tracing._bind import bind as bind
from .tracing._cache import clear_trace_cache as clear_trace_cache
from .tracing._cache import trace_cache_size as trace_cache_size
from .tracing._captured import CapturedStateError as CapturedStateError
from .tracing._kernel_access import KernelAccess as KernelAccess
from .tracing._kernel_access import kernel_access as kernel_access
from .tracing._trace import trace as trace
from .tracing._trace import trace_step as trace_step
from .tracing._triton import LaunchStreamError as LaunchStreamError
from .tracing._triton import UnboundedKernelError as UnboundedKernelError
from .tracing._triton import launches_unseen as launches_unseen

__all__ = [
    "BODY", "EAGER", "PREPARE_IN_GRAPH", "PREPARE_OUT_GRAPH", "SHARED_BUFFERS", "STAGES", "STAGE_ENDS",
    "AuditReport", "BackendLike", "BufferAudit", "ChildRun", "CapturedStateError", "Disagreement", "ForwardMode",
    "Interpreter", "LayerScan", "ModelConfig", "NotGraphSafe", "Observation", "OutputGuard", "Program", "ReadObserver", "Stage", "StageCall",
    "StageGraph", "StageOutputError", "StageThreadError", "StageWriteError", "StepFunctions", "StepInputs",
    "KernelAccess", "Latent", "LaunchStreamError", "TensorParallel", "UnboundedKernelError", "Unsound", "Verdict", "Watched",
    "all_reduce", "audit", "audit_report", "bind", "check_stage_output", "clear_trace_cache", "cross_check",
    "cross_into_graph", "default_batch_sizes", "eval_step", "example_step", "flatten_group", "flatten_inputs",
    "forward", "init_params", "kernel_access", "launches_unseen", "make_pools", "make_shared_state", "observe", "observe_program", "observe_step",
    "prepare", "rms_norm", "rotary", "run_program", "run_scan", "run_step", "split_batch", "stage_named", "step_functions",
    "tokens_per_request", "trace", "trace_cache_size", "trace_step", "validate_replay", "varied_step",
]
