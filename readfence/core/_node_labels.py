"""A stage graph run node by node under the read observer, each touch labelled with its node.

``Ledger.observe_program`` (lowering's rehearsal, the runs on varied states) runs a captured
stage's graph this way, so a read the observer sees is named by the graph node that made it
(``stage:node``), the node EXACT places a fence after.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ._observe import ReadObserver
from .tracing import PLAIN_VALUES


class NodeLabels:
    """Runs a stage graph node by node, as ``fx.Interpreter`` does (placeholders bound to the
    arguments in order, attributes fetched, each call made, every value dropped after its last
    use), labelling what each node touches with ``stage:node``. A loop over the nodes rather than
    an interpreter: an ``fx.Interpreter`` with a label's context per node cost twice the observed
    ops themselves on a 64-layer body. A value known to hold no buffer's memory in its storage (an
    input or attribute the observer found so, a result of torch's own ops on such values alone)
    is not looked at again: the ops on it run below the modes unlabelled, as they record nothing.
    A graph with other nodes (``call_module``, ``call_method``) runs under ``fx.Interpreter``.

    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> shared = {"seq_lens": torch.arange(4)}
    >>> gm = make_fx(lambda t: (t * 2)[1:].sum())(shared["seq_lens"])
    >>> seen = []
    >>> for run in (NodeLabels, LabelledInterpreter):   # the loop, and the interpreter it replaces
    ...     observer = ReadObserver(shared)
    ...     with observer:
    ...         out = run(gm, observer, "body").run(shared["seq_lens"])
    ...     seen.append((out.item(), [(a.buffer, a.stage) for a in observer.accesses], observer.current_stage))
    >>> seen[0] == seen[1], seen[0]
    (True, (12, [('seq_lens', 'body:mul')], 'unlabelled'))
    """

    def __init__(self, gm: torch.fx.GraphModule, observer: ReadObserver, stage: str) -> None:
        self.gm, self.observer, self.stage_name = gm, observer, stage

    def run(self, *args: Any) -> Any:
        gm, observer, prefix = self.gm, self.observer, f"{self.stage_name}:"
        nodes = list(gm.graph.nodes)
        if any(n.op not in PLAIN_NODES for n in nodes):
            return LabelledInterpreter(gm, observer, self.stage_name).run(*args)
        last: dict[torch.fx.Node, torch.fx.Node] = {}  # each value's last user
        for n in nodes:
            for used in n.all_input_nodes:
                last[used] = n
        dropped: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for used, user in last.items():
            dropped.setdefault(user, []).append(used)
        env: dict[torch.fx.Node, Any] = {}
        fetch = env.__getitem__
        inputs = iter(args)
        before = observer.current_stage
        alone = observer.below_modes()  # (a node touching no buffer then runs below the modes: run_node_op)
        run_op, quiet = observer.run_node_op, observer.quiet
        # the nodes whose values hold no buffer's memory in their storages: an input or attribute the
        # observer found so, or a quiet op's result on such values alone (new memory or views of
        # those storages); a quiet op on them alone touches no buffer, and is not looked at again.
        # Any other op may re-point a tensor (``set_``): its inputs are clean no more, and after an
        # op that is not torch's own (it may reach any tensor), no value is
        clean: set[torch.fx.Node] = set()
        try:
            for n in nodes:
                op = n.op
                if op == "call_function":
                    target = n.target
                    made_clean = (alone and all(a in clean for a in n.all_input_nodes)
                                  and (target is operator.getitem or quiet(target)) and _plain_arguments(n))
                    if not made_clean:  # (a clean node records nothing: no label)
                        observer.current_stage = prefix + n.name
                    call_args = tuple(env[a] if type(a) is torch.fx.Node else torch.fx.node.map_arg(a, fetch)
                                      for a in n.args)
                    call_kwargs = torch.fx.node.map_arg(n.kwargs, fetch) if n.kwargs else {}
                    env[n] = run_op(target, call_args, call_kwargs, alone, made_clean)
                    if made_clean:
                        clean.add(n)
                    elif clean:
                        if target is operator.getitem or quiet(target):
                            # torch's own op re-points only what it is handed (``set_`` onto a buffer)
                            clean.difference_update(n.all_input_nodes)
                        else:
                            # a kernel not torch's may re-point any tensor it was given or keeps
                            clean.clear()
                elif op == "placeholder":
                    env[n] = next(inputs)
                    if alone and observer.holds_no_buffer(env[n]):
                        clean.add(n)
                elif op == "get_attr":
                    observer.current_stage = prefix + n.name
                    env[n] = _attribute(gm, str(n.target))
                    if alone and observer.holds_no_buffer(env[n]):
                        clean.add(n)
                else:  # the output
                    return torch.fx.node.map_arg(n.args[0], fetch)
                for used in dropped.get(n, ()):
                    del env[used]
        finally:
            observer.current_stage = before
        return None


#: The nodes :class:`NodeLabels` runs itself.
PLAIN_NODES = frozenset({"placeholder", "get_attr", "call_function", "output"})


def _plain_arguments(n: torch.fx.Node) -> bool:
    # every argument a node or a plain Python value (in lists, tuples and dicts): a tensor, a
    # storage or any other object written into the arguments is memory not looked at
    for v in (*n.args, *n.kwargs.values()):
        kind = type(v)
        if kind is not torch.fx.Node and kind not in PLAIN_VALUES and not _plain(v):
            return False
    return True


def _plain(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(x) for x in v.values())
    return type(v) is torch.fx.Node or type(v) in PLAIN_VALUES



def _attribute(gm: torch.nn.Module, target: str) -> Any:
    # a get_attr node's value (a dotted path into the module)
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


class LabelledInterpreter(torch.fx.Interpreter):
    """``fx.Interpreter`` labelling what each node touches with ``stage:node``."""

    def __init__(self, gm: torch.fx.GraphModule, observer: ReadObserver, stage: str) -> None:
        super().__init__(gm)
        self.observer, self.stage_name = observer, stage

    def run_node(self, n: torch.fx.Node) -> Any:
        with self.observer.stage(f"{self.stage_name}:{n.name}"):
            return super().run_node(n)
