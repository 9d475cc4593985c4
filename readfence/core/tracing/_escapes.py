"""Escapes: where a value or memory leaves the traced graph, and whose line it was.

An escape is recorded in the graph as a ``readfence::opaque`` node on the escaping tensor: a
*value* escape (``item()``, ``tolist()``, a host read at the dispatcher) reads the tensor there
and then; a *reference* escape (``data_ptr()``, numpy, DLPack, a ``.data =`` assignment) hands out
its memory, read later by code the tracer cannot see. Every node is named after the user's
source line that made it: the innermost frame outside torch, triton and the tracer's own
modules (and the files registered with :func:`not_user_code`).
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch
from torch import fx

from ._origin import own_op
from ._record import HOST_READ


@torch.library.custom_op("readfence::opaque", mutates_args=())
def _opaque(t: torch.Tensor, what: str) -> None:
    """Marks, in a traced graph, that ``t`` escaped to code the tracer cannot see."""
    return None


@_opaque.register_fake
def _opaque_fake(t: torch.Tensor, what: str) -> None:
    return None


own_op(_opaque)  # readfence's by this registration, not by its namespace


OPAQUE_OP = torch.ops.readfence.opaque.default

#: Escapes that read the value there and then (the host gets a copy).
_VALUE_ESCAPES: dict[Any, str] = {
    torch.Tensor.item: "item()",
    torch.Tensor.__int__: "__int__()",
    torch.Tensor.__float__: "__float__()",
    torch.Tensor.__bool__: "__bool__()",
    torch.Tensor.__index__: "__index__()",
    torch.Tensor.tolist: "tolist()",
}
#: Escapes that hand out the memory itself: code the tracer cannot see may read it later.
REFERENCE_ESCAPES: dict[Any, str] = {
    torch.Tensor.data_ptr: "data_ptr()",
    torch.Tensor.untyped_storage: "untyped_storage()",
    torch.Tensor.storage: "storage()",
    torch.Tensor.numpy: "numpy()",
    torch.Tensor.__array__: "__array__()",
    torch.Tensor.__dlpack__: "__dlpack__()",
    torch.to_dlpack: "to_dlpack()",
    torch.utils.dlpack.to_dlpack: "to_dlpack()",
    # ``t.data = x`` points ``t`` at ``x``'s memory; the trace follows tensors by identity, so
    # what the code then does through ``t`` the graph does to ``t``'s old value
    torch.Tensor.data.__set__: ".data assignment",  # type: ignore[attr-defined]
}
ESCAPES = {**_VALUE_ESCAPES, **REFERENCE_ESCAPES}
_VALUE_WHATS = frozenset(_VALUE_ESCAPES.values())


def is_value_escape(node: fx.Node) -> bool:
    """Whether an opaque node is a value escape (read there and then), not a reference one."""
    return len(node.args) > 1 and (node.args[1] in _VALUE_WHATS or str(node.args[1]).startswith(HOST_READ))


#: The tracer's own modules: their frames sit between a user's stage and the ops it runs (the
#: modes a stage is traced under, triton's launch hooks, the stage's rerun on a live state), so
#: a node is named after the first frame outside them. A module of the tracer missing here
#: names its own line in findings instead of the user's.
_TRACER_MODULES = ("_trace.py", "_trace_modes.py", "_escapes.py", "_triton.py", "_analysis.py", "_bind.py", "_cache.py",
                   "_captured.py", "_consumed.py")
_SKIP = (os.path.dirname(os.path.abspath(torch.__file__)),
         *(os.path.join(os.path.dirname(os.path.abspath(__file__)), m) for m in _TRACER_MODULES))


#: Files of readfence's own machinery that a user's code calls into (an engine adapter's views
#: of the live state): an op they run is named after the user's line that called them.
_MACHINERY: set[str] = set()


def not_user_code(*files: str) -> None:
    """Name the caller of ``files``' functions, not them, as the source line of the ops they
    run (an engine's ``forward_batch.seq_lens``: the engine's line that reads it).

    >>> not_user_code(__file__)  # the tracer's own frames: skipped already
    >>> os.path.abspath(__file__) in _skipped()
    True
    """
    _MACHINERY.update(os.path.abspath(f) for f in files)


def _skipped() -> tuple[str, ...]:
    triton = sys.modules.get("triton")
    where = getattr(triton, "__file__", None)
    key = (where, len(_MACHINERY))  # (files are only ever added to ``_MACHINERY``)
    known = _SKIPPED.get(key)
    if known is None:
        skip = (*_SKIP, *sorted(_MACHINERY))
        known = _SKIPPED[key] = skip if where is None else (*skip, os.path.dirname(os.path.abspath(where)))
    return known


#: ``_skipped()`` by triton's file and the machinery's count: asked for every torch call a traced
#: stage makes, and a path made absolute each time cost more than the walk up the stack.
_SKIPPED: dict[tuple[str | None, int], tuple[str, ...]] = {}


def user_line(also_skip: tuple[str, ...] = ()) -> str:
    """``file:line in function`` of the innermost caller outside torch, triton and the tracer (and
    the folders or files ``also_skip`` names)."""
    skip = (*_skipped(), *also_skip)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"

