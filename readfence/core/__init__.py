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
from ._audit import default_batch_sizes as default_batch_sizes
from ._backend_trace import trace as trace
from ._model import run_step as run_step
from ._model import step_functions as step_functions
from ._modes import ForwardMode as ForwardMode
from ._observe import Disagreement as Disagreement
from ._observe import Observation as Observation
from ._observe import ReadObserver as ReadObserver
from ._observe import cross_check as cross_check
from ._observe import observe as observe
from ._parallel import TensorParallel as TensorParallel
from ._parallel import all_reduce as all_reduce
from ._program import Program as Program
from ._program import StageAnalysis as StageAnalysis
from ._program import StageGraph as StageGraph
from ._program import StageHooks as StageHooks
from ._program import TracedGraph as TracedGraph
from ._program import run_program as run_program
from ._protocol import BackendLike as BackendLike
from ._protocol import ChildRun as ChildRun
from ._state import SHARED_BUFFERS as SHARED_BUFFERS
from ._state import ModelConfig as ModelConfig
from ._state import StepInputs as StepInputs
from ._state import make_shared_state as make_shared_state
from ._state import varied_step as varied_step
from ._step import BODY as BODY
from ._step import PREPARE_IN_GRAPH as PREPARE_IN_GRAPH
from ._step import PREPARE_OUT_GRAPH as PREPARE_OUT_GRAPH
from ._step import STAGES as STAGES
from ._step import Stage as Stage
from ._step import StageArgumentError as StageArgumentError
from ._step import StageOutputError as StageOutputError
from ._step import cross_into_graph as cross_into_graph
from ._step import eval_step as eval_step
from ._threads import StageThreadError as StageThreadError
from ._validate import NotGraphSafe as NotGraphSafe
from .tracing import CapturedStateError as CapturedStateError
from .tracing import KernelAccess as KernelAccess
from .tracing import LaunchStreamError as LaunchStreamError
from .tracing import StageWriteError as StageWriteError
from .tracing import UnboundedKernelError as UnboundedKernelError
from .tracing import UntraceableStage as UntraceableStage
from .tracing import bind as bind
from .tracing import clear_trace_cache as clear_trace_cache
from .tracing import kernel_access as kernel_access

__all__ = [
    "BODY", "PREPARE_IN_GRAPH", "PREPARE_OUT_GRAPH", "SHARED_BUFFERS", "STAGES", "AuditReport",
    "BackendLike", "BufferAudit", "ChildRun", "CapturedStateError", "Disagreement", "ForwardMode", "ModelConfig",
    "NotGraphSafe", "Observation", "Program", "ReadObserver", "Stage", "StageAnalysis", "StageArgumentError", "StageGraph", "StageHooks",
    "StageOutputError",
    "StageThreadError", "StageWriteError", "StepInputs", "KernelAccess", "Latent", "LaunchStreamError",
    "TensorParallel", "TracedGraph", "UnboundedKernelError", "Unsound", "UntraceableStage", "Verdict", "all_reduce", "audit",
    "bind", "clear_trace_cache",
    "cross_check", "cross_into_graph", "default_batch_sizes", "eval_step", "kernel_access", "make_shared_state",
    "observe", "run_program", "run_step", "step_functions", "trace", "varied_step",
]
