"""FX pass: at every replay, hold an opaque op's outputs to the aliasing the analysis found.

The analysis decides what a custom op's output aliases from its schema, checked on the memory of
the examples it ran on. A kernel registered without an alias annotation may still return a view
of its input on a path no example took (a fast path when the batch's rows are consecutive): its
output then aliases a shared buffer the analysis took it not to, and a consumer after the
buffer's release reads the live buffer. :func:`insert_alias_checks` inserts, after every op that
is neither torch's own (``aten``, ``prims``) nor readfence's, a check of its outputs' memory
against the live shared buffers' address ranges: a hit the analysis did not count refuses the
step (:class:`ReplayAliasError`, naming the op), before any consumer runs. It costs an address
comparison per opaque op per replay, and applies where a replay runs Python: the CPU device.
Each check is a hook of the compiled code (``_fx_memory.HOOK_KEY``): the lowering's translation
validation runs the code with it off, on states that are not the live one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from readfence.core.internal import ALIASES_KEY, BufferMap, copy_graph
from readfence.effects import ReadfenceError

from ._fx_memory import HOOK_KEY

ALIAS_CHECK_KEY = "readfence_alias_check"
_OWN_NAMESPACES = frozenset({"aten", "prims", "readfence"})


class ReplayAliasError(ReadfenceError, RuntimeError):
    """An opaque op's output shared memory with a shared buffer at a replay, where the analysis,
    from the op's schema and the examples, took it to alias none of it.

    ``backend``, ``stage``, ``node``, ``op`` and ``buffers`` say where and what.
    """

    def __init__(self, backend: str, stage: str, node: str, op: str, buffers: frozenset[str]) -> None:
        self.backend, self.stage, self.node, self.op, self.buffers = backend, stage, node, op, buffers
        super().__init__(
            f"backend {backend!r} stage {stage}: op {op} (node {node!r}) returned a tensor sharing memory with "
            f"shared buffer(s) {sorted(buffers)} on this step, which no example showed: its consumers would read the "
            f"live buffer after its release. The step is refused; annotate the op's schema with the alias it may "
            f"return (Tensor(a) -> Tensor(a)), or return a copy")


def opaque_op(node: fx.Node) -> bool:
    """A call of an op that is neither torch's own nor readfence's: a kernel a user registered.

    >>> gm = fx.symbolic_trace(lambda x: x + 1)
    >>> [opaque_op(n) for n in gm.graph.nodes]
    [False, False, False]
    """
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace not in _OWN_NAMESPACES)


class _AliasCheck:
    """The inserted check: the op's outputs alias no shared buffer beyond ``expected``."""

    def __init__(self, backend: str, stage: str, node: str, op: str, expected: frozenset[str],
                 buffers: BufferMap) -> None:
        self.backend, self.stage, self.node, self.op = backend, stage, node, op
        self.expected, self.buffers = expected, buffers
        self.__name__ = f"alias_check_{node}"

    def __call__(self, value: Any) -> None:
        hit = self.buffers.touched_by(value) - self.expected
        if hit:
            raise ReplayAliasError(self.backend, self.stage, self.node, self.op, hit)


def insert_alias_checks(gm: fx.GraphModule, live: BufferMap, *, backend: str, stage: str) -> fx.GraphModule:
    """``gm`` with an alias check after every opaque op (see the module docstring), or ``gm``
    itself when it calls none.

    >>> from torch.fx.experimental.proxy_tensor import make_fx
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
    >>> checked = insert_alias_checks(gm, BufferMap.of({"seq_lens": lens}), backend="mine", stage="body")
    >>> checked(lens, torch.tensor([3, 1])).tolist()
    [3, 1]
    >>> checked(lens, torch.tensor([1, 2]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.graph.lowering._fx_aliases.ReplayAliasError: backend 'mine' stage body: op alias_check_demo.rows_of.default ...
    """
    if not any(opaque_op(n) for n in gm.graph.nodes):
        return gm
    out = copy_graph(gm)
    graph = out.graph
    for node in [n for n in graph.nodes if opaque_op(n)]:
        check = _AliasCheck(backend, stage, node.name, str(node.target), frozenset(node.meta.get(ALIASES_KEY, ())),
                            live)
        with graph.inserting_after(node):
            inserted = graph.call_function(check, (node,))
        inserted.meta[ALIAS_CHECK_KEY] = True
        inserted.meta[HOOK_KEY] = ("alias_check", node.name)  # the same check in every slot
    out.recompile()
    return out


__all__ = ["ALIAS_CHECK_KEY", "ReplayAliasError", "insert_alias_checks", "opaque_op"]
