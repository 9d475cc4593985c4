"""A stage's graph analysed: what each node reads, and the writes to shared buffers refused.

The tracer analyses a stage on the example it ran on; ``bind`` analyses it again on the live
state. Both go through :func:`analysed`, so a stage's reads and its refused writes are decided
by one rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import fx

from readfence.effects import ReadfenceError

from .._program import SOURCE_KEY, Captured, StageGraph
from .._step import BODY, Stage
from ._alias import Analysis, Write, analyse
from ._escapes import OPAQUE_OP, is_value_escape
from ._memory import BufferMap
from ._origin import torch_op
from ._triton import is_launch_op, launch_of, launch_write_reason


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
    if node is None or not torch_op(node.target):  # a kernel someone registered, whatever its namespace
        why += (" (a torch.library.custom_op registered with mutates_args='unknown' claims to write "
                "every tensor argument: if the op only reads them, register it with mutates_args=())")
    return why


@attrs.frozen
class StageFacts:
    """What the analysis of one stage's graph goes on besides the graph: what its inputs and
    captured tensors alias, and what its nodes' real values touched."""

    initial: Mapping[str, frozenset[str]]  # placeholder -> buffers it aliases, in graph order
    captured: tuple[Captured, ...]
    memory: Mapping[str, frozenset[str]]  # node -> buffers its real value touched
    copies: frozenset[str] | None  # nodes whose real memory refutes their view claim; None: no memory
    changed: tuple[tuple[fx.Node, str], ...]  # (node, buffer whose bytes it changed)
    hidden: Mapping[str, frozenset[str]]  # higher-order op node -> buffers its branches captured
    # op node -> the argument nodes it pointed at a shared buffer's memory -> those buffers
    rebound: Mapping[str, Mapping[str, frozenset[str]]] = attrs.Factory(dict)


def analysed(backend: str, stage: Stage, gm: fx.GraphModule, facts: StageFacts, *,
             before: Iterable[StageGraph], inputs: Sequence[str], buffers: Iterable[str]) -> Analysis:
    """The stage's analysis, its writes to shared buffers refused (``StageWriteError``).

    The inputs that an earlier in-graph stage of ``before`` running its Python hands over are
    analysed as aliasing every shared buffer: on a path the trace did not take they may be views
    of any of them, so their consumers read every buffer (the annotations kept are these). Writes
    are checked on the traced aliases: like the Python stage's own writes on other paths, a write
    through such a view there is for the write guard to see.
    """
    result = _analyse(gm, facts.initial, facts, last=stage is BODY)
    _check_writes(backend, stage.name, gm, result, facts.changed)
    widen = _handed_over(before, inputs, facts.initial, buffers)
    if widen:
        result = _analyse(gm, {**facts.initial, **widen}, facts, last=stage is BODY)
    return result


def _analyse(gm: fx.GraphModule, initial: Mapping[str, frozenset[str]], facts: StageFacts, *, last: bool) -> Analysis:
    initial = {**initial, **{c.node: c.buffers for c in facts.captured}}
    return analyse(gm.graph, initial, escape_op=OPAQUE_OP, escape_reads=is_value_escape,
                   output_reads=last, observed=facts.memory, copies=facts.copies, hidden=facts.hidden,
                   rebound=facts.rebound)


def in_branches(gm: fx.GraphModule, buffers: BufferMap) -> dict[str, frozenset[str]]:
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


def _handed_over(before: Iterable[StageGraph], inputs: Iterable[str], placeholders: Iterable[str],
                 buffers: Iterable[str]) -> dict[str, frozenset[str]]:
    """Placeholder -> every buffer, for each input an in-graph stage of ``before`` that runs its
    Python function returns (its outputs are not copied; see ``_program``)."""
    python = {o for s in before if not s.analysis.faithful and s.stage.in_graph for o in s.graph.outputs}
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
