"""The tracer: how readfence turns a stage's Python into an FX graph of reads.

This module is the tracer's face: what the rest of readfence uses of it, and nothing else
imports its private modules. Recording a stage (``_record``), splicing pure segments
(``_segment``), matching tensors to shared buffers by memory (``_memory``), the schema-driven
alias analysis (``_alias``, ``_schema``, and what functional collectives hide from it:
``_collectives``), what an op's real run shows (``_probe``), triton launches as ops
(``_triton``) and what a kernel reads and writes (``_kernel_ir`` from triton's IR, ``_ttir``
its dataflow, ``_kernel_access`` the source-walk fallback), the dispatch-mode base
(``_dispatch``), FX builders (``_fx``), the collector held off (``_collect``), escapes and the
user's source line (``_escapes``), the modes a stage is traced under, which mark them
(``_trace_modes``), a stage's graph analysed and its writes refused (``_analysis``), captured
tensors matched by memory (``_captured``), the tracer that ties them into a ``Program``
(``_trace``), the program bound to the live state (``_bind``), what a backend's code can read
and where it keeps what a graph captured (``_guards``) and readfence's caches, one object of
named tables keyed by them (``_cache``).

The tracer sits above the step's data (``core._step``, ``_program``, ``_protocol``, ``_modes``,
``_checks``, ``_threads``), which never import it, and below the model, the example state and
everything that runs a trace (``core._backend_trace`` traces a backend on the example state).
Loading it loads torch (which ``readfence.core`` loads anyway), never triton: the kernel
analysis imports triton when it first meets a kernel.

>>> from readfence.core.tracing import BufferMap, trace_step
>>> BufferMap.__module__
'readfence.core.tracing._memory'
"""

from __future__ import annotations

from ._alias import analyse as analyse
from ._analysis import StageWriteError as StageWriteError
from ._bind import bind as bind
from ._bind import state_key as state_key
from ._cache import CACHES as CACHES
from ._cache import Caches as Caches
from ._cache import CodeKey as CodeKey
from ._cache import Table as Table
from ._cache import clear_trace_cache as clear_trace_cache
from ._cache import code_key as code_key
from ._cache import trace_cache_size as trace_cache_size
from ._captured import CapturedStateError as CapturedStateError
from ._codegen import define as define
from ._collect import collection_paused as collection_paused
from ._dispatch import DispatchMode as DispatchMode
from ._dispatch import runs_an_op_for_a_mode as runs_an_op_for_a_mode
from ._escapes import REFERENCE_ESCAPES as REFERENCE_ESCAPES
from ._escapes import not_user_code as not_user_code
from ._escapes import user_line as user_line
from ._fx import add_node as add_node
from ._fx import copy_graph as copy_graph
from ._guards import KeptTensor as KeptTensor
from ._guards import StaleCaptureError as StaleCaptureError
from ._guards import UnkeptCaptureError as UnkeptCaptureError
from ._guards import first_stale as first_stale
from ._guards import kept_tensors as kept_tensors
from ._guards import reach as reach
from ._kernel_access import KernelAccess as KernelAccess
from ._kernel_ir import kernel_access as kernel_access
from ._memory import PLAIN_VALUES as PLAIN_VALUES
from ._memory import BufferMap as BufferMap
from ._memory import Span as Span
from ._memory import cuda_devices as cuda_devices
from ._memory import defined_memory as defined_memory
from ._memory import leaves as leaves
from ._memory import meet_shared as meet_shared
from ._memory import metadata_claim_holds as metadata_claim_holds
from ._memory import random_kept as random_kept
from ._memory import random_state as random_state
from ._memory import same_values as same_values
from ._memory import set_random_state as set_random_state
from ._memory import span_of as span_of
from ._memory import tensors_in as tensors_in
from ._memory import unobserved as unobserved
from ._memory import view_claim_holds as view_claim_holds
from ._origin import torch_op as torch_op
from ._origin import trusted_op as trusted_op
from ._probe import metadata_templates as metadata_templates
from ._probe import rerun_with as rerun_with
from ._record import SHARES_KEY as SHARES_KEY
from ._record import note_output_memory as note_output_memory
from ._schema import OpAliasing as OpAliasing
from ._schema import bind as bind_arguments
from ._schema import moves_metadata_only as moves_metadata_only
from ._schema import op_aliasing as op_aliasing
from ._segment import SPLICED_KEY as SPLICED_KEY
from ._segment import Listing as Listing
from ._segment import Segment as Segment
from ._segment import SegmentSignature as SegmentSignature
from ._segment import Spliced as Spliced
from ._segment import Template as Template
from ._segment import segment_signature as segment_signature
from ._trace import UntraceableStage as UntraceableStage
from ._trace import trace_functions as trace_functions
from ._trace import trace_step as trace_step
from ._triton import LaunchStreamError as LaunchStreamError
from ._triton import UnboundedKernelError as UnboundedKernelError
from ._triton import is_launch_op as is_launch_op
from ._triton import launches_unseen as launches_unseen

__all__ = [
    "analyse", "bind", "bind_arguments", "BufferMap", "CACHES", "Caches", "CapturedStateError", "clear_trace_cache", "collection_paused",
    "code_key", "CodeKey", "copy_graph", "DispatchMode", "first_stale", "is_launch_op", "kept_tensors", "KeptTensor",
    "kernel_access", "KernelAccess", "launches_unseen", "leaves", "LaunchStreamError", "meet_shared", "metadata_claim_holds",
    "cuda_devices", "defined_memory", "random_kept",
    "metadata_templates", "not_user_code", "op_aliasing", "OpAliasing", "random_state", "reach", "REFERENCE_ESCAPES",
    "rerun_with", "same_values", "Segment", "segment_signature", "SegmentSignature", "set_random_state", "Span",
    "SHARES_KEY", "note_output_memory", "SPLICED_KEY", "Spliced", "Template", "add_node",
    "span_of", "StageWriteError", "StaleCaptureError", "state_key", "UnkeptCaptureError", "Table", "tensors_in", "torch_op",
    "unobserved",
    "trace_cache_size", "trace_functions", "trace_step", "trusted_op", "UnboundedKernelError", "UntraceableStage",
    "user_line", "view_claim_holds", "define", "Listing", "PLAIN_VALUES",
]
