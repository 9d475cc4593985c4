"""What an op's schema says about aliasing and writes, for the static and the runtime checks.

Both the alias analysis over traced graphs and the runtime read observer ask the same three
questions of an op: which arguments does it write, which arguments may each output contain
an alias of, and is it a pure view (it only makes aliases, reading no data). They are
answered from the schema by torch's own alias oracle (``torch._C._SchemaInfo``), which knows
containers (``Tensor(a)[]`` pieces of ``split``/``unbind``), wildcards and write annotations,
rather than from a list of op names (a list is how holes get in).

A fourth question, which arguments an op uses only for their metadata (shape, dtype, device,
strides: ``zeros_like``'s ``self``), is answered from torch's own classification of its ops:
the ``*_like`` and ``new_*`` constructors its fake tensors build from metadata alone, and the
metadata queries they answer without data. Like a view claim, it is a claim that the memory
checks hold an op's real run to (``_memory.metadata_claim_holds``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch._C import _SchemaArgType as _ArgType
from torch._C import _SchemaArgument as _Arg
from torch._C import _SchemaInfo

from ._origin import trusted_op

_OPAQUE_KINDS = ("AnyType", "ClassType", "InterfaceType", "PyObjectType", "CapsuleType")


def _is_opaque_type(ty: Any) -> bool:
    kind = ty.kind()
    if kind in _OPAQUE_KINDS:
        return True
    if kind in ("OptionalType", "ListType"):
        return _is_opaque_type(ty.getElementType())
    if kind == "TupleType":
        return any(_is_opaque_type(t) for t in ty.elements())
    return False


@attrs.frozen
class OpAliasing:
    """An op's aliasing, by argument position (``schema.arguments`` order).

    ``writes``: arguments the op may write. ``outputs``: per return, the arguments it may
    contain an alias of. ``opaque``: an argument type the analysis cannot look into (a Python
    object, ``Any``): then anything it touches is unknown; ``opaque_args`` are those arguments
    (a call that binds each of them to a name or a number hides nothing: see ``_collectives``).

    >>> a = op_aliasing(torch.ops.aten.split.Tensor)
    >>> a.outputs, a.is_view
    (((0,),), True)
    >>> op_aliasing(torch.ops.aten.index_put_.default).writes
    (0,)
    >>> op_aliasing(torch.ops.aten.index_select.default).is_view
    False
    >>> a = op_aliasing(torch.ops.aten._foreach_add.Scalar)  # the oracle's worst case, not a claim
    >>> a.is_view, a.annotated
    (True, False)
    """

    name: str
    writes: tuple[int, ...]
    outputs: tuple[tuple[int, ...], ...]
    opaque: bool
    opaque_args: tuple[int, ...] = ()
    # every return carries an alias annotation (``Tensor(a)``): the claim is the op's own, not
    # the oracle's worst case for an unannotated list (``Tensor[] -> Tensor[]``)
    annotated: bool = True
    # arguments the op uses only for their metadata (shape, dtype, device, strides): it reads
    # none of their data (``zeros_like``'s ``self``)
    metadata_args: tuple[int, ...] = ()

    @property
    def is_view(self) -> bool:
        """Only makes aliases: every output aliases an input and nothing is written.

        A view reads no data; its consumers do."""
        return bool(self.outputs) and all(self.outputs) and not self.writes

    def data_args(self, count: int) -> tuple[int, ...]:
        """The positions among ``count`` arguments whose data the op may read (all but its
        :attr:`metadata_args`)."""
        return tuple(i for i in range(count) if i not in self.metadata_args)

    def written_names(self, schema: torch._C.FunctionSchema) -> tuple[str, ...]:
        return tuple(schema.arguments[i].name for i in self.writes)


@functools.lru_cache(maxsize=4096)  # keyed by op overload: a finite set per process
def _aliasing(op: Any) -> OpAliasing:
    schema = op._schema
    info = _SchemaInfo(schema)
    n_args, n_rets = len(schema.arguments), len(schema.returns)
    writes = tuple(j for j in range(n_args) if info.is_mutable(_Arg(_ArgType.input, j)))
    outputs = tuple(
        tuple(j for j in range(n_args) if info.may_contain_alias(_Arg(_ArgType.output, i), _Arg(_ArgType.input, j)))
        for i in range(n_rets)
    )
    opaque_args = tuple(j for j, a in enumerate(schema.arguments) if _is_opaque_type(a.type))
    annotated = all(r.alias_info is not None for r in schema.returns)
    template = (schema.arguments and op in _metadata_ops() and schema.arguments[0].type.kind() == "TensorType"
                and 0 not in writes and not any(0 in o for o in outputs))
    return OpAliasing(f"{schema.name}.{schema.overload_name}".rstrip("."), writes, outputs, bool(opaque_args),
                      opaque_args, annotated, (0,) if template else ())


#: torch's in-place view ops that can reallocate the storage under ``self`` (a write of its memory)
_STORAGE_RESIZERS = ("aten::resize_", "aten::resize_as_")


def moves_metadata_only(op: Any) -> bool:
    """Whether ``op`` is one of torch's own in-place view ops (tag ``inplace_view``: ``unsqueeze_``,
    ``t_``, ``as_strided_``, ``set_``): it changes ``self``'s shape, strides or storage pointer, no
    byte of the memory it was over; not one that can reallocate that storage (``resize_``), nor
    anyone else's op carrying the tag (torch's own is decided by where it was registered). Its
    schema marks ``self`` written: a write of the tensor object, which matters where that object is
    one another party holds (a state's buffer itself), not where it is a view of one.

    >>> moves_metadata_only(torch.ops.aten.unsqueeze_.default), moves_metadata_only(torch.ops.aten.resize_.default)
    (True, False)
    >>> moves_metadata_only(torch.ops.aten.add_.Tensor)
    False
    """
    return (isinstance(op, torch._ops.OpOverload) and torch.Tag.inplace_view in op.tags
            and op.name() not in _STORAGE_RESIZERS and trusted_op(op))


@functools.cache
def _metadata_ops() -> frozenset[Any]:
    """The ops torch itself runs from their first argument's metadata alone: the constructors its
    fake tensors build from metadata (``zeros_like``, ``empty_like``, ``new_zeros``, ...) and the
    metadata queries they answer without data (``size``, ``stride``); empty where this torch names
    neither (every argument then counts as read).

    >>> torch.ops.aten.zeros_like.default in _metadata_ops(), torch.ops.aten.clone.default in _metadata_ops()
    (True, False)
    """
    ops: set[Any] = set()
    try:
        from torch._subclasses.fake_impls import _like_tensor_constructors

        ops.update(_like_tensor_constructors)
    except ImportError:  # pragma: no cover - a torch without the registry
        pass
    try:
        from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS

        ops.update(_DISPATCH_META_HANDLERS)
    except ImportError:  # pragma: no cover
        pass
    return frozenset(ops)


def op_aliasing(op: object) -> OpAliasing | None:
    """The aliasing of an op overload (``torch.ops.ns.op.overload``); ``None`` without a schema."""
    if getattr(op, "_schema", None) is None:
        return None
    return _aliasing(op)


def bind(op: Any, args: Sequence[object], kwargs: Mapping[str, object], *, defaults: bool = False) -> list[Any]:
    """The value passed for each schema argument, in schema order (``None`` when omitted, or
    with ``defaults`` the schema's default where it has one: two calls that differ only in
    spelling a default out then bind alike).

    >>> bind(torch.ops.aten.add.Tensor, (1, 2), {"alpha": 3})
    [1, 2, 3]
    >>> bind(torch.ops.aten.add.Tensor, (1, 2), {}), bind(torch.ops.aten.add.Tensor, (1, 2), {}, defaults=True)
    ([1, 2, None], [1, 2, 1])
    """
    out = []
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out.append(args[i])
        elif arg.name in kwargs or not defaults or not arg.has_default_value():
            out.append(kwargs.get(arg.name))
        else:
            out.append(arg.default_value)
    return out
