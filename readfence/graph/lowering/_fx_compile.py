"""FX pass: a stage graph as one straight-line Python function, for replays and eager launches.

``fx.GraphModule`` code calls ``torch.ops.aten.mul.Tensor(...)`` for every node: attribute
lookups and a Python frame (``OpOverload.__call__``) around the C++ handle of the op. On the
tiny demo model (batch 4) the body is about 500 nodes of microsecond kernels, so that per-node
Python decides the speed of a CpuDevice replay: the GraphModule ran the body about 1.3x slower
than the eager model it was traced from. :func:`compile_graph` emits the same calls in the same
order, on each op's C++ handle, after two passes that only drop recomputation:

* constant folding: a pure node that depends on no input (``arange`` and the rotary
  frequencies computed from it) is computed once, when the graph is compiled;
* common subexpressions: a pure node equal to an earlier one (same op, same arguments) whose
  inputs nothing in the graph writes is replaced by it (a mask or index every layer rebuilds).

Neither touches a value whose memory the graph may write, or that leaves the graph. Which memory
that is comes from facts (``_fx_memory``): the real storages of the tensors the graph captured
and of its inputs (the lowering says what each input holds), so that a workspace and a view of
it, two tensors over one storage or a DLPack alias are one memory; the ops' schemas (what each
writes, what each output may alias); and their tags (``set_``, ``inplace_view``, makes a tensor
any memory it was given). Lowering does not trust this: it validates the compiled code against
the stages' Python, and runs the plain translation where only the passes' code differs.

On the demo's body (362 calls; the model computes its rotary tables once a step) the passes
fold 9 and share 15, and bindings carry 301 of the rest. Medians side by side on a quiet 2-core
VM, measured when the body still rebuilt the rotary tables in every layer (446 calls, 99
shared): GraphModule 1.80 ms, the same calls on their handles 1.33 ms, with the two passes
0.93 ms, with bindings 0.82 ms; the whole eager step the body was traced from took 1.37 ms.

*Pure* is read from the op's schema (``core._schema``): an ``aten`` op that writes none of its
arguments, returns something, and is not tagged nondeterministic. Opaque Python callables
(a check's poison actions) may write anything they can reach, so a graph holding one only
gets the plain translation; the nodes that fire events are known to write nothing. Those
inserted calls (events, poison, checks: ``HOOK_KEY``) are called through names the generated
code binds (:meth:`CompiledGraph.bind`): one compiled code serves every event-ring slot, and is
validated with its hooks bound to nothing.

An ``aten`` call is then emitted as the op's generated Python binding where one reaches the
very same op: ``TensorBase.view(x, size)`` instead of ``aten.view.default``'s handle, which
parses its arguments against the schema at every call (2.3 against 0.9 us for a ``view`` on
this machine). A binding is used only after a probe: called on meta tensors shaped like the
node's traced values, it must dispatch exactly one op, the node's own overload, with the same
arguments (a dispatch mode records what reaches the dispatcher; :func:`binding_for`). The probe
runs no kernel: the mode answers the op with stand-ins for the node's traced outputs and stops
the candidate at a second op (torch's Python meta kernels import its compiler, about two seconds
at a process's first lowering).
Every kernel that runs, runs on the same inputs as in the GraphModule, so outputs are
bit-identical. A value used once, by the very next call (no statement, hook or dropped reference
in between), is written into that call, and every function is one name however many nodes call
it: the same calls in the same order, in fewer statements (a 64-layer body's 10,778 lines became
8,860, and Python's ``compile`` of them went from about 97 to 78 ms).

>>> import torch
>>> from torch import fx
>>> from torch.fx.experimental.proxy_tensor import make_fx
>>> def f(x):
...     w = torch.arange(4.0).exp()          # depends on no input: folded
...     return x * w + x * w                 # the second product is the first one
>>> from readfence.core.tracing import note_output_memory
>>> gm = note_output_memory(make_fx(f)(torch.ones(4)), torch.ones(4))   # (what readfence's trace notes)
>>> run = compile_graph(gm)
>>> x = torch.randn(4)
>>> torch.equal(run(x), gm(x))
True
>>> run.stats                               # the add and the one product left go through bindings
{'nodes': 5, 'folded': 2, 'shared': 1, 'bound': 2, 'pieces': 0, 'layer_runs': 0}
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import torch
from torch import fx

from readfence.core.internal import DispatchMode, bind_arguments, collection_paused, op_aliasing, torch_op

from ._fx_keys import arg_key
from ._fx_layers import hoists_hold, outline_layers
from ._fx_memory import HOOK_KEY, WRITES_KEY, GraphMemory, InputMemory
from ._fx_pieces import outline_pieces

_IMPURE_TAGS = frozenset({torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise})


def _aten_op(target: Any) -> TypeGuard[torch._ops.OpOverload]:
    # an op of torch's aten, as torch defined it: one defined in that namespace by other code, or
    # one of torch's whose kernel other code replaced, is no op the pass may reason about
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and torch_op(target)


def _pure(node: fx.Node) -> bool:
    """A call the pass may compute once for several uses: an aten op that writes nothing,
    returns something and is deterministic (from its schema and tags, not from a list)."""
    target = node.target
    if node.op != "call_function" or not _aten_op(target):
        return False
    aliasing = op_aliasing(target)
    if aliasing is None or aliasing.opaque or aliasing.writes or not target._schema.returns:
        return False
    return not _IMPURE_TAGS.intersection(target.tags)


def _refs(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


def _key(value: Any) -> Any:
    """A hashable stand-in for an argument (``_fx_keys``): a node stands for itself (nodes are
    equal only to themselves)."""
    return arg_key(value, node=_node_itself)


def _node_itself(node: fx.Node) -> fx.Node:
    return node


def _simplify(gm: fx.GraphModule, keep: frozenset[str], inputs: Sequence[InputMemory] | None,
              ) -> tuple[dict[fx.Node, Any], dict[fx.Node, fx.Node], GraphMemory]:
    """The folded constants, and each shared node's earlier equal (see the module docstring);
    the nodes named in ``keep`` are neither. ``inputs`` is what the graph's inputs are known to
    hold (``GraphMemory``); the memory analysis is returned with the answer."""
    graph = gm.graph
    memory = GraphMemory(gm, inputs)
    if memory.opaque:
        return {}, {}, memory
    kept_apart = memory.written | memory.leaving  # memory a merge or a fold would make one
    folded: dict[fx.Node, Any] = {}
    same: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    for node in graph.nodes:
        if node.name in keep or not _pure(node) or memory.classes(node) & kept_apart:
            continue
        target: Any = node.target  # an aten OpOverload (_pure)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: same.get(n, n))
        inputs_of = _refs((args, kwargs))
        if memory.classes((args, kwargs)) & kept_apart:
            continue
        try:
            first = seen.setdefault((node.target, _key(args), _key(kwargs)), node)
        except TypeError:  # an argument that cannot be compared: computed where it is
            first = node
        if first is not node:
            same[node] = first
        elif all(n in folded for n in inputs_of):
            args, kwargs = fx.node.map_arg((args, kwargs), folded.__getitem__)
            folded[node] = target(*args, **kwargs)
    return folded, same, memory


# ------------------------------------------------------------------------- bindings, by probe

def _same_argument(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_argument(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and _key(a) == _key(b)
    return type(a) is type(b) and a == b


class _SecondOp(Exception):
    """A candidate dispatched a second op: not a binding of one op."""


class _Dispatched(DispatchMode):
    """Records the op that reaches the dispatcher and answers it with ``result`` (no kernel
    runs); a second op stops the candidate."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result  # its spec (``_result_spec``)
        self.call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.call is not None:
            raise _SecondOp(func)
        self.call = (func, args, kwargs or {})
        # new tensors at every call (torch detaches one a mode had before the call: a second op)
        return _stand_in(self.result)


def _candidates(op: Any) -> list[Callable[..., Any]]:
    """The generated bindings named like ``op``: the tensor method, then the ``torch`` function
    (the C ones, not Python wrappers such as ``torch.Tensor.split``)."""
    name = op._schema.name.split("::", 1)[1]
    found = [getattr(torch._C.TensorBase, name, None), getattr(torch._C._VariableFunctions, name, None)]
    return [f for f in found if f is not None]


def binding_for(op: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object],
                candidates: Iterable[Callable[..., object]] | None = None, *,
                result: object = None) -> Callable[..., object] | None:
    """A binding that, called with ``args``/``kwargs`` (meta tensors standing for the values),
    dispatches exactly ``op`` once with the same arguments; ``None`` if no candidate does.
    ``result`` (meta tensors standing for what ``op`` returns; default: ``op`` run on ``args``)
    is the op's answer to a candidate: no kernel runs while one is probed.

    >>> x = torch.empty(2, 3, device="meta")
    >>> binding_for(torch.ops.aten.view.default, (x, [6]), {}) is torch._C.TensorBase.view
    True
    >>> binding_for(torch.ops.aten.mul.Tensor, (x, x), {}, candidates=[torch.add]) is None
    True
    """
    expected = bind_arguments(op, args, kwargs, defaults=True)
    try:
        answer = _result_spec(op(*args, **kwargs) if result is None else result)
    except _Unknown:  # an op that returns no tensor: not compiled through a binding
        return None
    for fn in _candidates(op) if candidates is None else candidates:
        seen = _Dispatched(answer)
        try:
            with seen:
                fn(*args, **kwargs)
        except Exception:  # not a way to call this op (or more than one op): try the next one
            continue
        if seen.call is None:
            continue
        func, got_args, got_kwargs = seen.call
        if func is op and all(_same_argument(a, b) for a, b in
                              zip(bind_arguments(op, got_args, got_kwargs, defaults=True), expected, strict=True)):
            return fn
    return None


class _Unknown(Exception):
    """A traced value the probe cannot stand in for."""


def _spec(value: Any, memo: dict[fx.Node, Any]) -> Any:
    """A hashable description of an argument, from which :func:`_stand_in` rebuilds it (nodes by
    their traced value, as a meta tensor's shape, strides and dtype; ``memo`` keeps each node's)."""
    if isinstance(value, fx.Node):
        spec = memo.get(value)
        if spec is None:
            val = value.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise _Unknown(value.name)
            spec = memo[value] = _result_spec(val)
        return spec
    if isinstance(value, (list, tuple)):
        return (type(value), tuple([_spec(v, memo) for v in value]))
    if isinstance(value, dict):
        raise _Unknown("dict")
    return ("value", _key(value), value)


def _stand_in(spec: Any) -> Any:
    kind = spec[0]
    if kind == "tensor":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    if kind == "value":
        return spec[2]
    return kind(_stand_in(v) for v in spec[1])


def _result_spec(val: Any) -> Any:
    """:func:`_spec` of a value an op returned (a tensor or a list of them)."""
    if isinstance(val, torch.Tensor):
        return ("tensor", tuple(val.shape), tuple(val.stride()), val.dtype)
    if isinstance(val, (list, tuple)) and val:
        return (type(val), tuple(_result_spec(v) for v in val))
    raise _Unknown("a result that is no tensor")


@functools.lru_cache(maxsize=4096)  # keyed by op and argument shapes: a few hundred per model
def _probed(op: Any, args: Any, kwargs: Any, result: Any) -> Callable[..., Any] | None:
    return binding_for(op, _stand_in(args), {k: _stand_in(v) for k, v in kwargs}, result=_stand_in(result))


def _binding(node: fx.Node, memo: dict[fx.Node, Any]) -> Callable[..., Any] | None:
    """The probed binding for an aten call node whose traced values are known, else ``None``
    (``memo``: the specs of the graph's nodes met so far, see :func:`_spec`)."""
    target = node.target
    if not _aten_op(target):
        return None
    try:
        args = _spec(tuple(node.args), memo)
        kwargs = tuple((k, _spec(v, memo)) for k, v in node.kwargs.items())
        return _probed(target, args, kwargs, _result_spec(node.meta.get("val")))
    except (_Unknown, TypeError):  # a value without a traced shape, or one that cannot be a key
        return None


class CompiledGraph:
    """A stage graph compiled by :func:`compile_graph`: call it like the GraphModule.

    ``fn`` is the generated function (call it directly on a hot path), ``source`` its code;
    ``stats`` counts the graph's calls, the folded ones, the ones shared with an earlier equal
    node and the ones emitted as a probed binding. ``hooks`` are the inserted calls (events,
    poison, checks: nodes marked ``HOOK_KEY``), as ``(key, target)`` in graph order: :meth:`bind`
    gives the same code calling other targets (another ring slot's events, or nothing while the
    code is validated). ``computation`` is the code with the hook calls and the reference drops
    left out: two compilations with equal ``computation`` of one graph compute alike whatever their
    hooks. ``memory`` is the memory analysis the passes used (``None`` without them).
    """

    def __init__(self, bind: Callable[..., Callable[..., Any]], source: str, stats: dict[str, int],
                 hooks: tuple[tuple[Hashable, Callable[..., Any]], ...], computation: str,
                 memory: GraphMemory | None) -> None:
        self._bind, self.source, self.stats, self.hooks = bind, source, stats, hooks
        self.computation, self.memory = computation, memory
        self.fn = bind(*(target for _, target in hooks))
        self.outlined: fx.GraphModule | None = None  # the graph compiled, after the outlining passes
        self.hoisted: frozenset[str] = frozenset()  # its nodes computed once for a class of layers

    def bind(self, targets: Mapping[Hashable, Callable[..., Any]]) -> Callable[..., Any]:
        """The compiled function (the same code object as :attr:`fn`'s) with each hook calling
        ``targets[key]``; a key ``targets`` lacks is a ``KeyError``."""
        return self._bind(*(targets[key] for key, _ in self.hooks))

    def __call__(self, *args: object) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"<CompiledGraph {self.stats}>"


def compile_graph(gm: fx.GraphModule, *, keep: Iterable[str] = (), simplify: bool = True,
                  bindings: bool = True, inputs: Sequence[InputMemory] | None = None) -> CompiledGraph:
    """``gm`` as straight-line Python over the ops' bindings (see the module docstring).

    The nodes named in ``keep`` run where they are, as often as they are (lowering keeps the
    reads of shared buffers, so that a replay reads them exactly where the trace says);
    ``simplify=False`` keeps every node (no folding, no sharing); ``bindings=False`` calls
    every op through its C++ handle. ``inputs`` says, per placeholder, what it will hold (the
    tensor, or the memory an earlier graph's output may be; ``None``: unknown): the passes keep
    apart what may share memory with what the graph writes (``_fx_memory``); without it the
    inputs are taken to share none. A node marked ``HOOK_KEY`` (an inserted event, poison or
    check) is called through a hook (:class:`CompiledGraph`)."""
    kept = frozenset(keep)
    # the compile makes tens of thousands of short-lived tuples and sets; each young collection
    # they trigger may walk the process's traced graphs (a 64-layer body's compile took 0.71 s of
    # CPU with the collector on, 0.37 s with it off); nothing it makes is cyclic garbage
    with collection_paused():
        if not (simplify and bindings):
            compiled = _compile(gm, kept, simplify, bindings, inputs)
            compiled.stats["pieces"] = compiled.stats["layer_runs"] = 0
            return compiled
        # each class of layers one function (``_fx_layers``: what every run computes alike computed
        # once before the first, every other node as traced inside it), then each spliced model
        # piece one call of code compiled once (``_fx_pieces``), inside a class's function and out
        # (a check's poison may write anything: no value is known to be computed alike then)
        hoist = not any(n.meta.get(WRITES_KEY) for n in gm.graph.nodes)
        compiled = _outlined(gm, kept, inputs, hoist=hoist)
        if not hoists_hold(compiled.outlined, compiled.memory, compiled.hoisted):  # a value computed once is written
            compiled = _outlined(gm, kept, inputs, hoist=False)
    return compiled


def _outlined(gm: fx.GraphModule, kept: frozenset[str], inputs: Sequence[InputMemory] | None, hoist: bool,
              ) -> CompiledGraph:
    pieces = 0

    def piece(graph: fx.GraphModule, given: tuple[InputMemory, ...]) -> CompiledGraph:
        return _compile(graph, frozenset(), True, True, given)

    def layer(block: fx.GraphModule) -> CompiledGraph:
        nonlocal pieces
        block, inside = outline_pieces(block, kept, piece)
        pieces += inside
        return _compile(block, kept, False, True, None)

    hoistable = (lambda node: node.name not in kept and _pure(node)) if hoist else None
    outlined, layers, hoisted = outline_layers(gm, layer, hoistable)
    # (a value computed once stays the node it is, for ``hoists_hold`` to find)
    outlined, outside = outline_pieces(outlined, kept | hoisted, piece)
    compiled = _compile(outlined, kept, True, True, inputs)
    compiled.stats["pieces"], compiled.stats["layer_runs"] = pieces + outside, layers
    compiled.outlined, compiled.hoisted = outlined, hoisted
    return compiled


def _compile(gm: fx.GraphModule, keep: frozenset[str], simplify: bool, bindings: bool,
             inputs: Sequence[InputMemory] | None) -> CompiledGraph:
    graph = gm.graph
    folded, same, memory = _simplify(gm, keep, inputs) if simplify else ({}, {}, None)
    nodes = list(graph.nodes)
    names: dict[fx.Node, str] = {}
    scope: dict[str, Any] = {}
    last_use: dict[fx.Node, fx.Node] = {}

    def resolved(n: fx.Node) -> fx.Node:
        return same.get(n, n)

    uses: dict[fx.Node, int] = {}
    for node in nodes:
        if node in same or node in folded:
            continue  # emits no code: its arguments are not used there
        for ref in map(resolved, _refs((node.args, node.kwargs))):
            last_use[ref] = node
            uses[ref] = uses.get(ref, 0) + 1

    functions: list[str] = []  # what each called function is: part of the computation

    named: dict[int, str] = {}  # a function called at many nodes is one name (by identity)

    def constant(value: Any, hint: str) -> str:
        if hint == "f" and id(value) in named:
            return named[id(value)]
        name = f"_{hint}{len(scope)}"
        scope[name] = value
        if hint == "f":
            named[id(value)] = name
            functions.append(f"{name} = {value!r}")
        return name

    # a value used once, by the very next statement, is written into it (no name, no line to drop it):
    # ``pending`` is the last statement while it may still be, ``(node, call, index in body)``
    pending: list[tuple[fx.Node, str, int]] = []
    inlined: set[fx.Node] = set()

    def emit(value: Any) -> str:
        if isinstance(value, fx.Node):
            node = resolved(value)
            if pending and pending[0][0] is node:
                _, call, at = pending.pop()
                del body[at]
                inlined.add(node)
                return call
            return names[node]
        if isinstance(value, list):
            return "[" + ", ".join(emit(v) for v in value) + "]"
        if isinstance(value, tuple):
            return "(" + "".join(emit(v) + ", " for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {emit(v)}" for k, v in value.items()) + "}"
        if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            return repr(value)
        return constant(value, "c")

    params: list[str] = []
    body: list[tuple[str, str]] = []  # (kind, line): "op", "hook" or "free"
    hooks: list[tuple[Hashable, Callable[..., Any]]] = []
    bound = 0
    specs: dict[fx.Node, Any] = {}  # each node's traced value, as the bindings' probe describes it
    freed: dict[fx.Node, list[fx.Node]] = {}
    for ref, user in last_use.items():
        freed.setdefault(user, []).append(ref)
    values = 0  # values are numbered without the hooks: hooks change no other line
    for node in nodes:
        if node in same:
            continue
        if HOOK_KEY in node.meta and node.op == "call_function":
            pending.clear()  # a hook's arguments are named (the computation leaves hook lines out)
            hook = f"_h{len(hooks)}"
            hooks.append((node.meta[HOOK_KEY], node.target))
            args = [emit(a) for a in node.args] + [f"{k}={emit(v)}" for k, v in node.kwargs.items()]
            body.append(("hook", f"{hook}({', '.join(args)})"))
        else:
            name = names[node] = f"v{values}"
            values += 1
            if node.op == "placeholder":
                params.append(name)
                continue
            if node in folded:
                names[node] = constant(folded[node], "k")
                continue
            if node.op == "get_attr":
                names[node] = constant(_attr(gm, str(node.target)), "a")
                continue
            if node.op == "output":
                body.append(("op", f"return {emit(node.args[0])}"))
                continue
            if node.op != "call_function":
                raise NotImplementedError(
                    f"compile_graph: node {node.name!r} is a {node.op} (make_fx graphs call functions)")
            if node.target is operator.getitem:
                call = f"{emit(node.args[0])}[{emit(node.args[1])}]"
            else:
                # the probed binding, else the C++ handle behind OpOverload.__call__
                fn = _binding(node, specs) if bindings else None
                bound += fn is not None
                fn = fn or getattr(node.target, "_op", node.target)
                args = [emit(a) for a in node.args] + [f"{k}={emit(v)}" for k, v in node.kwargs.items()]
                call = f"{constant(fn, 'f')}({', '.join(args)})"
            pending.clear()
            body.append(("op", f"{name} = {call}"))
            if uses.get(node) == 1 and node.name not in keep:
                pending.append((node, call, len(body) - 1))
        done = [names[r] for r in freed.get(node, ()) if r not in inlined and names.get(r, "").startswith("v")]
        if done:  # free intermediates at their last use, as GraphModule code does
            pending.clear()
            body.append(("free", " = ".join(done) + " = None"))
    hook_names = [f"_h{i}" for i in range(len(hooks))]
    source = (f"def bind({', '.join(hook_names)}):\n    def run({', '.join(params)}):\n"
              + "".join(f"        {line}\n" for _, line in body) + "    return run\n")
    exec(compile(source, f"<readfence compiled {gm.__class__.__name__}>", "exec"), scope)
    stats = {"nodes": sum(n.op == "call_function" and HOOK_KEY not in n.meta for n in nodes), "folded": len(folded),
             "shared": len(same), "bound": bound}
    computation = "".join(f"{line}\n" for line in (f"run({', '.join(params)})", *functions,
                                                   *(line for kind, line in body if kind == "op")))
    return CompiledGraph(scope["bind"], source, stats, tuple(hooks), computation, memory)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
