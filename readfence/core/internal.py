"""readfence's internal API of ``core``: what the other layers of the package share with it.

Not part of the public API (its names may change without notice); the layers above ``core``
(``backends``, ``graph``, ``engine``, ``parallel``, ``cli``) import these names from here rather
than reaching into ``core``'s private modules, so what they depend on is listed in one place.
"""

from ._audit import BufferAudit as BufferAudit
from ._audit import escape_note as escape_note
from ._audit import format_table as format_table
from ._checks import check_backend as check_backend
from ._checks import check_buffers as check_buffers
from ._checks import check_forward_mode as check_forward_mode
from ._checks import check_mode as check_mode
from ._checks import did_you_mean as did_you_mean
from ._checks import positive_int as positive_int
from ._checks import positive_seconds as positive_seconds
from ._invariant import ROW_BLOCK as ROW_BLOCK
from ._invariant import matmul_rows as matmul_rows
from ._invariant import pad_rows as pad_rows
from ._program import ALIASES_KEY as ALIASES_KEY
from ._protocol import child_runs as child_runs
from ._protocol import replayed as replayed
from ._protocol import runs_as as runs_as
from ._state import buffer_ranges as buffer_ranges
from ._state import request_ranges as request_ranges
from ._state import split_batch as split_batch
from ._state import tokens_per_request as tokens_per_request
from ._validate import observe_varied as observe_varied
from .tracing._bind import state_key as state_key
from .tracing._cache import cache_with_traces as cache_with_traces
from .tracing._cache import remember as remember
from .tracing._dispatch import DispatchMode as DispatchMode
from .tracing._escapes import not_user_code as not_user_code
from .tracing._fx import copy_graph as copy_graph
from .tracing._memory import BufferMap as BufferMap
from .tracing._memory import Span as Span
from .tracing._memory import span_of as span_of
from .tracing._schema import bind as bind_arguments
from .tracing._schema import op_aliasing as op_aliasing

__all__ = [
    "ALIASES_KEY", "ROW_BLOCK", "BufferAudit", "BufferMap", "DispatchMode", "Span", "bind_arguments",
    "buffer_ranges", "cache_with_traces", "check_backend", "check_buffers", "check_forward_mode",
    "check_mode", "child_runs", "copy_graph", "did_you_mean", "escape_note", "format_table", "matmul_rows",
    "not_user_code", "observe_varied", "op_aliasing", "pad_rows", "positive_int", "positive_seconds", "remember", "request_ranges",
    "replayed", "runs_as", "span_of", "split_batch", "state_key", "tokens_per_request",
]
