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
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _probe
from ._memory import BufferMap, leaves
from ._probe import NO_FACTS, MemoryProbe, OpFacts, ProbeResult
from ._scan import LayerScan

_NOTHING: frozenset[str] = frozenset()

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
    it returned; ``facts``, when the run was probed, what each op showed of the shared buffers
    (not part of what the layer does: two layers alike may touch other parts of a buffer)."""

    index: int
    ops: tuple[tuple[Any, Any, tuple[Any, ...]], ...]
    returned: Any
    facts: tuple[OpFacts, ...] = attrs.field(default=(), eq=False)


class _Recorder(TorchDispatchMode):
    """Records the ops each layer dispatches (see the module docstring).

    Under ``make_fx`` (``graph`` given) it also keeps, per op, the graph nodes its call made:
    where to put a copy's own layer index.
    """

    supports_higher_order_operators = True

    def __init__(self, names: Mapping[int, str], escape_op: Any, graph: fx.Graph | None = None,
                 shared: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.names = names  # id of an input tensor -> its dotted name
        self.escape_op = escape_op
        self.graph = graph
        # the shared buffers, when every recorded op is to be probed (``probe_op``)
        self.probe = None if shared is None else (BufferMap.of(shared), shared)
        self.facts: list[OpFacts] = []
        # id -> (layer, ref, the tensor, the shared buffers its memory touches): the tensor
        # weakly, since a strong reference to an op's output makes torch detach it on return (a
        # node the plain trace does not have); what it touches, when probing, as the op that
        # made it showed (an op that moves a tensor's memory, ``set_``, returns it: made anew)
        self.origin: dict[int, tuple[int, tuple[Any, ...], weakref.ref[torch.Tensor], frozenset[str]]] = {}
        self.touches: dict[int, frozenset[str]] = {}  # id of an input -> what it touches (inputs stay alive)
        self.watch: frozenset[str] = _NOTHING  # what the current op's arguments touch
        self.constants: list[torch.Tensor] = []  # a constant is named by its id: it stays alive
        self.layer = -1
        self.own = ""
        self.ops: list[tuple[Any, Any, tuple[Any, ...]]] = []
        self.nodes: list[list[fx.Node]] = []

    def begin(self, index: int, own: str, carry: torch.Tensor) -> None:
        self.layer, self.own, self.ops, self.nodes, self.facts = index, own, [], [], []
        touched = _NOTHING if self.probe is None else self._touched(carry)
        self.origin[id(carry)] = (index, ("carry", _meta(carry)), weakref.ref(carry), touched)

    def end(self, out: object) -> LayerRecord:
        """The layer's record; ops after it (between layers) are not recorded."""
        record = LayerRecord(self.layer, tuple(self.ops), self._leaf(out), tuple(self.facts))
        self.layer = -1
        return record

    def _tensor(self, t: torch.Tensor) -> tuple[Any, ...]:
        hit = self.origin.get(id(t))
        if hit is not None and hit[2]() is t:
            if hit[0] != self.layer:
                raise _Unrecordable("a layer reads a tensor another layer computed")
            self.watch |= hit[3]
            return hit[1]
        name = self.names.get(id(t))
        meta = _meta(t)
        if self.probe is not None:
            touched = self.touches.get(id(t))
            if touched is None:
                touched = self._touched(t)
                if name is not None:
                    self.touches[id(t)] = touched
            self.watch |= touched
        if name is not None:
            return ("own", name[len(self.own):], meta) if name.startswith(self.own) else ("input", name, meta)
        self.constants.append(t)
        return ("constant", id(t), meta)

    def _touched(self, t: torch.Tensor) -> frozenset[str]:
        assert self.probe is not None
        with torch._C.DisableTorchFunction():  # looking at its memory is no escape of the stage's
            return self.probe[0].touched(t)

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
        self.watch = _NOTHING
        if func is _LIFT_FRESH and _small_literal(args[0]):
            encoded: tuple[Any, ...] = (_literal(args[0]),)  # a literal by its value: a new tensor every call
        else:
            encoded = tuple(self._leaf(v) for v in leaves((args, kwargs)))
        spec = _structure(args, kwargs)
        tail = self.graph._root.prev if self.graph is not None else None
        facts = NO_FACTS
        if self.probe is None:
            out = func(*args, **kwargs)
        else:
            # what the arguments touch is known from where each came from; the probe's own
            # calls are no part of the stage (hidden from the tracer's modes)
            out, facts = _probe.probe_op(func, args, kwargs, *self.probe, lambda: func(*args, **kwargs),
                                  torch._C.DisableTorchFunction, watch=self.watch)
            self.facts.append(facts)
        if self.graph is not None:
            made, node = [], tail.next if tail is not None else self.graph._root.next
            while node is not self.graph._root:
                made.append(node)
                node = node.next
            self.nodes.append(made)
        j = len(self.ops)
        self.ops.append((func, spec, encoded))
        if isinstance(out, torch.Tensor):
            self.origin[id(out)] = (self.layer, ("op", j, 0), weakref.ref(out), facts.touched)
        else:
            for k, t in enumerate(leaves(out)):
                if isinstance(t, torch.Tensor):
                    touched = facts.pieces[k] if k < len(facts.pieces) else _NOTHING
                    self.origin[id(t)] = (self.layer, ("op", j, k), weakref.ref(t), touched)
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
    """What tracing a scan's parts gives: the body's graph module and its eager output, and,
    when the run was probed, what each node of the graph touches in memory."""

    gm: fx.GraphModule
    out: Any
    classes: int  # how many layers were traced with make_fx
    probe: ProbeResult | None = None


def trace_scan(
    scan: LayerScan,
    inputs: Callable[[Sequence[torch.Tensor]], dict[str, Any]],
    args: Sequence[torch.Tensor],
    input_names: Sequence[str],
    *,
    traced: Callable[[], Any],
    recording: Callable[[], Any],
    tracing: Callable[[], Any],
    escape_op: Any,
    outputs: Callable[[Any], tuple[torch.Tensor, ...]],
    eager: Callable[[], Any] = contextlib.nullcontext,
    shared: Mapping[str, torch.Tensor] | None = None,
) -> ScanTrace | None:
    """The body's graph, from one ``make_fx`` trace per class of layers; ``None`` when the
    layers cannot be shown to repeat (then trace the body whole).

    ``inputs(tensors)`` rebuilds the body's keyword groups from its tensor inputs ``args``
    (named ``input_names``); ``traced()`` is the context every run of user code under
    ``make_fx`` is in (the tracer's modes), ``recording()`` the one of the eager recording run,
    ``tracing()`` the one around ``make_fx``; ``outputs(out)`` the
    tensors the body's graph returns of what it returned; ``eager()`` the context of the
    recording run (the fake mode, under fake tensors). With ``shared`` (the step's shared
    buffers, real tensors) every op the layers run is probed as it is recorded
    (:func:`~readfence.core._probe.probe_op`), so the graph's memory facts need no second run
    of the layers.
    """
    if scan.count < 2:
        return None  # one layer: nothing to reuse, and the recording would cost a run
    names = {id(t): n for t, n in zip(args, input_names)}
    recorder = _Recorder(names, escape_op, shared=shared)
    groups = inputs(args)
    records, carries = [], []
    try:
        with eager(), recording():
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
    stitched = _stitch(scan, parts, found, input_names)
    if stitched is None:
        return None
    gm, copies = stitched
    probe = None if shared is None else _probed(copies, records, args, carry, shared)
    return ScanTrace(gm, out, len(found), probe)


@attrs.frozen
class _Part:
    """One traced part of the body: its graph, the positions (among the body's inputs) of the
    inputs its placeholders stand for, before the carry a layer or the head takes last, and,
    for a layer, the graph nodes each recorded op made."""

    gm: fx.GraphModule
    positions: tuple[int, ...]
    nodes: tuple[tuple[fx.Node, ...], ...] = ()


@attrs.frozen
class _Parts:
    pre: _Part
    layers: dict[int, _Part]  # by the index of the class's first layer
    post: _Part


def _traced_parts(scan: LayerScan, inputs: Callable[[Sequence[torch.Tensor]], dict[str, Any]],
                  args: Sequence[torch.Tensor], carries: list[torch.Tensor], last: torch.Tensor,
                  found: list[LayerClass], input_names: Sequence[str], traced: Callable[[], Any],
                  tracing: Callable[[], Any], escape_op: Any, outputs: Callable[[Any], tuple[torch.Tensor, ...]],
                  ) -> _Parts | None:
    # Each part takes as placeholders only the inputs it may use: a layer its own weights and
    # what belongs to no layer, the embedding and the head what belongs to no layer. So a
    # part's trace does not grow with the model's depth; a part that used another input
    # anyway would hold it as a constant, and is refused below.
    owns = tuple(scan.own(i) for i in range(scan.count))
    common = tuple(k for k, n in enumerate(input_names) if not n.startswith(owns))

    def positions_of(index: int) -> tuple[int, ...]:
        mine = scan.own(index)
        return tuple(sorted({*common, *(k for k, n in enumerate(input_names) if n.startswith(mine))}))

    def widened(positions: tuple[int, ...], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = list(args)
        for k, t in zip(positions, tensors, strict=True):
            flat[k] = t
        return flat

    def pre(*t: torch.Tensor) -> torch.Tensor:
        with traced():
            return scan.pre(inputs(widened(common, t)))

    def post(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with traced():
            return outputs(scan.post(t[-1], inputs(widened(common, t[:-1]))))

    layers = {}
    with tracing():
        pre_gm = make_fx(pre, tracing_mode="real")(*[args[k] for k in common])
        for c in found:
            index = c.rep.index
            positions = positions_of(index)
            seen: dict[str, Any] = {}

            def layer(*t: torch.Tensor, index: int = index, positions: tuple[int, ...] = positions,
                      seen: dict[str, Any] = seen) -> torch.Tensor:
                proxy = get_proxy_mode()
                flat = widened(positions, t[:-1])
                rec = _Recorder({id(x): n for x, n in zip(flat, input_names)}, escape_op,
                                graph=proxy.tracer.graph if proxy is not None else None)
                with traced(), rec:
                    rec.begin(index, scan.own(index), t[-1])
                    out = scan.layer(index, t[-1], inputs(flat))
                    seen["record"], seen["nodes"] = rec.end(out), rec.nodes
                return out

            gm = make_fx(layer, tracing_mode="real")(*[args[k] for k in positions], carries[index])
            # the traced run must be the recorded one: same ops, same arguments
            if seen["record"] != c.rep:
                return None
            layers[index] = _Part(gm, positions, tuple(map(tuple, seen["nodes"])))
        post_gm = make_fx(post, tracing_mode="real")(*[args[k] for k in common], last)
    parts = _Parts(_Part(pre_gm, common), layers, _Part(post_gm, common))
    held = {id(t) for t in args}
    for part in (parts.pre, *parts.layers.values(), parts.post):
        for node in part.gm.graph.nodes:
            if node.op == "get_attr" and id(getattr(part.gm, str(node.target))) in held:
                return None  # an input it was not given: trace the body whole
    return parts


@attrs.frozen
class _Copy:
    """A part as it was copied into the stitched graph: per node of its graph, the new node."""

    part: _Part
    env: dict[fx.Node, fx.Node]
    record: LayerRecord | None = None  # a layer's: what its run showed


def _stitch(scan: LayerScan, parts: _Parts, found: list[LayerClass], input_names: Sequence[str],
            ) -> tuple[fx.GraphModule, list[_Copy]] | None:
    """One graph: the inputs, ``pre``, every layer (a copy of its class's graph, its own weights
    and index put in) and ``post``, and where each part's nodes went; ``None`` if a copy's
    index is not where the record says."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    graph = fx.Graph()
    root = torch.nn.Module()
    position = {n: k for k, n in enumerate(input_names)}
    # make_fx names the whole body's placeholders by position (the tracer renames them after
    # their dotted names); each takes the record of the first part that holds it
    inputs = [graph.placeholder(f"arg{k}_1") for k in range(len(input_names))]
    attrs_made: dict[tuple[int, str], str] = {}
    copies: list[_Copy] = []

    def copy_in(gm: fx.GraphModule, env: dict[fx.Node, Any], patch: Mapping[fx.Node, Sequence[int]] = {},
                value: int = 0) -> Any:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                if not env[node].meta:
                    env[node].meta = dict(node.meta)
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
                new = _node_copy(graph, node, env)
                where = patch.get(node)
                if where:  # (pytree's order is ``leaves``' order)
                    flat, spec = pytree.tree_flatten((new.args, new.kwargs))
                    for k in where:
                        flat[k] = value
                    new.args, new.kwargs = pytree.tree_unflatten(flat, spec)
            env[node] = new
        raise AssertionError("a traced graph without an output")  # pragma: no cover

    pre_env = dict(_inputs_of(parts.pre, inputs))
    carry = copy_in(parts.pre.gm, pre_env)
    copies.append(_Copy(parts.pre, pre_env))
    owner = {i: c for c in found for i in c.members}
    for i in range(scan.count):
        c = owner[i]
        rep = c.rep.index
        part = parts.layers[rep]
        mine, theirs = scan.own(i), scan.own(rep)
        env: dict[fx.Node, Any] = {}
        ph = [n for n in part.gm.graph.nodes if n.op == "placeholder"]
        for node, k in zip(ph, part.positions):
            name = input_names[k]
            if name.startswith(theirs):
                at = position.get(mine + name[len(theirs):])
                if at is None:
                    return None
                env[node] = inputs[at]
            else:
                env[node] = inputs[k]
        env[ph[-1]] = carry
        patch: dict[fx.Node, list[int]] = {}
        for j, k in c.members[i]:
            made = [n for n in part.nodes[j] if n.op == "call_function"]
            if len(made) != 1 or made[0].target is not c.rep.ops[j][0]:
                return None
            held = leaves((made[0].args, made[0].kwargs))
            if len(held) != len(c.rep.ops[j][2]) or held[k] != rep or type(held[k]) is not int:
                return None
            patch.setdefault(made[0], []).append(k)
        carry = copy_in(part.gm, env, patch, i)
        copies.append(_Copy(part, env))
    post_env = dict(_inputs_of(parts.post, inputs))
    post_env[[n for n in parts.post.gm.graph.nodes if n.op == "placeholder"][-1]] = carry
    graph.output(copy_in(parts.post.gm, post_env))
    copies.append(_Copy(parts.post, post_env))
    return _LazyGraphModule(root, graph), copies


def _node_copy(graph: fx.Graph, node: fx.Node, env: Mapping[fx.Node, fx.Node]) -> fx.Node:
    """``graph.node_copy(node, env.__getitem__)``, without its walk of every argument for a
    symbolic value (a trace of real tensors holds none): that walk was two thirds of a copy."""
    new = graph.create_node(node.op, node.target, None, None, node.name, node.type)
    new.args = fx.node.map_arg(node.args, env.__getitem__)
    new.kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    new.meta = dict(node.meta)
    return new


def _inputs_of(part: _Part, inputs: Sequence[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """The part's placeholders that stand for body inputs (a layer's or the head's carry, the
    last, aside), each with the stitched graph's input it is."""
    ph = [n for n in part.gm.graph.nodes if n.op == "placeholder"]
    return [(node, inputs[k]) for node, k in zip(ph, part.positions)]


def _probed(copies: Sequence[_Copy], records: Sequence[LayerRecord], args: Sequence[torch.Tensor], last: torch.Tensor,
            shared: Mapping[str, torch.Tensor]) -> ProbeResult | None:
    """What each node of the stitched graph (its inputs aside) touches in memory: the
    embedding's and the head's by running their graphs, every layer's from what its recorded
    ops showed (the layer's graph nodes are those ops, one call each); ``None`` if a layer's
    graph holds a call that no recorded op made one of (then probe the whole graph)."""
    buffers = BufferMap.of(shared)
    result = ProbeResult()
    pre, *layers, post = copies

    def run(copy: _Copy, values: Sequence[torch.Tensor]) -> None:
        probe = MemoryProbe(copy.part.gm, shared)
        probe.run(*values)
        new = {n.name: copy.env[n] for n in copy.part.gm.graph.nodes if n.op not in ("placeholder", "output")}
        for name, touched in probe.result.touched.items():
            if name in new:
                result.touched[new[name].name] = touched
        result.changed += [(copy.env[n], b) for n, b in probe.result.changed]
        result.copies |= {new[n].name for n in probe.result.copies}

    run(pre, [args[k] for k in pre.part.positions])
    for copy, record in zip(layers, records, strict=True):
        part, env = copy.part, copy.env
        if len(part.nodes) != len(record.facts):
            return None
        made = set()
        for (op, _, _), nodes, facts in zip(record.ops, part.nodes, record.facts):
            calls = [n for n in nodes if n.op == "call_function"]
            main = [n for n in calls if n.target is not operator.getitem]
            if len(main) != 1 or main[0].target is not op:
                return None
            result.add(env[main[0]], facts)
            for n in calls[1:]:  # the elements of a list it returned (``unbind``, ``split``)
                if n.target is not operator.getitem or n.args[0] is not main[0] or type(n.args[1]) is not int:
                    return None
                if n.args[1] < len(facts.pieces) and facts.pieces[n.args[1]]:
                    result.touched[env[n].name] = facts.pieces[n.args[1]]
            made.update(calls)
        for node in part.gm.graph.nodes:
            if node.op == "call_function" and node not in made:
                return None
            if node.op == "get_attr":
                touched = buffers.touched_by(getattr(part.gm, str(node.target)))
                if touched:
                    result.touched[env[node].name] = touched
    run(post, [*[args[k] for k in post.part.positions], last])
    return result
