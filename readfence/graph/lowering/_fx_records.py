"""FX pass: insert event records right after chosen nodes of a traced stage graph.

The inserted node calls ``device.record_here(event)``, so the event fires at exactly that
point of the (eager or replayed) stage. The pass also yields the stage's ``ops`` list (reads
and records in node order) that the device and its sanitizer see at enqueue time.

Each inserted call is a *hook* (``node.meta[HOOK_KEY]``, a key naming the anchor node and the
call's place after it): the compiled code calls it through a name each event-ring slot binds to
its own events (:func:`hooks_for`), and the validation of that code binds to nothing, so that
one compiled code serves every slot and is validated once without firing an event.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from torch import fx

from readfence.core.internal import copy_graph

from ..devices import Device, Event, Op, Read, Record
from ._fx_memory import HOOK_KEY, WRITES_KEY

RECORD_KEY = "readfence_record"


class _RecordHere:
    """The target of an inserted record node (a named callable, so FX code stays readable)."""

    def __init__(self, device: Any, event: Any) -> None:
        self.device, self.event = device, event
        self.__name__ = f"record_{event.name}".replace("/", "_").replace(":", "_").replace("#", "_")

    def __call__(self) -> None:
        self.device.record_here(self.event)


def hooks_for(after: Mapping[str, Sequence[Event]], device: Device | None,
              actions: Mapping[str, Sequence[Callable[[], object]]] | None = None) -> dict[Hashable, Callable[[], object]]:
    """The calls :func:`insert_records` inserts for ``after`` and ``actions``, by hook key: what
    code compiled from a graph with the same anchors binds for these events.

    >>> class Ev: name = "e"
    >>> sorted(hooks_for({"add": [Ev(), Ev()]}, None, {"add": [print]}))
    [('action', 'add', 0), ('record', 'add', 0), ('record', 'add', 1)]
    """
    hooks: dict[Hashable, Callable[[], object]] = {}
    for name, events in after.items():
        for i, event in enumerate(events):
            hooks[("record", name, i)] = _RecordHere(device, event)
    for name, acts in (actions or {}).items():
        for i, action in enumerate(acts):
            hooks[("action", name, i)] = action
    return hooks


def insert_records(
    gm: fx.GraphModule, after: Mapping[str, Sequence[Event]], device: Device | None,
    actions: Mapping[str, Sequence[Callable[[], object]]] | None = None,
) -> fx.GraphModule:
    """A copy of ``gm`` recording ``after[node]`` events (in order) right after each node,
    then calling ``actions[node]`` (plain callables, e.g. a check's poison, which may write
    anything) after them; each inserted call is a hook (see the module docstring).

    >>> import torch
    >>> gm = fx.symbolic_trace(lambda x: (x + 1) * 2)
    >>> class Dev:
    ...     fired = []
    ...     def record_here(self, ev): self.fired.append(ev.name)
    >>> class Ev: name = "e"
    >>> out = insert_records(gm, {"add": [Ev()]}, Dev())
    >>> out(torch.ones(1)).item(), Dev.fired
    (4.0, ['e'])
    """
    out = copy_graph(gm)
    graph = out.graph
    nodes = {n.name: n for n in graph.nodes}
    actions = actions or {}
    missing = [name for name in (*after, *actions) if name not in nodes]
    if missing:
        raise KeyError(f"cannot place records after unknown nodes {missing}")
    hooks = hooks_for(after, device, actions)
    for name in dict.fromkeys((*after, *actions)):
        anchor = nodes[name]
        for i, event in enumerate(after.get(name, ())):
            key = ("record", name, i)
            with graph.inserting_after(anchor):
                anchor = graph.call_function(hooks[key], ())
                anchor.meta[RECORD_KEY] = event
                anchor.meta[HOOK_KEY] = key
        for i in range(len(actions.get(name, ()))):
            key = ("action", name, i)
            with graph.inserting_after(anchor):
                anchor = graph.call_function(hooks[key], ())
                anchor.meta[HOOK_KEY] = key
                anchor.meta[WRITES_KEY] = True
    return out


def stage_ops(gm: fx.GraphModule, reads: Mapping[str, frozenset[str]], stage: str,
              hooks: Mapping[Hashable, Callable[[], object]] | None = None) -> tuple[Op, ...]:
    """The reads (``Read(buffer, "stage:node")``) and inserted records of ``gm``, in order; with
    ``hooks`` (:func:`hooks_for` of another slot's events), the records of those events."""
    ops: list[Op] = []
    for node in gm.graph.nodes:
        for buffer in sorted(reads.get(node.name, ())):
            ops.append(Read(buffer, f"{stage}:{node.name}"))
        if RECORD_KEY in node.meta:
            target = node.target if hooks is None else hooks[node.meta[HOOK_KEY]]
            assert isinstance(target, _RecordHere)
            ops.append(Record(target.event))
    return tuple(ops)
