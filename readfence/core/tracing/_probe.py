"""What an op's real run shows of the shared buffers, whatever its schema claims.

The static analysis joins two sources: op schemas (``_alias``) and memory. The memory side is
one question asked of every op a traced stage runs on real tensors: which shared buffers its
output's memory touches, whose bytes it changed, and whether a view it claims is one (an op
whose output shares no memory with what it claims to alias copied it). :func:`probe_op`
answers it for one call; :class:`MemoryProbe` asks it of every node of a graph as
``fx.Interpreter`` runs it, and the recorder (``_record``) of every op a stage dispatches as it
runs, so a recorded graph needs no second run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import fx

from ._memory import BufferMap, leaves, metadata_claim_holds, tensors_in, view_claim_holds
from ._origin import trusted_op
from ._schema import bind as bind_arguments
from ._schema import op_aliasing


@attrs.frozen
class OpFacts:
    """What one op's run showed: the buffers its output touches, those whose bytes it changed,
    and whether its claim to read no data of a buffer it is given is refuted by its memory
    (``copied``: a view claim whose output is a copy, or a metadata claim, ``zeros_like``'s, whose
    output shares the argument's memory or changes with its bytes)."""

    touched: frozenset[str]
    changed: tuple[str, ...]
    copied: bool
    pieces: tuple[frozenset[str], ...] = ()  # of an output that is a list or tuple: per leaf
    # the arguments the op pointed at a shared buffer's memory (``set_``, ``as_strided_``, a kernel
    # that re-points its ``out``): ``(id(tensor), buffers it touches now and did not before)``
    rebound: tuple[tuple[int, frozenset[str]], ...] = ()


NO_FACTS = OpFacts(frozenset(), (), False)


def probe_op(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], buffers: BufferMap,
             shared: Mapping[str, torch.Tensor], run: Callable[[], Any],
             quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
             watch: frozenset[str] | None = None) -> tuple[Any, OpFacts]:
    """``run()`` (the call of ``op`` on ``args`` and ``kwargs``) and what it showed of ``shared``
    (named by ``buffers``, their memory map); the probe's own work runs in ``quiet()`` (a
    context that hides it from the modes watching the stage). ``watch``, when the caller
    knows it, is what the arguments touch (else their memory is looked at).

    A view claim is checked where it matters, on an op given memory of a shared buffer: one
    given none aliases none whether it copied or not. An op that may point a tensor it is given
    at other memory (one whose schema marks an argument written, or whose kernel is not torch's or
    readfence's own: ``_origin.trusted_op``) has its arguments' memory looked at again after it ran
    (``OpFacts.rebound``): the tensor then aliases what it points at, whatever the schema says.

    >>> table = torch.arange(6)
    >>> shared = {"table": table}
    >>> out, facts = probe_op(torch.ops.aten.narrow.default, (table, 0, 0, 2), {}, BufferMap.of(shared), shared,
    ...                       lambda: table.narrow(0, 0, 2))
    >>> facts
    OpFacts(touched=frozenset({'table'}), changed=(), copied=False, pieces=(), rebound=())
    """
    if watch is None:
        with quiet():
            watch = buffers.touched_by((args, kwargs))
    # an op given no memory of a buffer (most ops): only its output can show one
    aliasing = op_aliasing(op) if watch else None
    view = aliasing is not None and aliasing.is_view
    templates: list[torch.Tensor] = []
    if aliasing is not None and aliasing.metadata_args:
        with quiet():
            templates = metadata_templates(op, args, kwargs, aliasing.metadata_args, buffers)
    before: dict[str, torch.Tensor] = {}
    if watch and not view:
        with quiet():
            before = {b: shared[b].clone() for b in watch}
    given: list[tuple[torch.Tensor, frozenset[str]]] = []
    if _may_repoint(op):
        with quiet():
            given = [(t, buffers.touched(t)) for t in tensors_in((args, kwargs))]
    out = run()
    with quiet():
        copied = False
        if view:
            assert aliasing is not None
            values = bind_arguments(op, args, kwargs)
            outs = out if len(aliasing.outputs) > 1 else (out,)
            copied = not view_claim_holds(outs, [[values[i] for i in src] for src in aliasing.outputs])
        elif templates:
            copied = not metadata_claim_holds(out, templates, lambda ts: rerun_with(op, args, kwargs, templates, ts))
        touched = buffers.touched_by(out)
        changed = tuple(b for b, old in before.items() if not torch.equal(old, shared[b]))
        pieces = tuple(buffers.touched_by(x) for x in leaves(out)) if touched and isinstance(out, (list, tuple)) else ()
        rebound = tuple((id(t), now) for t, was in given if (now := buffers.touched(t) - was))
    if not touched and not changed and not copied and not rebound:
        return out, NO_FACTS
    return out, OpFacts(touched, changed, copied, pieces, rebound)


def _may_repoint(op: Any) -> bool:
    """Whether ``op`` may point a tensor it is given at other memory: its schema marks an argument
    written (``set_``, ``as_strided_``, ``resize_``, an ``out=``), or its kernel is someone else's
    (whose schema is only a claim)."""
    aliasing = op_aliasing(op)
    return aliasing is not None and (bool(aliasing.writes) or not trusted_op(op))


def metadata_templates(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any], positions: Sequence[int],
                       buffers: BufferMap) -> list[torch.Tensor]:
    """The tensors at schema ``positions`` (an op's metadata-only arguments) that touch a shared
    buffer: those whose metadata claim is worth checking on memory."""
    values = bind_arguments(op, args, kwargs)
    return [v for i in positions if isinstance(v := values[i], torch.Tensor) and buffers.touched(v)]


def rerun_with(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any], old: Sequence[torch.Tensor],
           new: Sequence[torch.Tensor]) -> Any:
    """``op`` called again with each tensor of ``old`` (by identity) replaced by its ``new``."""
    swap = {id(o): n for o, n in zip(old, new)}
    return op(*[swap.get(id(a), a) for a in args], **{k: swap.get(id(v), v) for k, v in kwargs.items()})


@attrs.define
class ProbeResult:
    """What running a graph showed, by node: ``touched`` (node name -> the buffers its value
    touches), ``changed`` (``(node, buffer)`` of every write the bytes showed), ``copies``
    (the nodes whose claim to read no data, a view's or a metadata-only op's, the memory refutes)
    and ``rebound`` (op node -> the argument nodes it pointed at a shared buffer's memory -> those
    buffers: their values alias them after that node)."""

    touched: dict[str, frozenset[str]] = attrs.Factory(dict)
    changed: list[tuple[fx.Node, str]] = attrs.Factory(list)
    copies: set[str] = attrs.Factory(set)
    rebound: dict[str, dict[str, frozenset[str]]] = attrs.Factory(dict)

    def add(self, node: fx.Node, facts: OpFacts, given: Mapping[int, fx.Node] | None = None) -> None:
        """Record ``facts`` as ``node``'s; an argument it re-pointed at a shared buffer
        (``facts.rebound``) in ``rebound``, by the node ``given`` maps its tensor's id to."""
        if facts.touched:
            self.touched[node.name] = facts.touched
        self.changed += [(node, b) for b in facts.changed]
        if facts.copied:
            self.copies.add(node.name)
        for tid, bufs in facts.rebound:
            arg = (given or {}).get(tid)
            if arg is not None:  # the argument's value aliases them from this node on
                moved = self.rebound.setdefault(node.name, {})
                moved[arg.name] = moved.get(arg.name, frozenset()) | bufs


class MemoryProbe(fx.Interpreter):
    """Runs a traced stage on real tensors, recording what each node's value touches in memory
    (:func:`probe_op` for every call), in ``result``.

    Independent of the schemas: a node whose output overlaps a shared buffer aliases it,
    whatever its schema says, and a node that changes a shared buffer's bytes writes it.
    """

    def __init__(self, gm: fx.GraphModule, shared: Mapping[str, torch.Tensor]) -> None:
        super().__init__(gm)
        self.shared = shared
        self.buffers = BufferMap.of(shared)
        self.result = ProbeResult()

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            out = super().run_node(n)
            touched = self.buffers.touched_by(out)
            if touched:
                self.result.touched[n.name] = touched
            return out
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out, facts = probe_op(n.target, args, kwargs, self.buffers, self.shared, lambda: super(MemoryProbe, self).run_node(n))
        given = {id(self.env[a]): a for a in n.all_input_nodes} if facts.rebound else None
        self.result.add(n, facts, given)
        return out

