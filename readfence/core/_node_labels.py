"""A stage graph run node by node under the read observer, each touch labelled with its node.

``Ledger.observe_program`` (lowering's rehearsal, the runs on varied states) runs a captured
stage's graph this way, so a read the observer sees is named by the graph node that made it
(``stage:node``), the node EXACT places a fence after.
"""

from __future__ import annotations

from typing import Any

import torch

from ._observe import ReadObserver


class NodeLabels:
    """Runs a stage graph node by node, as ``fx.Interpreter`` does (placeholders bound to the
    arguments in order, attributes fetched, each call made, every value dropped after its last
    use), labelling what each node touches with ``stage:node``. A loop over the nodes rather than
    an interpreter: an ``fx.Interpreter`` with a label's context per node cost twice the observed
    ops themselves on a 64-layer body. A graph with other nodes (``call_module``, ``call_method``)
    runs under ``fx.Interpreter``.

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
        run_op = observer.run_node_op
        try:
            for n in nodes:
                op = n.op
                if op == "call_function":
                    observer.current_stage = prefix + n.name
                    call_args = tuple(env[a] if type(a) is torch.fx.Node else torch.fx.node.map_arg(a, fetch)
                                      for a in n.args)
                    call_kwargs = torch.fx.node.map_arg(n.kwargs, fetch) if n.kwargs else {}
                    env[n] = run_op(n.target, call_args, call_kwargs, alone)
                elif op == "placeholder":
                    env[n] = next(inputs)
                elif op == "get_attr":
                    observer.current_stage = prefix + n.name
                    env[n] = _attribute(gm, str(n.target))
                else:  # the output
                    return torch.fx.node.map_arg(n.args[0], fetch)
                for used in dropped.get(n, ()):
                    del env[used]
        finally:
            observer.current_stage = before
        return None


#: The nodes :class:`NodeLabels` runs itself.
PLAIN_NODES = frozenset({"placeholder", "get_attr", "call_function", "output"})


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
