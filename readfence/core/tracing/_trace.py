"""Trace a backend's step into a ``Program``: one FX graph per stage, reads on every node.

Each stage is recorded as it runs once (``_record``: the graph ``make_fx`` would make, written
op by op as the dispatcher runs them), or, where a record cannot hold it, traced with
``make_fx`` (real tensors on CPU; fake tensors for any other device, so ``device="cuda"``
traces on a machine without a GPU). The graphs are *not* functionalized: they keep the ops as
written (views, in-place writes to ``pools``) so they can be executed as they are; reads
through views are found by alias analysis over op schemas instead (see ``_alias``), joined
with the memory each node's real value touches (``_probe``: as the record runs, or when the
graph is run once more on the example; real tensors only, under fake tensors the schemas are
all there is). Tensors are matched to shared buffers by memory range (``_memory``).

Escapes the tracer cannot see through are recorded in the graph as a ``readfence::opaque``
node on the escaping tensor, at the user's source line: a *value* escape (``item()``,
``int()``, ``tolist()``...) reads the tensor there and then; a *reference* escape
(``data_ptr()``, ``numpy()``, DLPack, ``untyped_storage()``, a ``.data =`` assignment) lets code
the tracer cannot see read it at any later time, so its buffers are ``UNKNOWN``. Either makes the stage unfaithful
(see ``_program``: such a stage is given every shared buffer).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch
from torch import fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, make_fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from readfence.effects import ReadfenceError

from .._checks import check_backend, check_mode, positive_int
from .._modes import ForwardMode
from .._program import INPUT_KEY, SOURCE_KEY, Captured, Program, StageGraph, flatten_inputs
from .._protocol import BackendLike
from .._step import (
    BODY,
    EAGER,
    OutputGuard,
    Stage,
    StageCall,
    StageOutputError,
    StepFunctions,
    eval_step,
    foreign_subclass,
)
from .._threads import watch_threads
from ._alias import Analysis, Write, analyse
from ._collect import collection_paused
from ._dispatch import DispatchMode
from ._fx import copy_graph
from ._memory import BufferMap, meet_shared, met_shared, span_of, tensors_in
from ._probe import MemoryProbe as _MemoryProbe
from ._probe import ProbeResult
from ._record import HOST_READ, GraphRecorder, Unrecordable, record
from ._schema import bind as bind_arguments
from ._schema import op_aliasing
from ._triton import is_launch_op, launch_of, launch_write_reason

if TYPE_CHECKING:
    from .._state import ModelConfig


class StageWriteError(ReadfenceError):
    """A stage writes a shared buffer (in place, ``out=``, or a mutating custom op).

    Stages may only *read* shared state; the scheduler owns it. Writes to ``pools`` are fine.
    ``why`` says what revealed the write: the op's schema (and which arguments it marks as
    written), or the buffer's bytes changing when the graph ran.
    """

    def __init__(self, backend: str, stage: str, buffer: str, node: str, op: str, why: str = "",
                 source: str = "?") -> None:
        self.backend, self.stage, self.buffer, self.node, self.op = backend, stage, buffer, node, op
        self.why, self.source = why, source
        super().__init__(
            f"backend {backend!r} writes shared buffer {buffer!r} in stage {stage} "
            f"(node {node!r}, op {op}, at {source}){': ' + why if why else ''}; stages may only "
            f"read shared state (pools may be written) - compute into a fresh tensor instead"
        )

    def at(self, path: str) -> StageWriteError:
        """The same error, naming the backend by its path in a combinator tree."""
        return StageWriteError(path, self.stage, self.buffer, self.node, self.op, self.why, self.source)


def _write_reason(w: Write, node: fx.Node | None = None) -> str:
    if node is not None and is_launch_op(node.target):
        return launch_write_reason(launch_of(node.args))
    args = ", ".join(w.arguments)
    why = f"its schema `{w.schema}` marks argument(s) {args} as written"
    if not w.op.startswith(("aten.", "prims.")):
        why += (" (a torch.library.custom_op registered with mutates_args='unknown' claims to write "
                "every tensor argument: if the op only reads them, register it with mutates_args=())")
    return why


# -- the escape marker -----------------------------------------------------------------------
@torch.library.custom_op("readfence::opaque", mutates_args=())
def _opaque(t: torch.Tensor, what: str) -> None:
    """Marks, in a traced graph, that ``t`` escaped to code the tracer cannot see."""
    return None


@_opaque.register_fake
def _opaque_fake(t: torch.Tensor, what: str) -> None:
    return None


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
_REFERENCE_ESCAPES: dict[Any, str] = {
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
_ESCAPES = {**_VALUE_ESCAPES, **_REFERENCE_ESCAPES}
_VALUE_WHATS = frozenset(_VALUE_ESCAPES.values())


def _is_value_escape(node: fx.Node) -> bool:
    return len(node.args) > 1 and (node.args[1] in _VALUE_WHATS or str(node.args[1]).startswith(HOST_READ))


_SKIP = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.abspath(__file__),
         os.path.abspath(os.path.join(os.path.dirname(__file__), "_triton.py")))


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
    skip = (*_SKIP, *sorted(_MACHINERY))
    return skip if where is None else (*skip, os.path.dirname(os.path.abspath(where)))


def _user_line() -> str:
    """``file:line in function`` of the innermost caller outside torch, triton and the tracer."""
    skip = _skipped()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _through_compiled_functions() -> Any:
    """Trace a ``torch.compile``'d function a stage calls as the Python it compiles.

    Dynamo refuses to be traced by FX unless told to run the original function instead; then
    its ops are traced like the stage's own (and the lowering compiles the stage itself). A
    process that never imported ``torch._dynamo`` has no compiled function to trace through.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return contextlib.nullcontext()
    return dynamo.config.patch(error_on_nested_fx_trace=False)


@contextlib.contextmanager
def _meta_values() -> Iterator[None]:
    """While tracing real tensors: record each node's value (``node.meta["val"]``) as a meta
    tensor of its shape, strides and dtype rather than as a fake tensor.

    make_fx makes a fake tensor per node for that record, about a quarter of a real trace's
    time (a fake tensor costs ~370 us to make, a meta one ~5 us); what readfence reads of
    the record (shapes, strides, dtypes: the compiler's probes, the rehearsal's shape check)
    a meta tensor holds. Values of any other kind keep make_fx's own record.
    """
    from torch.fx.experimental import proxy_tensor

    real = proxy_tensor.extract_val

    def light(val: Any, include_real: bool = False) -> Any:
        if type(val) is torch.Tensor and not val.is_sparse:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return real(val, include_real)

    proxy_tensor.extract_val = light
    try:
        yield
    finally:
        proxy_tensor.extract_val = real


def _forget_nested_dynamo(stages: Iterable[StageGraph]) -> None:
    """After tracing a higher-order op (``torch.cond``), whose eager entry is a dynamo-compiled
    wrapper that the trace ran as plain Python (see ``_through_compiled_functions``): drop what
    dynamo cached meanwhile, or the next eager call of the op fails inside dynamo."""
    hop = torch._ops.HigherOrderOperator
    if any(isinstance(n.target, hop) for s in stages for n in s.gm.graph.nodes) and "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


class _Aborted(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _HostReads(DispatchMode):
    """Marks, at the dispatcher, every op whose result is a Python value computed from tensor
    data (``torch.Tag.data_dependent_output``: ``equal``, ``allclose``, ``item``, and the
    ``_local_scalar_dense`` under ``bool(t)``, ``x in t``, ``is_nonzero`` and a 0-d tensor used
    as a slice bound), whatever Python spelling reached it, as a value escape, and computes it
    on the real tensors: the graph cannot hold it, so the stage runs as Python. The op tag, not a
    list of spellings, decides. Under fake tensors there is no value to compute: the trace stops.
    """

    supports_higher_order_operators = True  # ``torch.cond`` and the like go on to make_fx's own rules

    def __init__(self, *, fake: bool) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output not in getattr(func, "tags", ()) or get_proxy_mode() is None:
            return func(*args, **kwargs)
        what = f"{HOST_READ}{func}"
        for t in tensors_in((args, kwargs)):
            OPAQUE_OP(t, what)
        if self.fake:
            raise _Aborted(f"{what} escapes under fake tensors (at {_user_line()})")
        with disable_proxy_modes_tracing():
            return func(*args, **kwargs)


class _TraceMode(TorchFunctionMode):
    """Records escapes and the user's source line of every node; under fake tensors on a
    device this build lacks, indexes via aten."""

    def __init__(self, *, fake: bool, recorder: GraphRecorder | None = None) -> None:
        super().__init__()
        self.fake = fake
        # the graph being recorded (``_record``), else make_fx's, if any; and how the value an
        # escape hands the host is computed outside it
        self.graph = None if recorder is None else recorder.graph
        self.outside: Callable[[], Any] = disable_proxy_modes_tracing if recorder is None else recorder.paused

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        graph = self.graph
        if graph is None:
            proxy = get_proxy_mode()
            graph = proxy.tracer.graph if proxy is not None else None
        tail = graph._root.prev if graph is not None else None
        try:
            return self._call(func, args, kwargs)
        finally:
            if graph is not None and graph._root.prev is not tail:
                line = _user_line()
                node = tail.next if tail is not None else graph._root.next
                while node is not graph._root:
                    node.meta.setdefault(SOURCE_KEY, line)
                    node = node.next

    def _call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        what = _ESCAPES.get(func)
        if what is not None and args and isinstance(args[0], torch.Tensor):
            for t in args:  # the memory handed over too (a ``.data`` assignment's value)
                if isinstance(t, torch.Tensor):
                    OPAQUE_OP(t, what)
            if self.fake:
                raise _Aborted(f"{what} escapes under fake tensors (at {_user_line()})")
            # the value leaves the graph: compute it on the real tensor, outside the tracer
            with self.outside():
                return func(*args, **kwargs)
        if self.fake and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            if func is torch.Tensor.__getitem__:
                return _getitem(args[0], args[1])
            if func is torch.Tensor.__setitem__:
                return _setitem(args[0], args[1], args[2])
            # Python bindings that take a device guard this build lacks: use the op instead
            if func is torch.Tensor.__invert__:
                return torch.bitwise_not(args[0])
            if func is torch.Tensor.cuda:
                return args[0].to(torch.device("cuda", args[0].device.index or 0))
            if func is torch.Tensor.type and (len(args) > 1 or kwargs):
                dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
                if isinstance(dtype, torch.dtype):
                    return args[0].to(dtype)
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                # a Python binding that takes a CUDA device guard: call the aten op directly
                packet = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
                if "not linked with support for cuda" not in str(e) or packet is None:
                    raise
                return packet(*args, **kwargs)
        return func(*args, **kwargs)


def _basic_index(t: torch.Tensor, idx: Any) -> tuple[torch.Tensor, list[Any]]:
    """Apply ints, slices, None and Ellipsis; collect tensor indices for ``aten.index``."""
    if not isinstance(idx, tuple):
        idx = (idx,)

    def consumes(i: Any) -> int:
        if i is None or i is Ellipsis:
            return 0
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            return i.dim()
        return 1

    used = sum(consumes(i) for i in idx)
    out, dim = t, 0
    adv: list[torch.Tensor | None] = []  # per indexed dim: its tensor index, None for a kept dim
    for item in idx:
        if item is None:
            out = torch.ops.aten.unsqueeze.default(out, dim)
            adv.append(None)
            dim += 1
        elif item is Ellipsis:
            skip = t.dim() - used  # the dims the ellipsis stands for
            adv.extend([None] * skip)
            dim += skip
        elif isinstance(item, (int, torch.SymInt)) and not isinstance(item, bool):
            out = torch.ops.aten.select.int(out, dim, item)
        elif isinstance(item, slice):
            if any(isinstance(b, torch.Tensor) for b in (item.start, item.stop, item.step)):
                # a tensor as a slice bound is read on the host: no value under fake tensors
                raise _Aborted(f"{HOST_READ}a tensor used as a slice bound escapes under fake tensors "
                               f"(at {_user_line()})")
            start = 0 if item.start is None else item.start
            stop = out.shape[dim] if item.stop is None else item.stop
            out = torch.ops.aten.slice.Tensor(out, dim, start, stop, 1 if item.step is None else item.step)
            adv.append(None)
            dim += 1
        else:
            tensor = item if isinstance(item, torch.Tensor) else torch.tensor(item, device=t.device)
            adv.append(tensor)
            dim += 1
    while adv and adv[-1] is None:
        adv.pop()
    return out, adv


def _getitem(t: torch.Tensor, idx: Any) -> torch.Tensor:
    out, adv = _basic_index(t, idx)
    return torch.ops.aten.index.Tensor(out, adv) if adv else out


def _setitem(t: torch.Tensor, idx: Any, value: Any) -> None:
    out, adv = _basic_index(t, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.ops.aten.full.default([], value, dtype=t.dtype, device=t.device)
    if adv:
        torch.ops.aten.index_put_.default(out, adv, torch.ops.aten._to_copy.default(value, dtype=out.dtype))
    else:
        torch.ops.aten.copy_.default(out, value)


# -- tracing one stage -----------------------------------------------------------------------
def _identifier(dotted: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in dotted)
    return out if out and not out[0].isdigit() else "_" + out


_LITERAL_USERS = frozenset({torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default})


def _captured(backend: str, stage: str, gm: fx.GraphModule, buffers: BufferMap, owned: BufferMap) -> list[Captured]:
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or not node.users:
            continue
        if foreign_subclass(value):
            source = next((str(u.meta[SOURCE_KEY]) for u in node.users if SOURCE_KEY in u.meta), "?")
            raise StageOutputError(
                f"backend {backend!r} stage {stage} uses a {type(value).__name__} (a tensor subclass) at {source}: "
                f"make_fx does not trace through it, so the trace would hold a constant made while tracing; "
                f"unwrap it to a plain tensor inside the stage, or keep the subclass out of the step")
        # a literal (``torch.tensor(...)`` in the stage) is copied by its users on every run:
        # from fresh memory, or from memory the stage keeps (see ``_fresh_literals_dropped``)
        literal = all(u.op == "call_function" and u.target in _LITERAL_USERS for u in node.users)
        users = tuple(u.name for u in node.users)
        source = next((str(u.meta[SOURCE_KEY]) for u in node.users if SOURCE_KEY in u.meta), "?")
        out.append(Captured(stage, node.name, str(node.target), users, source, _match(value, buffers, owned),
                            literal=literal))
    return out


def _fresh_literals_dropped(stages: list[StageGraph], persistence_known: bool) -> list[StageGraph]:
    """The stages without the literals that are constants of the code (``torch.tensor([1, 2])``).

    A literal over no memory of the state that the step, run once more, does not read again
    was made while tracing: a constant, fine on every run. One the step reads again (the
    literal of a numpy mirror of a buffer) copies that memory on every run, and stays
    captured, matched like any other. Without the rerun (fake tensors) every literal over no
    memory of the example is taken for a constant.
    """
    out = []
    for s in stages:
        kept = tuple(c for c in s.captured
                     if not (c.literal and c.matches[0] == "none" and not (persistence_known and c.persistent)))
        out.append(s if kept == s.captured else attrs.evolve(s, captured=kept))
    return out


def _match(value: torch.Tensor, buffers: BufferMap, owned: BufferMap) -> tuple[str, tuple[str, ...]]:
    hit = buffers.touched(value)
    if hit:
        return ("shared", tuple(sorted(hit)))
    if owned.touched(value):
        return ("owned", ())
    return ("none", ())


def _analyse_stage(gm: fx.GraphModule, initial: Mapping[str, frozenset[str]], captured: Iterable[Captured],
                   memory: Mapping[str, frozenset[str]], copies: frozenset[str] | None, last: bool,
                   hidden: Mapping[str, frozenset[str]]) -> Analysis:
    initial = {**initial, **{c.node: c.buffers for c in captured}}
    return analyse(gm.graph, initial, escape_op=OPAQUE_OP, escape_reads=_is_value_escape,
                   output_reads=last, observed=memory, copies=copies, hidden=hidden)


def _in_branches(gm: fx.GraphModule, buffers: BufferMap) -> dict[str, frozenset[str]]:
    """Per higher-order op node (``torch.cond``), the shared buffers the tensors its branch
    graphs captured touch: make_fx keeps a tensor a branch closes over as a constant of the
    branch's own graph, which no argument of the op shows."""
    out: dict[str, frozenset[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        held = [getattr(gm, str(a.target)) for a in _node_refs(node.args) if a.op == "get_attr"]
        tensors = [t for m in held if isinstance(m, torch.nn.Module) for t in [*m.parameters(), *m.buffers(),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]]
        if tensors:
            out[node.name] = buffers.touched_by(tensors)
    return out


def _node_refs(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


def _analysed(backend: str, stage: str, gm: fx.GraphModule, initial: Mapping[str, frozenset[str]],
              captured: Iterable[Captured], memory: Mapping[str, frozenset[str]], copies: frozenset[str] | None,
              last: bool, changed: Iterable[tuple[fx.Node, str]], widen: Mapping[str, frozenset[str]],
              hidden: Mapping[str, frozenset[str]]) -> Analysis:
    """The stage's analysis, its writes to shared buffers refused (``StageWriteError``).

    ``widen`` maps the placeholders an earlier in-graph stage running its Python hands over to
    every shared buffer: on a path the trace did not take they may be views of any of them, so
    their consumers read every buffer (the annotations kept are these). Writes are checked on
    the traced aliases: like the Python stage's own writes on other paths, a write through
    such a view there is for the write guard to see.
    """
    captured = tuple(captured)
    result = _analyse_stage(gm, initial, captured, memory, copies, last, hidden)
    _check_writes(backend, stage, gm, result, changed)
    if widen:
        result = _analyse_stage(gm, {**initial, **widen}, captured, memory, copies, last, hidden)
    return result


def _handed_over(before: Iterable[StageGraph], inputs: Iterable[str], placeholders: Iterable[str],
                 buffers: Iterable[str]) -> dict[str, frozenset[str]]:
    """Placeholder -> every buffer, for each input an in-graph stage of ``before`` that runs its
    Python function returns (its outputs are not copied; see ``_program``)."""
    python = {o for s in before if not s.faithful and s.stage.in_graph for o in s.outputs}
    every = frozenset(buffers)
    return {node: every for node, dotted in zip(placeholders, inputs, strict=True) if dotted in python}


def _check_writes(backend: str, stage: str, gm: fx.GraphModule, result: Analysis,
                  changed: Iterable[tuple[fx.Node, str]]) -> None:
    sources = {n.name: str(n.meta.get(SOURCE_KEY, "?")) for n in gm.graph.nodes}
    nodes = {n.name: n for n in gm.graph.nodes}
    for w in result.writes:
        raise StageWriteError(backend, stage, sorted(w.buffers)[0], w.node, w.op, _write_reason(w, nodes.get(w.node)),
                              sources[w.node])
    for node, buf in changed:
        raise StageWriteError(backend, stage, buf, node.name, str(node.target),
                              "the buffer's bytes changed when the node ran, though its schema "
                              "declares no write", sources[node.name])


def _eager_stage(call: StageCall, names: Sequence[str], leaves: Sequence[Any], spec: pytree.TreeSpec,
                 guard: OutputGuard) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The stage run as written on an environment of its inputs by name (how a stage that
    runs its Python runs in the lowered step), its outputs held to ``guard`` (what the stages
    after it take as traced). In a step that is not replayed (``call.replayed`` False) its Python
    values cross too: it returns them by name, and takes its own from ``env`` where an earlier
    stage's Python returned them (a replayed step's graphs bake them). It keeps the call without its arguments and
    the shape of those, not the traced example's tensors: a cached program would keep them
    alive (a deep model's caches, for every program the trace cache and the lowered sizes hold)."""
    bare = attrs.evolve(call, kwargs={})
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    tensor_names = [names[i] for i in tensor_pos]
    crossing = not call.replayed  # Python values cross between the stages' Python too
    value_pos = [(i, names[i]) for i, leaf in enumerate(leaves) if crossing and not isinstance(leaf, torch.Tensor)]

    def eager(env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = list(skeleton)
        for i, name in zip(tensor_pos, tensor_names, strict=True):
            flat[i] = env[name]
        for i, name in value_pos:
            if name in env:
                flat[i] = env[name]
        kwargs = bare.rebuild(flat, spec)
        with watch_threads(bare.backend, bare.stage.name):
            out = bare.fn(**kwargs)
        guard.check(out, bare.fn, kwargs)  # the stages after it were traced on the traced step's outputs
        return {n: v for n, v in bare.output_names(out) if crossing or isinstance(v, torch.Tensor)}

    return eager


def _trace_stage(call: StageCall, shared: Mapping[str, Any], owned: BufferMap, fake_mode: Any,
                 before: Iterable[StageGraph] = (), carried: dict[str, frozenset[str]] | None = None,
                 recorded: bool = True) -> tuple[StageGraph, Any]:
    backend, stage = call.backend, call.stage
    names, leaves, spec = call.named_leaves()
    # one placeholder per distinct name: a tensor the stage receives twice is one input
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    input_names = tuple(dict.fromkeys(names[i] for i in tensor_pos))
    slot = {n: k for k, n in enumerate(input_names)}
    stash: dict[str, Any] = {}

    def outputs_of(out: Any) -> list[tuple[str, Any]]:
        return [(n, v) for n, v in call.output_names(out) if isinstance(v, torch.Tensor)]

    def with_inputs(tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        flat = list(leaves)
        for i in tensor_pos:
            flat[i] = tensors[slot[names[i]]]
        return call.rebuild(flat, spec)

    def flat_fn(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fake = fake_mode is not None
        with _TraceMode(fake=fake), _HostReads(fake=fake), watch_threads(backend, stage.name, "the trace"):
            out = call.fn(**with_inputs(tensors))
        pairs = outputs_of(out)
        stash["out"], stash["names"] = out, tuple(n for n, _ in pairs)
        return tuple(v for _, v in pairs)

    args = [leaves[tensor_pos[[names[i] for i in tensor_pos].index(n)]] for n in input_names]

    @contextlib.contextmanager
    def tracing() -> Iterator[None]:
        with contextlib.ExitStack() as ctx:
            if fake_mode is not None:
                ctx.enter_context(fake_mode)
            else:
                # make_fx records a fake "val" per node; without a fake mode in the tracing
                # context it builds a new FakeTensorMode for every node (most of the tracing
                # time). Share one.
                from torch._guards import TracingContext, tracing
                from torch._subclasses.fake_tensor import FakeTensorMode

                ctx.enter_context(tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))))
                ctx.enter_context(_meta_values())
            ctx.enter_context(_through_compiled_functions())
            # the graph's Python code is made when something calls it, not at every recompile
            ctx.enter_context(_use_lazy_graph_module(True))
            yield

    @contextlib.contextmanager
    def recorded_in(recorder: GraphRecorder) -> Iterator[None]:
        # the stage run eagerly, its ops written down by ``recorder``: the tracer's escapes and
        # source lines (host reads at the dispatcher the recorder marks itself)
        with contextlib.ExitStack() as ctx:
            if fake_mode is not None:
                ctx.enter_context(fake_mode)
            ctx.enter_context(_TraceMode(fake=fake_mode is not None, recorder=recorder))
            ctx.enter_context(watch_threads(backend, stage.name, "the trace"))
            yield

    try:
        if not recorded:
            raise Unrecordable("make_fx asked for")
        gm, out, probe = record(lambda *t: call.fn(**with_inputs(t)), args, input_names,
                                outputs=lambda out: [v for _, v in outputs_of(out)], context=recorded_in,
                                escape_op=OPAQUE_OP, shared=shared if fake_mode is None else None,
                                fake=fake_mode is not None)
        stash.update(out=out, names=tuple(n for n, _ in outputs_of(out)), probe=probe, recorded=True)
    except Exception:  # what the record cannot hold, or the stage's own error: make_fx's trace, as always
        with tracing():
            gm = make_fx(flat_fn, tracing_mode="real")(*args)
    # in a step that is not replayed no graph bakes the shapes or the Python values a stage returns:
    # they may change every step (the stages after it take them by name); its structure may not
    guard = OutputGuard.of(stage, stash["out"], backend=backend, values=call.replayed)

    eager = _eager_stage(call, names, leaves, spec, guard)

    buffers = BufferMap.of(shared)
    initial: dict[str, frozenset[str]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, dotted, t in zip(placeholders, input_names, args, strict=True):
        node._rename(_identifier(dotted))
        node.target = node.name
        node.meta[INPUT_KEY] = dotted
        # what its memory touches, and what an earlier stage's analysis says it may alias (all
        # there is under fake tensors, whose memory is only their storage's identity)
        initial[node.name] = buffers.touched(t) | (carried or {}).get(dotted, frozenset())
    gm.recompile()
    captured = _captured(backend, stage.name, gm, buffers, owned)

    memory: dict[str, frozenset[str]] = {}
    changed: list[tuple[fx.Node, str]] = []
    copies: frozenset[str] | None = None  # no memory under fake tensors
    if fake_mode is None:
        found: ProbeResult | None = stash.get("probe")
        if found is None:
            memory_probe = _MemoryProbe(gm, shared)
            memory_probe.run(*args)
            found = memory_probe.result
        else:  # a recorded stage was probed as it ran; its inputs touch what they hold
            for node, t in zip(placeholders, args):
                if buffers.touched_by(t):
                    found.touched[node.name] = buffers.touched_by(t)
        memory, changed, copies = found.touched, found.changed, frozenset(found.copies)
    last = stage is BODY
    widen = _handed_over(before, input_names, initial, shared)
    hidden = _in_branches(gm, buffers)
    result = _analysed(backend, stage.name, gm, initial, captured, memory, copies, last, changed, widen, hidden)
    if carried is not None:
        carried.update(zip(stash["names"], result.output_aliases, strict=True))
    graph = StageGraph(
        name=stage.name,
        gm=gm,
        inputs=input_names,
        outputs=stash["names"],
        reads=result.reads,
        unknown=result.unknown,
        opaque=result.opaque,
        faithful=not result.escapes,
        eager=eager,
        guard=guard,
        captured=tuple(captured),
        memory=memory,
        copies=copies,
        hidden=hidden,
        initial=initial,
        # (not in a step that is not replayed: its graphs never run, and a rerun of one on the
        # example would pair its inputs with what the backend's own buffers hold now, from another step)
        example=tuple(args) if captured and fake_mode is None and not result.escapes and call.replayed else None,
        recorded=stash.get("recorded", False),
        replayed=call.replayed,
    )
    return graph, stash["out"]


class _Consumed(DispatchMode):
    """Records the memory every op's tensor arguments span (to tell kept constants from
    values a stage computed once), and the memory of the arguments it writes (a buffer the
    step fills itself: the backend's own)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[Any] = []
        self.written: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for t in tensors_in((args, kwargs)):
            span = span_of(t)
            if span is not None:
                self.spans.append(span)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        aliasing = op_aliasing(func)
        if aliasing is not None and aliasing.writes:
            values = bind_arguments(func, args, kwargs)
            self.written += [sp for i in aliasing.writes for t in tensors_in(values[i]) if (sp := span_of(t)) is not None]
        return func(*args, **kwargs)


def _bind_captured(c: Captured, value: torch.Tensor, shared: BufferMap, owned: BufferMap) -> Captured:
    matches = _match(value, shared, owned)
    if matches[0] == "none" and c.persistent and c.matches[0] in ("none", "constant"):
        matches = _kept(value)
    return attrs.evolve(c, matches=matches, state="live")


def _kept(value: torch.Tensor) -> tuple[str, tuple[str, ...]]:
    """What a tensor the step reads again on every call, and no part of the state it runs on, is:
    a shared buffer of another state when its memory is one (:func:`met_shared`), else the
    backend's own (its constants, its persistent metadata buffers: whatever their shape)."""
    other = met_shared(value)
    return ("foreign", (other,)) if other is not None else ("constant", ())


class _Tracer:
    """The interpreter that traces each stage into a :class:`StageGraph` (``make_fx``) and
    hands on its real outputs, as the step computed them."""

    def __init__(self, shared: Mapping[str, Any], owned: BufferMap, fake_mode: Any, recorded: bool = True) -> None:
        self.shared, self.owned, self.fake_mode, self.recorded = shared, owned, fake_mode, recorded
        self.stages: list[StageGraph] = []
        self.current: Stage | None = None  # the stage being traced
        self.carried: dict[str, frozenset[str]] = {}  # what each stage's outputs may alias, by name

    def call(self, call: StageCall) -> Any:
        self.current = call.stage
        graph, out = _trace_stage(call, self.shared, self.owned, self.fake_mode, before=self.stages,
                                  carried=self.carried, recorded=self.recorded)
        self.stages.append(graph)
        return out


def _mark_persistent(stages: list[StageGraph], fns: StepFunctions, groups: Mapping[str, Any]) -> list[StageGraph]:
    # Run the step once more, eagerly: a captured tensor whose memory it reads again is a
    # constant the backend keeps; one it does not read again was computed for that one call.
    consumed = _Consumed()
    with consumed:
        eval_step(EAGER, fns, groups)
    marked = []
    for s in stages:
        captured = []
        for c in s.captured:
            span = span_of(getattr(s.gm, c.target))
            again = span is not None and any(span.overlaps(other) for other in consumed.spans)
            filled = span is not None and any(span.overlaps(other) for other in consumed.written)
            if c.matches[0] != "none":
                captured.append(c)
                continue
            # read again on the next call: the backend's own, unless its memory is a known state's
            kept = _kept(getattr(s.gm, c.target)) if again else ("none", ())
            captured.append(attrs.evolve(c, persistent=again, filled=filled,
                                         matches=kept if kept[0] == "constant" else c.matches))
        marked.append(attrs.evolve(s, captured=tuple(captured)))
    return marked


class CapturedStateError(ReadfenceError, ValueError):
    """A stage reads a tensor it did not receive that is not live state of the step.

    Such a tensor is a constant of the traced graph: trace-time state (a copy or a DLPack view
    made while tracing, a tensor kept from another state) that would be replayed stale.
    """

    def __init__(self, backend: str, mode: ForwardMode, captured: Iterable[Captured]) -> None:
        self.backend, self.mode, self.captured = backend, mode, tuple(captured)
        reasons = "; ".join(grouped_reasons(self.captured))
        super().__init__(
            f"cannot lower {backend} for {mode.name}: {reasons}. Pass live state to the stage "
            f"through its arguments (shared, pools), or compute the tensor inside the stage"
        )


def _made_in(source: str) -> str:
    """Whose code a source line (``file:line in function``) is in: triton's interpreter, torch, or the file."""
    path = source.split(":")[0]
    for name, who in (("triton", "triton's interpreter"), ("torch", "torch")):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if where is not None and os.path.abspath(path).startswith(os.path.dirname(os.path.abspath(where)) + os.sep):
            return who
    return os.path.basename(path) or "?"


def grouped_reasons(captured: Iterable[Captured]) -> list[str]:
    """One clause per cause: the captured tensors refused for the same reason in the same stage and
    made in the same code, counted, with one of them as the example.

    >>> c = Captured("body", "_tensor_constant0", "_tensor_constant0", ("add",), "/x/model.py:3 in f", ("none", ()))
    >>> grouped_reasons([c, attrs.evolve(c, target="_tensor_constant1", node="_tensor_constant1")])[0][:58]
    'stage body: 2 captured tensors made in model.py (_tensor_c'
    """
    groups: dict[tuple[str, str, str, str], list[Captured]] = {}
    for c in captured:
        groups.setdefault((c.stage, c.matches[0], c.state, _made_in(c.source)), []).append(c)
    out = []
    for (stage, _, _, made), cs in groups.items():
        names = list(dict.fromkeys(c.target for c in cs))
        if len(names) == 1:
            out.append(f"stage {stage}: {cs[0].why()}")
            continue
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"stage {stage}: {len(names)} captured tensors made in {made} ({shown}), e.g. {cs[0].why()}")
    return out


def bind(program: Program, state: Mapping[str, Mapping[str, torch.Tensor]]) -> Program:
    """``program`` as it runs on ``state`` (``shared``, ``pools``, ``params``): every captured
    tensor matched, by memory range, against that state instead of the example.

    A captured tensor that is one of ``state``'s shared buffers is a read of that buffer;
    one that is a pool or a parameter is fine; anything else stays unusable (``Captured.usable``
    is False) and the caller refuses it (``CapturedStateError``). Programs without captured
    tensors are returned as they are.

    Computed once per traced program and place in memory (see :func:`state_key`): the audit and
    every lowering of the step on one live state share the answer. It depends on where the live
    tensors are, not on the values they hold (the stages that rerun on it are faithful: no
    value of theirs reaches Python), and nothing downstream changes a bound program (every
    lowering pass builds new graphs from it).

    >>> from readfence.backends import paged
    >>> prog = trace(paged(), ForwardMode.DECODE)
    >>> bind(prog, {"shared": {}, "pools": {}, "params": {}}) is prog
    True
    """
    if not program.captured():
        return program
    meet_shared(state["shared"])  # a tensor another backend kept of this state is known for one
    key = (id(program), state_key(state))
    hit = _BOUND.get(key)
    if hit is not None:
        return hit[1]
    # the program kept beside its binding: its id is not reused while the entry lives
    return remember(_BOUND, key, (program, _bind(program, state)), _BOUND_LIMIT)[1]


def state_key(state: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[tuple[Any, ...], ...]:
    """Where ``state``'s tensors are: per group and name, the data pointer, shape and dtype.

    >>> state_key({"shared": {"seq_lens": torch.zeros(2, dtype=torch.int32)}})[0][3:]
    ((2,), torch.int32)
    """
    return tuple((g, k, t.data_ptr(), tuple(t.shape), t.dtype) for g, d in state.items() for k, t in d.items())


def _bind(program: Program, state: Mapping[str, Mapping[str, torch.Tensor]]) -> Program:
    """:func:`bind`, computed (``program`` has captured tensors)."""
    shared = BufferMap.of(state["shared"])
    owned = BufferMap.of(flatten_inputs(pools=state.get("pools", {}), params=state.get("params", {})))
    stages = []
    # what an in-graph stage's outputs alias under this state, by dotted name: a view of a
    # captured live buffer handed to the next stage is a read of that buffer there
    carried: dict[str, frozenset[str]] = {}
    for s in program.stages:
        initial = {node: aliases | carried.get(dotted, frozenset())
                   for node, dotted, aliases in zip(s.initial, s.inputs, s.initial.values(), strict=True)}
        if not s.captured and initial == s.initial:
            stages.append(s)
            continue
        gm = copy_graph(s.gm)
        captured = tuple(c if c.state == "live" else _bind_captured(c, getattr(gm, c.target), shared, owned)
                         for c in s.captured)
        memory, changed = _live_memory(s, gm, state)
        widen = _handed_over(stages, s.inputs, initial, program.buffers)
        live = _in_branches(gm, shared)
        hidden = {n: s.hidden.get(n, frozenset()) | live.get(n, frozenset()) for n in {*s.hidden, *live}}
        result = _analysed(program.backend, s.name, gm, initial, captured, memory, s.copies, s.stage is BODY,
                           changed, widen, hidden)
        # (the out-of-graph stage's outputs are its copies into the graph: they alias nothing)
        carried.update(zip(s.outputs, result.output_aliases, strict=True))
        stages.append(attrs.evolve(s, gm=gm, reads=result.reads, unknown=result.unknown, opaque=result.opaque,
                                   captured=captured, initial=initial))
    return attrs.evolve(program, stages=tuple(stages))


def _live_memory(s: StageGraph, gm: fx.GraphModule, state: Mapping[str, Mapping[str, torch.Tensor]],
                 ) -> tuple[dict[str, frozenset[str]], list[tuple[fx.Node, str]]]:
    """What ``s``'s nodes touch of the live shared buffers, joined with what they touched of the
    example's, and the live buffers a node changed: the stage (its captured tensors being live
    memory) run once more on its example inputs. A handle made on a captured buffer
    (``torch.empty(0).set_(table)``) aliases the live buffer though no schema says so; only
    the memory does. Everything in ``state`` holds its values again afterwards."""
    if s.example is None or not s.faithful:
        return dict(s.memory), []
    saved = [(t, t.clone()) for group in state.values() for t in group.values() if isinstance(t, torch.Tensor)]
    probe = _MemoryProbe(gm, state["shared"])
    try:
        probe.run(*s.example)
    finally:
        for t, old in saved:
            t.copy_(old)
    memory = dict(s.memory)
    for node, touched in probe.result.touched.items():
        memory[node] = memory.get(node, frozenset()) | touched
    return memory, probe.result.changed


def _fake_tree(tree: Any, fake_mode: Any, device: str) -> Any:
    def conv(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        with fake_mode:
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=device)

    return pytree.tree_map(conv, tree)


def trace_functions(
    backend: str,
    mode: ForwardMode,
    *,
    inputs: Mapping[str, Any],
    prepare_out_graph: Callable[..., object],
    prepare_in_graph: Callable[..., object],
    body: Callable[..., object],
    device: str = "cpu",
) -> Program:
    """Trace three stage functions over named input groups into a ``Program``.

    ``inputs`` maps group names (``shared`` required, then e.g. ``batch``, ``pools``,
    ``params``) to pytrees of tensors. The stages are called with keyword groups:
    ``prepare_out_graph(shared=, batch=)``, ``prepare_in_graph(shared=, batch=, meta=)`` and
    ``body(**inputs, meta=)``; each prepare stage returns a ``meta`` dict (the body sees
    ``{**out_graph_meta, **in_graph_meta}``, as ``core._model.prepare`` builds it), the body
    returns the logits. This is the engine under ``trace``; tests use it with toy functions.

    >>> import torch
    >>> shared = {"req_to_token": torch.zeros(2, 8, dtype=torch.int32), "seq_lens": torch.ones(2)}
    >>> prog = trace_functions(
    ...     "toy", ForwardMode.DECODE, inputs={"shared": shared, "batch": {}},
    ...     prepare_out_graph=lambda shared, batch: {"pt": shared["req_to_token"][:, :4]},
    ...     prepare_in_graph=lambda shared, batch, meta: {"lens": shared["seq_lens"][:1]},
    ...     body=lambda shared, batch, meta: meta["pt"].float().sum() + meta["lens"].sum())
    >>> prog.traced()  # out-of-graph outputs cross as copies; in-graph views are read in the body
    ReadEffect({'req_to_token': PRE_REPLAY, 'seq_lens': POST_REPLAY}, default=NONE)
    """
    fns = StepFunctions(prepare_out_graph, prepare_in_graph, body, backend)
    return trace_step(fns, mode, inputs, device=device)


def trace_step(fns: StepFunctions, mode: ForwardMode, inputs: Mapping[str, Any], *, device: str = "cpu",
               recorded: bool = True) -> Program:
    """Trace one step of ``fns`` on ``inputs`` (groups: ``shared`` required, then ``batch``,
    ``pools``, ``params``...) into a ``Program``: :func:`~readfence.core.eval_step` run by the
    tracing interpreter, each stage as the step hands it its arguments, recorded as it runs
    (``core._record``) or, where a record cannot hold it (or ``recorded`` is False), traced
    with ``make_fx``: the same graph. On a device other than CPU the inputs become fake tensors.
    """
    device = str(device)
    fake_mode = None
    groups = dict(inputs)
    if torch.device(device).type != "cpu":
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
        groups = {g: _fake_tree(t, fake_mode, device) for g, t in groups.items()}
    shared = groups.get("shared", {})
    owned = BufferMap.of(flatten_inputs(**{g: t for g, t in groups.items() if g != "shared"}))
    tracer = _Tracer(shared, owned, fake_mode, recorded)
    aborted = None
    try:
        with collection_paused():
            eval_step(tracer, fns, groups)
    except _Aborted as e:
        aborted = f"stage {tracer.current}: {e.why}"
    stages = tracer.stages
    _forget_nested_dynamo(stages)
    rerun = fake_mode is None and aborted is None and any(c.matches[0] == "none" for s in stages for c in s.captured)
    if rerun:
        stages = _mark_persistent(stages, fns, groups)
    stages = _fresh_literals_dropped(stages, rerun)
    return Program(
        backend=fns.backend, mode=mode, device=device, buffers=tuple(shared.keys()), stages=tuple(stages),
        aborted=aborted,
    )


# -- the public entry point ------------------------------------------------------------------
def _default_cfg() -> ModelConfig:
    from .._state import ModelConfig

    return ModelConfig()


def _code_key(backend: BackendLike) -> Any:
    """What a trace depends on: the code, not the declaration.

    A leaf that carries a ``kernel`` (the backends layer's ``Leaf``) is keyed by its name,
    kernel and options, so ``redeclare``d copies share one trace; anything else by itself.
    """
    kernel = getattr(backend, "kernel", None)
    if kernel is not None and not backend.children():
        try:
            key = (type(backend), backend.name, kernel, tuple(getattr(backend, "options", ())))
            hash(key)
            return key
        except TypeError:
            pass
    return backend


_CACHE: dict[Any, Program] = {}
_CACHE_LIMIT = 1024
#: ... and at most this many graph nodes in all, the oldest forgotten first: a program of a
#: 64-layer model is some 20,000 nodes (about 6 MB), and lowering every size of a capture list
#: traces three programs per size for a combinator of two
_CACHE_NODES = 1_000_000
_CACHE_SIZES: dict[Any, int] = {}  # nodes per cached program


#: Other caches of what a backend's code does (``observe``'s): forgotten with the traces.
_DEPENDENT_CACHES: list[dict[Any, Any]] = []


def code_key(backend: BackendLike) -> Any:
    """What a trace or an observation of ``backend`` depends on: its code, not its declaration
    (see ``_code_key``)."""
    return _code_key(backend)


def cache_with_traces(cache: dict[Any, Any]) -> dict[Any, Any]:
    """Register ``cache`` to be forgotten with the traces (``clear_trace_cache``)."""
    _DEPENDENT_CACHES.append(cache)
    return cache


_V = TypeVar("_V")


def remember(cache: dict[Any, Any], key: Any, value: _V, limit: int) -> _V:
    """Put ``value`` in ``cache`` under ``key``, forgetting the oldest entry first when the
    cache holds ``limit``; returns ``value``. The one rule of readfence's bounded caches: a
    forgotten entry only costs computing it again.

    >>> cache = {}
    >>> [remember(cache, k, k * 10, 2) for k in (1, 2, 3)], cache
    ([10, 20, 30], {2: 20, 3: 30})
    """
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


#: Bound programs (:func:`bind`), by the traced program's identity and the state's place in
#: memory, the oldest forgotten first.
_BOUND: dict[tuple[Any, ...], tuple[Program, Program]] = cache_with_traces({})
_BOUND_LIMIT = 256


def clear_trace_cache() -> None:
    """Forget every cached trace and observation (``trace`` caches one program per backend code,
    mode, model config, batch size, device and seed, ``observe`` one observation per backend
    code and its arguments; the next call traces or observes again).

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> clear_trace_cache(); _ = trace(paged(), ForwardMode.DECODE); trace_cache_size()
    1
    """
    _CACHE.clear()
    _CACHE_SIZES.clear()
    for cache in _DEPENDENT_CACHES:
        cache.clear()


def trace_cache_size() -> int:
    """How many traced programs are cached (at most 1024 programs and a million graph nodes in
    all: the oldest is forgotten first)."""
    return len(_CACHE)


def _trace_cached(backend: BackendLike, mode: ForwardMode, cfg: Any, batch_size: int, device: str, seed: int) -> Program:
    key = (_code_key(backend), mode, cfg, batch_size, device, seed)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _trace_uncached(backend, mode, cfg, batch_size, device, seed)
        nodes = sum(len(s.gm.graph.nodes) for s in hit.stages)
        while _CACHE and (len(_CACHE) >= _CACHE_LIMIT or sum(_CACHE_SIZES.values()) + nodes > _CACHE_NODES):
            oldest = next(iter(_CACHE))
            del _CACHE[oldest], _CACHE_SIZES[oldest]
        _CACHE[key], _CACHE_SIZES[key] = hit, nodes
    return hit


def _trace_uncached(backend: BackendLike, mode: ForwardMode, cfg: Any, batch_size: int, device: str, seed: int) -> Program:
    from .._model import step_functions
    from .._state import example_step

    step = example_step(cfg, mode, batch_size, seed=seed, device="cpu")
    return trace_step(step_functions(backend, mode, cfg), mode, step.groups(), device=device)


def trace(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_size: int = 2,
    device: str = "cpu",
    seed: int = 0,
) -> Program:
    """Trace ``backend``'s step in ``mode`` into a ``Program`` (cached per arguments).

    Stages: ``prepare_out_graph`` (eager, before replay), ``prepare_in_graph`` (first nodes
    of the graph) and ``body`` (the model's forward, calling ``attend`` per layer). Inputs
    come from ``example_step(cfg, mode, batch_size, seed=seed)``; on a device other than
    CPU they are fake tensors, so no such device is needed. Raises ``StageWriteError`` if a
    stage writes a shared buffer.

    >>> from readfence.backends import paged
    >>> prog = trace(paged(), ForwardMode.DECODE)
    >>> prog.traced() <= paged().read_effect(ForwardMode.DECODE)
    True
    """
    check_backend(backend)
    check_mode(mode)
    if cfg is None:
        cfg = _default_cfg()
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    return _trace_cached(backend, mode, cfg, batch_size, str(device), seed)
