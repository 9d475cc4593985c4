"""Compile pass: every spliced call of a model piece becomes one call of the piece compiled once.

A deep model's body repeats its own pieces in every layer (norms, projections, rotary, the MLP:
``core.tracing.Segment``): the recorder records a piece once per input signature and splices that
template for every later call, so a 64-layer body holds the same few dozen nodes once per layer,
about half its nodes. Compiled node by node, every copy pays its memory analysis, its
simplification, its bindings and its lines of generated Python. :func:`outline_pieces` hands
``compile_graph`` a graph in which each spliced call is one call of its template compiled on its
own, once per template, where that is the same computation:

* the call's nodes are still exactly its template's (``Template.inputs_of``: the same targets and
  arguments, node for node, each input one node), one after the other, none kept in place (a
  read of a shared buffer) and no inserted hook among them, and nothing outside them uses a value
  the piece does not return;
* the template writes no memory, as the memory analysis of its own graph finds (from each op's
  schema, taken at its word only for torch's and readfence's own ops: any other makes it find
  nothing, and the call stays node by node).

The piece's call runs the same ops on the same values in the same order; what a call computes
inside it is its own (the simplifying pass does not share a value of one call with another). The
memory analysis takes the call at what was checked here (``PIECE_KEY``): it writes nothing, and
each value it returns may be memory of the arguments the piece's own analysis says (a view of an
input is that input's memory). The lowering validates the code compiled from this graph, as it
validates any.

>>> from readfence.backends import paged
>>> from readfence.core import BODY, ForwardMode, ModelConfig, trace
>>> from readfence.graph.lowering._fx_compile import _compile
>>> body = trace(paged(), ForwardMode.DECODE, cfg=ModelConfig(layers=3)).stage(BODY).graph.gm
>>> compile_piece = lambda graph, given: _compile(graph, frozenset(), True, True, given)
>>> outline_pieces(body, (), compile_piece)[1] in (6, 9)   # three a layer (layer 0's once an earlier trace made the templates)
True
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import attrs
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from readfence.core.internal import SPLICED_KEY, Template, add_node

from ._fx_memory import HOOK_KEY, PIECE_KEY, PIECE_WRITES_KEY, UNKNOWN, GraphMemory, InputMemory


class CompiledPiece(Protocol):
    """What this pass asks of a compiled piece (``compile_graph``'s ``CompiledGraph`` is one)."""

    fn: Callable[..., Any]
    computation: str
    memory: GraphMemory | None


#: How a piece's graph is compiled, given what each of its inputs holds (``compile_graph``'s ``inputs``).
CompilePiece = Callable[[fx.GraphModule, tuple[InputMemory, ...]], CompiledPiece]


class Piece:
    """A template compiled on its own (``compiled``): called with its inputs' values, in the
    order of the segment's inputs, it returns the tuple of its outputs (``returned``: which of the
    template's nodes). Its ``repr`` names the code it runs (a digest of its ``computation``), so
    that the code of a graph that calls it says what it computes."""

    def __init__(self, compiled: CompiledPiece, returned: tuple[int, ...], shares: tuple[tuple[int, ...], ...],
                 writes: tuple[int, ...] = ()) -> None:
        self.fn, self.returned, self.computation = compiled.fn, returned, compiled.computation
        self.shares = shares  # per value returned, the inputs (by position) it may be memory of
        self.writes = writes  # the inputs (by position) whose memory it may write
        # (a name as FX's own code generation asks of a call's target)
        self.__name__ = self.__qualname__ = f"piece_{hashlib.sha1(compiled.computation.encode()).hexdigest()[:16]}"

    def __call__(self, *inputs: Any) -> Any:
        return self.fn(*inputs)

    def __repr__(self) -> str:
        return f"<{self.__name__}>"


def outline_pieces(gm: fx.GraphModule, keep: Collection[str], compile_piece: CompilePiece,
                   ) -> tuple[fx.GraphModule, int]:
    """``gm`` with each spliced call that may be one call of its template compiled once (see the
    module docstring) replaced by that call and a ``getitem`` per value it returns, and how many
    calls were; ``gm`` itself where none may (it is never changed). ``keep`` names the nodes that
    stay where they are; ``compile_piece`` compiles a template's graph (through the passes, which
    say what each value it returns may be memory of)."""
    calls: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        mark = node.meta.get(SPLICED_KEY)
        if mark is not None:
            calls.setdefault(mark.call, []).append(node)
    pieces: dict[int, Piece | None] = {}  # by template (identity)
    chosen: dict[fx.Node, Outlined] = {}
    for nodes in calls.values():
        template = nodes[0].meta[SPLICED_KEY].template
        inputs = _call_inputs(nodes, template, keep)
        if inputs is None:
            continue
        if id(template) not in pieces:
            pieces[id(template)] = _piece(template, inputs, compile_piece)
        piece = pieces[id(template)]
        if piece is not None:
            chosen[nodes[0]] = Outlined(piece, nodes, inputs)
    if not chosen:
        return gm, 0
    return rebuilt(gm, chosen, "piece")


def _call_inputs(nodes: list[fx.Node], template: Template, keep: Collection[str]) -> dict[int, fx.Node] | None:
    # the nodes of one splice, as its template made them, else None
    if [n.meta[SPLICED_KEY].index for n in nodes] != list(range(len(template.nodes))):
        return None
    if any(a.next is not b for a, b in zip(nodes, nodes[1:])):  # one after the other: no hook among them
        return None
    if any(n.name in keep or HOOK_KEY in n.meta or n.meta[SPLICED_KEY].template is not template for n in nodes):
        return None
    inputs = template.inputs_of(nodes)
    if inputs is None:
        return None
    inside, returned = set(nodes), {nodes[i] for i in template.returned}
    if any(user not in inside for n in nodes if n not in returned for user in n.users):
        return None
    return inputs


def _piece(template: Template, inputs: dict[int, fx.Node], compile_piece: CompilePiece) -> Piece | None:
    # the template compiled on its own, where its own memory analysis finds it writes nothing (an op
    # whose schema is not taken at its word makes the analysis opaque; ``set_`` writes its tensor)
    graph, returned = template.graph({i: node.meta.get("val") for i, node in inputs.items()})
    given = tuple(frozenset({("piece input", position)}) for position in range(len(inputs)))
    compiled = compile_piece(graph, given)
    memory = compiled.memory
    if memory is None or memory.opaque or memory.written:
        return None
    shares = tuple(tuple(p for p in range(len(inputs)) if UNKNOWN in tokens or ("piece input", p) in tokens)
                   for tokens in memory.outputs())
    return Piece(compiled, returned, shares)


@attrs.frozen(eq=False)
class Outlined:
    """A run of ``nodes`` made one call of ``piece`` on ``inputs`` (by position: nodes or other
    values), after ``before`` (nodes of the run copied as they are, ahead of the call: values the
    piece takes as inputs); ``equal`` maps each node of the run computed by an earlier copy to it."""

    piece: Piece
    nodes: list[fx.Node]
    inputs: Mapping[int, Any]
    before: tuple[fx.Node, ...] = ()
    equal: Mapping[fx.Node, fx.Node] = attrs.field(factory=dict)


def rebuilt(gm: fx.GraphModule, chosen: Mapping[fx.Node, Outlined], prefix: str) -> tuple[fx.GraphModule, int]:
    """A new graph: every node of ``gm`` copied under its own name, each chosen run of nodes (by
    its first) one call named ``prefix...`` and a ``getitem`` per value it returns; and how many
    calls."""
    names = {n.name for n in gm.graph.nodes}
    while any(name.startswith(prefix) for name in names):
        prefix += "_"
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    skipped: set[fx.Node] = set()
    count = 0

    def copy(node: fx.Node) -> fx.Node:
        env[node] = copied = add_node(graph, node.op, node.target, fx.node.map_arg(node.args, env.__getitem__),
                                      fx.node.map_arg(node.kwargs, env.__getitem__), node.name, node.type)
        copied.meta.update(node.meta)
        return copied

    for node in gm.graph.nodes:
        if node in skipped:
            continue
        hit = chosen.get(node)
        if hit is None:
            if copy(node).name != node.name:  # (names are what ``keep`` and the hooks' sites say)
                return gm, 0
            continue
        for early in hit.before:
            copy(early)
        for later, earlier in hit.equal.items():
            env[later] = env[earlier]
        piece, nodes, inputs = hit.piece, hit.nodes, hit.inputs
        call = add_node(graph, "call_function", piece,
                        tuple(env[v] if isinstance(v, fx.Node) else v for v in (inputs[i] for i in sorted(inputs))),
                        {}, f"{prefix}{count}")
        call.meta[PIECE_KEY] = piece.shares
        call.meta[PIECE_WRITES_KEY] = piece.writes
        for k, index in enumerate(piece.returned):
            out = add_node(graph, "call_function", operator.getitem, (call, k), {}, f"{prefix}{count}_{k}")
            out.meta.update((key, v) for key, v in nodes[index].meta.items() if key != SPLICED_KEY)
            env[nodes[index]] = out
        skipped.update(nodes)
        count += 1
    return _LazyGraphModule(gm, graph), count


__all__ = ["Outlined", "Piece", "outline_pieces", "rebuilt"]
