"""What a traced collective reads: its inputs, until the wait of its output.

torch's functional collectives (``torch.distributed._functional_collectives``) trace to two
nodes: an op of the ``_c10d_functional`` namespace that *starts* the collective and returns
its output at once, and a ``wait_tensor`` of that output that blocks until it is done. In
between, the process group's backend (gloo's worker threads, NCCL's stream) may still read
the op's inputs, so a fence placed right after the starting node would let the scheduler
overwrite a buffer the collective is still reading: the read of a collective's inputs ends at
the wait of its output. ``wait_tensor`` returns its argument itself (its schema says nothing
of it), so its output aliases what its argument aliases.

The schemas take the process group by name (``Any group_name``); a name is a string, which
cannot carry a tensor into the op, so an ``Any`` argument bound to a string (or a number)
does not make the op opaque.

These are the rules ``_alias`` applies; they are keyed by op namespace and overload, like
every other rule of the analysis, not by call sites.

>>> import torch
>>> import torch.distributed._functional_collectives  # registers the ops
>>> starts_collective(torch.ops._c10d_functional.all_reduce.default)
True
>>> starts_collective(torch.ops._c10d_functional.wait_tensor.default), is_wait(torch.ops._c10d_functional.wait_tensor.default)
(False, True)
>>> starts_collective(torch.ops.aten.add.Tensor)
False
"""

from __future__ import annotations

from typing import Any

from ._origin import torch_op

#: Namespaces whose ops start a collective that a later ``wait_tensor`` completes.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})

#: Values an ``Any``-typed argument may hold without being able to carry a tensor.
_INERT = (str, int, float, bool, type(None))


def _collective(op: Any) -> bool:
    # torch's own functional collectives: an op defined in their namespace by other code is any op
    return getattr(op, "namespace", None) in COLLECTIVE_NAMESPACES and torch_op(op)


def is_wait(op: object) -> bool:
    """Whether ``op`` is the wait that completes a functional collective."""
    return _collective(op) and getattr(op, "__name__", "").startswith("wait_tensor")


def starts_collective(op: object) -> bool:
    """Whether ``op`` starts a collective whose reads of its inputs last until a wait."""
    return _collective(op) and not is_wait(op)


def inert(value: object) -> bool:
    """Whether an argument value cannot carry a tensor into an op (a name, a number, None).

    >>> inert("0"), inert(3), inert(object())
    (True, True, False)
    """
    return isinstance(value, _INERT)


#: Collectives that write an argument though their schema marks no write: ``irecv`` receives
#: into its tensor argument (by position in the schema).
HIDDEN_WRITES: dict[str, tuple[int, ...]] = {"_c10d_functional::irecv": (0,)}


def hidden_writes(op: object) -> tuple[int, ...]:
    """Argument positions ``op`` writes that its schema does not declare.

    >>> import torch
    >>> import torch.distributed._functional_collectives  # registers the ops
    >>> hidden_writes(torch.ops._c10d_functional.irecv.default), hidden_writes(torch.ops.aten.add.Tensor)
    ((0,), ())
    """
    schema = getattr(op, "_schema", None)
    return () if schema is None else HIDDEN_WRITES.get(schema.name, ())
