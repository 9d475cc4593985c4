"""FX pass: insert event records right after chosen nodes of a traced stage graph.

The inserted node calls ``device.record_here(event)``, so the event fires at exactly that
point of the (eager or replayed) stage. The pass also yields the stage's ``ops`` list (reads
and records in node order) that the device and its sanitizer see at enqueue time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

from readfence.core.internal import copy_graph

from ..devices import Device, Event, Op, Read, Record

RECORD_KEY = "readfence_record"


class _RecordHere:
    """The target of an inserted record node (a named callable, so FX code stays readable)."""

    def __init__(self, device: Any, event: Any) -> None:
        self.device, self.event = device, event
        self.__name__ = f"record_{event.name}".replace("/", "_").replace(":", "_").replace("#", "_")

    def __call__(self) -> None:
        self.device.record_here(self.event)


def insert_records(
    gm: fx.GraphModule, after: Mapping[str, Sequence[Event]], device: Device,
    actions: Mapping[str, Sequence[Callable[[], object]]] | None = None,
) -> fx.GraphModule:
    """A copy of ``gm`` recording ``after[node]`` events (in order) right after each node,
    then calling ``actions[node]`` (plain callables, e.g. a check's poison) after them.

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
    for name in dict.fromkeys((*after, *actions)):
        anchor = nodes[name]
        for event in after.get(name, ()):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(_RecordHere(device, event), ())
                anchor.meta[RECORD_KEY] = event
        for action in actions.get(name, ()):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(action, ())
    return out


def stage_ops(gm: fx.GraphModule, reads: Mapping[str, frozenset[str]], stage: str) -> tuple[Op, ...]:
    """The reads (``Read(buffer, "stage:node")``) and inserted records of ``gm``, in order."""
    ops: list[Op] = []
    for node in gm.graph.nodes:
        for buffer in sorted(reads.get(node.name, ())):
            ops.append(Read(buffer, f"{stage}:{node.name}"))
        if RECORD_KEY in node.meta:
            ops.append(Record(node.meta[RECORD_KEY]))
    return tuple(ops)
