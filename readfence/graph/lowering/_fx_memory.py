"""Which values of a stage graph may share memory, and which memory the graph writes.

A pass that computes a value once for several uses (``compile_graph``'s folding and sharing) is
right only if nothing writes the memory that value was read from between its uses. The answer
is decided from facts, never from op names:

* the real storages of the tensors the graph is given (its inputs, where the caller knows the
  tensors they will be, and the tensors it captured, ``get_attr``): two tensors over one
  storage, or over storages whose address ranges overlap (a DLPack or ``from_blob`` alias), are
  one memory, whatever their offsets;
* each op's schema: the arguments it writes and the arguments each output may alias, taken at its
  word only for an op whose kernel its schema's authors wrote (torch's or readfence's own, decided
  by where it was registered: ``trusted_op``; a triton launch, whose writes readfence derived from
  the kernel): any other op, in whatever namespace, may write what it can reach, as a Python
  callable may;
* each op's tags: an ``inplace_view`` op (``set_``) changes which memory its ``self`` is, so
  from then on that tensor may be any memory the op was given;
* what each op's output was seen to be when the trace ran it (``SHARES_KEY``): the storage of
  an argument, which a schema may not say (torch's ``_unsafe_view``, which ``reshape`` calls on a
  copy it made, returns a view under a schema that declares a fresh output).

Memory is named by *tokens*: ``("storage", space, start, stop)`` for a real storage, and any
other hashable for memory made while a graph runs (its allocation site) or given by an earlier
graph (:meth:`GraphMemory.outputs`). A value whose memory is unknown (``None`` for an input, a
fake tensor) may be any real memory: every storage the graph reaches becomes one memory.

>>> import torch
>>> from torch.fx.experimental.proxy_tensor import make_fx
>>> ws = torch.zeros(4); view = ws[:2]                 # two tensors over one storage
>>> gm = make_fx(lambda a, b: (a.add_(1), b.sum()))(ws, view)
>>> GraphMemory(gm, (ws, view)).written_by_any(["b_1"])  # b is written through a
True
>>> GraphMemory(gm, (ws, torch.zeros(2))).written_by_any(["b_1"])
False
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import fx

from readfence.core.internal import SHARES_KEY, bind_arguments, is_launch_op, leaves, op_aliasing, trusted_op

#: What a graph input's memory is, as the caller knows it: the tensor it will hold, the tokens
#: of the memory it may be (an earlier graph's :meth:`GraphMemory.outputs`), or ``None``: any.
InputMemory = torch.Tensor | frozenset[Hashable] | None

#: The token of memory that may be any real storage.
UNKNOWN = ("unknown",)

#: Nodes that call no op on tensors' data: the events, poison and checks lowering inserts
#: carry this key in ``node.meta`` (see ``_fx_records``); an inserted call that may write
#: (a check's poison) says so with :data:`WRITES_KEY`.
HOOK_KEY = "readfence_hook"
WRITES_KEY = "readfence_hook_writes"

#: A call of a piece of the graph compiled on its own (``_fx_pieces``, ``_fx_layers``): a function
#: of its arguments that returns a tuple; ``node.meta[PIECE_KEY]`` says, per value returned,
#: which arguments (by position) it may be memory of, as the piece's own analysis found.
PIECE_KEY = "readfence_piece"
#: The arguments (by position) such a call may write, as the piece's own analysis found (none
#: for a model piece; a layer's run compiled once writes its slice of the caches).
PIECE_WRITES_KEY = "readfence_piece_writes"


def storage_token(t: object) -> Hashable:
    """The token of ``t``'s whole storage (``UNKNOWN`` for a value with no real memory to see:
    a fake or meta tensor, a sparse one).

    >>> base = torch.zeros(8)
    >>> storage_token(base[2:4]) == storage_token(base), storage_token(base) == storage_token(torch.zeros(8))
    (True, False)
    """
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_meta:
        return UNKNOWN
    if type(t) is not torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return UNKNOWN
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return ("storage", t.device.type, t.device.index, start, start + storage.nbytes())


def _refs(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


class GraphMemory:
    """The memory each value of ``gm``'s graph may be, and the memory the graph may write.

    ``inputs`` gives, per placeholder in order, what it is known to hold (:data:`InputMemory`);
    without it each input is memory of its own (the caller vouches that no two alias).
    ``opaque`` is set when the graph calls a Python function that may write anything it can
    reach (a check's poison): then no memory is known to be unwritten.
    """

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[InputMemory] | None = None) -> None:
        self._parent: dict[Hashable, Hashable] = {}
        self._tokens: dict[fx.Node, frozenset[Hashable]] = {}
        self._written: set[Hashable] = set()
        self.opaque = False
        self._site = id(gm)  # tells this graph's made memory from another's (outputs())
        self._nodes = {n.name: n for n in gm.graph.nodes}
        placeholders = 0
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                given = inputs[placeholders] if inputs is not None and placeholders < len(inputs) else ()
                placeholders += 1
                self._tokens[node] = self._input(node, given)
            elif node.op == "get_attr":
                self._tokens[node] = frozenset({storage_token(_attr(gm, str(node.target)))})
            else:
                self._tokens[node] = self._visit(node)
        self._close()
        find = self.find
        self._classes = {node: frozenset(map(find, tokens)) for node, tokens in self._tokens.items()}
        self.written = frozenset(map(find, self._written))
        output = next((n for n in gm.graph.nodes if n.op == "output"), None)
        self.leaving = self.classes(output.args) if output is not None else frozenset()

    # -- the walk --------------------------------------------------------------------------
    def _input(self, node: fx.Node, given: object) -> frozenset[Hashable]:
        if given == ():  # not described: memory of its own
            return frozenset({("input", self._site, node.name)})
        if given is None:
            return frozenset({UNKNOWN})
        if isinstance(given, frozenset):
            return given
        return frozenset({storage_token(given)})

    def tokens(self, value: Any) -> frozenset[Hashable]:
        """The tokens of every node in ``value`` (a node, or args holding nodes)."""
        refs = _refs(value)
        if len(refs) == 1:
            return self._tokens[refs[0]]
        out: set[Hashable] = set()
        for n in refs:
            out |= self._tokens[n]
        return frozenset(out)

    def _visit(self, node: fx.Node) -> frozenset[Hashable]:
        if node.op == "output":
            return self.tokens(node.args)
        if node.target is operator.getitem:
            source = node.args[0]
            if isinstance(source, fx.Node) and PIECE_KEY in source.meta:  # a piece's value: what the piece said
                shares = source.meta[PIECE_KEY][node.args[1]]
                return self.tokens([source.args[i] for i in shares]) | {("made", self._site, node.name)}
            return self.tokens(node.args[0])
        if HOOK_KEY in node.meta:  # an event or a check: it touches no tensor's data
            if node.meta.get(WRITES_KEY):
                self.opaque = True
            return frozenset()
        if PIECE_KEY in node.meta:  # nodes called as one: what they write, the tuple returned (its getitems above)
            for i in node.meta.get(PIECE_WRITES_KEY, ()):
                self._written |= self.tokens(node.args[i])
            return frozenset({("made", self._site, node.name)})
        aliasing = op_aliasing(node.target) if node.op == "call_function" and _schema_holds(node.target) else None
        if aliasing is None or aliasing.opaque:
            # a Python callable, or an op whose kernel someone else wrote (anyone may register one,
            # in ``aten`` too): it may write whatever it can reach, closures included
            self.opaque = True
            return self.tokens((node.args, node.kwargs)) | {("made", self._site, node.name)}
        values = bind_arguments(node.target, node.args, node.kwargs)
        for i in aliasing.writes:
            self._written |= self.tokens(values[i])
        if torch.Tag.inplace_view in getattr(node.target, "tags", ()):
            # ``set_`` and kin: the tensor written is, from now on, any memory the op was given
            self._union(self.tokens((node.args, node.kwargs)))
        out: set[Hashable] = set()
        for sources in aliasing.outputs:
            out |= self.tokens([values[i] for i in sources]) if sources else {("made", self._site, node.name)}
        # and the memory the output was seen to be when the op ran, whatever the schema claims
        # (``_unsafe_view``'s output is its input's memory, under a schema that declares none);
        # where no run looked (a graph make_fx traced), any memory it was given
        if not all(aliasing.outputs):
            flat = leaves((node.args, node.kwargs))
            shares = node.meta.get(SHARES_KEY, range(len(flat)))
            out |= self.tokens([flat[i] for i in shares if i < len(flat) and isinstance(flat[i], fx.Node)])
        return frozenset(out or {("made", self._site, node.name)})

    # -- classes of tokens that may be one memory ------------------------------------------
    def find(self, token: Hashable) -> Hashable:
        """The representative of the memory ``token`` may share."""
        parent = self._parent
        root = token
        while parent.get(root, root) != root:
            root = parent[root]
        while token != root:  # path compression
            parent[token], token = root, parent[token]
        return root

    def _union(self, tokens: Iterable[Hashable]) -> None:
        it = iter(tokens)
        first = next(it, None)
        if first is None:
            return
        root = self.find(first)
        for t in it:
            other = self.find(t)
            if other != root:
                self._parent[other] = root

    def _close(self) -> None:
        # real storages whose address ranges overlap are one memory (a sweep per address
        # space: each storage joins the running class while it starts before the class ends);
        # memory that may be any real storage is one with every real storage the graph reaches
        every = {t for ts in self._tokens.values() for t in ts}
        storages = sorted((t for t in every if isinstance(t, tuple) and t[:1] == ("storage",)),
                          key=lambda t: (t[1], -1 if t[2] is None else t[2], t[3], t[4]))
        space: object = None
        run_end, run_first = -1, None
        for t in storages:
            if t[1:3] != space:
                space, run_end, run_first = t[1:3], -1, None
            if run_first is not None and t[3] < run_end:
                self._union((run_first, t))
            else:
                run_first = t
            run_end = max(run_end, t[4])
        if UNKNOWN in every:
            self._union([UNKNOWN, *storages])

    # -- answers ---------------------------------------------------------------------------
    def classes(self, value: Any) -> frozenset[Hashable]:
        """The memories (class representatives) the nodes in ``value`` may be."""
        if isinstance(value, fx.Node):
            return self._classes[value]
        refs = _refs(value)
        if len(refs) == 1:
            return self._classes[refs[0]]
        out: set[Hashable] = set()
        for n in refs:
            out |= self._classes[n]
        return frozenset(out)

    def written_by_any(self, names: Iterable[str]) -> bool:
        """Whether the graph may write memory any of the nodes ``names`` may be."""
        return bool(self.classes([self._nodes[n] for n in names]) & self.written)

    def outputs(self) -> tuple[frozenset[Hashable], ...]:
        """Per output of the graph, in order, every token of the memory it may be: what a graph
        that takes these values as inputs is given (``inputs=``)."""
        output = next(n for n in self._nodes.values() if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        members: dict[Hashable, set[Hashable]] = {}
        for t in {t for ts in self._tokens.values() for t in ts}:
            members.setdefault(self.find(t), set()).add(t)
        if self.opaque:  # a Python call may have put anything anywhere
            return tuple(frozenset({UNKNOWN}) for _ in values)
        return tuple(frozenset().union(*(members[c] for c in self.classes(v))) if isinstance(v, fx.Node)
                     else frozenset() for v in values)


def _schema_holds(op: object) -> bool:
    """Whether ``op``'s schema says all that its kernel writes and aliases: torch's or readfence's
    own op (by where it was registered), or a triton launch.

    >>> _schema_holds(torch.ops.aten.add_.Tensor), _schema_holds(print)
    (True, False)
    """
    return trusted_op(op) or is_launch_op(op)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


__all__ = ["HOOK_KEY", "PIECE_KEY", "PIECE_WRITES_KEY", "UNKNOWN", "WRITES_KEY", "GraphMemory", "InputMemory", "storage_token"]
