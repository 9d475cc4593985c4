"""FX pass: at every replay, hold every tensor of an opaque op to the aliasing the analysis found.

The analysis decides what a custom op's output aliases from its schema, checked on the memory of
the examples it ran on. A kernel registered without an alias annotation may still return a view
of its input on a path no example took (a fast path when the batch's rows are consecutive): its
output then aliases a shared buffer the analysis took it not to, and a consumer after the
buffer's release reads the live buffer. Its arguments are no safer: a kernel given a mutable
``out`` (``Tensor(a!) out``), or one whose schema claims nothing, may point a tensor it is given at
other memory (``set_``, ``as_strided_`` after a ``set_``, a tensor made over the same bytes with
DLPack), and every later use of that tensor reads where it now points. :func:`insert_alias_checks` inserts, after every op whose kernel
is not torch's or readfence's own (``trusted_op``: decided by where the op was registered, never
by its namespace: anyone may define an op in ``aten``), a check of the memory of its outputs and
of every tensor it was given, as they are after the call, against the live shared buffers'
address ranges: a hit the analysis did not count for that value refuses the step
(:class:`ReplayAliasError`, naming the op and the value), before any consumer runs. It costs an
address comparison per tensor of an opaque op per replay, and applies where a replay runs
Python: the CPU device. Each check is a hook of the compiled code (``_fx_memory.HOOK_KEY``): the
lowering's translation validation runs the code with it off, on states that are not the live one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from readfence.core.internal import ALIASES_KEY, BufferMap, bind_arguments, copy_graph, trusted_op, unobserved
from readfence.effects import ReadfenceError

from ._fx_memory import HOOK_KEY

ALIAS_CHECK_KEY = "readfence_alias_check"


class ReplayAliasError(ReadfenceError, RuntimeError):
    """An opaque op's output, or a tensor it was given as it is after the call, shared memory with a
    shared buffer at a replay, where the analysis, from the op's schema and the examples, took that
    value to alias none of it.

    ``backend``, ``stage``, ``node``, ``op``, ``buffers`` and ``value`` (``"its output"`` or the
    argument) say where and what.
    """

    def __init__(self, backend: str, stage: str, node: str, op: str, buffers: frozenset[str],
                 value: str = "its output") -> None:
        self.backend, self.stage, self.node, self.op, self.buffers = backend, stage, node, op, buffers
        self.value = value
        fix = ("annotate the op's schema with the alias it may return (Tensor(a) -> Tensor(a)), or return a copy"
               if value == "its output" else "write into the tensor it is given (out.copy_(...)) instead of "
               "pointing it at other memory (set_, as_strided_)")
        super().__init__(
            f"backend {backend!r} stage {stage}: op {op} (node {node!r}) left {value} sharing memory with "
            f"shared buffer(s) {sorted(buffers)} on this step, which no example showed: its consumers would read the "
            f"live buffer after its release. The step is refused; {fix}")


def opaque_op(node: fx.Node) -> bool:
    """A call of an op whose kernel neither torch nor readfence registered: a kernel a user
    registered, in whatever namespace (``aten`` included).

    >>> gm = fx.symbolic_trace(lambda x: x + 1)
    >>> [opaque_op(n) for n in gm.graph.nodes]
    [False, False, False]
    """
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and not trusted_op(target)


def _checked_values(node: fx.Node) -> list[tuple[fx.Node, str]]:
    """What an opaque op's check looks at: its output, then each distinct node among its arguments
    (named by the schema argument it was passed as)."""
    out = [(node, "its output")]
    seen = {node}
    values = bind_arguments(node.target, node.args, node.kwargs)
    for arg, value in zip(node.target._schema.arguments, values):  # type: ignore[union-attr]
        for ref in _refs(value):
            if ref not in seen:
                seen.add(ref)
                out.append((ref, f"its argument {arg.name!r} (node {ref.name!r})"))
    return out


def _refs(value: Any) -> list[fx.Node]:
    refs: list[fx.Node] = []
    fx.node.map_arg(value, refs.append)
    return refs


class _AliasCheck:
    """The inserted check: after the op, each value it returned or was given touches no shared
    buffer beyond what the analysis found for that value (``expected``, in ``values`` order)."""

    def __init__(self, backend: str, stage: str, node: str, op: str, values: tuple[str, ...],
                 expected: tuple[frozenset[str], ...], buffers: BufferMap) -> None:
        self.backend, self.stage, self.node, self.op = backend, stage, node, op
        self.values, self.expected, self.buffers = values, expected, buffers
        self.__name__ = f"alias_check_{node}"

    def __call__(self, *values: Any) -> None:
        touched = self.buffers.touched_by
        for value, expected, what in zip(values, self.expected, self.values, strict=True):
            # readfence's own look at memory (``data_ptr()``): no mode watching the step (check
            # mode's read observer) may take it for the step's code handing memory out
            with unobserved():
                hit = touched(value) - expected
            if hit:
                raise ReplayAliasError(self.backend, self.stage, self.node, self.op, hit, what)


def insert_alias_checks(gm: fx.GraphModule, live: BufferMap, *, backend: str, stage: str) -> fx.GraphModule:
    """``gm`` with an alias check after every opaque op, of its output and of every tensor it was
    given (see the module docstring), or ``gm`` itself when it calls none.

    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> from readfence.core.tracing import analyse  # what the analysis finds each value aliases
    >>> lib = torch.library.Library("alias_check_demo", "FRAGMENT")
    >>> _ = lib.define("rows_of(Tensor lens, Tensor rows) -> Tensor")  # no alias annotation
    >>> def rows_of(lens, rows):  # a fast path: a view when the rows are consecutive
    ...     first = int(rows[0])
    ...     if rows.tolist() == list(range(first, first + len(rows))):
    ...         return lens.narrow(0, first, len(rows))
    ...     return lens.index_select(0, rows)
    >>> lib.impl("rows_of", rows_of, "CPU")
    >>> lens = torch.arange(4)
    >>> gm = make_fx(lambda t, rows: torch.ops.alias_check_demo.rows_of(t, rows) + 0)(lens, torch.tensor([2, 0]))
    >>> _ = analyse(gm.graph, {"t_1": frozenset({"seq_lens"})})
    >>> checked = insert_alias_checks(gm, BufferMap.of({"seq_lens": lens}), backend="mine", stage="body")
    >>> checked(lens, torch.tensor([3, 1])).tolist()
    [3, 1]
    >>> checked(lens, torch.tensor([1, 2]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.graph.lowering._fx_aliases.ReplayAliasError: backend 'mine' stage body: op alias_check_demo.rows_of.default ...

    An op that points a tensor it is given at the live buffer is refused the same way:

    >>> _ = lib.define("rows_into(Tensor lens, Tensor rows, Tensor(a!) out) -> ()")
    >>> def rows_into(lens, rows, out):
    ...     if rows.tolist() == [0, 1]:  # a fast path: the tensor it was given, pointed at the lengths
    ...         out.set_(lens.untyped_storage(), 0, (2,), (1,))
    ...     else:
    ...         out.copy_(lens.index_select(0, rows))
    >>> lib.impl("rows_into", rows_into, "CPU")
    >>> def stage(t, rows):
    ...     out = torch.empty(2, dtype=t.dtype)
    ...     torch.ops.alias_check_demo.rows_into(t, rows, out)
    ...     return out + 0
    >>> gm = make_fx(stage)(lens, torch.tensor([3, 1]))
    >>> _ = analyse(gm.graph, {"t_1": frozenset({"seq_lens"})})
    >>> checked = insert_alias_checks(gm, BufferMap.of({"seq_lens": lens}), backend="mine", stage="body")
    >>> checked(lens, torch.tensor([3, 1])).tolist()
    [3, 1]
    >>> checked(lens, torch.tensor([0, 1]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.graph.lowering._fx_aliases.ReplayAliasError: backend 'mine' stage body: op ... left its argument 'out' (node 'empty') ...
    """
    if not any(opaque_op(n) for n in gm.graph.nodes):
        return gm
    out = copy_graph(gm)
    graph = out.graph
    for node in [n for n in graph.nodes if opaque_op(n)]:
        checked = _checked_values(node)
        check = _AliasCheck(backend, stage, node.name, str(node.target), tuple(what for _, what in checked),
                            tuple(frozenset(n.meta.get(ALIASES_KEY, ())) for n, _ in checked), live)
        with graph.inserting_after(node):
            inserted = graph.call_function(check, tuple(n for n, _ in checked))
        inserted.meta[ALIAS_CHECK_KEY] = True
        inserted.meta[HOOK_KEY] = ("alias_check", node.name)  # the same check in every slot
    out.recompile()
    return out


__all__ = ["ALIAS_CHECK_KEY", "ReplayAliasError", "insert_alias_checks", "opaque_op"]
