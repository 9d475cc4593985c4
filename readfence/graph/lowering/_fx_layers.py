"""Compile pass: the layers of a body that compute alike become calls of one compiled function.

A deep model's body runs the same layer code in every layer: the recorder marks the nodes each
layer made (``core.internal.LAYER_KEY``, written while the scan runs that layer), and a 64-layer
body holds a few classes of layers, each repeated dozens of times. Compiled node by node, every
copy pays its memory analysis, its bindings and its lines of generated Python. :func:`outline_layers`
hands ``compile_graph`` a graph in which each layer's run of nodes is one call of a function
compiled once per class, where that is the same computation. A class is decided from the nodes
themselves, never from the layer's index or the backend's word:

* a run is a layer's nodes one after the other, all calls of functions, no inserted hook among
  them (an event, a poison, a check splits it);
* two runs are one class when they are the same ops, node for node, on arguments of the same
  structure (a node inside the run by its position there, one outside by the order it is first
  met, each constant equal, floats by their bits) with the same traced values' shapes, strides
  and dtypes, returning the same nodes; an integer that differs between the runs of a class (the
  layer's own slice of a pool) is an argument of the function, as the tensors are;
* the function runs every node of the run as traced, in order, on its arguments (no value is
  shared or folded inside it: the arguments of one call may be one memory), and the graph's
  memory analysis takes each call as writing the arguments its own analysis finds written (an op
  whose schema is not taken at its word, or a ``set_``, leaves the run node by node);
* a value every run of a class computes alike (a pure op on the same outside nodes, integers that
  do not vary, other such values: the causal mask each attention layer builds from the lengths)
  is computed once, before the class's first run, and handed to the function; the compile keeps
  that only where the compiled graph's memory analysis finds that value's memory and its
  arguments' unwritten (:func:`hoists_hold`), else it compiles the graph again without.

The lowering validates the code compiled from this graph, as it validates any.

>>> from readfence.backends import paged
>>> from readfence.core import BODY, ForwardMode, ModelConfig, trace
>>> from readfence.graph.lowering._fx_compile import compile_graph
>>> body = trace(paged(), ForwardMode.DECODE, cfg=ModelConfig(layers=3)).stage(BODY).graph.gm
>>> compile_graph(body).stats["layer_runs"]   # the three layers compute alike: one run each
3
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from readfence.core.internal import LAYER_KEY, add_node

from ._fx_keys import arg_key
from ._fx_memory import HOOK_KEY, UNKNOWN, GraphMemory
from ._fx_pieces import CompiledPiece, Outlined, Piece, rebuilt

#: How a class's function is compiled from the graph of its first run (every node kept, as traced).
CompileLayer = Callable[[fx.GraphModule], CompiledPiece]


class _Unshareable(Exception):
    """A run whose arguments cannot be compared with another's."""


def _runs(gm: fx.GraphModule) -> list[list[fx.Node]]:
    # each layer's nodes, one run a stretch of calls that no hook or other node breaks
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    layer: object = None
    for node in gm.graph.nodes:
        mark = node.meta.get(LAYER_KEY)
        if mark is None or node.op != "call_function" or HOOK_KEY in node.meta or mark != layer:
            if len(current) > 1:
                runs.append(current)
            current, layer = [], mark
            if mark is None or node.op != "call_function" or HOOK_KEY in node.meta:
                continue
        current.append(node)
    if len(current) > 1:
        runs.append(current)
    return runs


def _value_key(val: Any) -> Hashable:
    if isinstance(val, torch.Tensor):
        return ("tensor", tuple(val.shape), tuple(val.stride()), val.dtype, val.device.type)
    if isinstance(val, (list, tuple)):
        return (type(val).__name__, tuple(_value_key(v) for v in val))
    return type(val).__name__


class _Run:
    """A run's shape: its key (everything but its integers), its integers in order, the outside
    nodes it reads in the order first met, and the positions of the nodes it returns."""

    def __init__(self, nodes: list[fx.Node]) -> None:
        self.nodes = nodes
        self.position = position = {n: i for i, n in enumerate(nodes)}
        self.inputs: list[fx.Node] = []
        self.integers: list[int] = []
        inputs, integers = self.inputs, self.integers
        input_at: dict[fx.Node, int] = {}

        def node(value: fx.Node) -> Hashable:
            at = position.get(value)
            if at is not None:
                return at  # (a node of the run: its place; nothing else in a key is a bare int)
            k = input_at.get(value)
            if k is None:
                k = input_at[value] = len(inputs)
                inputs.append(value)
            return ("input", k)

        def integer(value: int) -> Hashable:
            integers.append(value)
            return "int"

        def arg(value: Any) -> Hashable:
            try:
                return arg_key(value, node, integer)
            except TypeError as e:
                raise _Unshareable from e

        steps = []
        self._integer_spans: list[tuple[int, int]] = []  # per node, the numbers of the integers it uses
        for n in nodes:
            first = len(integers)
            steps.append((n.target, arg(n.args), arg(n.kwargs) if n.kwargs else (), _value_key(n.meta.get("val"))))
            self._integer_spans.append((first, len(integers)))
        self.returned = tuple(i for i, n in enumerate(nodes) if any(u not in position for u in n.users))
        self.key: Hashable = (tuple(steps), self.returned, len(inputs), len(integers))

    def uses(self) -> list[tuple[set[int], set[int], set[int]]]:
        """Per node: the outside nodes and integers it uses (by their numbers in the run) and the
        nodes of the run (by place)."""
        input_at = {node: k for k, node in enumerate(self.inputs)}
        position = self.position
        return [({input_at[a] for a in n.all_input_nodes if a not in position}, set(range(*span)),
                 {position[a] for a in n.all_input_nodes if a in position})
                for n, span in zip(self.nodes, self._integer_spans)]


def _invariant(runs: Sequence[_Run], varying: Sequence[int], hoistable: Callable[[fx.Node], bool]) -> list[int]:
    """The positions of the nodes every run of a class computes alike: a pure op on the same
    outside nodes in every run, integers that do not vary and other such nodes (their memory
    never written: :func:`hoists_hold`, after the fact)."""
    first = runs[0]
    same = {k for k, node in enumerate(first.inputs) if all(r.inputs[k] is node for r in runs)}
    varies, chosen = set(varying), set[int]()
    for j, (node, (inputs, integers, made)) in enumerate(zip(first.nodes, first.uses())):
        if inputs <= same and not integers & varies and made <= chosen and hoistable(node):
            chosen.add(j)
    return sorted(chosen)


def _block(gm: fx.GraphModule, run: _Run, varying: Sequence[int], hoisted: Sequence[int]) -> fx.GraphModule:
    # the run's nodes as a graph of their own: its inputs, the integers that differ between the
    # runs of its class and the values computed once before its first run, as placeholders;
    # returning the nodes used after it
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, node in enumerate(run.inputs):
        env[node] = placeholder = graph.placeholder(f"input{k}")
        placeholder.meta["val"] = node.meta.get("val")
    integer = {i: graph.placeholder(f"integer{i}") for i in varying}
    for j in hoisted:
        env[run.nodes[j]] = placeholder = graph.placeholder(f"invariant{j}")
        placeholder.meta["val"] = run.nodes[j].meta.get("val")
    count = [0]

    def mapped(value: Any) -> Any:
        if type(value) is fx.Node:
            return env[value]
        if type(value) is int:
            at = count[0]
            count[0] += 1
            return integer.get(at, value)
        if isinstance(value, (list, tuple)):
            return type(value)(mapped(v) for v in value)
        if isinstance(value, dict):
            return {k: mapped(v) for k, v in value.items()}
        return value

    for node in run.nodes:  # (the same walk as the key's: integers are numbered alike)
        args, kwargs = mapped(node.args), mapped(node.kwargs)
        if node not in env:
            env[node] = copied = add_node(graph, "call_function", node.target, args, kwargs, node.name)
            copied.meta.update(node.meta)
    graph.output(tuple(env[run.nodes[i]] for i in _returned(run, hoisted)))
    return _LazyGraphModule(gm, graph)


def _returned(run: _Run, hoisted: Sequence[int]) -> tuple[int, ...]:
    held = set(hoisted)
    return tuple(i for i in run.returned if i not in held)


def _layer_piece(block: fx.GraphModule, run: _Run, hoisted: Sequence[int], compile_layer: CompileLayer) -> Piece | None:
    # the class's function, where the block's own memory analysis knows what it writes
    if any(torch.Tag.inplace_view in getattr(n.target, "tags", ()) for n in run.nodes):
        return None
    given = tuple(frozenset({("piece input", p)}) for p in range(len(block.graph.find_nodes(op="placeholder"))))
    memory = GraphMemory(block, given)
    if memory.opaque:
        return None
    positions = range(len(given))
    written = {p for p in positions if memory.find(("piece input", p)) in memory.written}
    if any(memory.find(UNKNOWN) == c for c in memory.written):
        written = set(positions)
    shares = tuple(tuple(p for p in positions if UNKNOWN in tokens or ("piece input", p) in tokens)
                   for tokens in memory.outputs())
    return Piece(compile_layer(block), _returned(run, hoisted), shares, writes=tuple(sorted(written)))


def outline_layers(gm: fx.GraphModule, compile_layer: CompileLayer,
                   hoistable: Callable[[fx.Node], bool] | None = None) -> tuple[fx.GraphModule, int, frozenset[str]]:
    """``gm`` with each layer's run whose class has more than one run (see the module docstring)
    replaced by one call of the class's function, how many runs were, and the names of the nodes
    computed once for every run of their class (``hoistable`` says which nodes may be: pure ops;
    none without it; :func:`hoists_hold` must confirm them on the new graph's memory analysis).
    ``gm`` itself where no run was (it is never changed). ``compile_layer`` compiles a class's
    graph."""
    classes: dict[Hashable, list[_Run]] = {}
    for nodes in _runs(gm):
        try:
            run = _Run(nodes)
        except _Unshareable:
            continue
        classes.setdefault(run.key, []).append(run)
    chosen: dict[fx.Node, Outlined] = {}
    hoisted_names: set[str] = set()
    for runs in classes.values():
        if len(runs) < 2:
            continue
        first = runs[0]
        varying = [i for i in range(len(first.integers)) if any(r.integers[i] != first.integers[i] for r in runs)]
        hoisted = _invariant(runs, varying, hoistable) if hoistable is not None else []
        piece = _layer_piece(_block(gm, first, varying, hoisted), first, hoisted, compile_layer)
        if piece is None:
            continue
        invariants = [first.nodes[j] for j in hoisted]
        hoisted_names.update(n.name for n in invariants)
        for run in runs:
            arguments: list[Any] = [*run.inputs, *(run.integers[i] for i in varying), *invariants]
            chosen[run.nodes[0]] = Outlined(
                piece, run.nodes, dict(enumerate(arguments)), before=tuple(invariants) if run is first else (),
                equal={} if run is first else {run.nodes[j]: first.nodes[j] for j in hoisted})
    if not chosen:
        return gm, 0, frozenset()
    outlined, count = rebuilt(gm, chosen, "layer")
    return outlined, count, frozenset(hoisted_names) if count else frozenset()


def hoists_hold(gm: fx.GraphModule | None, memory: GraphMemory | None, hoisted: frozenset[str]) -> bool:
    """Whether computing the nodes ``hoisted`` once, before the first run of their class, computes
    what each run did: no memory any of them or their arguments may be is written in ``gm`` (by
    ``memory``, the analysis of ``gm`` the compile made; ``None`` or opaque: not known)."""
    if not hoisted:
        return True
    if gm is None or memory is None or memory.opaque:
        return False
    nodes = [n for n in gm.graph.nodes if n.name in hoisted]
    if len(nodes) != len(hoisted):  # one a later pass made something else: not known
        return False
    return not memory.classes([*nodes, *(a for n in nodes for a in n.all_input_nodes)]) & memory.written


__all__ = ["hoists_hold", "outline_layers"]
