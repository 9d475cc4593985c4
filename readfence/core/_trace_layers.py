"""Trace a scan's layers once per distinct behaviour, and build the body's graph from them.

A model's layers call the same backend with the same shapes, so tracing every one with
``make_fx`` (about a millisecond per op) makes a trace cost grow with depth. When the body is
a :class:`~readfence.core._scan.LayerScan`, the body runs once eagerly under a recorder (tens
of microseconds per op) that writes down, per layer, every op the dispatcher runs and its
arguments, each tensor named by where it comes from: an op of the same layer, the carry, an
input (a layer's own weights by their name within the layer), or a constant by identity.
Two layers whose records differ only where one holds its layer index and the other its own
do the same thing: one ``make_fx`` trace of the first serves both, its nodes copied with the
index replaced. Anything the records cannot vouch for is traced as before: a layer that
escapes (a host read), runs a higher-order op, reads what another layer computed, or passes
an argument the record cannot compare; a copy whose index the traced node does not hold
where the record says.

The graph built is the graph ``make_fx`` would have made of the whole body, node for node,
so every analysis after it (aliases, memory, captured tensors, writes) runs on it unchanged;
``tests/core/test_trace_layers.py`` holds the two to each other. The runtime checks (the
observer, poison, the serial comparison) never see the records: they stay independent.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ._memory import leaves
from ._scan import LayerScan

#: Python values an op argument may hold that a record compares by value.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


@functools.lru_cache(maxsize=4096)  # keyed by op: a finite set per process
def _recordable(func: Any) -> bool:
    # a higher-order op runs graphs the record does not hold; a data-dependent op is a host read
    return not isinstance(func, torch._ops.HigherOrderOperator) and \
        torch.Tag.data_dependent_output not in getattr(func, "tags", ())


def _structure(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """How an op's arguments nest (the leaves aside): an op's schema fixes the rest."""
    shape = tuple(len(a) if type(a) in (list, tuple) else -1 for a in args)
    if any(type(x) in (list, tuple, dict) for a in args if type(a) in (list, tuple) for x in a):
        return pytree.tree_structure((args, kwargs))  # deeper than a schema's lists: the full spec
    return shape, tuple(kwargs)


_LIFT_FRESH = torch.ops.aten.lift_fresh.default  # what ``torch.tensor(...)`` dispatches


def _small_literal(t: object) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu" and not t.is_meta and t.numel() <= 256


def _literal(t: torch.Tensor) -> tuple[Any, ...]:
    with torch._C.DisableTorchFunction():  # its values, not a host read of the traced code
        return ("literal", _meta(t), tuple(t.flatten().tolist()))


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


class _Unrecordable(Exception):
    """A layer did something its record cannot vouch for: trace every layer."""


@attrs.frozen
class LayerRecord:
    """What one layer dispatched: per op ``(op, argument spec, encoded arguments)``, and what
    it returned."""

    index: int
    ops: tuple[tuple[Any, Any, tuple[Any, ...]], ...]
    returned: Any


class _Recorder(TorchDispatchMode):
    """Records the ops each layer dispatches (see the module docstring).

    Under ``make_fx`` (``graph`` given) it also keeps, per op, the graph nodes its call made:
    where to put a copy's own layer index.
    """

    supports_higher_order_operators = True

    def __init__(self, names: Mapping[int, str], escape_op: Any, graph: fx.Graph | None = None) -> None:
        super().__init__()
        self.names = names  # id of an input tensor -> its dotted name
        self.escape_op = escape_op
        self.graph = graph
        # id -> (layer, ref, the tensor): weakly, since a strong reference to an op's output
        # makes torch detach it on return (a node the plain trace does not have)
        self.origin: dict[int, tuple[int, tuple[Any, ...], weakref.ref[torch.Tensor]]] = {}
        self.constants: list[torch.Tensor] = []  # a constant is named by its id: it stays alive
        self.layer = -1
        self.own = ""
        self.ops: list[tuple[Any, Any, tuple[Any, ...]]] = []
        self.nodes: list[list[fx.Node]] = []

    def begin(self, index: int, own: str, carry: torch.Tensor) -> None:
        self.layer, self.own, self.ops, self.nodes = index, own, [], []
        self.origin[id(carry)] = (index, ("carry", _meta(carry)), weakref.ref(carry))

    def end(self, out: object) -> LayerRecord:
        """The layer's record; ops after it (between layers) are not recorded."""
        record = LayerRecord(self.layer, tuple(self.ops), self._leaf(out))
        self.layer = -1
        return record

    def _tensor(self, t: torch.Tensor) -> tuple[Any, ...]:
        hit = self.origin.get(id(t))
        if hit is not None and hit[2]() is t:
            if hit[0] != self.layer:
                raise _Unrecordable("a layer reads a tensor another layer computed")
            return hit[1]
        name = self.names.get(id(t))
        meta = _meta(t)
        if name is not None:
            return ("own", name[len(self.own):], meta) if name.startswith(self.own) else ("input", name, meta)
        self.constants.append(t)
        return ("constant", id(t), meta)

    def _leaf(self, v: object) -> Any:
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and not type(v).__module__.startswith("torch"):
                raise _Unrecordable("a tensor subclass")
            return self._tensor(v)
        if isinstance(v, _PLAIN):
            return (type(v), v)
        raise _Unrecordable(f"an argument of type {type(v).__name__}")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.layer < 0:
            return func(*args, **kwargs)
        if not _recordable(func) or func is self.escape_op:
            raise _Unrecordable(f"{func} escapes or holds a graph")
        if func is _LIFT_FRESH and _small_literal(args[0]):
            encoded: tuple[Any, ...] = (_literal(args[0]),)  # a literal by its value: a new tensor every call
        else:
            encoded = tuple(self._leaf(v) for v in leaves((args, kwargs)))
        spec = _structure(args, kwargs)
        tail = self.graph._root.prev if self.graph is not None else None
        out = func(*args, **kwargs)
        if self.graph is not None:
            made, node = [], tail.next if tail is not None else self.graph._root.next
            while node is not self.graph._root:
                made.append(node)
                node = node.next
            self.nodes.append(made)
        j = len(self.ops)
        self.ops.append((func, spec, encoded))
        for k, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.origin[id(t)] = (self.layer, ("op", j, k), weakref.ref(t))
        return out


def substitutions(rep: LayerRecord, other: LayerRecord) -> tuple[tuple[int, int], ...] | None:
    """Where ``other`` differs from ``rep``, as ``(op, argument leaf)`` positions, if it differs
    only where ``rep`` holds its layer index and ``other`` its own; else ``None``.

    >>> a = LayerRecord(2, ((torch.ops.aten.select.int, None, ((int, 0), (int, 2))),), ("op", 0, 0))
    >>> b = LayerRecord(5, ((torch.ops.aten.select.int, None, ((int, 0), (int, 5))),), ("op", 0, 0))
    >>> substitutions(a, b), substitutions(a, attrs.evolve(b, index=6))
    (((0, 1),), None)
    """
    if len(rep.ops) != len(other.ops) or rep.returned != other.returned:
        return None
    at, index = (int, rep.index), (int, other.index)
    out = []
    for j, ((fa, sa, la), (fb, sb, lb)) in enumerate(zip(rep.ops, other.ops)):
        if fa is not fb or sa != sb:
            return None
        for k, (x, y) in enumerate(zip(la, lb)):
            if x != y:
                if x != at or y != index:
                    return None
                out.append((j, k))
    return tuple(out)


def _shape_key(record: LayerRecord) -> tuple[Any, ...]:
    # what two records must share to be compared at all: the ops and their argument counts
    return tuple((f, len(leaves)) for f, _, leaves in record.ops)


@attrs.frozen
class LayerClass:
    """Layers that do what their first, ``rep``, does; per layer, where its index goes."""

    rep: LayerRecord
    members: dict[int, tuple[tuple[int, int], ...]]


def classes(records: Sequence[LayerRecord]) -> list[LayerClass]:
    """The records grouped into classes of layers that do the same (see :func:`substitutions`)."""
    out: list[LayerClass] = []
    buckets: dict[tuple[Any, ...], list[LayerClass]] = {}
    for r in records:
        bucket = buckets.setdefault(_shape_key(r), [])
        for c in bucket:
            subs = substitutions(c.rep, r)
            if subs is not None:
                c.members[r.index] = subs
                break
        else:
            c = LayerClass(r, {r.index: ()})
            bucket.append(c)
            out.append(c)
    return out


@attrs.frozen
class ScanTrace:
    """What tracing a scan's parts gives: the body's graph module and its eager output."""

    gm: fx.GraphModule
    out: Any
    classes: int  # how many layers were traced with make_fx


def trace_scan(
    scan: LayerScan,
    inputs: Callable[[Sequence[torch.Tensor]], dict[str, Any]],
    args: Sequence[torch.Tensor],
    input_names: Sequence[str],
    *,
    traced: Callable[[], Any],
    tracing: Callable[[], Any],
    escape_op: Any,
    outputs: Callable[[Any], tuple[torch.Tensor, ...]],
    eager: Callable[[], Any] = contextlib.nullcontext,
) -> ScanTrace | None:
    """The body's graph, from one ``make_fx`` trace per class of layers; ``None`` when the
    layers cannot be shown to repeat (then trace the body whole).

    ``inputs(tensors)`` rebuilds the body's keyword groups from its tensor inputs ``args``
    (named ``input_names``); ``traced()`` is the context every run of user code is in (the
    tracer's function modes), ``tracing()`` the one around ``make_fx``; ``outputs(out)`` the
    tensors the body's graph returns of what it returned; ``eager()`` the context of the
    recording run (the fake mode, under fake tensors).
    """
    if scan.count < 2:
        return None  # one layer: nothing to reuse, and the recording would cost a run
    names = {id(t): n for t, n in zip(args, input_names)}
    recorder = _Recorder(names, escape_op)
    groups = inputs(args)
    records, carries = [], []
    try:
        with eager(), traced():
            carry = scan.pre(groups)
            with recorder:
                for i in range(scan.count):
                    carries.append(carry)
                    recorder.begin(i, scan.own(i), carry)
                    carry = scan.layer(i, carry, groups)
                    records.append(recorder.end(carry))
            out = scan.post(carry, groups)
    except Exception:  # the whole body's trace says what went wrong, as it always has
        return None
    found = classes(records)
    if len(found) == scan.count:
        return None  # nothing repeats: the whole body's trace costs no more
    try:
        parts = _traced_parts(scan, inputs, args, carries, carry, found, input_names, traced, tracing, escape_op,
                              outputs)
    except Exception:  # as above: a failing part is the whole body's trace's to report
        return None
    if parts is None:
        return None
    gm = _stitch(scan, parts, found, input_names)
    return None if gm is None else ScanTrace(gm, out, len(found))


@attrs.frozen
class _Parts:
    pre: fx.GraphModule
    layers: dict[int, tuple[fx.GraphModule, list[list[fx.Node]]]]  # rep index -> graph, nodes per op
    post: fx.GraphModule


def _traced_parts(scan: LayerScan, inputs: Callable[[Sequence[torch.Tensor]], dict[str, Any]],
                  args: Sequence[torch.Tensor], carries: list[torch.Tensor], last: torch.Tensor,
                  found: list[LayerClass], input_names: Sequence[str], traced: Callable[[], Any],
                  tracing: Callable[[], Any], escape_op: Any, outputs: Callable[[Any], tuple[torch.Tensor, ...]],
                  ) -> _Parts | None:
    def pre(*t: torch.Tensor) -> torch.Tensor:
        with traced():
            return scan.pre(inputs(t))

    def post(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with traced():
            return outputs(scan.post(t[-1], inputs(t[:-1])))

    layers = {}
    with tracing():
        pre_gm = make_fx(pre, tracing_mode="real")(*args)
        for c in found:
            index = c.rep.index
            seen: dict[str, Any] = {}

            def layer(*t: torch.Tensor, index: int = index, seen: dict[str, Any] = seen) -> torch.Tensor:
                proxy = get_proxy_mode()
                rec = _Recorder({id(x): n for x, n in zip(t[:-1], input_names)}, escape_op,
                                graph=proxy.tracer.graph if proxy is not None else None)
                with traced(), rec:
                    rec.begin(index, scan.own(index), t[-1])
                    out = scan.layer(index, t[-1], inputs(t[:-1]))
                    seen["record"], seen["nodes"] = rec.end(out), rec.nodes
                return out

            gm = make_fx(layer, tracing_mode="real")(*args, carries[index])
            # the traced run must be the recorded one: same ops, same arguments
            if seen["record"] != c.rep:
                return None
            layers[index] = (gm, seen["nodes"])
        post_gm = make_fx(post, tracing_mode="real")(*args, last)
    return _Parts(pre_gm, layers, post_gm)


def _stitch(scan: LayerScan, parts: _Parts, found: list[LayerClass], input_names: Sequence[str]) -> fx.GraphModule | None:
    """One graph: the inputs, ``pre``, every layer (a copy of its class's graph, its own weights
    and index put in) and ``post``; ``None`` if a copy's index is not where the record says."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    graph = fx.Graph()
    root = torch.nn.Module()
    position = {n: k for k, n in enumerate(input_names)}
    pre_ph = [n for n in parts.pre.graph.nodes if n.op == "placeholder"]
    inputs = []
    for node, _ in zip(pre_ph, input_names, strict=True):
        placeholder = graph.placeholder(node.name)
        placeholder.meta = dict(node.meta)
        inputs.append(placeholder)
    attrs_made: dict[tuple[int, str], str] = {}

    def copy_in(gm: fx.GraphModule, env: dict[fx.Node, Any], patch: Mapping[fx.Node, Sequence[int]] = {},
                value: int = 0) -> Any:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: env[n])
            if node.op == "get_attr":
                key = (id(gm), str(node.target))
                if key not in attrs_made:
                    attrs_made[key] = f"_layered{len(attrs_made)}"
                    setattr(root, attrs_made[key], getattr(gm, str(node.target)))
                new = graph.get_attr(attrs_made[key])
                new.meta = dict(node.meta)
            else:
                new = graph.node_copy(node, lambda n: env[n])
                where = patch.get(node)
                if where:  # (pytree's order is ``leaves``' order)
                    flat, spec = pytree.tree_flatten((new.args, new.kwargs))
                    for k in where:
                        flat[k] = value
                    new.args, new.kwargs = pytree.tree_unflatten(flat, spec)
            env[node] = new
        raise AssertionError("a traced graph without an output")  # pragma: no cover

    carry = copy_in(parts.pre, dict(zip(pre_ph, inputs)))
    owner = {i: c for c in found for i in c.members}
    for i in range(scan.count):
        c = owner[i]
        rep = c.rep.index
        gm, nodes = parts.layers[rep]
        ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        mine, theirs = scan.own(i), scan.own(rep)
        env: dict[fx.Node, Any] = {}
        for node, name in zip(ph, input_names):
            if name.startswith(theirs):
                k = position.get(mine + name[len(theirs):])
                if k is None:
                    return None
                env[node] = inputs[k]
            else:
                env[node] = inputs[position[name]]
        env[ph[-1]] = carry
        patch: dict[fx.Node, list[int]] = {}
        for j, k in c.members[i]:
            made = [n for n in nodes[j] if n.op == "call_function"]
            if len(made) != 1 or made[0].target is not c.rep.ops[j][0]:
                return None
            held = leaves((made[0].args, made[0].kwargs))
            if len(held) != len(c.rep.ops[j][2]) or held[k] != rep or type(held[k]) is not int:
                return None
            patch.setdefault(made[0], []).append(k)
        carry = copy_in(gm, env, patch, i)
    ph = [n for n in parts.post.graph.nodes if n.op == "placeholder"]
    graph.output(copy_in(parts.post, {**dict(zip(ph, inputs)), ph[-1]: carry}))
    return _LazyGraphModule(root, graph)
