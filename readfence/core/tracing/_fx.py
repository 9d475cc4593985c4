"""Building and copying FX graphs of real tensors for less than ``fx.Graph.create_node`` asks.

``create_node`` walks every argument of a new node through pytree, looking for a symbolic
value (a ``SymInt``) to warn about, and ``Node.__setattr__`` takes a node out of and back into
the graph's lookup table on every attribute set. A graph of real (or fake) tensors holds no
symbolic value, and a node's arguments are no part of that table, so for the tens of thousands
of nodes a deep model's trace makes both were most of a node's cost. :func:`add_node` and
:func:`copy_graph` make the same nodes without them.
"""

from __future__ import annotations

from typing import Any

from torch import fx


def add_node(graph: fx.Graph, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None = None,
             type_expr: Any = None) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)``, without the walk.

    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> add_node(g, "call_function", max, (x, 1), {}).args
    (x, 1)
    """
    node = graph.create_node(op, target, None, None, name, type_expr)
    object.__setattr__(node, "args", args)  # (the property's setter: users registered, no re-indexing)
    object.__setattr__(node, "kwargs", kwargs)
    return node


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes (and each node's metadata dict) are its own, over the same
    attributes; its Python code is made when something calls it.

    A pass that annotates or inserts nodes works on this, not on a traced stage's graph. Unlike
    ``copy.deepcopy`` it shares what the metadata holds (a traced value, a source line): the
    passes replace entries, never change them.

    >>> gm = fx.symbolic_trace(lambda x: x + 1)
    >>> new = copy_graph(gm)
    >>> [n.name for n in new.graph.nodes], next(iter(new.graph.nodes)) is next(iter(gm.graph.nodes))
    (['x', 'add', 'output'], False)
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = add_node(graph, node.op, node.target, fx.node.map_arg(node.args, env.__getitem__),
                       fx.node.map_arg(node.kwargs, env.__getitem__), node.name, node.type)
        new.meta.update(node.meta)
        env[node] = new
    return _LazyGraphModule(gm, graph)
