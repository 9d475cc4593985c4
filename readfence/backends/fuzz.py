"""Generated user backends for differential fuzzing of the analysis: an op vocabulary, programs
built from it, and hypothesis strategies that draw them.

A *pattern* is a small named building block that reads (or writes) one shared buffer: a view
or list view, a real or a no-op copy, a host read, a conditional read, a custom op, a write,
a read handed to another thread; or uses only its metadata (``zeros_like``, ``new_zeros``,
``size``...), which reads nothing.
A :class:`Placement` puts a pattern in a stage of a leaf, on a buffer, reaching the buffer
*via* the stage's argument or a reference the leaf keeps (closure, attribute, global, DLPack,
a stash made in ``prepare_out_graph``); from a prepare stage its result is either reduced
there or *carried* into the body as metadata (what crosses into the graph). A
:class:`FuzzLeaf` is a paged leaf with placements and a random declaration, a
:class:`FuzzTree` a combinator (``join``, ``tbo``, ``hybrid_linear``, ``select``) over
them, and a :class:`FuzzProgram` a tree and the mode it runs in. Every value a pattern reads
goes into the leaf's attention output through a fingerprint, so a race changes the logits;
indices stay in range whatever the buffers hold (in-range poison included).

Programs are data: they print, compare and shrink; :meth:`FuzzProgram.build` makes the
backend against the live state the checks run on (patterns that keep a reference to a buffer
need it). ``readfence.graph.fuzz.check_program`` holds the analysis to the dynamic checks on
one program.

Fuzz your own op vocabulary: add patterns to a copy of :data:`VOCABULARY` and draw programs
from ``programs(vocabulary=...)`` (hypothesis: shrinks a failing program to a small one) or
``random_programs(n, seed, vocabulary=...)`` (uniform: long runs cover it evenly).

>>> from hypothesis import given, settings
>>> @settings(max_examples=20, database=None)
... @given(programs())
... def check(program):
...     assert 1 <= program.layers <= 3 and program.leaves()
>>> check()
>>> chunk = VOCABULARY["chunk"]
>>> mine = FuzzLeaf("mine", (Placement(chunk, "prepare_in_graph", "seq_lens", carry=True),),
...                 declared(POST_REPLAY=["seq_lens"]))
>>> print(FuzzProgram(mine, ForwardMode.DECODE))
mine in DECODE
  mine: metadata in prepare_in_graph; declares seq_lens=POST_REPLAY
    chunk(seq_lens) in prepare_in_graph, carried
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
import torch
from hypothesis import strategies as st
from torch import Tensor

from readfence.core import PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.core.internal import tokens_per_request
from readfence.effects import ReadEffect, ReadEnd

from ._attention import page_meta, softmax_attention, store_kv
from ._backend import Backend, leaf
from ._combinators import hybrid_linear, join, select, tbo

Tensors = Mapping[str, Tensor]
State = Mapping[str, Mapping[str, Tensor]]
M = ForwardMode
OUT, IN, ATTEND = PREPARE_OUT_GRAPH.name, PREPARE_IN_GRAPH.name, "attend"

#: The stages a pattern can be placed in, in execution order.
STAGE_NAMES: tuple[str, ...] = (OUT, IN, ATTEND)

#: The read end of a read made in each stage (``attend`` runs in the model body).
STAGE_END: dict[str, ReadEnd] = {OUT: ReadEnd.PRE_REPLAY, IN: ReadEnd.IN_REPLAY, ATTEND: ReadEnd.POST_REPLAY}

#: How a stage reaches its buffer: the stage's ``shared`` argument, or a reference the leaf
#: keeps to the live buffer (``closure``, ``attribute``, ``global``, ``dlpack``), or a
#: tensor ``prepare_out_graph`` stashed on the leaf (``stash_clone``, ``stash_dlpack``:
#: trace-time state, only for the later stages).
VIAS: tuple[str, ...] = ("argument", "closure", "attribute", "global", "dlpack", "stash_clone", "stash_dlpack")
_LIVE_VIAS = frozenset({"closure", "attribute", "global", "dlpack"})
_STASH_VIAS = frozenset({"stash_clone", "stash_dlpack"})

#: The modes programs run in: both replay a captured graph.
FUZZ_MODES: tuple[ForwardMode, ...] = (M.DECODE, M.TARGET_VERIFY)

#: The combinators trees are built with.
COMBINATORS: tuple[str, ...] = ("join", "tbo", "hybrid_linear", "select")

#: How a leaf's prepare stages return their metadata (what the step carries, see
#: ``readfence.core.internal.check_stage_output``): a flat dict; nested in a dict per stage; as a list
#: of (key, value) tuples; under tuple and int keys; with Python scalars and ``None`` beside
#: the tensors; and, from ``prepare_in_graph``, a refinement of an out-of-graph tensor under
#: its own key.
RETURN_SHAPES: tuple[str, ...] = ("flat", "nested", "sequences", "odd_keys", "python_values", "same_key")
_LAYER_SPLITTING = frozenset({"join", "hybrid_linear"})  # children attend different layers


# ------------------------------------------------------------------------------------------
# Custom ops: a pure kernel, one that claims to write everything, and plan/run
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("readfence_fuzz::gather_rows", mutates_args=())
def gather_rows(buf: Tensor, rows: Tensor) -> Tensor:
    """A pure custom kernel: rows ``rows`` of ``buf`` as int64 (reads ``buf``)."""
    return buf.index_select(0, rows).long()


@gather_rows.register_fake
def _(buf: Tensor, rows: Tensor) -> Tensor:
    return buf.new_empty((rows.shape[0], *buf.shape[1:]), dtype=torch.long)


@torch.library.custom_op("readfence_fuzz::gather_rows_unknown", mutates_args="unknown")
def gather_rows_unknown(buf: Tensor, rows: Tensor) -> Tensor:
    """The same kernel registered without saying what it mutates (so it claims to write all)."""
    return buf.index_select(0, rows).long()


@torch.library.custom_op("readfence_fuzz::copy_pieces", mutates_args=())
def copy_pieces(buf: Tensor) -> list[Tensor]:
    """A list-returning kernel registered as the README recommends (``mutates_args=()``): its
    schema, ``Tensor[]`` with no alias annotation, lets torch's alias oracle take it for a
    view, while it copies (custom ops may not return views of their inputs)."""
    return [buf.clone(), buf.clone()]


@copy_pieces.register_fake
def _(buf: Tensor) -> list[Tensor]:
    return [torch.empty_like(buf), torch.empty_like(buf)]


_KEPT: dict[int, Tensor] = {}
_HANDLES = itertools.count()


def keep(buf: Tensor) -> int:
    """Plan: keep a reference to ``buf`` for :func:`planned_gather`; returns its handle.

    Like an engine's plan keeping its persistent buffers, the reference lives as long as the
    process (a reference costs no copy of the buffer).

    >>> lens = torch.tensor([5, 7, 9], dtype=torch.int32)
    >>> planned_gather(torch.tensor([2, 0]), keep(lens)).tolist()
    [9, 5]
    """
    handle = next(_HANDLES)
    _KEPT[handle] = buf
    return handle


@torch.library.custom_op("readfence_fuzz::plan_run", mutates_args=())
def planned_gather(rows: Tensor, handle: int) -> Tensor:
    """Run: rows ``rows`` of the buffer planned under ``handle``, read by reference (FlashInfer's
    plan/run keeping a tensor on the wrapper): none of its arguments is the buffer, so no static
    analysis sees the read."""
    return _KEPT[handle].index_select(0, rows).long()


@planned_gather.register_fake
def _(rows: Tensor, handle: int) -> Tensor:
    buf = _KEPT[handle]
    return rows.new_empty((rows.shape[0], *buf.shape[1:]), dtype=torch.long)


# ------------------------------------------------------------------------------------------
# The vocabulary
# ------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------
# Programs
# ------------------------------------------------------------------------------------------


@attrs.frozen(repr=False)
class Placement:
    """A pattern placed in a ``stage`` on a ``buffer``, reaching it ``via`` (see :data:`VIAS`);
    from a prepare stage, ``carry`` returns the pattern's result as metadata for the body to
    read (else the stage reduces it to its fingerprint)."""

    pattern: Pattern
    stage: str
    buffer: str
    via: str = "argument"
    carry: bool = False

    def __attrs_post_init__(self) -> None:
        if self.stage not in self.pattern.stages:
            raise ValueError(f"pattern {self.pattern.name!r} cannot be placed in {self.stage!r} "
                             f"(only {', '.join(self.pattern.stages)})")
        if self.buffer not in SHARED_BUFFERS:
            raise ValueError(f"unknown buffer {self.buffer!r}; shared buffers are {list(SHARED_BUFFERS)}")
        if self.via not in VIAS:
            raise ValueError(f"unknown via {self.via!r}; one of {list(VIAS)}")
        if self.via in _STASH_VIAS and self.stage == OUT:
            raise ValueError(f"via {self.via!r} reads what prepare_out_graph stashed: place it in a later stage")
        if self.carry and self.stage == ATTEND:
            raise ValueError("only a prepare stage can carry its result into the body")

    def __repr__(self) -> str:
        via = "" if self.via == "argument" else f" via {self.via}"
        carry = ", carried" if self.carry else ""
        return f"{self.pattern.name}({self.buffer}){via} in {self.stage}{carry}"


def declared(**ends: Sequence[str]) -> tuple[tuple[str, ReadEnd], ...]:
    """A declaration from ``END=[buffers]`` keywords (buffers not named: ``NONE``).

    >>> declared(IN_REPLAY=["seq_lens"])[:2]
    (('req_to_token', <ReadEnd.NONE: 0>), ('seq_lens', <ReadEnd.IN_REPLAY: 2>))
    """
    per = {b: ReadEnd[end] for end, buffers in ends.items() for b in buffers}
    return tuple((b, per.get(b, ReadEnd.NONE)) for b in SHARED_BUFFERS)


@attrs.frozen(repr=False)
class FuzzLeaf:
    """A paged leaf: attention over the page-table metadata built in ``meta_stage`` (``None``:
    from the batch alone, reading no shared buffer), its placements, and its declaration
    (per buffer, the end it declares: the same in every mode)."""

    name: str
    placements: tuple[Placement, ...]
    declared: tuple[tuple[str, ReadEnd], ...]
    meta_stage: str | None = IN
    returns: str = "flat"  # how its prepare stages return their metadata (see RETURN_SHAPES)

    def __attrs_post_init__(self) -> None:
        if self.returns not in RETURN_SHAPES:
            raise ValueError(f"unknown return shape {self.returns!r}; one of {list(RETURN_SHAPES)}")

    def effect(self) -> ReadEffect:
        return ReadEffect.of(dict(self.declared))

    def __repr__(self) -> str:
        meta = f"metadata in {self.meta_stage}" if self.meta_stage else "metadata from the batch"
        if self.returns != "flat":
            meta += f", returned {self.returns}"
        ends = ", ".join(f"{b}={e.name}" for b, e in self.declared if e is not ReadEnd.NONE) or "nothing"
        lines = [f"{self.name}: {meta}; declares {ends}"]
        lines += [f"  {p!r}" for p in self.placements]
        return "\n".join(lines)


@attrs.frozen(repr=False)
class FuzzTree:
    """A combinator over generated nodes. ``option``: the layer pattern of ``hybrid_linear``
    (child indices), the primary's child index for ``tbo`` (``tbo(children[i], *children)``),
    the mode that selects ``children[0]`` for ``select`` (``children[1]`` is the default)."""

    combinator: str
    children: tuple[Node, ...]
    option: Any = None

    def __attrs_post_init__(self) -> None:
        if self.combinator not in COMBINATORS:
            raise ValueError(f"unknown combinator {self.combinator!r}; one of {list(COMBINATORS)}")
        if len(self.children) < (2 if self.combinator == "select" else 1):
            raise ValueError(f"{self.combinator} needs more children, got {len(self.children)}")

    def selected(self, mode: ForwardMode) -> tuple[int, ...]:
        """Indices of the children that run in ``mode``."""
        if self.combinator == "select":
            return (0,) if self.option is mode else (1,)
        return tuple(range(len(self.children)))

    def __repr__(self) -> str:
        opt = "" if self.option is None else f"[{getattr(self.option, 'name', self.option)}]"
        return f"{self.combinator}{opt}({', '.join(_head(c) for c in self.children)})"


Node = FuzzLeaf | FuzzTree


def _head(node: Node) -> str:
    return node.name if isinstance(node, FuzzLeaf) else repr(node)


def _layers(node: Node) -> int:
    if isinstance(node, FuzzLeaf):
        return 1
    own = 1
    if node.combinator == "join":
        own = len(node.children)  # round-robin: child i attends layer i
    elif node.combinator == "hybrid_linear":
        own = len(node.option)
    return max(own, *(_layers(c) for c in node.children))


@attrs.frozen(repr=False)
class FuzzProgram:
    """A generated backend (a leaf or a tree of them) and the mode it runs in."""

    root: Node
    mode: ForwardMode = M.DECODE

    @property
    def layers(self) -> int:
        """Layers the model needs so that every child of a layer-splitting combinator attends."""
        return _layers(self.root)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with at least :attr:`layers` layers."""
        return cfg if cfg.layers >= self.layers else attrs.evolve(cfg, layers=self.layers)

    def leaves(self) -> tuple[FuzzLeaf, ...]:
        """Every distinct leaf, pre-order."""
        return tuple(dict.fromkeys(self._walk(False)))

    def active_leaves(self) -> tuple[FuzzLeaf, ...]:
        """The leaves that run in :attr:`mode` (a ``select`` runs one child)."""
        return tuple(dict.fromkeys(self._walk(True)))

    def _walk(self, active: bool) -> Iterator[FuzzLeaf]:
        stack: list[Node] = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, FuzzLeaf):
                yield node
                continue
            picks = node.selected(self.mode) if active else range(len(node.children))
            stack.extend(node.children[i] for i in reversed(tuple(picks)))

    def placements(self) -> tuple[Placement, ...]:
        """Every placement of every leaf."""
        return tuple(p for node in self.leaves() for p in node.placements)

    def invisible_reads(self) -> dict[str, ReadEnd]:
        """Per buffer, the latest end of a read no static analysis can see, in the leaves that
        run (a plan/run kernel reads in the stage it is placed in)."""
        out: dict[str, ReadEnd] = {}
        for node in self.active_leaves():
            for p in node.placements:
                if p.pattern.invisible:
                    out[p.buffer] = out.get(p.buffer, ReadEnd.NONE) | STAGE_END[p.stage]
        return out

    def thread_reads(self) -> frozenset[str]:
        """The buffers read on a thread a stage starts, in the leaves that run: whatever the
        declaration, no fence covers such a read, so the checks must refuse or catch it."""
        return frozenset(p.buffer for node in self.active_leaves() for p in node.placements if p.pattern.threaded)

    def uncapturable(self) -> tuple[Placement, ...]:
        """The placements, in the leaves that run, that bring a device value to the host inside
        the captured graph (``prepare_in_graph`` or ``attend``). CUDA forbids a device-to-host
        copy while a stream is captured (the capture fails), so no CUDA engine runs such a
        backend: only the CPU device, which runs that stage's Python in the step, does. A host
        read in ``prepare_out_graph`` runs every step before the replay on CUDA too."""
        return tuple(p for node in self.active_leaves() for p in node.placements
                     if p.pattern.host_read and p.stage != OUT)

    def needs_state(self) -> bool:
        """Whether building it needs the live state (a pattern keeps a reference to a buffer)."""
        return any(p.via in _LIVE_VIAS or p.pattern.invisible for p in self.placements())

    def build(self, state: State | None = None) -> Backend:
        """The backend, built against ``state`` (``shared``, ...: the live tensors the checks
        will run on; needed when :meth:`needs_state`)."""
        if state is None and self.needs_state():
            raise ValueError("this program keeps references to live buffers: build it with the state "
                             "you pass to audit(state=...) and verify(state=...)")
        live = None if state is None else state["shared"]
        built: dict[int, Backend] = {}

        def make(node: Node) -> Backend:
            hit = built.get(id(node))
            if hit is None:
                hit = built[id(node)] = _build_leaf(node, live) if isinstance(node, FuzzLeaf) else _combine(node, make)
            return hit

        return make(self.root)

    def __str__(self) -> str:
        lines = [f"{_head(self.root)} in {self.mode.name}"]
        for node in self.leaves():
            lines += ["  " + line for line in repr(node).splitlines()]
        return "\n".join(lines)

    __repr__ = __str__


def _combine(node: FuzzTree, make: Callable[[Node], Backend]) -> Backend:
    kids = [make(c) for c in node.children]
    if node.combinator == "join":
        return join(*kids)
    if node.combinator == "hybrid_linear":
        return hybrid_linear(*kids, pattern="".join(map(str, node.option)))
    if node.combinator == "tbo":
        return tbo(kids[node.option], *kids)
    return select({node.option: kids[0]}, default=kids[1])


# ------------------------------------------------------------------------------------------
# Building a leaf
# ------------------------------------------------------------------------------------------


class _Holder:
    """An engine-style object keeping a reference to a live buffer."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


_GLOBALS: dict[str, Tensor] = {}  # module globals some leaves read (one key per leaf and placement)


def _live_buffer(live: Tensors | None, spec: FuzzLeaf, p: Placement) -> Tensor:
    if live is None:  # FuzzProgram.build refuses to build such a program without the state
        raise ValueError(f"leaf {spec.name!r} keeps a reference to {p.buffer!r}: build it with the live state")
    return live[p.buffer]


class _Refs:
    """What a built leaf keeps: references to live buffers per placement, the handles of its
    planned buffers, and what ``prepare_out_graph`` stashed. Compared by identity: two leaves
    holding references are never the same code."""

    def __init__(self, spec: FuzzLeaf, live: Tensors | None) -> None:
        self.sources: dict[int, Callable[[], Tensor]] = {}
        self.handles: dict[int, int] = {}
        self.stash: dict[int, Tensor] = {}
        for i, p in enumerate(spec.placements):
            if p.pattern.invisible:
                self.handles[i] = keep(_live_buffer(live, spec, p))
            if p.via in _LIVE_VIAS:
                self.sources[i] = self._source(p.via, _live_buffer(live, spec, p), f"{id(self)}/{i}")
            elif p.via in _STASH_VIAS:
                self.sources[i] = functools.partial(self.stash.__getitem__, i)

    def _source(self, via: str, buf: Tensor, key: str) -> Callable[[], Tensor]:
        if via == "closure":
            return lambda: buf
        if via == "attribute":
            holder = _Holder(buf)
            return lambda: holder.tensor
        if via == "global":
            _GLOBALS[key] = buf
            weakref.finalize(self, _GLOBALS.pop, key, None)
            return lambda: _GLOBALS[key]
        alias = torch.from_dlpack(torch.to_dlpack(buf))  # a new storage object over the same memory
        return lambda: alias


@attrs.frozen
class _Code:
    """The code of a generated leaf, shared by its three stage functions. Equal code traces
    equally, so leaves drawn twice share a cached trace (``refs`` compares by identity)."""

    placements: tuple[Placement, ...]
    meta_stage: str | None
    refs: _Refs | None
    returns: str = "flat"

    def source(self, i: int, shared: Tensors) -> Tensor:
        p = self.placements[i]
        if self.refs is not None and i in self.refs.sources:
            return self.refs.sources[i]()
        return shared[p.buffer]

    def value(self, i: int, mode: ForwardMode, shared: Tensors, batch: Tensors, layer: int | None) -> Tensor:
        p = self.placements[i]
        handle = self.refs.handles.get(i, -1) if self.refs is not None else -1
        return p.pattern.op(self.source(i, shared), Site(p.buffer, p.stage, mode, batch, layer, handle))

    def prepared(self, stage: str, mode: ForwardMode, shared: Tensors, batch: Tensors,
                 meta: Mapping[Any, Any] | None = None) -> dict[Any, Any]:
        out = page_meta(shared, batch) if self.meta_stage == stage else {}
        for i, p in enumerate(self.placements):
            if p.stage == stage:
                x = self.value(i, mode, shared, batch, None)
                out[f"p{i}"] = x if p.carry else fingerprint(x).reshape(1)
        return _packed(self.returns, stage, out, meta)

    def unpacked(self, meta: Mapping[Any, Any]) -> dict[str, Tensor]:
        return _unpacked(self.returns, meta)


def _packed(shape: str, stage: str, out: dict[str, Tensor], meta: Mapping[Any, Any] | None) -> dict[Any, Any]:
    """``out`` (flat, string keys) as a leaf of return shape ``shape`` returns it from ``stage``."""
    if shape == "nested":
        return {stage: out} if out else {}
    if shape == "sequences":
        return {stage: [(k, (v,)) for k, v in out.items()]} if out else {}
    if shape == "odd_keys":
        return {(stage, int(k[1:])) if k.startswith("p") else k: v for k, v in out.items()}
    if shape == "python_values":
        return {**out, f"{stage}.scale": 1, f"{stage}.none": None, f"{stage}.on": True, f"{stage}.tag": "t"}
    if shape == "same_key" and stage == IN and meta is not None and "kv_lens" in meta and "kv_lens" not in out:
        return {**out, "kv_lens": meta["kv_lens"].clamp(min=1)}  # refines the copy under its own key
    return out


def _unpacked(shape: str, meta: Mapping[Any, Any]) -> dict[str, Tensor]:
    """The flat metadata the attention reads, from what both prepare stages returned."""
    if shape == "nested":
        return {k: v for stage in (OUT, IN) for k, v in meta.get(stage, {}).items()}
    if shape == "sequences":
        return {k: v[0] for stage in (OUT, IN) for k, v in meta.get(stage, [])}
    if shape == "odd_keys":
        return {f"p{k[1]}" if isinstance(k, tuple) else k: v for k, v in meta.items()}
    if shape == "python_values":
        scale = sum(v for k, v in meta.items() if isinstance(k, str) and k.endswith(".scale"))
        return {k: v * scale if k.startswith("p") else v for k, v in meta.items() if isinstance(v, Tensor)}
    return dict(meta)


@attrs.frozen
class _Out:
    code: _Code

    def __call__(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        refs = self.code.refs
        if refs is not None:  # a leaf that stashes holds references (see _build_leaf)
            for i, p in enumerate(self.code.placements):
                if p.via == "stash_clone":
                    refs.stash[i] = shared[p.buffer].clone()
                elif p.via == "stash_dlpack":
                    refs.stash[i] = torch.from_dlpack(torch.to_dlpack(shared[p.buffer]))
        return self.code.prepared(OUT, mode, shared, batch)


@attrs.frozen
class _In:
    code: _Code

    def __call__(self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return self.code.prepared(IN, mode, shared, batch, meta)


def _batch_meta(mode: ForwardMode, batch: Tensors) -> tuple[Tensor, Tensor]:
    # attention over each request's newest token only: indices and lengths from the batch
    rows, n = batch["req_pool_indices"].shape[0], tokens_per_request(mode)
    last = batch["out_cache_loc"].view(rows, n).narrow(1, n - 1, 1)
    lens = batch["positions"].view(rows, n).narrow(1, n - 1, 1).squeeze(1) + 1
    return last, lens


@attrs.frozen
class _Attend:
    code: _Code

    def __call__(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
                 shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        code = self.code
        meta = code.unpacked(meta)
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        if code.meta_stage is None:
            indices, lens = _batch_meta(mode, batch)
        else:
            m = page_meta(shared, batch) if code.meta_stage == ATTEND else meta
            indices, lens = m["kv_indices"], m["kv_lens"]
        out = softmax_attention(mode, q, pools, layer, indices, lens)
        mix = []
        for i, p in enumerate(code.placements):
            if p.stage == ATTEND:
                mix.append(fingerprint(code.value(i, mode, shared, batch, layer)))
            else:  # a carried result is read here; a reduced one is already a fingerprint
                mix.append(fingerprint(meta[f"p{i}"]) if p.carry else meta[f"p{i}"].sum())
        if not mix:
            return out
        return out + torch.stack(mix).sum().mul(0.125)


def _build_leaf(spec: FuzzLeaf, live: Tensors | None) -> Backend:
    holds = any(p.via != "argument" or p.pattern.invisible for p in spec.placements)
    code = _Code(spec.placements, spec.meta_stage, _Refs(spec, live) if holds else None, spec.returns)
    effect = spec.effect()
    return leaf(spec.name, _Attend(code), prepare_out_graph=_Out(code), prepare_in_graph=_In(code),
                declare=lambda mode: effect)


# ------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------


#: How often each class of pattern is drawn, relative to the others (a class not listed: 1).
#: Writes and threads are refused while tracing, whatever else the leaf does: drawn often,
#: they would hide the rest of the program from the checks.
CLASS_WEIGHTS: dict[str, int] = {"view": 6, "list_view": 6, "copy": 4, "conditional": 4, "custom_op": 3, "host": 2,
                                  "relation": 2, "view_claim": 2}


T = TypeVar("T")


@attrs.frozen(eq=False)
class _Choice(Generic[T]):
    """One choice point of the generator: its options, and the strategy drawing one."""

    options: tuple[T, ...]
    strategy: st.SearchStrategy[T] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "strategy", st.sampled_from(self.options))


Pick = Callable[[_Choice[Any]], Any]

#: Declared ends, weighted towards the later ones so that about half of the programs are
#: accepted. The first (what hypothesis draws most, and shrinks to) is POST_REPLAY, sound for
#: any traced read.
_ENDS = (ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN,
         ReadEnd.IN_REPLAY, ReadEnd.PRE_REPLAY, ReadEnd.NONE, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN)


class _Generator:
    """The generator of one vocabulary, written once against ``pick`` (a choice -> one of its
    options): hypothesis draws the choices in :func:`programs` (and shrinks them), a seeded
    ``random.Random`` in :func:`random_programs` (uniformly: long runs cover the vocabulary
    evenly). The choice points are built once: building hypothesis strategies inside each
    draw costs more than the draw."""

    def __init__(self, vocabulary: Mapping[str, Pattern]) -> None:
        if not vocabulary:
            raise ValueError("the vocabulary is empty: give at least one Pattern")
        by_class: dict[str, list[Pattern]] = {}
        for name in sorted(vocabulary, key=lambda n: (vocabulary[n].klass, n)):
            by_class.setdefault(vocabulary[name].klass, []).append(vocabulary[name])
        weighted = sorted(by_class, key=lambda k: -CLASS_WEIGHTS.get(k, 1))
        self.klass = _Choice(tuple(k for k in weighted for _ in range(CLASS_WEIGHTS.get(k, 1))))
        self.pattern = {k: _Choice(tuple(ps)) for k, ps in by_class.items()}
        self.stage = {p.name: _Choice(p.stages) for ps in by_class.values() for p in ps}
        self.buffer = _Choice(SHARED_BUFFERS)
        self.via = {stage: _Choice(tuple(v for v in VIAS if stage != OUT or v not in _STASH_VIAS)) for stage in STAGE_NAMES}
        self.flip = _Choice((False, True))
        self.count = _Choice((1, 1, 2, 2, 0, 3))  # one or two placements mostly
        self.meta = _Choice((IN, OUT, ATTEND, None))
        self.returns = _Choice(RETURN_SHAPES)
        self.end = _Choice(_ENDS)
        self.uniform = _Choice((False, False, True))  # one end for every buffer a third of the time
        self.is_tree = _Choice((False, False, False, True, True))  # trees 40% of the time
        self.nest = _Choice((False, False, True))
        self.width = _Choice((2, 2, 2, 3))
        self.combinator = {ok: _Choice(tuple(c for c in COMBINATORS if ok or c not in _LAYER_SPLITTING))
                           for ok in (True, False)}
        self.layers = {n: _Choice(tuple(itertools.permutations(range(n)))) for n in (2, 3)}
        self.index = {n: _Choice(tuple(range(n))) for n in (2, 3)}
        self.mode = _Choice(FUZZ_MODES)

    def placement(self, pick: Pick) -> Placement:
        pattern = pick(self.pattern[pick(self.klass)])
        stage = pick(self.stage[pattern.name])
        buffer = pick(self.buffer)
        # the argument half the time: the kept references are the rarer, deliberate case
        via = "argument" if pattern.invisible or not pick(self.flip) else pick(self.via[stage])
        carry = stage != ATTEND and pick(self.flip)
        return Placement(pattern, stage, buffer, via, carry)

    def declared(self, pick: Pick) -> tuple[tuple[str, ReadEnd], ...]:
        if pick(self.uniform):
            end = pick(self.end)
            return tuple((b, end) for b in SHARED_BUFFERS)
        return tuple((b, pick(self.end)) for b in SHARED_BUFFERS)

    def leaf(self, pick: Pick, max_placements: int) -> FuzzLeaf:
        n = min(pick(self.count), max_placements)
        placed = tuple(self.placement(pick) for _ in range(n))
        return FuzzLeaf("leaf", placed, self.declared(pick), pick(self.meta), pick(self.returns))

    def tree(self, pick: Pick, budget: int, split_ok: bool, max_placements: int) -> Node:
        if budget < 2 or not pick(self.is_tree):
            return self.leaf(pick, max_placements)
        # at most one layer-splitting combinator on a path, so that every child attends a layer
        combinator = pick(self.combinator[split_ok])
        n = 2 if combinator == "select" or budget < 3 else pick(self.width)
        inner_ok = split_ok and combinator not in _LAYER_SPLITTING
        children: list[Node] = []
        left = budget
        for i in range(n):
            share = left - (n - i - 1)  # keep one leaf for each later child
            nested = i == 0 and share >= 2 and pick(self.nest)
            children.append(self.tree(pick, 2, inner_ok, max_placements) if nested else self.leaf(pick, max_placements))
            left -= _count(children[-1])
        option: Any = {"hybrid_linear": lambda: pick(self.layers[n]), "tbo": lambda: pick(self.index[n]),
                       "select": lambda: pick(self.mode), "join": lambda: None}[combinator]()
        return FuzzTree(combinator, tuple(children), option)

    def program(self, pick: Pick, modes: _Choice[ForwardMode], max_leaves: int, max_placements: int) -> FuzzProgram:
        mode = pick(modes)
        root = self.tree(pick, max_leaves, True, max_placements)
        return FuzzProgram(_renamed(root, (f"f{i}" for i in itertools.count())), mode)


_GENERATORS: dict[tuple[tuple[str, Pattern], ...], _Generator] = {}


def _generator(vocabulary: Mapping[str, Pattern] | None) -> _Generator:
    vocabulary = VOCABULARY if vocabulary is None else vocabulary
    key = tuple(sorted(vocabulary.items()))
    hit = _GENERATORS.get(key)
    if hit is None:
        hit = _GENERATORS[key] = _Generator(vocabulary)
    return hit


def _drawn(draw: st.DrawFn) -> Pick:
    return lambda choice: draw(choice.strategy)


def placements(vocabulary: Mapping[str, Pattern] | None = None) -> st.SearchStrategy[Placement]:
    """A pattern of ``vocabulary`` (default :data:`VOCABULARY`; classes weighted by
    :data:`CLASS_WEIGHTS`) placed in a stage it allows, on any buffer, via any way of reaching
    it, carried or not.

    >>> from hypothesis import find, settings
    >>> find(placements(), lambda p: p.via == "closure", settings=settings(database=None, derandomize=True))
    chunk(req_to_token) via closure in attend
    """
    gen = _generator(vocabulary)
    return st.composite(lambda draw: gen.placement(_drawn(draw)))()


def declarations() -> st.SearchStrategy[tuple[tuple[str, ReadEnd], ...]]:
    """Per buffer, an end drawn from the lattice (weighted towards the later ends): one end for
    every buffer a third of the time (a stage that escapes the tracer in the graph reads every
    buffer until ``POST_REPLAY``), else one per buffer."""
    gen = _generator(None)
    return st.composite(lambda draw: gen.declared(_drawn(draw)))()


def leaves(vocabulary: Mapping[str, Pattern] | None = None, *, max_placements: int = 3) -> st.SearchStrategy[FuzzLeaf]:
    """A generated leaf (named ``leaf``; :func:`programs` renames them) with up to
    ``max_placements`` placements, one or two mostly."""
    gen = _generator(vocabulary)
    return st.composite(lambda draw: gen.leaf(_drawn(draw), max_placements))()


def _check_sizes(max_leaves: int, max_placements: int, modes: Sequence[ForwardMode]) -> _Choice[ForwardMode]:
    if max_leaves < 1 or max_placements < 0:
        raise ValueError(f"max_leaves must be at least 1 and max_placements at least 0, got {max_leaves} "
                         f"and {max_placements}")
    if not modes or any(m not in FUZZ_MODES for m in modes):
        raise ValueError(f"modes must be some of {[m.name for m in FUZZ_MODES]}, got {list(modes)!r}")
    return _Choice(tuple(modes))


def programs(vocabulary: Mapping[str, Pattern] | None = None, *, max_leaves: int = 3, max_placements: int = 3,
             modes: Sequence[ForwardMode] = FUZZ_MODES) -> st.SearchStrategy[FuzzProgram]:
    """Generated programs: a leaf, or a tree of up to ``max_leaves`` leaves under ``join``,
    ``tbo``, ``hybrid_linear`` and ``select``, run in one of ``modes``; leaves are named
    ``f0``, ``f1``, ... in pre-order. Hypothesis draws (and shrinks) every choice; it favours
    the first option of each, so for long runs that should cover the vocabulary evenly use
    :func:`random_programs`.

    >>> from hypothesis import find, settings
    >>> smallest_tree = find(programs(), lambda p: isinstance(p.root, FuzzTree),
    ...                      settings=settings(database=None, derandomize=True))
    >>> print(str(smallest_tree).splitlines()[0])
    join(f0, f1) in DECODE
    """
    gen, modes_ = _generator(vocabulary), _check_sizes(max_leaves, max_placements, modes)
    return st.composite(lambda draw: gen.program(_drawn(draw), modes_, max_leaves, max_placements))()


def random_programs(n: int, seed: int = 0, vocabulary: Mapping[str, Pattern] | None = None, *, max_leaves: int = 3,
                    max_placements: int = 3, modes: Sequence[ForwardMode] = FUZZ_MODES) -> Iterator[FuzzProgram]:
    """``n`` programs drawn like :func:`programs` but evenly, from ``random.Random(seed)``:
    the same programs for the same seed, every option of every choice equally often. Each
    choice deals from its own shuffled deck of options, reshuffled when empty, so a short run
    already covers the vocabulary (independent uniform draws leave a third of it out in fifty
    programs).

    >>> [str(p).splitlines()[0] for p in random_programs(2, seed=1)]
    ['select[DECODE](f0, f1) in DECODE', 'f0 in TARGET_VERIFY']
    """
    gen, modes_ = _generator(vocabulary), _check_sizes(max_leaves, max_placements, modes)
    rng = random.Random(seed)
    decks: dict[int, tuple[_Choice[Any], list[Any]]] = {}

    def pick(choice: _Choice[Any]) -> Any:
        _, deck = decks.setdefault(id(choice), (choice, []))
        if not deck:
            deck.extend(choice.options)
            rng.shuffle(deck)
        return deck.pop()

    for _ in range(n):
        yield gen.program(pick, modes_, max_leaves, max_placements)


def _count(node: Node) -> int:
    return 1 if isinstance(node, FuzzLeaf) else sum(_count(c) for c in node.children)


def _renamed(node: Node, names: Iterator[str]) -> Node:
    if isinstance(node, FuzzLeaf):
        return attrs.evolve(node, name=next(names))
    return attrs.evolve(node, children=tuple(_renamed(c, names) for c in node.children))


__all__ = [
    "CLASS_WEIGHTS",
    "COMBINATORS",
    "FUZZ_MODES",
    "RETURN_SHAPES",
    "STAGE_NAMES",
    "STAGE_END",
    "VIAS",
    "VOCABULARY",
    "FuzzLeaf",
    "FuzzProgram",
    "FuzzTree",
    "Pattern",
    "Placement",
    "Site",
    "declarations",
    "declared",
    "copy_pieces",
    "fingerprint",
    "gather_rows",
    "gather_rows_unknown",
    "keep",
    "leaves",
    "placements",
    "planned_gather",
    "programs",
    "random_programs",
]
