"""Alias and read analysis over a traced (non-functionalized) FX graph, from op schemas.

Each node gets the set of shared buffers its value may alias (storage identity, an
over-approximation, which is sound). Views propagate aliases and read nothing; every other
op reads the buffers its tensor arguments alias. Schema alias info with ``is_write`` on an
argument aliasing a shared buffer is a write: the caller turns it into ``StageWriteError``.
Ops without a schema the analysis can reason about (higher-order ops, opaque arguments, the
``readfence::opaque`` escape marker) make the buffers they touch ``UNKNOWN``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import fx

from ._program import OPAQUE_KEY, READS_KEY

Aliases = frozenset[str]
_EMPTY: Aliases = frozenset()


@attrs.frozen
class Write:
    node: str
    op: str
    buffers: frozenset[str]


@attrs.frozen
class Analysis:
    reads: dict[str, frozenset[str]]  # node -> buffers, graph order, only non-empty
    opaque: dict[str, str]  # node -> why
    unknown: frozenset[str]
    writes: tuple[Write, ...]
    output_aliases: tuple[Aliases, ...]


def _node_refs(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


def _is_opaque_type(ty: torch._C.JitType) -> bool:  # type: ignore[name-defined]
    kind = ty.kind()
    if kind in ("AnyType", "ClassType", "InterfaceType", "PyObjectType", "CapsuleType"):
        return True
    if kind in ("OptionalType", "ListType"):
        return _is_opaque_type(ty.getElementType())
    if kind == "TupleType":
        return any(_is_opaque_type(t) for t in ty.elements())
    return False


def _bind(schema: torch._C.FunctionSchema, node: fx.Node) -> list[tuple[Any, Any]]:  # type: ignore[name-defined]
    """``[(schema argument, value)]`` for the arguments the node passes."""
    bound = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            bound.append((arg, node.kwargs[arg.name]))
    return bound


def analyse(
    graph: fx.Graph,
    initial: Mapping[str, Aliases],
    *,
    opaque_ops: frozenset[Any] = frozenset(),
    output_reads: bool = False,
) -> Analysis:
    """Annotate ``graph``'s nodes with ``READS_KEY`` (and ``OPAQUE_KEY``) in place.

    ``initial`` maps placeholder / get_attr node names to the shared buffers they alias.
    ``opaque_ops`` are op overloads that mark an escape (their tensor arguments' buffers go
    ``UNKNOWN``). With ``output_reads`` the output node reads what the outputs alias (the
    step's consumer reads them after the forward).
    """
    alias: dict[fx.Node, Any] = {}
    reads: dict[str, frozenset[str]] = {}
    opaque: dict[str, str] = {}
    unknown: set[str] = set()
    writes: list[Write] = []

    def al(v: Any) -> Aliases:
        out: set[str] = set()
        for n in _node_refs(v):
            a = alias.get(n, _EMPTY)
            if isinstance(a, tuple):
                for x in a:
                    out |= x
            else:
                out |= a
        return frozenset(out)

    def mark(node: fx.Node, bufs: Aliases) -> None:
        node.meta[READS_KEY] = bufs
        if bufs:
            reads[node.name] = bufs

    def mark_opaque(node: fx.Node, bufs: Aliases, why: str) -> None:
        node.meta[OPAQUE_KEY] = why
        opaque[node.name] = why
        unknown.update(bufs)

    output_aliases: tuple[Aliases, ...] = ()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            alias[node] = frozenset(initial.get(node.name, _EMPTY))
            mark(node, _EMPTY)
            continue
        if node.op == "output":
            outs = node.args[0]
            seq = outs if isinstance(outs, (tuple, list)) else (outs,)
            output_aliases = tuple(al(o) for o in seq)
            mark(node, al(outs) if output_reads else _EMPTY)
            continue
        target = node.target
        if node.op == "call_function" and target is operator.getitem:
            src, idx = node.args[0], node.args[1]
            a = alias.get(src, _EMPTY) if isinstance(src, fx.Node) else _EMPTY
            alias[node] = a[idx] if isinstance(a, tuple) and isinstance(idx, int) and idx < len(a) else (
                frozenset().union(*a) if isinstance(a, tuple) else a
            )
            mark(node, _EMPTY)
            continue
        everything = al((node.args, node.kwargs))
        schema = getattr(target, "_schema", None) if node.op == "call_function" else None
        if node.op == "call_function" and target in opaque_ops:
            alias[node] = _EMPTY
            mark(node, everything)
            mark_opaque(node, everything, f"escape: {node.args[1] if len(node.args) > 1 else target}")
            continue
        if schema is None:
            if not everything:
                alias[node] = _EMPTY
                mark(node, _EMPTY)
                continue
            # a higher-order op, a call_module/call_method, or a python callable in the graph
            alias[node] = everything
            mark(node, everything)
            mark_opaque(node, everything, f"no schema: {getattr(target, '__name__', target)}")
            continue
        bound = _bind(schema, node)
        if any(_is_opaque_type(arg.type) for arg, _ in bound):
            alias[node] = everything
            mark(node, everything)
            mark_opaque(node, everything, f"opaque argument type in {schema.name}")
            continue
        written: set[str] = set()
        sets_of: dict[str, set[str]] = {}  # alias set letter -> buffers of the args in it
        is_view = bool(schema.returns)
        for arg, value in bound:
            info = arg.alias_info
            a = al(value)
            if info is not None:
                if info.is_write:
                    written |= a
                for letter in info.before_set:
                    sets_of.setdefault(letter, set()).update(a)
        outs: list[Aliases] = []
        for ret in schema.returns:
            info = ret.alias_info
            if info is None:
                is_view = False
                outs.append(_EMPTY)
                continue
            if info.is_write:
                is_view = False
            got: set[str] = set()
            for letter in info.before_set:
                got |= sets_of.get(letter, set())
            outs.append(frozenset(got))
        if written:
            writes.append(Write(node.name, str(target), frozenset(written)))
        alias[node] = outs[0] if len(outs) == 1 else tuple(outs)
        mark(node, _EMPTY if is_view and not written else everything)
    return Analysis(reads, opaque, frozenset(unknown), tuple(writes), output_aliases)
