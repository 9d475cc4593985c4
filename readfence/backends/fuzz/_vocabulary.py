"""The op vocabulary: :class:`Pattern` values, each a small named building block that reads (or
writes) one shared buffer at a :class:`Site`, and :func:`fingerprint`, through which every value
read reaches the logits.

>>> VOCABULARY["chunk"].klass, VOCABULARY["thread_joined"].threaded
('list_view', True)
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Mapping

import attrs
import torch
from torch import Tensor

from readfence.core import ForwardMode

from ._axes import ATTEND, STAGE_NAMES, M, Tensors
from ._ops import copy_pieces, gather_rows, gather_rows_unknown, planned_gather


@attrs.frozen(eq=False)  # holds the batch's tensors: compared by identity
class Site:
    """Where a pattern runs: its buffer, stage, mode, batch and layer (``None`` outside
    ``attend``), and the handle of the buffer its leaf planned (plan/run patterns)."""

    buffer: str
    stage: str
    mode: ForwardMode
    batch: Tensors
    layer: int | None = None
    handle: int = -1

    @property
    def rows(self) -> Tensor:
        """The rows of the buffer the batch uses (always valid indices into its first dim)."""
        return self.batch["out_cache_loc" if self.buffer == "swa_map" else "req_pool_indices"]

    @property
    def batch_size(self) -> int:
        return int(self.batch["req_pool_indices"].shape[0])


Op = Callable[[Tensor, Site], Tensor]


@attrs.frozen(repr=False)
class Pattern:
    """A named building block: ``op(buf, site)`` reads (or writes) ``buf`` and returns a tensor
    holding what it read (possibly a view of ``buf``: its consumer then reads it).

    ``klass`` groups patterns by the hole they probe; ``stages`` are those it may be placed
    in; ``invisible`` marks a read no static analysis can see (only the dynamic checks do);
    ``threaded`` a read made on a thread the stage starts, which no fence covers: the tracer
    and the read observer follow the stage's own thread, so they must refuse it.
    ``host_read`` marks a pattern that brings a device value to the host (``.item()``,
    ``int()``, ``bool()``, ``.tolist()``, ``torch.equal``...): a device-to-host copy, which
    CUDA forbids while a stream is captured, so a CUDA graph cannot hold it
    (:meth:`FuzzProgram.uncapturable`).
    """

    name: str
    klass: str
    op: Op
    stages: tuple[str, ...] = STAGE_NAMES
    invisible: bool = False
    threaded: bool = False
    host_read: bool = False

    def __repr__(self) -> str:
        return self.name


def _gather(t: Tensor, s: Site) -> Tensor:
    return t.index_select(0, s.rows)


def _zeros_like_gather(t: Tensor, s: Site) -> Tensor:
    return torch.zeros((s.rows.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)


def _when(cond: Callable[[Site], bool]) -> Op:
    def op(t: Tensor, s: Site) -> Tensor:
        return _gather(t, s) if cond(s) else _zeros_like_gather(t, s)

    return op


def _branch_on_content(t: Tensor, s: Site) -> Tensor:
    # the path depends on the batch's data: the trace holds only the one the example took
    if bool((s.batch["positions"] % 2 == 0).any()):
        return _gather(t, s)
    return _zeros_like_gather(t, s)


def _branch_on_value(t: Tensor, s: Site) -> Tensor:
    if bool(_gather(t, s).sum() > 0):  # reads the buffer on the host to decide
        return _gather(t, s)
    return _zeros_like_gather(t, s)


def _host_scalar(value: int | float, t: Tensor) -> Tensor:
    return torch.full((1,), value, dtype=torch.long, device=t.device)


def _as_index(t: Tensor, s: Site) -> Tensor:
    # the values index a table: in range whatever the buffer holds
    table = torch.arange(7, dtype=torch.long, device=t.device).mul(3)
    return table.index_select(0, _gather(t, s).reshape(-1).long().remainder(7))


def _equalities(t: Tensor, s: Site) -> Tensor:
    # only whether values are equal: the first row with the same value as each row
    g = _gather(t, s).reshape(-1)
    return (g.unsqueeze(0) == g.unsqueeze(1)).to(torch.long).argmax(1)


def _order(t: Tensor, s: Site) -> Tensor:
    # only the order of the values
    return torch.argsort(_gather(t, s).reshape(-1), stable=True)


def _reduction(t: Tensor, s: Site) -> Tensor:
    # only a sum
    return _gather(t, s).reshape(-1).to(torch.long).sum().reshape(1)


def _maximum(t: Tensor, s: Site) -> Tensor:
    # only the largest value
    return _gather(t, s).reshape(-1).max().to(torch.long).reshape(1)


def _set_handle(t: Tensor, s: Site) -> Tensor:
    # a handle on the buffer's memory that no schema says aliases it
    return _gather(torch.empty(0, dtype=t.dtype, device=t.device).set_(t), s)  # type: ignore[call-overload]


def _slice_bound(t: Tensor, s: Site) -> Tensor:
    # a 0-d tensor as a slice bound: the bound is read on the host
    flat = _gather(t, s).reshape(-1)
    start = flat[0].remainder(flat.numel())
    return _host_scalar(int(flat[start:].to(torch.long).sum()), t)


def _write_view(t: Tensor, s: Site) -> Tensor:
    v = t[:1]
    v.add_(0)
    return v


def _write_chunk(t: Tensor, s: Site) -> Tensor:
    piece = t.chunk(2)[0]
    piece.mul_(1)
    return piece


def _write_unbind(t: Tensor, s: Site) -> Tensor:
    piece = t.unbind(0)[0]
    piece.add_(0)
    return piece


def _write_setitem(t: Tensor, s: Site) -> Tensor:
    t[0:1] = t[0:1].clone()
    return t


def _write_index_copy(t: Tensor, s: Site) -> Tensor:
    return t.index_copy_(0, s.rows, t.index_select(0, s.rows))


#: How long a stage waits for its reader at most: a wedged reader cannot hang a run. The
#: readers a stage starts are daemons and the pool's jobs never block, so none keeps the
#: process from exiting either.
_THREAD_TIMEOUT_S = 10.0

#: How long the reader a stage leaves running sleeps before it reads: the stage returns first.
_LATE_S = 0.002


def _copy_rows(out: Tensor, t: Tensor, s: Site) -> None:
    out.copy_(_gather(t, s))


def _on_joined_thread(t: Tensor, s: Site) -> Tensor:
    # the thread fills the stage's result: a trace that missed it would replay zeros
    out = _zeros_like_gather(t, s)
    reader = threading.Thread(target=_copy_rows, args=(out, t, s), name="fuzz-joined-reader", daemon=True)
    reader.start()
    reader.join(_THREAD_TIMEOUT_S)
    return out


def _late_copy(out: Tensor, t: Tensor, s: Site) -> None:
    time.sleep(_LATE_S)
    _copy_rows(out, t, s)


def _on_thread_left_running(t: Tensor, s: Site) -> Tensor:
    # the stage's result is read now; the reader it leaves running reads the buffer again once
    # the stage has returned and writes what it saw into that result, which its consumers may
    # read later: after a fence released the buffer, that is poison or the next step's values
    out = _gather(t, s)
    threading.Thread(target=_late_copy, args=(out, t, s), name="fuzz-late-reader", daemon=True).start()
    return out


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fuzz-pool")


def _in_pool_job(t: Tensor, s: Site) -> Tensor:
    out = _zeros_like_gather(t, s)
    _pool().submit(_copy_rows, out, t, s).result(timeout=_THREAD_TIMEOUT_S)
    return out


def _vocabulary() -> dict[str, Pattern]:
    p = Pattern
    h = functools.partial(Pattern, host_read=True)  # a device value brought to the host
    patterns = [
        # views: read when consumed
        p("slice", "view", lambda t, s: t[:]),
        p("narrow", "view", lambda t, s: t.narrow(0, 1, t.shape[0] - 1)),
        p("view", "view", lambda t, s: t.view(-1)),
        p("reshape", "view", lambda t, s: t.reshape(-1, 1)),
        p("transpose", "view", lambda t, s: t.view(t.shape[0], -1).t()),
        p("movedim", "view", lambda t, s: t.unsqueeze(-1).movedim(-1, 0)),
        p("expand", "view", lambda t, s: t.unsqueeze(0).expand(2, *t.shape)[1]),
        p("detach", "view", lambda t, s: t.detach()),
        p("to_same_dtype", "view", lambda t, s: t.to(t.dtype)),
        p("contiguous", "view", lambda t, s: t.contiguous()),
        p("select", "view", lambda t, s: t.select(0, t.shape[0] - 1)),
        p("squeeze", "view", lambda t, s: t.unsqueeze(1).squeeze(1)),
        p("view_dtype", "view", lambda t, s: t.view(torch.uint8)),
        p("as_strided", "view", lambda t, s: t.as_strided(t.shape, t.stride())),
        p("unfold", "view", lambda t, s: t.view(-1).unfold(0, 2, 1)),
        p("step_slice", "view", lambda t, s: t.view(-1)[::2]),
        # list views: pieces alias their source
        p("split", "list_view", lambda t, s: torch.cat(t.split(1))),
        p("split_piece", "list_view", lambda t, s: t.split(t.shape[0])[0]),
        p("chunk", "list_view", lambda t, s: t.chunk(2)[-1]),
        p("unbind", "list_view", lambda t, s: torch.stack(t.unbind(0))),
        p("unbind_piece", "list_view", lambda t, s: t.unbind(0)[0]),
        p("split_with_sizes", "list_view", lambda t, s: t.split_with_sizes([1, t.shape[0] - 1])[1]),
        p("tensor_split", "list_view", lambda t, s: torch.cat(t.tensor_split(3))),
        p("iteration", "list_view", lambda t, s: torch.stack([row for row in t])),
        # real copies: the read is the copy
        p("clone", "copy", lambda t, s: t.clone()),
        p("index_select", "copy", _gather),
        p("to_int64", "copy", lambda t, s: t.to(torch.int64)),
        p("arith", "copy", lambda t, s: t.add(1)),
        p("as_index", "copy", _as_index),
        # a reference escaping through DLPack
        p("dlpack_roundtrip", "escape", lambda t, s: torch.from_dlpack(torch.to_dlpack(t))),
        # host reads
        h("item", "host", lambda t, s: _host_scalar(_gather(t, s).sum().item(), t)),
        h("int", "host", lambda t, s: _host_scalar(int(_gather(t, s).sum()), t)),
        h("tolist", "host", lambda t, s: torch.tensor(t.tolist(), dtype=torch.long)),
        h("host_iteration", "host", lambda t, s: _host_scalar(sum(int(x) for x in _gather(t, s).reshape(-1)), t)),
        # conditional reads
        p("if_layer0", "conditional", _when(lambda s: s.layer == 0), stages=(ATTEND,)),
        p("if_layer1", "conditional", _when(lambda s: s.layer == 1), stages=(ATTEND,)),
        p("if_decode", "conditional", _when(lambda s: s.mode is M.DECODE)),
        p("if_verify", "conditional", _when(lambda s: s.mode is M.TARGET_VERIFY)),
        p("if_batch_gt2", "conditional", _when(lambda s: s.batch_size > 2)),
        p("if_batch_1", "conditional", _when(lambda s: s.batch_size == 1)),
        h("if_content", "conditional", _branch_on_content),
        h("if_value", "conditional", _branch_on_value),
        # a buffer lending only its shape, dtype or strides: no read of its values
        p("zeros_like", "metadata", lambda t, s: torch.zeros_like(t).add(s.rows.shape[0])),
        p("empty_like", "metadata", lambda t, s: torch.empty_like(t).fill_(3)),
        p("new_zeros", "metadata", lambda t, s: t.new_zeros((s.rows.shape[0], 2))),
        p("size", "metadata", lambda t, s: _host_scalar(t.size(0) * 7 + t.size(-1), t)),
        p("stride", "metadata", lambda t, s: _host_scalar(sum(t.stride()) + t.dim(), t)),
        # copies a schema claims are views: the read is the copy (checked on memory)
        p("foreach_add", "view_claim", lambda t, s: torch._foreach_add([_gather(t, s)], 0)[0]),
        p("foreach_pair", "view_claim", lambda t, s: torch._foreach_mul([_gather(t, s), _gather(t, s)], 1)[1]),
        p("list_custom_op", "view_claim", lambda t, s: copy_pieces(_gather(t, s))[0]),
        # a handle no schema names, on the buffer's memory
        p("set_handle", "handle", _set_handle),
        # readers that use a value only through one relation: poison must break each
        p("equalities", "relation", _equalities),
        p("order", "relation", _order),
        p("sum_only", "relation", _reduction),
        p("max_only", "relation", _maximum),
        # host reads torch makes inside C++ (ops tagged data_dependent_output)
        h("equal", "host", lambda t, s: _host_scalar(int(torch.equal(_gather(t, s), _gather(t, s).flip(0))), t)),
        h("allclose", "host", lambda t, s: _host_scalar(
            int(torch.allclose(_gather(t, s).float(), _gather(t, s).float().flip(0))), t)),
        h("contains", "host", lambda t, s: _host_scalar(int(_gather(t, s).reshape(-1)[0] in _gather(t, s).reshape(-1)[1:]), t)),
        h("is_nonzero", "host", lambda t, s: _host_scalar(
            int((_gather(t, s).reshape(-1)[0] - _gather(t, s).reshape(-1)[-1]).is_nonzero()), t)),
        h("slice_bound", "host", _slice_bound),
        # custom ops
        p("custom_op", "custom_op", lambda t, s: gather_rows(t, s.rows)),
        p("plan_run", "custom_op", lambda t, s: planned_gather(s.rows, s.handle), invisible=True),
        # writes, each value-preserving (a write that slipped through would change nothing)
        p("write_view", "write", _write_view),
        p("write_chunk", "write", _write_chunk),
        p("write_unbind", "write", _write_unbind),
        p("write_out", "write", lambda t, s: torch.mul(t, 1, out=t)),
        p("write_setitem", "write", _write_setitem),
        p("write_copy", "write", lambda t, s: t.copy_(t.clone())),
        p("write_index_copy", "write", _write_index_copy),
        p("write_custom_unknown", "write", lambda t, s: gather_rows_unknown(t, s.rows)),
        # reads handed to another thread, which no fence covers
        p("thread_joined", "thread", _on_joined_thread, threaded=True),
        p("thread_left_running", "thread", _on_thread_left_running, threaded=True),
        p("pool_job", "thread", _in_pool_job, threaded=True),
    ]
    return {x.name: x for x in patterns}


#: The op vocabulary: pattern name -> :class:`Pattern`.
VOCABULARY: Mapping[str, Pattern] = _vocabulary()


def fingerprint(t: Tensor) -> Tensor:
    """A float32 scalar that changes when any value of ``t`` changes (reads all of ``t``).

    >>> a = torch.tensor([3, 1, 4]); b = torch.tensor([3, 1, 5])
    >>> bool(fingerprint(a) != fingerprint(b))
    True
    """
    x = t.reshape(-1).to(torch.float32)
    w = torch.arange(x.shape[0], dtype=torch.float32, device=x.device).mul(0.6180339887).remainder(1.0).add(0.5)
    return torch.sin(x.mul(w).sum().mul(0.01))
