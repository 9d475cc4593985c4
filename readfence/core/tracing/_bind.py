"""A traced program bound to the live state it runs on: its captured tensors matched against
that state's memory, and every stage analysed again with what it touches there.

A program is traced on an example state; lowering runs it on the engine's own. What a captured
tensor is (a live shared buffer, a pool, a constant the backend keeps) is a fact about the live
state, so :func:`bind` decides it again there, once per program and place in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import fx

from .._program import MatchedOn, Program, StageGraph, flatten_inputs
from ._analysis import StageFacts, analysed, in_branches
from ._cache import CACHES
from ._captured import bind_captured
from ._fx import copy_graph
from ._memory import BufferMap, meet_shared, tensors_in
from ._origin import torch_op
from ._probe import MemoryProbe
from ._triton import is_launch_op


@attrs.frozen
class BoundKey:
    """What a bound program depends on: the traced ``program`` (by identity: a trace of other
    code or other settings is another program) and where the live state is (:func:`state_key`)."""

    program: Program
    state: tuple[tuple[Any, ...], ...]


#: Bound programs (:func:`bind`), the oldest forgotten first.
_BOUND = CACHES.table("bound", BoundKey, "the program with its captured tensors matched on a live state",
                      limit=256)


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
    >>> from readfence.core import ForwardMode, trace
    >>> prog = trace(paged(), ForwardMode.DECODE)
    >>> bind(prog, {"shared": {}, "pools": {}, "params": {}}) is prog
    True
    """
    if not program.captured():
        return program
    meet_shared(state["shared"])  # a tensor another backend kept of this state is known for one
    key = BoundKey(program, state_key(state))
    hit: Program | None = _BOUND.get(key)
    return hit if hit is not None else _BOUND.put(key, _bind(program, state))


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
        a, g = s.analysis, s.graph
        initial = {node: aliases | carried.get(dotted, frozenset())
                   for node, dotted, aliases in zip(a.initial, g.inputs, a.initial.values(), strict=True)}
        if not a.captured and initial == a.initial:
            stages.append(s)
            continue
        gm = copy_graph(g.gm)
        captured = tuple(c if c.state is MatchedOn.LIVE else bind_captured(c, getattr(gm, c.target), shared, owned)
                         for c in a.captured)
        memory, changed, rebound = _live_memory(s, gm, state)
        live = in_branches(gm, shared)
        hidden = {n: a.hidden.get(n, frozenset()) | live.get(n, frozenset()) for n in {*a.hidden, *live}}
        facts = StageFacts(initial=initial, captured=captured, memory=memory, copies=a.copies, changed=tuple(changed),
                           hidden=hidden, rebound=rebound)
        result = analysed(program.backend, s.stage, gm, facts, before=stages, inputs=g.inputs, buffers=program.buffers)
        # (the out-of-graph stage's outputs are its copies into the graph: they alias nothing)
        carried.update(zip(g.outputs, result.output_aliases, strict=True))
        analysis = attrs.evolve(a, reads=result.reads, unknown=result.unknown, opaque=result.opaque, captured=captured,
                                initial=initial)
        stages.append(attrs.evolve(s, graph=attrs.evolve(g, gm=gm), analysis=analysis))
    return attrs.evolve(program, stages=tuple(stages))


def _live_memory(s: StageGraph, gm: fx.GraphModule, state: Mapping[str, Mapping[str, torch.Tensor]],
                 ) -> tuple[dict[str, frozenset[str]], list[tuple[fx.Node, str]], dict[str, dict[str, frozenset[str]]]]:
    """What ``s``'s nodes touch of the live shared buffers, joined with what they touched of the
    example's, and the live buffers a node changed: the stage (its captured tensors being live
    memory) run once more on its example inputs. A handle made on a captured buffer
    (``torch.empty(0).set_(table)``) aliases the live buffer though no schema says so; only
    the memory does. So does an argument an op pointed at a live buffer (``rebound``). Everything
    in ``state`` holds its values again afterwards."""
    rebound = {op: dict(moved) for op, moved in s.analysis.rebound.items()}
    if s.hooks.example is None or not s.analysis.faithful:
        return dict(s.analysis.memory), [], rebound
    if not _may_touch(gm, s.hooks.example, BufferMap.of(state["shared"])):
        return dict(s.analysis.memory), [], rebound  # the run would show nothing of the live buffers: it is not made
    saved = [(t, t.clone()) for group in state.values() for t in group.values() if isinstance(t, torch.Tensor)]
    probe = MemoryProbe(gm, state["shared"])
    try:
        probe.run(*s.hooks.example)
    finally:
        for t, old in saved:
            t.copy_(old)
    memory = dict(s.analysis.memory)
    for node, touched in probe.result.touched.items():
        memory[node] = memory.get(node, frozenset()) | touched
    for op, moved in probe.result.rebound.items():
        mine = rebound.setdefault(op, {})
        for arg, bufs in moved.items():
            mine[arg] = mine.get(arg, frozenset()) | bufs
    return memory, probe.result.changed, rebound


def _own_memory(op: object) -> bool:
    """Whether ``op``'s outputs are memory of its arguments or fresh memory: one of torch's own
    (:func:`~readfence.core.tracing._origin.torch_op`: by where it was registered, not its
    namespace, into which anyone may register a fragment) or a triton launch (which touches only
    its arguments, bounded by them, and returns nothing).

    >>> _own_memory(torch.ops.aten.add.Tensor), _own_memory(print)
    (True, False)
    """
    return torch_op(op) or is_launch_op(op)


def _may_touch(gm: fx.GraphModule, example: tuple[torch.Tensor, ...], shared: BufferMap) -> bool:
    """Whether a run of ``gm`` on ``example`` could touch the memory of ``shared``: some tensor it
    can reach (an input, a tensor it holds: their whole storages) overlaps it, or it calls an op
    that may reach other memory (a custom op closing over a tensor, a higher-order op). Where it
    cannot, :func:`_live_memory`'s run would show nothing (decided from memory, without running
    the stage: an interpreted triton kernel's run costs seconds).

    >>> table = torch.arange(4)
    >>> gm = fx.symbolic_trace(lambda x: x + 1)
    >>> live = BufferMap.of({"req_to_token": table})
    >>> _may_touch(gm, (torch.zeros(4),), live), _may_touch(gm, (table[:0],), live)  # (an empty view: its storage)
    (False, True)
    """
    held = [*gm.parameters(), *gm.buffers()] + [v for m in gm.modules() for v in vars(m).values()
                                                  if isinstance(v, torch.Tensor)]
    for t in [*tensors_in(example), *held]:
        if t.layout is not torch.strided or t.is_meta or shared.touched(_storage_of(t)):
            return True
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            return True
        if node.op == "call_function" and not (_own_memory(node.target)
                                               or getattr(node.target, "__module__", None) == "_operator"):
            return True
    return False


def _storage_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, as bytes (a view reaches all of it through ``as_strided``)."""
    with torch._C.DisableTorchFunction():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
