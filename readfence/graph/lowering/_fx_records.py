"""FX pass: insert event records right after chosen nodes of a traced stage graph.

The inserted node calls ``device.record_here(event)`` for each event placed after its node, so
the event fires at exactly that point of the (eager or replayed) stage, then a check's poison
actions placed there. The pass also yields the stage's ``ops`` list (reads and records in node
order) that the device and its sanitizer see at enqueue time.

Each inserted call is a *hook* (``node.meta[HOOK_KEY]`` is ``("after", node)``): the compiled
code calls it through a name that each event-ring slot binds to its own events
(:func:`hooks_for`) and that the validation of the code binds to nothing. :func:`insert_hooks`
places the calls before the events exist, after every node an event may follow: one compiled
code then serves every slot and every plan, validated once without firing an event.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from torch import fx

from readfence.core.internal import copy_graph

from ..devices import Device, Event, Op, Read, Record
from ._fx_memory import HOOK_KEY, WRITES_KEY

#: ``node.meta`` key of an inserted call: the events it records (in order).
RECORD_KEY = "readfence_record"


class AfterNode:
    """What runs right after a node: its events' records, then a check's actions (poison)."""

    def __init__(self, node: str, device: Any = None, events: Sequence[Event] = (),
                 actions: Sequence[Callable[[], object]] = ()) -> None:
        self.device, self.events, self.actions = device, tuple(events), tuple(actions)
        self.__name__ = f"after_{node}"

    def __call__(self) -> None:
        for event in self.events:
            self.device.record_here(event)
        for action in self.actions:
            action()


def site_key(node: str) -> tuple[str, str]:
    """The hook key of the call inserted after ``node``."""
    return ("after", node)


def hooks_for(after: Mapping[str, Sequence[Event]], device: Device | None,
              actions: Mapping[str, Sequence[Callable[[], object]]] | None = None) -> dict[Hashable, AfterNode]:
    """The calls that record ``after[node]`` (in order) and then run ``actions[node]`` after each
    node, by hook key: what code compiled with a hook after those nodes binds for these events.

    >>> class Ev: name = "e"
    >>> sorted(hooks_for({"add": [Ev(), Ev()]}, None, {"mul": [print]}))
    [('after', 'add'), ('after', 'mul')]
    """
    actions = actions or {}
    return {site_key(n): AfterNode(n, device, after.get(n, ()), actions.get(n, ()))
            for n in dict.fromkeys((*after, *actions))}


def insert_hooks(gm: fx.GraphModule, sites: Iterable[str], *, writes: bool = False,
                 targets: Mapping[Hashable, Callable[[], object]] | None = None) -> fx.GraphModule:
    """A copy of ``gm`` with a hook called right after each node named in ``sites``: calling
    ``targets[key]`` (default: nothing). ``writes`` says the calls may write anything (a check's
    poison): compiled, such a graph gets no folding or sharing.

    >>> import torch
    >>> gm = insert_hooks(fx.symbolic_trace(lambda x: (x + 1) * 2), ["add"])
    >>> [n.name for n in gm.graph.nodes if HOOK_KEY in n.meta], gm(torch.ones(1)).item()
    (['after_add'], 4.0)
    """
    out = copy_graph(gm)
    graph = out.graph
    nodes = {n.name: n for n in graph.nodes}
    sites = list(dict.fromkeys(sites))
    missing = [name for name in sites if name not in nodes]
    if missing:
        raise KeyError(f"cannot place records after unknown nodes {missing}")
    for name in sites:
        key = site_key(name)
        target = (targets or {}).get(key) or AfterNode(name)
        with graph.inserting_after(nodes[name]):
            hook = graph.call_function(target, ())
        hook.meta[HOOK_KEY] = key
        if isinstance(target, AfterNode) and target.events:
            hook.meta[RECORD_KEY] = target.events
        if writes:
            hook.meta[WRITES_KEY] = True
    out.recompile()
    return out


def insert_records(
    gm: fx.GraphModule, after: Mapping[str, Sequence[Event]], device: Device | None,
    actions: Mapping[str, Sequence[Callable[[], object]]] | None = None,
) -> fx.GraphModule:
    """A copy of ``gm`` recording ``after[node]`` events (in order) right after each node,
    then calling ``actions[node]`` (plain callables, e.g. a check's poison, which may write
    anything) after them: one hook per node (:func:`insert_hooks`).

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
    hooks = hooks_for(after, device, actions)
    return insert_hooks(gm, dict.fromkeys((*after, *(actions or {}))), writes=any((actions or {}).values()),
                        targets=hooks)


def stage_ops(gm: fx.GraphModule, reads: Mapping[str, frozenset[str]], stage: str,
              hooks: Mapping[Hashable, Callable[..., object]] | None = None) -> tuple[Op, ...]:
    """The reads (``Read(buffer, "stage:node")``) and inserted records of ``gm``, in order; with
    ``hooks`` (what a slot binds the hooks to, :func:`hooks_for`), the records of those."""
    ops: list[Op] = []
    for node in gm.graph.nodes:
        for buffer in sorted(reads.get(node.name, ())):
            ops.append(Read(buffer, f"{stage}:{node.name}"))
        if HOOK_KEY in node.meta:
            target = node.target if hooks is None else hooks.get(node.meta[HOOK_KEY], node.target)
            ops.extend(Record(e) for e in getattr(target, "events", ()))
    return tuple(ops)


__all__ = ["RECORD_KEY", "AfterNode", "hooks_for", "insert_hooks", "insert_records", "site_key", "stage_ops"]
