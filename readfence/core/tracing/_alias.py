"""Alias and read analysis over a traced (non-functionalized) FX graph, from op schemas.

Each node gets the set of shared buffers its value may alias (an over-approximation, which is
sound): what torch's schema alias oracle says its outputs may contain (``_schema``), joined
with what its real value was seen to touch in memory when the graph was executed on the
example (``observed``; the tracer passes it when it traces real tensors). Pure views
propagate aliases and read nothing; an argument an op uses only for its metadata
(``zeros_like``'s ``self``: ``OpAliasing.metadata_args``) is not read; every other op reads the
buffers its tensor arguments alias, including list arguments (the pieces of
``split``/``chunk``/``unbind``). An argument
the schema marks as written, and aliasing a shared buffer, is a write: the caller turns it
into ``StageWriteError``. Ops the analysis cannot reason about (no schema, an argument of an
opaque type) make the buffers they touch ``UNKNOWN``; escapes (``readfence::opaque`` nodes)
are reported to the caller, which decides what they mean. A collective reads its inputs until
the wait of its output (``_collectives``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from torch import fx
from torch._ops import HigherOrderOperator

from .._program import ALIASES_KEY, ESCAPE, OPAQUE_KEY, READS_KEY
from ._collectives import hidden_writes, inert, is_wait, starts_collective
from ._schema import bind, moves_metadata_only, op_aliasing

Aliases = frozenset[str]
_EMPTY: Aliases = frozenset()


@attrs.frozen
class Write:
    """A node that writes shared buffers: what its schema says of the written arguments."""

    node: str
    op: str
    buffers: frozenset[str]
    schema: str = ""
    arguments: tuple[str, ...] = ()


@attrs.frozen
class Analysis:
    reads: dict[str, frozenset[str]]  # node -> buffers, graph order, only non-empty
    opaque: dict[str, str]  # node -> why
    unknown: frozenset[str]
    writes: tuple[Write, ...]
    output_aliases: tuple[Aliases, ...]
    escapes: dict[str, frozenset[str]]  # escape node -> the buffers of the escaping tensor


def _node_refs(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


def _made_here(value: Any) -> bool:
    """Whether ``value`` is a tensor the stage's own ops made (a view of a buffer, say), not one it
    was handed or captured (a state's buffer itself: its shape is another party's)."""
    return isinstance(value, fx.Node) and value.op == "call_function"


def analyse(
    graph: fx.Graph,
    initial: Mapping[str, Aliases],
    *,
    escape_op: Callable[..., object] | None = None,
    escape_reads: Callable[[fx.Node], bool] = lambda node: False,
    output_reads: bool = False,
    observed: Mapping[str, Aliases] | None = None,
    copies: frozenset[str] | None = None,
    hidden: Mapping[str, Aliases] | None = None,
    rebound: Mapping[str, Mapping[str, Aliases]] | None = None,
) -> Analysis:
    """Annotate ``graph``'s nodes with ``READS_KEY``, ``ALIASES_KEY`` (and ``OPAQUE_KEY``) in place.

    ``initial`` maps placeholder / get_attr node names to the shared buffers they alias.
    ``escape_op`` marks an escape of its first argument; ``escape_reads(node)`` says whether
    that escape is a read of the value there and then (``item()``) rather than a reference
    leaving the graph (``data_ptr()``: the buffer becomes ``UNKNOWN``). With ``output_reads``
    the output node reads what the outputs alias (they are consumed after the stage: copied
    into the graph, or read as the step's logits). ``observed`` maps node names to the
    buffers their real value touched in memory; it is joined into the aliases.

    A view claim is a claim: ``copies`` names the nodes whose schema claims a view but whose
    real output shares no memory with the inputs it claims (the memory probe's finding): they
    copied, so they read what they were given and alias nothing. So is a metadata claim: a node
    in ``copies`` whose op claims to use an argument for its metadata only reads it. Without memory (``copies``
    ``None``: fake tensors), a claim no annotation makes (``Tensor[] -> Tensor[]``: the oracle's
    worst case) counts both ways: the op may alias its inputs and may read them.

    ``hidden`` maps a node to the buffers it reaches other than through its arguments (the
    tensors a higher-order op's branch graphs captured): they count as its arguments.

    ``rebound`` maps a node to the argument nodes whose value its real run pointed at other memory
    (``set_``, ``as_strided_``, a kernel re-pointing the ``out`` it is given), to the buffers that
    memory is: from that node on, the argument's value aliases them too, whatever the schema says.
    """
    alias: dict[fx.Node, Aliases] = {}
    seen = observed or {}
    reads: dict[str, frozenset[str]] = {}
    opaque: dict[str, str] = {}
    escapes: dict[str, frozenset[str]] = {}
    unknown: set[str] = set()
    writes: list[Write] = []
    # a started collective -> the buffers it may still read until its output is waited for
    pending: dict[fx.Node, Aliases] = {}

    def al(v: Any) -> Aliases:
        out: set[str] = set()
        for n in _node_refs(v):
            out |= alias.get(n, _EMPTY)
        return frozenset(out)

    def pending_of(v: Any) -> Aliases:
        out: set[str] = set()
        for n in _node_refs(v):
            out |= pending.get(n, _EMPTY)
        return frozenset(out)

    def mark(node: fx.Node, bufs: Aliases) -> None:
        node.meta[READS_KEY] = bufs
        if bufs:
            reads[node.name] = bufs

    def mark_opaque(node: fx.Node, why: str) -> None:
        node.meta[OPAQUE_KEY] = why
        opaque[node.name] = why

    output_aliases: tuple[Aliases, ...] = ()
    moved = rebound or {}
    by_name = {n.name: n for n in graph.nodes} if moved else {}
    previous: fx.Node | None = None
    for node in graph.nodes:
        if previous is not None and previous.name in moved:  # what the node before re-pointed
            _repoint(alias, by_name, moved[previous.name])
        previous = node
        if node.op in ("placeholder", "get_attr"):
            alias[node] = frozenset(initial.get(node.name, _EMPTY)) | seen.get(node.name, _EMPTY)
            mark(node, _EMPTY)
            continue
        if node.op == "output":
            outs = node.args[0]
            seq = outs if isinstance(outs, (tuple, list)) else (outs,)
            output_aliases = tuple(al(o) for o in seq)
            leaked = pending_of(outs)
            mark(node, (al(outs) if output_reads else _EMPTY) | leaked)
            if leaked:  # a collective not waited for here: its reads last until no one knows when
                mark_opaque(node, "a collective leaves the stage before its wait")
                unknown.update(leaked)
            continue
        target = node.target
        everything = al((node.args, node.kwargs)) | (hidden or {}).get(node.name, _EMPTY)
        if node.op == "call_function" and target is operator.getitem:
            # a piece of a list or tuple output: it may alias whatever the container holds
            alias[node] = al(node.args[0]) | seen.get(node.name, _EMPTY)
            if node.args[0] in pending:  # a piece of a started collective's outputs
                pending[node] = pending[node.args[0]]
            mark(node, _EMPTY)
            continue
        if node.op == "call_function" and escape_op is not None and target is escape_op:
            escaping = al(node.args[0])
            alias[node] = _EMPTY
            escapes[node.name] = escaping
            mark(node, escaping)
            mark_opaque(node, f"{ESCAPE}{node.args[1] if len(node.args) > 1 else target}")
            if not escape_reads(node):
                unknown.update(escaping)
            continue
        if not everything and not pending and node.name not in seen:
            # given nothing that may alias a buffer (most nodes): it reads, writes and aliases
            # none, whatever its schema says (what follows would find exactly that)
            alias[node] = _EMPTY
            mark(node, _EMPTY)
            continue
        aliasing = op_aliasing(target) if node.op == "call_function" else None
        values = bind(target, node.args, node.kwargs) if aliasing is not None else []
        if aliasing is None or (aliasing.opaque and not all(inert(values[i]) for i in aliasing.opaque_args)):
            alias[node] = everything | seen.get(node.name, _EMPTY)
            mark(node, everything)
            if everything:
                # a higher-order op, a call_module/call_method, a Python callable, or an op
                # taking a Python object: the analysis cannot tell what it does with them
                why = f"opaque argument type in {aliasing.name}" if aliasing else (
                    f"higher-order op {target.name()}: the analysis does not look into its branches"
                    if isinstance(target, HigherOrderOperator) else f"no schema: {getattr(target, '__name__', target)}")
                mark_opaque(node, why)
                unknown.update(everything)
            continue
        arg_aliases = [al(v) for v in values]
        written: set[str] = set()
        write_args = aliasing.writes + hidden_writes(target)
        if write_args[:1] == (0,) and _made_here(values[0]) and moves_metadata_only(target):
            write_args = write_args[1:]  # a view the stage made, re-shaped or re-pointed: no byte written
        for i in write_args:
            written |= arg_aliases[i]
        outs = [frozenset().union(*(arg_aliases[i] for i in sources)) for sources in aliasing.outputs]
        if is_wait(target):  # it returns its argument itself, whatever its schema says
            outs = [arg_aliases[0]]
        alias[node] = frozenset().union(*outs) | seen.get(node.name, _EMPTY)
        if written:
            schema = target._schema
            names = tuple(schema.arguments[i].name for i in write_args if arg_aliases[i])
            writes.append(Write(node.name, str(target), frozenset(written), str(schema), names))
        view = aliasing.is_view or moves_metadata_only(target)  # (an in-place view op reads no byte either)
        refuted = copies is not None and node.name in copies  # its claim to read no data, on memory
        if view and (refuted or (copies is None and not aliasing.annotated)):
            view = False  # not a view after all, or maybe not: it reads its inputs
            if copies is not None:  # a copy: its output aliases only what it really touched
                alias[node] = seen.get(node.name, _EMPTY)
        read = _EMPTY if view else everything
        if aliasing.metadata_args and not view and not refuted:
            # it uses those arguments' shape, dtype and strides only (``zeros_like``): it reads
            # what its other arguments alias (and, for a higher-order op, what it reaches)
            read = frozenset().union(*(arg_aliases[i] for i in aliasing.data_args(len(values))),
                                     (hidden or {}).get(node.name, _EMPTY))
        if starts_collective(target):
            pending[node] = everything
        elif view or is_wait(target):  # a view of a pending output stays pending
            carried = pending_of((node.args, node.kwargs))
            if is_wait(target):
                read |= carried
            elif carried:
                pending[node] = carried
        mark(node, read)
    if previous is not None and previous.name in moved:
        _repoint(alias, by_name, moved[previous.name])
    for node, aliases in alias.items():  # what the replay's alias check holds each value to
        node.meta[ALIASES_KEY] = aliases
    return Analysis(reads, opaque, frozenset(unknown), tuple(writes), output_aliases, escapes)


def _repoint(alias: dict[fx.Node, Aliases], nodes: Mapping[str, fx.Node], moved: Mapping[str, Aliases]) -> None:
    # an argument an op pointed at a shared buffer aliases it from there on (its node is what later
    # uses of the tensor refer to)
    for name, bufs in moved.items():
        node = nodes.get(name)
        if node is not None:
            alias[node] = alias.get(node, _EMPTY) | bufs
