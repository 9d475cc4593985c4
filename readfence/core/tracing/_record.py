"""Trace a stage by running it once and writing down, as an FX graph, every op it dispatches.

``make_fx`` builds a stage's graph by running it on tensors it follows, an op at a time, at about
a millisecond per op (a proxy, a fake value and metadata per node): a deep model's body costs
seconds, and every backend's step traces the same model around its ``attend``. This module runs
the stage eagerly under :class:`GraphRecorder`, a dispatch mode that makes, for each op, the
node make_fx would make (named alike; ``lift_fresh`` as ``lift_fresh_copy``; a tensor that is
neither an input nor an op's output a ``get_attr`` constant, one per use; every element of a
returned list or tuple a ``getitem``; a composite op that reaches it decomposed, as make_fx
decomposes it), at tens of microseconds per op. With the step's shared buffers given, every op
is probed as it runs (:func:`~readfence.core.tracing._probe.probe_op`): what its arguments touch is known
from where each came from, so a graph's memory facts need no second run.

An escape is recorded as make_fx's trace records it: the tracer's ``readfence::opaque``
marker on what escapes (``item()``, ``data_ptr()``, and a host read, an op tagged
``data_dependent_output``, whatever Python reached it), its value computed on the real tensors
with the record paused (:meth:`GraphRecorder.paused`); the stage is then unfaithful, and runs
its Python in the step. What a record cannot hold stops it (:class:`Unrecordable`), and the
stage is traced with make_fx as before: a higher-order op, a tensor subclass other than
torch's own, an argument of a type the graph cannot hold, a host read of fake tensors (no value
to go on with), an error in the stage's code (make_fx's trace reports it). Such a stage runs
twice while traced (its record stopped partway, then make_fx's trace); a stage is pure, and
the escapes that make an engine's stage Python are recorded, so the engines' stages that keep
state (a capture-time call made once) run once. ``tests/core/test_record.py`` holds the recorded
graphs to make_fx's, node for node; the runtime checks (the observer, poison, the serial
comparison) never see the record: they stay independent.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .._scan import LAYER_KEY, layers_marked
from . import _probe
from ._dispatch import DispatchMode
from ._fx import add_node
from ._memory import BufferMap, leaves
from ._probe import NO_FACTS, OpFacts, ProbeResult
from ._schema import op_aliasing

NOTHING: frozenset[str] = frozenset()

#: Python values an op argument may hold (make_fx keeps them in the node as they are).
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN_TYPES = frozenset(_PLAIN)
#: Ops make_fx never decomposes, whatever autograd would do.
_KEPT = frozenset({torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.storage_offset.default})
_LIFT_FRESH, _LIFT_FRESH_COPY = torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default
_DEVICE = torch.ops.prim.device.default


class Unrecordable(Exception):
    """The stage did something a record cannot hold: trace it with make_fx."""


#: What a host read's escape marker says (the tracer tells a value escape by it).
HOST_READ = "host read by "


@functools.lru_cache(maxsize=4096)  # by op: a finite set per process
def _recordable(func: Any) -> bool:
    # an op overload of the dispatcher: a higher-order op runs graphs a node does not hold
    return isinstance(func, torch._ops.OpOverload)


@functools.lru_cache(maxsize=4096)  # by op: a finite set per process
def _host_read(func: Any) -> bool:
    # its result is a Python value computed from tensor data: the host reads it there and then
    return torch.Tag.data_dependent_output in func.tags


def node_target(func: Any) -> Any:
    """The op a node of ``func``'s call holds (make_fx writes ``lift_fresh`` as its copy)."""
    return _LIFT_FRESH_COPY if func is _LIFT_FRESH else func


@functools.lru_cache(maxsize=4096)  # by name: a finite set per process
def node_name(name: str) -> str:
    # what make_fx names an op's node (``Graph._target_to_str`` of the op's name)
    return fx.Graph()._target_to_str(name)


def _decomposed(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether make_fx runs ``func``'s composite decomposition rather than the op: it has one,
    and no kernel for the device of its first tensor argument (torch's
    ``autograd_would_have_decomposed``, asked once per op and device)."""
    if not _composite(func):
        return False  # (most ops: ``decompose`` would give NotImplemented)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return _no_kernel(func, None if first is None else first.device.type)


@functools.lru_cache(maxsize=4096)  # by op: a finite set per process
def _composite(func: Any) -> bool:
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return func not in _KEPT and (key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))


@functools.lru_cache(maxsize=4096)  # by op and device type: a finite set per process
def _no_kernel(func: Any, device: str | None) -> bool:
    if device is None:
        return True
    key = torch._C._parse_dispatch_key(torch._C._dispatch_key_for_device(device))
    return key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


def _val(out: Any) -> Any:
    """What make_fx keeps of a value in ``node.meta["val"]``: a tensor's shape, strides and
    dtype (a meta tensor; a fake tensor detached, as make_fx snapshots it: a reference to the
    op's output itself would make torch detach it on return, a node make_fx does not have),
    lists and tuples of them, Python values."""
    if type(out) is torch.Tensor:
        return _meta(out.shape, out.stride(), out.dtype)
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (list, tuple)):
        return type(out)([_val(x) for x in out])
    return out


@functools.lru_cache(maxsize=4096)  # by layout: a deep model's ops make a few hundred
def _meta(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # one meta tensor per layout, shared by the nodes of that layout (a meta tensor holds no data
    # and the passes only read it; making one per op was a tenth of what recording an op cost)
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


class GraphRecorder(DispatchMode):
    """A dispatch mode that builds ``graph``: one node per op dispatched while it is entered
    (see the module docstring). Give it the inputs with :meth:`placeholder` first, and the
    outputs with :meth:`output` last.

    ``escape_op`` is the tracer's escape marker (written on what a host read reads); ``shared``,
    when given (real tensors), the shared buffers: every op is probed, its facts in ``probe``;
    ``fake``: the tensors are fake (a host read has no value: it stops the record).
    """

    supports_higher_order_operators = True  # to refuse them, rather than be passed over

    def __init__(self, escape_op: Any, shared: Mapping[str, torch.Tensor] | None = None, *, fake: bool = False) -> None:
        super().__init__()
        self.fake = fake
        self.pauses = 0  # while positive, ops run unrecorded (an escape's value, computed for the host)
        self.unrecorded: Any = None  # when set (a spliced piece's listing), ops run unrecorded while they are its template's
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.escape_op = escape_op
        self.buffers = None if shared is None else BufferMap.of(shared)
        self.shared = shared
        self.probe = ProbeResult()
        # id -> (the tensor, weakly: a strong reference to an op's output makes torch detach
        # it on return; its node; the shared buffers its memory touches, as the op showed)
        self.tracked: dict[int, tuple[weakref.ref[torch.Tensor], fx.Node, frozenset[str]]] = {}
        self.constants: dict[int, tuple[Any, str]] = {}  # id -> (the object, its attribute)
        self.watch: frozenset[str] = NOTHING  # what the current op's arguments touch
        self.layer: tuple[int, fx.Node | None] | None = None  # the scan's layer running, the last node before it

    # -- the graph's ends --------------------------------------------------------------------
    def placeholder(self, name: str, t: torch.Tensor) -> fx.Node:
        """The input ``t``, as make_fx names it (the tracer renames it after its dotted name)."""
        node = self.graph.placeholder(name)
        node.meta["val"] = _val(t)
        self.track(t, node, self.touched(t))
        return node

    def output(self, tensors: Sequence[torch.Tensor]) -> fx.GraphModule:
        """The graph module returning ``tensors``."""
        from torch.fx._lazy_graph_module import _LazyGraphModule

        with torch._C.DisableTorchFunction():
            self.graph.output(tuple(self._arg(t) for t in tensors))
        return _LazyGraphModule(self.root, self.graph)

    def mark_layer(self, index: int | None) -> None:
        """The scan starts layer ``index``, or (``None``) the layer it ran returned: the nodes
        recorded in between carry ``LAYER_KEY`` (``core.internal.layers_marked``)."""
        if index is not None:
            self.layer = (index, next(iter(reversed(self.graph.nodes)), None))
            return
        if self.layer is None:
            return
        (index, before), self.layer = self.layer, None
        node = before.next if before is not None else next(iter(self.graph.nodes), None)
        while node is not None and node.op != "root":
            node.meta[LAYER_KEY] = index
            node = node.next

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run in the block are not recorded: the value an escape hands the host, computed on
        the real tensors (what make_fx's ``disable_proxy_modes_tracing`` is to its trace)."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    # -- the record ----------------------------------------------------------------------------
    def touched(self, t: torch.Tensor) -> frozenset[str]:
        """The shared buffers ``t``'s memory touches (none when the record is given none)."""
        if self.buffers is None:
            return NOTHING
        with torch._C.DisableTorchFunction():  # looking at its memory is no escape of the stage's
            return self.buffers.touched(t)

    def in_storage_of_buffer(self, t: torch.Tensor) -> bool:
        """Whether a shared buffer's memory may lie in ``t``'s storage (``BufferMap.in_storage_of``)."""
        if self.buffers is None:
            return False
        with torch._C.DisableTorchFunction():
            return self.buffers.in_storage_of(t)

    def track(self, t: torch.Tensor, node: fx.Node, touched: frozenset[str]) -> None:
        """Follow ``t`` as ``node``'s value, touching ``touched``."""
        self.tracked[id(t)] = (weakref.ref(t), node, touched)

    def _arg(self, v: Any) -> Any:
        """``v`` as a node argument: a tensor as the node that made it, containers mapped."""
        kind = type(v)
        if kind is torch.Tensor or isinstance(v, torch.Tensor):
            if kind is not torch.Tensor and not kind.__module__.startswith("torch"):
                raise Unrecordable(f"a tensor subclass ({kind.__name__})")
            hit = self.tracked.get(id(v))
            if hit is not None and hit[0]() is v:
                self.watch |= hit[2]
                return hit[1]
            return self._constant(v)
        if kind in _PLAIN_TYPES or isinstance(v, _PLAIN):
            return v
        if kind is list or kind is tuple:
            return kind(self._arg(x) for x in v)
        if kind is torch.Generator:  # an opaque object, held as make_fx holds one
            return self._attribute(v, "_opaque_obj")
        raise Unrecordable(f"an argument of type {kind.__name__}")

    def _attribute(self, value: Any, prefix: str) -> fx.Node:
        # one attribute per object (numbered per prefix, as make_fx's tracer does), a get_attr
        # node for each use
        known = self.constants.get(id(value))
        if known is None or known[0] is not value:
            count = sum(1 for v, n in self.constants.values() if n.startswith(prefix))
            known = self.constants[id(value)] = (value, f"{prefix}{count}")
            setattr(self.root, known[1], value)
        return self.graph.get_attr(known[1])

    def _constant(self, t: torch.Tensor) -> fx.Node:
        # as make_fx's tracer does: once as an attribute, a get_attr node for each use
        view = self._view_of_input(t)
        if view is not None:
            return view
        self.watch |= self.touched(t)
        node = self._attribute(t, "_param_constant" if isinstance(t, torch.nn.Parameter) else "_tensor_constant")
        node.meta["val"] = _val(t)
        touched = self.touched(t)
        if touched:
            self.probe.touched[node.name] = touched
        return node

    def _view_of_input(self, t: torch.Tensor) -> fx.Node | None:
        """``t``, a tensor the stage reached without receiving it (kept on an object or in a closure by
        an earlier stage), recorded as the view it is of a shared buffer the stage did receive, or
        ``None``. An earlier stage that keeps ``shared["seq_lens"][:]`` keeps a view of the state
        each step runs on: the graph then reads that view of its own input, on whatever state it
        runs on, where a constant would hold the example's memory. Code that kept a view of another
        step's state computes something else than that graph; the validation's replays on other
        states show it (only a view of the same dtype, within one contiguous buffer)."""
        if self.shared is None or self.fake or type(t) is not torch.Tensor or t.numel() == 0:
            return None
        touched = self.touched(t)
        buf = self.shared.get(next(iter(touched))) if len(touched) == 1 else None
        hit = None if buf is None else self.tracked.get(id(buf))
        if buf is None or hit is None or hit[0]() is not buf or hit[1].op != "placeholder":
            return None
        with torch._C.DisableTorchFunction():
            # where it starts in the buffer, by address (a DLPack alias of a piece has a storage of its own)
            start, itemsize = t.data_ptr() - buf.data_ptr(), t.element_size()
            same = t.dtype == buf.dtype and t.device == buf.device and buf.is_contiguous() and start % itemsize == 0
            offset = start // itemsize
            reach = offset + sum((dim - 1) * st for dim, st in zip(t.shape, t.stride()))
            if not same or offset < 0 or min(t.stride(), default=0) < 0 or reach >= buf.numel():
                return None
            aten, n = torch.ops.aten, int(buf.numel())
            # the elements in their logical order (the example's buffer is contiguous: its storage
            # order), a copy where the live buffer is laid out otherwise (a padded page table)
            steps: list[tuple[Any, tuple[Any, ...], Sequence[int], Sequence[int]]] = [
                (aten.reshape.default, ([-1],), (n,), (1,))]
            if offset:
                steps.append((aten.slice.Tensor, (0, offset, n), (n - offset,), (1,)))
            steps.append((aten.as_strided.default, (list(t.shape), list(t.stride())), t.shape, t.stride()))
            node = hit[1]
            for target, rest, shape, stride in steps:
                node = self._node(target, (node, *rest), {}, node_name(target.overloadpacket.__name__))
                node.meta["val"] = _meta(torch.Size(shape), tuple(stride), t.dtype)
                self.probe.touched[node.name] = touched
        self.watch |= touched
        self.track(t, node, touched)
        return node

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        listing = self.unrecorded
        if listing is not None and not self.pauses and func is not _DEVICE:
            # a spliced piece's run: each call run unrecorded while it is its template's, listed
            # as a record writes it (a composite decomposed); from the first that is not, the
            # calls before it are written from the template and this one and the rest recorded
            out = self._decomposition(func, args, kwargs)
            if out is not NotImplemented:
                return out
            at = listing.enter(node_target(func), args, kwargs)
            if not listing.diverged:
                out = func(*args, **kwargs)
                listing.leave(at, out)
                return out
            listing.resume()
        if func is _DEVICE or self.pauses:
            return func(*args, **kwargs)
        if not _recordable(func):
            raise Unrecordable(f"{func} holds a graph")
        if _host_read(func):
            # as the tracer's host-read mode marks it under make_fx: what it reads escapes here,
            # and its value is computed on the real tensors
            if self.fake:
                raise Unrecordable(f"{func} reads fake tensors on the host")
            with torch._C.DisableTorchFunction():
                for t in leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        self._record(self.escape_op, (t, f"{HOST_READ}{func}"), {})
            return func(*args, **kwargs)
        return self._record(func, args, kwargs)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` and write its node (what ``__torch_dispatch__`` does for an op)."""
        out = self._decomposition(func, args, kwargs)
        if out is not NotImplemented:
            return out
        # the record's own look at the tensors (their nodes, memory) is no part of the stage:
        # the tracer's function modes do not see it
        with torch._C.DisableTorchFunction():
            self.watch = NOTHING
            node_args = tuple(self._arg(a) for a in args)
            node_kwargs = {k: self._arg(v) for k, v in kwargs.items()}
            target = node_target(func)
            node = self._node(target, node_args, node_kwargs, node_name(target.overloadpacket.__name__))
            watch = self.watch
        if self.buffers is None:
            out, facts = func(*args, **kwargs), NO_FACTS
        else:  # what the arguments touch is known from where each came from
            assert self.shared is not None
            out, facts = _probe.probe_op(func, args, kwargs, self.buffers, self.shared,
                                         lambda: func(*args, **kwargs), torch._C.DisableTorchFunction, watch=watch)
            self.probe.add(node, facts, self._rebound(facts))
        with torch._C.DisableTorchFunction():
            self._outputs(out, node, facts)
            aliasing = op_aliasing(func)
            # (an output the schema says is an argument's memory needs no look: the schema holds that)
            if aliasing is None or aliasing.opaque or not all(aliasing.outputs):
                # (``()``: looked, and it shares none: a node without the key was not looked at)
                node.meta[SHARES_KEY] = shared_storage(out, args, kwargs, node_args, node_kwargs, real=not self.fake)
        return out

    def _rebound(self, facts: OpFacts) -> dict[int, fx.Node] | None:
        """The nodes of the arguments an op re-pointed at a shared buffer, by their tensors' ids; each
        followed from here on as touching it too."""
        if not facts.rebound:
            return None
        nodes = {}
        for tid, bufs in facts.rebound:
            hit = self.tracked.get(tid)
            if hit is not None and hit[0]() is not None:
                nodes[tid] = hit[1]
                self.tracked[tid] = (hit[0], hit[1], hit[2] | bufs)
        return nodes

    def _decomposition(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func``'s composite decomposition, run under the recorder (its ops recorded, or
        listed, one by one), where make_fx runs it; else ``NotImplemented``."""
        if not _decomposed(func, args, kwargs):
            return NotImplemented
        with self:
            return func.decompose(*args, **kwargs)

    def _node(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> fx.Node:
        return add_node(self.graph, "call_function", target, args, kwargs, name)

    def _outputs(self, out: Any, node: fx.Node, facts: OpFacts) -> None:
        node.meta["val"] = _val(out)
        if isinstance(out, torch.Tensor):
            self.track(out, node, facts.touched)
            return
        if not isinstance(out, (list, tuple)):
            return
        pieces = iter(facts.pieces)  # what each leaf touches, in ``leaves`` order

        def each(value: Any, parent: fx.Node) -> None:
            for index, element in enumerate(value):
                item = self._node(operator.getitem, (parent, index), {}, "getitem")
                if isinstance(element, (list, tuple)):
                    item.meta["val"] = _val(element)
                    each(element, item)
                    continue
                touched = next(pieces, NOTHING)
                if isinstance(element, torch.Tensor):
                    item.meta["val"] = _val(element)
                    if touched:
                        self.probe.touched[item.name] = touched
                    self.track(element, item, touched)

        each(out, node)


#: ``node.meta[SHARES_KEY]``: where the argument nodes are (positions among the leaves of the node's
#: arguments) whose storage an op's output was seen to share when it ran, whatever its schema says
#: (``aten._unsafe_view`` declares a fresh output and returns a view). The recorder sets it on every
#: op whose schema calls an output fresh (a graph make_fx traced has none: ``note_output_memory``);
#: the compile passes' memory analysis takes it beside the schema's claims.
SHARES_KEY = "readfence_shares"


def _storages(t: object, real: bool) -> tuple[tuple[str, int], ...]:
    # a tensor's storage, as the object under it (fake tensors' too: a view shares its base's) and,
    # for real memory, its address (a DLPack alias is another object over the same bytes)
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return ()
    st = t.untyped_storage()
    return (("impl", st._cdata), ("ptr", st.data_ptr())) if real and st.nbytes() and t.device.type != "meta" \
        else (("impl", st._cdata),)


def shared_storage(out: Any, args: Any, kwargs: Any, node_args: Any, node_kwargs: Any, *,
                   real: bool = True) -> tuple[int, ...]:
    """Where, among the leaves of an op's node arguments (``leaves((args, kwargs))``: a pass that
    copies the node keeps them), the nodes are whose storage one of its outputs is (``real``: the
    tensors hold memory, else fake or meta tensors, compared by their storage objects alone)."""
    produced = {k for o in ((out,) if isinstance(out, torch.Tensor) else leaves(out) if isinstance(out, (list, tuple))
                            else ()) for k in _storages(o, real)}
    if not produced:
        return ()
    return tuple(i for i, (t, n) in enumerate(zip(leaves((args, kwargs)), leaves((node_args, node_kwargs))))
                 if isinstance(n, fx.Node) and not produced.isdisjoint(_storages(t, real)))


def note_output_memory(gm: fx.GraphModule, *inputs: Any) -> fx.GraphModule:
    """``gm`` with each op's ``SHARES_KEY`` noted as the recorder notes it, from one run of it on
    copies of ``inputs``: for a graph traced otherwise (make_fx), whose compile passes would else
    take every output a schema calls fresh for any memory it was given.

    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = note_output_memory(make_fx(lambda x: x.t().reshape(-1) * 2)(torch.ones(2, 3)), torch.ones(2, 3))
    >>> [(n.name, n.meta[SHARES_KEY]) for n in gm.graph.nodes if n.op == "call_function"][1:]
    [('clone', ()), ('_unsafe_view', (0,)), ('mul', ())]
    """

    class Noting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.op == "call_function":
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                n.meta[SHARES_KEY] = shared_storage(out, args, kwargs, n.args, n.kwargs)
            return out

    Noting(gm).run(*(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs))
    return gm


@contextlib.contextmanager
def recording(recorder: GraphRecorder) -> Iterator[GraphRecorder]:
    """``recorder`` entered, with the cycle collector held off and compiled functions run as
    Python (as under every readfence mode: ``_dispatch``): compiled code calls kernels the
    dispatcher never sees (make_fx's trace does the same)."""
    from ._collect import collection_paused

    with collection_paused(), recorder:
        yield recorder


def record(fn: Callable[..., Any], args: Sequence[torch.Tensor], names: Sequence[str], *,
           outputs: Callable[[Any], Sequence[torch.Tensor]], context: Callable[[GraphRecorder], Any],
           escape_op: Any, shared: Mapping[str, torch.Tensor] | None = None, fake: bool = False,
           ) -> tuple[fx.GraphModule, Any, ProbeResult | None]:
    """The graph of ``fn(*args)`` (its placeholders ``arg0_1``... for ``args``, ``names`` only
    to keep their count), what it returned, and what its nodes touch of ``shared`` (when given);
    ``outputs(out)`` are the tensors the graph returns. ``context(recorder)`` is what the stage's
    code runs in (the tracer's function modes, writing source lines into ``recorder.graph`` and
    computing escapes' values ``recorder.paused()``); ``fake``: the tensors are fake. Raises
    :class:`Unrecordable` (or what the stage raised) where the stage cannot be recorded.

    >>> gm, out, _ = record(lambda x: (x * 2).sum(), [torch.ones(3)], ["x"], outputs=lambda o: (o,),
    ...                     context=lambda recorder: contextlib.nullcontext(), escape_op=None)
    >>> [n.op for n in gm.graph.nodes], out.item()
    (['placeholder', 'call_function', 'call_function', 'output'], 6.0)
    """
    recorder = GraphRecorder(escape_op, shared, fake=fake)
    for k, t in enumerate(args[:len(names)]):
        recorder.placeholder(f"arg{k}_1", t)
    with context(recorder), recording(recorder), layers_marked(recorder.mark_layer):
        out = fn(*args)
    gm = recorder.output(outputs(out))
    return gm, out, None if shared is None else recorder.probe
