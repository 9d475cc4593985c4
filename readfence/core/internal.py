"""readfence's internal API of ``core``: what the other layers of the package share with it.

Not part of the public API (its names may change without notice); the layers above ``core``
(``backends``, ``graph``, ``engine``, ``parallel``, ``cli``) import these names from here rather
than reaching into ``core``'s private modules, so what they depend on is listed in one place.
"""

from ._audit import BufferAudit as BufferAudit
from ._audit import audit_failure as audit_failure
from ._audit import audit_report as audit_report
from ._audit import escape_note as escape_note
from ._audit import format_table as format_table
from ._audit import refuse_writes as refuse_writes
from ._audit import verdict_nodes as verdict_nodes
from ._backend_trace import forget_trace as forget_trace
from ._batch_split import request_ranges as request_ranges
from ._batch_split import split_batch as split_batch
from ._checks import MAX_TREE_DEPTH as MAX_TREE_DEPTH
from ._checks import STATE_PARTS as STATE_PARTS
from ._checks import check_backend as check_backend
from ._checks import check_buffers as check_buffers
from ._checks import check_forward_mode as check_forward_mode
from ._checks import check_mode as check_mode
from ._checks import check_state as check_state
from ._checks import check_tree_depth as check_tree_depth
from ._checks import did_you_mean as did_you_mean
from ._checks import positive_int as positive_int
from ._checks import positive_seconds as positive_seconds
from ._checks import tree_depth as tree_depth
from ._invariant import ROW_BLOCK as ROW_BLOCK
from ._invariant import matmul_rows as matmul_rows
from ._invariant import pad_rows as pad_rows
from ._late_reads import ReadKind as ReadKind
from ._late_reads import late_read_fix as late_read_fix
from ._ledger import PYTHON as PYTHON
from ._ledger import REPLAY_SEEDS as REPLAY_SEEDS
from ._ledger import Ledger as Ledger
from ._ledger import Run as Run
from ._ledger import RunKind as RunKind
from ._ledger import Witness as Witness
from ._ledger import evidence_epoch as evidence_epoch
from ._ledger import ledger_of as ledger_of
from ._ledger import on_live_state as on_live_state
from ._ledger import state_label as state_label
from ._ledger import varied_states as varied_states
from ._model import forward as forward
from ._model import prepare as prepare
from ._model import rms_norm as rms_norm
from ._model import rotary as rotary
from ._observe import Watched as Watched
from ._observe import observe_step as observe_step
from ._program import ALIASES_KEY as ALIASES_KEY
from ._program import NodeReads as NodeReads
from ._program import NodeReadsIn as NodeReadsIn
from ._program import flatten_inputs as flatten_inputs
from ._protocol import child_runs as child_runs
from ._protocol import replayed as replayed
from ._protocol import runs_as as runs_as
from ._scan import LAYER_KEY as LAYER_KEY
from ._scan import LayerScan as LayerScan
from ._scan import layers_marked as layers_marked
from ._scan import run_scan as run_scan
from ._state import buffer_ranges as buffer_ranges
from ._state import example_step as example_step
from ._state import init_params as init_params
from ._state import make_pools as make_pools
from ._state import model_config as model_config
from ._state import shared_shapes as shared_shapes
from ._state import tokens_per_request as tokens_per_request
from ._state_values import preserved as preserved
from ._state_values import restore as restore
from ._state_values import snapshot as snapshot
from ._step import EAGER as EAGER
from ._step import Interpreter as Interpreter
from ._step import OutputGuard as OutputGuard
from ._step import StageCall as StageCall
from ._step import StepFunctions as StepFunctions
from ._step import as_static as as_static
from ._step import check_stage_output as check_stage_output
from ._step import flatten_group as flatten_group
from ._step import stage_named as stage_named
from ._validate import StaleTrace as StaleTrace
from ._validate import differs_on as differs_on
from ._validate import validate_replay as validate_replay
from ._words import as_words as as_words
from .tracing import CACHES as CACHES
from .tracing import SHARES_KEY as SHARES_KEY
from .tracing import SPLICED_KEY as SPLICED_KEY
from .tracing import BufferMap as BufferMap
from .tracing import Caches as Caches
from .tracing import CodeKey as CodeKey
from .tracing import DispatchMode as DispatchMode
from .tracing import KeptTensor as KeptTensor
from .tracing import Segment as Segment
from .tracing import Span as Span
from .tracing import Spliced as Spliced
from .tracing import StaleCaptureError as StaleCaptureError
from .tracing import Table as Table
from .tracing import Template as Template
from .tracing import UnkeptCaptureError as UnkeptCaptureError
from .tracing import add_node as add_node
from .tracing import bind_arguments as bind_arguments
from .tracing import code_key as code_key
from .tracing import collection_paused as collection_paused
from .tracing import copy_graph as copy_graph
from .tracing import cuda_devices as cuda_devices
from .tracing import define as define
from .tracing import first_stale as first_stale
from .tracing import is_launch_op as is_launch_op
from .tracing import kept_tensors as kept_tensors
from .tracing import launches_unseen as launches_unseen
from .tracing import leaves as leaves
from .tracing import not_user_code as not_user_code
from .tracing import op_aliasing as op_aliasing
from .tracing import random_kept as random_kept
from .tracing import random_state as random_state
from .tracing import reach as reach
from .tracing import runs_an_op_for_a_mode as runs_an_op_for_a_mode
from .tracing import same_values as same_values
from .tracing import set_random_state as set_random_state
from .tracing import span_of as span_of
from .tracing import state_key as state_key
from .tracing import torch_op as torch_op
from .tracing import trace_cache_size as trace_cache_size
from .tracing import trace_step as trace_step
from .tracing import trusted_op as trusted_op
from .tracing import unobserved as unobserved

__all__ = [
    "add_node", "ALIASES_KEY", "audit_failure", "audit_report", "bind_arguments", "buffer_ranges", "BufferAudit", "BufferMap", "Caches",
    "CACHES", "as_static", "as_words", "check_backend", "check_buffers", "check_forward_mode", "check_mode", "check_stage_output",
    "check_state", "check_tree_depth", "STATE_PARTS", "MAX_TREE_DEPTH", "tree_depth",
    "child_runs", "code_key", "collection_paused", "CodeKey", "copy_graph", "did_you_mean", "DispatchMode", "EAGER", "escape_note",
    "evidence_epoch", "example_step", "first_stale", "flatten_group", "flatten_inputs", "forget_trace",
    "format_table", "forward", "init_params", "Interpreter", "is_launch_op", "kept_tensors",
    "KeptTensor", "LAYER_KEY", "late_read_fix", "leaves", "layers_marked", "launches_unseen", "LayerScan", "Ledger", "ledger_of",
    "make_pools", "model_config",
    "matmul_rows", "NodeReads", "NodeReadsIn", "not_user_code", "observe_step",
    "on_live_state", "op_aliasing", "OutputGuard", "pad_rows", "positive_int", "positive_seconds", "prepare",
    "PYTHON", "cuda_devices", "random_kept", "refuse_writes", "runs_an_op_for_a_mode", "random_state", "set_random_state",
    "reach", "ReadKind", "REPLAY_SEEDS", "replayed", "request_ranges", "shared_shapes", "rms_norm", "rotary", "ROW_BLOCK",
    "preserved", "restore", "Run", "RunKind", "run_scan", "runs_as", "same_values", "Segment", "Span", "span_of", "unobserved", "snapshot",
    "split_batch", "SHARES_KEY", "SPLICED_KEY", "Spliced", "stage_named", "StageCall", "Template",
    "StaleCaptureError", "StaleTrace", "differs_on", "UnkeptCaptureError", "state_key", "state_label", "StepFunctions", "Table", "tokens_per_request",
    "torch_op", "trace_cache_size", "trace_step", "trusted_op", "validate_replay", "varied_states", "verdict_nodes", "Watched",
    "Witness", "define",
]
