"""The ``Backend`` value, leaves, user-defined leaves and redeclaration.

A backend is an immutable value. Its effect table (one :class:`ReadEffect` per
:class:`ForwardMode`) is computed once, at construction: a leaf's from its declaration, a
combinator's from its children's tables. So ``read_effect`` is a lookup, building a tree is
linear in its size, and deep trees never recurse. Equality, hashing and ``str`` are iterative
as well.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
from torch import Tensor

from readfence.core import PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, ChildRun, ForwardMode
from readfence.core.internal import check_mode
from readfence.effects import ReadEffect, ReadEnd

from ._effect_tables import _INDEX
from ._effect_tables import MODES as MODES
from ._effect_tables import EffectIds as EffectIds
from ._effect_tables import EffectPair as EffectPair
from ._effect_tables import Table as Table
from ._effect_tables import Tensors as Tensors
from ._effect_tables import check_buffers as check_buffers
from ._effect_tables import default_declaration as default_declaration
from ._effect_tables import intern as intern
from ._effect_tables import intern_table as intern_table
from ._effect_tables import join2 as join2
from ._effect_tables import join_effects as join_effects
from ._effect_tables import make_table as make_table
from ._effect_tables import table_of as table_of


def _hash_or_id(value: object) -> int:
    # a part of a backend that cannot be hashed (a callable dataclass instance as ``attend``): its
    # identity; ``__eq__`` compares hashes first, so equal backends still hash alike
    try:
        return hash(value)
    except TypeError:
        return id(value)


class Backend:
    """An attention backend: pure stage functions plus an effect table (immutable).

    Subclasses: :class:`Leaf` (declared effects) and the combinators (computed effects).

    >>> from readfence.backends import paged
    >>> b = paged()
    >>> b.read_end(ForwardMode.DECODE), b == paged(), str(b)
    (<ReadEnd.IN_REPLAY: 2>, True, 'paged')
    """

    __slots__ = ()

    # -- set by subclasses in __attrs_post_init__ -------------------------------------------
    _table: Table
    _hash: int

    @property
    def name(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def children(self) -> tuple[tuple[str, Backend], ...]:
        """``(label, child)`` pairs; ``()`` for a leaf."""
        return ()

    def active_children(self, mode: ForwardMode) -> tuple[tuple[str, Backend], ...]:
        """The children whose effects make up this node's effect in ``mode``; ``()`` for a leaf."""
        check_mode(mode)
        return ()

    def child_runs(self, mode: ForwardMode, batch_size: int) -> tuple[ChildRun, ...]:
        """The children a step in ``mode`` at ``batch_size`` runs, each at the batch size it is
        handed: by default every child, at ``batch_size``; ``()`` for a leaf. The audit judges
        each node only where it runs (``readfence.core.child_runs``).

        >>> from readfence.backends import join, paged, linear
        >>> [(r.label, r.batch_size) for r in join(paged(), linear()).child_runs(ForwardMode.DECODE, 2)]
        [('children[0]', 2), ('children[1]', 2)]
        """
        check_mode(mode)
        return tuple(ChildRun(label, child, batch_size) for label, child in self.children())

    def with_children(self, children: Sequence[Backend]) -> Backend:
        """The same node over new children (a leaf has none and returns itself)."""
        if tuple(children):
            raise ValueError(f"{self.name} is a leaf: it has no children to replace")
        return self

    def runs_as(self, mode: ForwardMode) -> Backend:
        """The backend whose stage functions this one's step in ``mode`` runs, unchanged: itself,
        or the child a wrapper hands the whole step to. Backends with the same ``runs_as`` have the
        same trace and observation in ``mode`` (``core.audit`` makes each once).

        >>> from readfence.backends import hybrid, paged, dense
        >>> str(hybrid(decode=paged(), prefill=dense()).runs_as(ForwardMode.EXTEND))
        'dense'
        """
        check_mode(mode)
        return self

    def read_effect(self, mode: ForwardMode) -> ReadEffect:
        """Per shared buffer, when this backend's last read of it ends in a step of ``mode``."""
        return self._table[_INDEX[check_mode(mode, "read_effect(mode)")]]

    def read_end(self, mode: ForwardMode) -> ReadEnd:
        """``read_effect(mode).end``: the join over all buffers."""
        return self.read_effect(check_mode(mode, "read_end(mode)")).end

    def effects(self) -> dict[ForwardMode, ReadEffect]:
        """The whole effect table, ``{mode: read_effect(mode)}``."""
        return dict(zip(MODES, self._table))

    def walk(self) -> Iterable[tuple[str, Backend]]:
        """Every node with its path (``tbo/children[0]/deepseek_v4``), pre-order, iterative.

        >>> from readfence.backends import tbo, paged, linear
        >>> [p for p, _ in tbo(paged(), linear()).walk()]
        ['tbo', 'tbo/primary/paged', 'tbo/children[0]/linear']
        """
        stack: list[tuple[str, Backend]] = [(self.name, self)]
        while stack:
            path, node = stack.pop()
            yield path, node
            for label, child in reversed(node.children()):
                stack.append((f"{path}/{label}/{child.name}", child))

    # -- stage functions (subclasses implement; see readfence.core.BackendLike) --------------
    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        """Eager metadata before the replay (``PRE_REPLAY``); see :meth:`readfence.core.BackendLike.prepare_out_graph`."""
        raise NotImplementedError

    def prepare_in_graph(
        self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors
    ) -> dict[str, Tensor]:
        """The graph's first nodes (``IN_REPLAY``); see :meth:`readfence.core.BackendLike.prepare_in_graph`."""
        raise NotImplementedError

    def attend(
        self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor,
        pools: dict[str, Tensor], shared: Tensors, batch: Tensors, meta: Tensors,
    ) -> Tensor:
        """One layer's attention in the model body (``POST_REPLAY``); see :meth:`readfence.core.BackendLike.attend`."""
        raise NotImplementedError

    # -- value semantics, all iterative ----------------------------------------------------
    def _shallow(self) -> tuple[Any, ...]:
        """What identifies this node apart from its children."""
        raise NotImplementedError

    def _spec_parts(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        """``(head, args)``: args are ``(keyword or None, Backend or literal)`` pairs."""
        raise NotImplementedError

    def _finish(self, table: Table) -> None:
        object.__setattr__(self, "_table", table)
        child_hashes = tuple((label, c._hash) for label, c in self.children())
        shallow = tuple(_hash_or_id(part) for part in self._shallow())
        object.__setattr__(self, "_hash", hash((type(self).__name__, shallow, child_hashes)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Backend):
            return NotImplemented
        stack: list[tuple[Backend, Backend]] = [(self, other)]
        while stack:
            a, b = stack.pop()
            if a is b:
                continue
            if type(a) is not type(b) or a._hash != b._hash or a._shallow() != b._shallow():
                return False
            ca, cb = a.children(), b.children()
            if len(ca) != len(cb):
                return False
            for (la, xa), (lb, xb) in zip(ca, cb):
                if la != lb:
                    return False
                stack.append((xa, xb))
        return True

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __str__(self) -> str:
        return to_spec(self)

    def __repr__(self) -> str:
        return f"<Backend {to_spec(self)}>"


def literal(value: object) -> str:
    """A spec literal: ``true``/``false``, ints, floats, double-quoted strings.

    >>> literal(True), literal(8), literal("0111")
    ('true', '8', '"0111"')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return f'"{value}"'
    raise TypeError(f"no spec literal for {value!r} ({type(value).__name__})")


def to_spec(backend: Backend) -> str:
    """The spec text of ``backend`` (``parse`` reads it back), built without recursion.

    >>> from readfence.backends import tbo, deepseek_v4, paged
    >>> to_spec(tbo(deepseek_v4(dspark=True), paged()))
    'tbo(deepseek_v4(dspark=true), paged)'
    """
    out: list[str] = []
    stack: list[Backend | str] = [backend]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        head, args = item._spec_parts()
        if not args:
            out.append(head)
            continue
        pieces: list[Backend | str] = [head + "("]
        for i, (key, value) in enumerate(args):
            if i:
                pieces.append(", ")
            if key is not None:
                pieces.append(f"{key}=")
            pieces.append(value if isinstance(value, Backend) else literal(value))
        pieces.append(")")
        stack.extend(reversed(pieces))
    return "".join(out)


# ------------------------------------------------------------------------------------------
# Leaves
# ------------------------------------------------------------------------------------------


def _as_dict(out: Any) -> Any:
    # a mapping as a dict; anything else as it is, for the step's check to name (a tensor given
    # to dict() fails with "dictionary update sequence element", naming nothing)
    return dict(out) if isinstance(out, Mapping) else out


@attrs.frozen(eq=False, repr=False)
class Functions:
    """A leaf kernel made of three plain functions (what :func:`leaf` builds)."""

    attend_fn: Callable[..., Tensor]
    prepare_out_graph_fn: Callable[..., dict[str, Tensor]] | None = None
    prepare_in_graph_fn: Callable[..., dict[str, Tensor]] | None = None

    def _key(self) -> tuple[Any, ...]:
        return (self.attend_fn, self.prepare_out_graph_fn, self.prepare_in_graph_fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Functions) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        fn = self.prepare_out_graph_fn
        return {} if fn is None else _as_dict(fn(mode, shared, batch))

    def prepare_in_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors,
                         meta: Tensors) -> dict[str, Tensor]:
        fn = self.prepare_in_graph_fn
        return {} if fn is None else _as_dict(fn(mode, shared, batch, meta))

    def attend(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor,
               pools: dict[str, Tensor], shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        return self.attend_fn(mode, layer, q, k, v, pools, shared, batch, meta)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a backend name must be an identifier (it appears in specs), got {name!r}")
    return name


class _Kernel(Protocol):
    """What a leaf runs: the three stage functions, called with the step's mode."""

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]: ...

    def prepare_in_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors,
                         meta: Tensors) -> dict[str, Tensor]: ...

    def attend(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor,
               pools: dict[str, Tensor], shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor: ...


@attrs.frozen(eq=False, repr=False)
class Leaf(Backend):
    """A leaf backend: a kernel (the three stage functions) and a declared effect table.

    ``IDLE`` is the empty step: the kernel is not called, prepare stages return ``{}`` and
    ``attend`` returns zeros shaped like ``q``, so no stage reads a shared buffer.
    """

    leaf_name: str = attrs.field(converter=_check_name)
    kernel: _Kernel
    declaration: Table
    options: tuple[tuple[str, bool | int | float | str], ...] = ()
    _table: Table = attrs.field(init=False, default=None)
    _hash: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if len(self.declaration) != len(MODES):
            raise ValueError(f"{self.leaf_name}: a declaration has one effect per mode")
        self._finish(intern_table(self.declaration))

    @property
    def name(self) -> str:
        return self.leaf_name

    def _shallow(self) -> tuple[Any, ...]:
        return (self.leaf_name, self.kernel, self._table, self.options)

    def _spec_parts(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        return self.leaf_name, tuple(self.options)

    def runs_as(self, mode: ForwardMode) -> Backend:
        """Itself, but in ``IDLE``, where no stage calls the kernel: one empty leaf's step, the
        same for every leaf."""
        return _empty_leaf() if check_mode(mode) is ForwardMode.IDLE else self

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        if check_mode(mode) is ForwardMode.IDLE:
            return {}
        return self._dict_of(PREPARE_OUT_GRAPH, self.kernel.prepare_out_graph, mode, shared, batch)

    def prepare_in_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors,
                         meta: Tensors) -> dict[str, Tensor]:
        if check_mode(mode) is ForwardMode.IDLE:
            return {}
        return self._dict_of(PREPARE_IN_GRAPH, self.kernel.prepare_in_graph, mode, shared, batch, meta)

    def _dict_of(self, stage: Any, fn: Callable[..., Any], *args: Any) -> dict[str, Tensor]:
        """What the kernel's ``stage`` returned, refused here (naming this leaf and the line) when it
        is no dict: a wrapper merging its children's dicts would fail on it naming nothing."""
        out = fn(*args)
        if not isinstance(out, Mapping):
            from readfence.core.internal import check_stage_output

            check_stage_output(stage, out, backend=self.name, fn=lambda: fn(*args))
        return out

    def attend(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor,
               pools: dict[str, Tensor], shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        if check_mode(mode) is ForwardMode.IDLE:
            return q.new_zeros(q.shape)
        args = (mode, layer, q, k, v, pools, shared, batch, meta)
        out = self.kernel.attend(*args)
        if not (isinstance(out, Tensor) and out.shape == q.shape and out.dtype == q.dtype and out.device == q.device):
            # named here, not by the model's reshape or a wrapper's sum
            from readfence.core import BODY
            from readfence.core.internal import check_stage_output

            check_stage_output(BODY, out, backend=self.name, like=q, layer=layer, fn=lambda: self.kernel.attend(*args))
        return out


Declaration = Mapping[ForwardMode, ReadEffect] | Callable[[ForwardMode], ReadEffect] | None


def declaration_table(name: str, declare: Declaration, reads: Iterable[str] | None) -> Table:
    """The table of ``declare`` (a mapping or function); unlisted modes get the default.

    A mapping must be non-empty (omit ``declare`` for the default) and map each mode it lists
    to a ``ReadEffect`` (leave a mode out for its default); ``reads`` and every declared
    buffer must be shared buffers.
    """
    if reads is not None:
        if isinstance(reads, str):
            raise TypeError(f"reads of {name} must be a list of buffer names, got {reads!r} (str); "
                            f"write [{reads!r}]")
        reads = check_buffers(reads, f"reads of {name}")
    if declare is None:
        return make_table(lambda m: default_declaration(m, reads), name)
    if callable(declare) and not isinstance(declare, Mapping):
        return make_table(declare, name)
    if not isinstance(declare, Mapping):
        raise TypeError(f"declare of {name} must be a mapping mode -> ReadEffect or a function, "
                        f"got {declare!r}")
    if not declare:
        raise ValueError(f"declare of {name} is an empty mapping; omit declare for the default declaration "
                         "(IN_REPLAY for DECODE and TARGET_VERIFY, UNKNOWN otherwise)")
    for key, effect in declare.items():
        mode = check_mode(key, f"declare key of {name}")
        if effect is None:
            raise TypeError(f"declare of {name} maps {mode.name} to None; give it a ReadEffect, or leave "
                            f"{mode.name} out for its default declaration")
    return make_table(lambda m: declare[m] if m in declare else default_declaration(m, reads), name)


#: What each stage of a leaf is called with, positionally (``readfence.core.BackendLike``).
STAGE_ARGUMENTS = {
    "attend": ("mode", "layer", "q", "k", "v", "pools", "shared", "batch", "meta"),
    PREPARE_OUT_GRAPH.name: ("mode", "shared", "batch"),
    PREPARE_IN_GRAPH.name: ("mode", "shared", "batch", "meta"),
}


def _check_stage(name: str, stage: str, fn: Callable[..., Any]) -> None:
    """Refuse a stage function that cannot be called the way the step calls it (a function
    whose signature Python cannot read, a builtin, is let through).

    >>> _check_stage("mine", "prepare_out_graph", lambda mode, shared: {})  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: prepare_out_graph of leaf 'mine' is called as prepare_out_graph(mode, shared, batch), but
    it takes (mode, shared): too many positional arguments
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    names = STAGE_ARGUMENTS[stage]
    try:
        sig.bind(*names)
    except TypeError as e:
        raise TypeError(f"{stage} of leaf {name!r} is called as {stage}({', '.join(names)}), but it takes "
                        f"{str(sig).split(' ->')[0]}: {e}") from None


def leaf(
    name: str,
    attend: Callable[..., Tensor],
    *,
    prepare_out_graph: Callable[..., dict[str, Tensor]] | None = None,
    prepare_in_graph: Callable[..., dict[str, Tensor]] | None = None,
    declare: Declaration = None,
    reads: Iterable[str] | None = None,
) -> Leaf:
    """Define your own leaf backend from plain functions.

    The stages are those of :class:`readfence.core.BackendLike` (its methods say what each
    receives, may read, must not write, and what crosses into the graph):

    * ``name``: an identifier; specs and messages use it;
    * ``attend(mode, layer, q, k, v, pools, shared, batch, meta) -> Tensor``: every layer, in the
      model body. Reads of ``shared`` here end at ``POST_REPLAY``; it may write ``pools`` (store
      ``k``/``v`` at ``batch["out_cache_loc"]``), never ``shared``; returns a tensor shaped like ``q``;
    * ``prepare_out_graph(mode, shared, batch) -> dict``: eager, before the replay (reads end at
      ``PRE_REPLAY``; host reads allowed). Its outputs cross into the graph as copies, made as
      it returns. Omitted: ``{}``;
    * ``prepare_in_graph(mode, shared, batch, meta) -> dict``: the graph's first nodes (reads
      end at ``IN_REPLAY``; device ops only). ``meta`` holds the copies of
      ``prepare_out_graph``'s outputs; its own outputs join ``meta`` for ``attend``, uncopied.
      Omitted: ``{}``;
    * ``declare``: per mode, when each buffer's last read ends: a mapping mode ->
      ``ReadEffect`` (modes it leaves out get the default) or a function of the mode. Omit it
      (rather than pass ``{}``) for the default everywhere: ``IN_REPLAY`` over ``reads`` for
      DECODE/TARGET_VERIFY, ``UNKNOWN`` otherwise;
    * ``reads``: the buffers the default declaration covers (every buffer when ``None``).

    Every buffer named (in ``reads`` or a declared effect) must be one of
    ``readfence.core.SHARED_BUFFERS``. ``core.audit`` checks the declaration against what the
    code reads; ``graph.verify`` checks it at run time.

    >>> from readfence.backends import softmax_attention, page_meta, store_kv
    >>> def prep(mode, shared, batch, meta):
    ...     return page_meta(shared, batch)          # reads req_to_token, seq_lens in graph
    >>> def attend(mode, layer, q, k, v, pools, shared, batch, meta):
    ...     store_kv(pools, layer, batch["out_cache_loc"], k, v)
    ...     return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
    >>> mine = leaf("mine", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])
    >>> mine.read_effect(ForwardMode.DECODE)
    ReadEffect({'req_to_token': IN_REPLAY, 'seq_lens': IN_REPLAY}, default=NONE)
    >>> mine.read_end(ForwardMode.EXTEND)
    <ReadEnd.UNKNOWN: 4>
    """
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"name of a leaf must be a non-empty str (specs and messages use it), got {name!r} "
                        f"({type(name).__name__})")
    if not callable(attend):
        raise TypeError(f"attend of leaf {name!r} must be callable, got {attend!r}")
    _check_stage(name, "attend", attend)
    for stage, fn in ((PREPARE_OUT_GRAPH.name, prepare_out_graph), (PREPARE_IN_GRAPH.name, prepare_in_graph)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{stage} of leaf {name!r} must be callable or None, got {fn!r}")
        if fn is not None:
            _check_stage(name, stage, fn)
    return Leaf(name, Functions(attend, prepare_out_graph, prepare_in_graph),
                declaration_table(name, declare, reads))


def _zeros_like_q(mode: ForwardMode, layer: int, q: Tensor, *rest: object) -> Tensor:
    return q.new_zeros(q.shape)


@functools.cache  # one value, so that every leaf's IDLE step is one trace
def _empty_leaf() -> Leaf:
    """The leaf whose step every leaf runs in ``IDLE`` (:meth:`Leaf.runs_as`)."""
    return leaf("empty", _zeros_like_q, reads=())


def redeclare(backend: Backend, read_effect: Callable[[ForwardMode], ReadEffect]) -> Leaf:
    """A copy of the leaf ``backend`` whose declaration is ``read_effect(mode)``.

    Combinators compute their effects, so only leaves can be redeclared. The buffers the
    effects name must be shared buffers (``readfence.core.SHARED_BUFFERS``).

    >>> from readfence.backends import paged
    >>> loose = redeclare(paged(), lambda mode: ReadEffect.unknown())
    >>> loose.read_end(ForwardMode.DECODE), loose == paged()
    (<ReadEnd.UNKNOWN: 4>, False)
    """
    if not isinstance(backend, Leaf):
        raise TypeError(
            f"redeclare takes a leaf; {backend.name if isinstance(backend, Backend) else backend!r} "
            "is a combinator whose effect is computed from its children (redeclare those)"
        )
    if not callable(read_effect):
        raise TypeError(f"read_effect must be a function mode -> ReadEffect, got {read_effect!r}")
    return attrs.evolve(backend, declaration=make_table(read_effect, backend.name))
