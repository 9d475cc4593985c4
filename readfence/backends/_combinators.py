"""Combinators: backends built from backends, whose effects are COMPUTED, never declared.

Two primitives decide every effect table:

* :class:`Select` (``select``, ``hybrid``): per mode, exactly the selected child's effect;
* :class:`Join` family (``join``, ``hybrid_linear``, ``minimax``, ``tbo``, ``per_stream``):
  per mode, the pointwise join of all children's effects.

They differ only in how they run: which child attends which layer (``join``,
``hybrid_linear``, ``minimax``), which micro-batch (``tbo``) or which stream (``per_stream``).
Children's metadata is namespaced ``"<label>/<key>"`` so siblings never collide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.core import ChildRun, ForwardMode
from readfence.core.internal import check_mode, request_ranges, split_batch, tokens_per_request

from ._backend import MODES, Backend, Table, join2
from ._backend import table_of as _table_of

Tensors = Mapping[str, Tensor]
M = ForwardMode


def _check_backends(where: str, backends: Sequence[object]) -> tuple[Backend, ...]:
    checked = []
    for i, b in enumerate(backends):
        if not isinstance(b, Backend):
            raise TypeError(f"{where}: argument {i} must be a Backend, got {b!r} ({type(b).__name__})")
        if isinstance(b, PerStream):
            # run as a backend, a group is its first member: nested, its other members never run
            raise TypeError(f"{where}: argument {i} is a per_stream group ({b}), which places one member on each "
                            f"forward stream of a whole step: it cannot be a child of another backend (only its "
                            f"first member would run); put per_stream at the top, or inside a step shape")
        checked.append(b)
    return tuple(checked)


def _namespaced(label: str, meta: Mapping[Any, Any]) -> dict[Any, Any]:
    # a string key becomes ``label/key``; any other key (a stage may use any hashable) ``(label, key)``
    return {f"{label}/{key}" if isinstance(key, str) else (label, key): value for key, value in meta.items()}


def _own(label: str, meta: Mapping[Any, Any]) -> dict[Any, Any]:
    """The metadata of child ``label``, as it returned it (the inverse of :func:`_namespaced`).

    >>> _own("primary", _namespaced("primary", {"lens": 1, ("k", 2): 3}) | _namespaced("micro", {"lens": 4}))
    {'lens': 1, ('k', 2): 3}
    """
    prefix = label + "/"
    out: dict[Any, Any] = {}
    for key, value in meta.items():
        if isinstance(key, str):
            if key.startswith(prefix):
                out[key[len(prefix):]] = value
        elif isinstance(key, tuple) and len(key) == 2 and key[0] == label:
            out[key[1]] = value
    return out


def _relabel(arms: tuple[tuple[str, Backend], ...], children: Sequence[Backend]
             ) -> tuple[tuple[str, Backend], ...]:
    if len(children) != len(arms):
        raise ValueError(f"expected {len(arms)} children, got {len(children)}")
    _check_backends("with_children", children)
    return tuple((label, child) for (label, _), child in zip(arms, children))


# ------------------------------------------------------------------------------------------
# select
# ------------------------------------------------------------------------------------------


@attrs.frozen(eq=False, repr=False)
class Select(Backend):
    """Per mode, run (and take the effect of) exactly one child: ``arms[route[mode]]``."""

    head: str
    arms: tuple[tuple[str, Backend], ...]
    route: tuple[int, ...]  # per mode, in MODES order: index into arms
    _table: Table = attrs.field(init=False, default=None)
    _hash: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._finish(_table_of(tuple(self.arms[r][1]._table[i] for i, r in enumerate(self.route))))

    @property
    def name(self) -> str:
        return self.head

    def children(self) -> tuple[tuple[str, Backend], ...]:
        return self.arms

    def active_children(self, mode: ForwardMode) -> tuple[tuple[str, Backend], ...]:
        """The children whose effects make up this node's effect in ``mode``: the selected one."""
        return (self.arms[self.route[MODES.index(check_mode(mode))]],)

    def child_runs(self, mode: ForwardMode, batch_size: int) -> tuple[ChildRun, ...]:
        """Only the selected arm runs, at ``batch_size``: the others are not run in ``mode``."""
        label, child = self.arms[self.route[MODES.index(check_mode(mode))]]
        return (ChildRun(label, child, batch_size),)

    def with_children(self, children: Sequence[Backend]) -> Select:
        """The same select over new children (same labels and routing)."""
        return attrs.evolve(self, arms=_relabel(self.arms, children))

    def selected(self, mode: ForwardMode) -> Backend:
        """The child that runs ``mode``."""
        return self.arms[self.route[MODES.index(check_mode(mode))]][1]

    def runs_as(self, mode: ForwardMode) -> Backend:
        """What the selected child runs as: a select only forwards each stage to it."""
        return self.selected(mode).runs_as(mode)

    def _shallow(self) -> tuple[Any, ...]:
        return (self.head, self.route)

    def _spec_parts(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        return self.head, self.arms

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        return self.selected(mode).prepare_out_graph(mode, shared, batch)

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return self.selected(mode).prepare_in_graph(mode, shared, batch, meta)

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        return self.selected(mode).attend(mode, layer, q, k, v, pools, shared, batch, meta)


def select(cases: Mapping[ForwardMode, Backend], default: Backend | None = None) -> Select:
    """Run ``cases[mode]`` (else ``default``); the effect is exactly the selected child's.

    >>> from readfence.backends import paged, deepseek_v4
    >>> b = select({ForwardMode.DECODE: paged()}, default=deepseek_v4())
    >>> b.read_effect(ForwardMode.DECODE) == paged().read_effect(ForwardMode.DECODE)
    True
    >>> str(b)
    'select(decode=paged, default=deepseek_v4)'
    """
    if not isinstance(cases, Mapping):
        raise TypeError(f"select: cases must be a mapping ForwardMode -> Backend, got {cases!r}")
    arms: list[tuple[str, Backend]] = []
    index: dict[ForwardMode, int] = {}
    for mode in MODES:  # canonical order, so equal selects print and compare equal
        if mode in cases:
            _check_backends(f"select case {mode}", [cases[mode]])
            index[mode] = len(arms)
            arms.append((mode.value, cases[mode]))
    for key in cases:
        check_mode(key, "select case key")
    if default is not None:
        _check_backends("select default", [default])
        arms.append(("default", default))
    missing = [m.value for m in MODES if m not in index]
    if missing and default is None:
        raise ValueError(f"select: no backend for modes {', '.join(missing)}; give them or a default")
    if not arms:
        raise ValueError("select needs at least one backend")
    route = tuple(index.get(m, len(arms) - 1) for m in MODES)
    return Select("select", tuple(arms), route)


def hybrid(
    decode: Backend, prefill: Backend, verify: Backend | None = None, draft_extend: Backend | None = None
) -> Select:
    """Decode-like modes on ``decode``, EXTEND on ``prefill``; TARGET_VERIFY on ``verify`` and
    DRAFT_EXTEND on ``draft_extend`` when given (else ``decode``); IDLE on ``decode``.

    >>> from readfence.backends import trtllm_mha, deepseek_v4
    >>> h = hybrid(decode=trtllm_mha(), prefill=deepseek_v4())
    >>> h.read_end(ForwardMode.DECODE), h.read_end(ForwardMode.EXTEND)
    (<ReadEnd.PRE_REPLAY: 1>, <ReadEnd.PRE_REPLAY: 1>)
    """
    _check_backends("hybrid (decode, prefill)", [decode, prefill])
    given = {"decode": decode, "prefill": prefill, "verify": verify, "draft_extend": draft_extend}
    arms = tuple((k, b) for k, b in given.items() if b is not None)
    _check_backends("hybrid", [b for _, b in arms])
    labels = [k for k, _ in arms]
    pick = {
        M.DECODE: "decode",
        M.TARGET_VERIFY: "verify" if verify is not None else "decode",
        M.DRAFT_EXTEND: "draft_extend" if draft_extend is not None else "decode",
        M.EXTEND: "prefill",
        M.IDLE: "decode",
    }
    return Select("hybrid", arms, tuple(labels.index(pick[m]) for m in MODES))


# ------------------------------------------------------------------------------------------
# join family
# ------------------------------------------------------------------------------------------


@attrs.frozen(eq=False, repr=False)
class _JoinBase(Backend):
    """Effect = pointwise join of all children, for every mode."""

    head: str
    arms: tuple[tuple[str, Backend], ...]
    _table: Table = attrs.field(init=False, default=None)
    _hash: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if not self.arms:
            raise ValueError(f"{self.head} needs at least one backend")
        tables = [b._table for _, b in self.arms]
        if len(tables) == 1:
            self._finish(tables[0])
            return
        unique = list({id(t): t for t in tables}.values())  # many children share a table
        acc = list(unique[0])
        for table in unique[1:]:
            for i, effect in enumerate(table):
                acc[i] = join2(acc[i], effect)
        self._finish(_table_of(tuple(acc)))

    @property
    def name(self) -> str:
        return self.head

    def children(self) -> tuple[tuple[str, Backend], ...]:
        return self.arms

    def active_children(self, mode: ForwardMode) -> tuple[tuple[str, Backend], ...]:
        """The children whose effects make up this node's effect in ``mode``: all of them."""
        check_mode(mode)
        return self.arms

    def with_children(self, children: Sequence[Backend]) -> _JoinBase:
        """The same combinator over new children (same labels and options)."""
        return attrs.evolve(self, arms=_relabel(self.arms, children))

    @property
    def backends(self) -> tuple[Backend, ...]:
        return tuple(b for _, b in self.arms)

    def _options(self) -> tuple[tuple[str, Any], ...]:
        return ()

    def _shallow(self) -> tuple[Any, ...]:
        return (self.head, self._options())

    def _spec_parts(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        return self.head, tuple((None, b) for _, b in self.arms) + self._options()


@attrs.frozen(eq=False, repr=False)
class Join(_JoinBase):
    """Every child prepares; layer ``l`` attends with ``children[pattern[l % len(pattern)]]``
    (round-robin when ``pattern`` is empty)."""

    pattern: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        bad = [p for p in self.pattern if not isinstance(p, int) or not 0 <= p < len(self.arms)]
        if bad:
            raise ValueError(f"{self.head}: pattern entries must be child indices 0..{len(self.arms) - 1}, "
                             f"got {bad}")

    def _options(self) -> tuple[tuple[str, Any], ...]:
        if not self.pattern:
            return ()
        return (("pattern", "".join(str(p) for p in self.pattern)),)

    def owner(self, layer: int) -> int:
        """Index of the child that attends ``layer``."""
        if self.pattern:
            return self.pattern[layer % len(self.pattern)]
        return layer % len(self.arms)

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        meta: dict[str, Tensor] = {}
        for label, child in self.arms:
            meta.update(_namespaced(label, child.prepare_out_graph(mode, shared, batch)))
        return meta

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for label, child in self.arms:
            out.update(_namespaced(label, child.prepare_in_graph(mode, shared, batch, _own(label, meta))))
        return out

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        label, child = self.arms[self.owner(layer)]
        return child.attend(mode, layer, q, k, v, pools, shared, batch, _own(label, meta))


def _indexed(prefix: str, backends: Sequence[Backend]) -> tuple[tuple[str, Backend], ...]:
    return tuple((f"{prefix}[{i}]", b) for i, b in enumerate(backends))


def join(*backends: Backend) -> Join:
    """All children prepare; layers go round-robin to them; effect = pointwise join.

    >>> from readfence.backends import paged, linear
    >>> join(paged(), linear()).read_effect(ForwardMode.DECODE)
    ReadEffect({'req_to_token': IN_REPLAY, 'seq_lens': IN_REPLAY, 'state_slots': IN_REPLAY}, default=NONE)
    """
    return Join("join", _indexed("children", _check_backends("join", backends)))


def _pattern(pattern: str | Sequence[int] | None, count: int) -> tuple[int, ...]:
    if pattern is None:
        return ()
    if isinstance(pattern, str):
        if not pattern or not pattern.isdigit():
            raise ValueError(f"pattern must be a non-empty string of child indices like \"0111\", "
                             f"got {pattern!r}")
        return tuple(int(c) for c in pattern)
    entries: object = pattern  # a caller's value: checked, whatever its annotation says
    if not isinstance(entries, Sequence) or isinstance(entries, bytes) or any(isinstance(p, bool) for p in entries):
        raise TypeError(f"hybrid_linear: pattern must be a string of child indices like \"0111\" or a sequence of "
                        f"ints such as [0, 1, 1, 1], got {pattern!r} ({type(pattern).__name__})")
    return tuple(entries)


def hybrid_linear(*backends: Backend, pattern: str | Sequence[int] | None = None) -> Join:
    """Layer ``l`` uses ``backends[pattern[l % len(pattern)]]`` (round-robin by default),
    e.g. full attention every fourth layer: ``hybrid_linear(paged(), linear(), pattern="0111")``.
    The effect is the join: every child prepares every step.

    >>> from readfence.backends import trtllm_mha, linear
    >>> h = hybrid_linear(trtllm_mha(), linear(), pattern="0111")
    >>> h.owner(4), h.owner(5), str(h)
    (0, 1, 'hybrid_linear(trtllm_mha, linear, pattern="0111")')
    """
    checked = _check_backends("hybrid_linear", backends)
    return Join("hybrid_linear", _indexed("children", checked), _pattern(pattern, len(checked)))


def minimax(sparse: Backend, dense: Backend) -> Join:
    """MiniMax-style pair: even layers sparse, odd layers dense; the effect is the join.

    >>> from readfence.backends import sparse, dense
    >>> m = minimax(sparse(), dense())
    >>> [label for label, _ in m.children()], m.read_end(ForwardMode.DECODE)
    (['sparse', 'dense'], <ReadEnd.POST_REPLAY: 3>)
    """
    _check_backends("minimax", [sparse, dense])
    return Join("minimax", (("sparse", sparse), ("dense", dense)))


@attrs.frozen(eq=False, repr=False)
class Tbo(_JoinBase):
    """Two-batch overlap: ``primary`` prepares the whole batch; the batch is split into one
    micro-batch of consecutive requests per child, and each child prepares and attends its
    own. With no children, ``primary`` attends everything."""

    @property
    def primary(self) -> Backend:
        return self.arms[0][1]

    @property
    def micro(self) -> tuple[tuple[str, Backend], ...]:
        return self.arms[1:]

    def child_runs(self, mode: ForwardMode, batch_size: int) -> tuple[ChildRun, ...]:
        """``primary`` at ``batch_size``; each child at the size of its micro-batch (``0``: it is
        handed no request), as :meth:`attend` splits the batch.

        >>> from readfence.backends import paged, dense
        >>> [(r.label, r.batch_size) for r in tbo(paged(), dense(), paged()).child_runs(ForwardMode.DECODE, 1)]
        [('primary', 1), ('children[0]', 1), ('children[1]', 0)]
        """
        check_mode(mode)
        (primary_label, primary), micro = self.arms[0], self.micro
        runs = [ChildRun(primary_label, primary, batch_size)]
        if micro:
            ranges = request_ranges(batch_size, len(micro))
            runs += [ChildRun(label, child, hi - lo) for (label, child), (lo, hi) in zip(micro, ranges)]
        return tuple(runs)

    def _parts(self, mode: M, batch: Tensors) -> list[tuple[str, Backend, dict[str, Tensor], tuple[int, int]]]:
        """Each child handed a request, with its micro-batch and its range of requests: a child
        whose micro-batch is empty (a batch smaller than the children) runs nothing, as
        :meth:`child_runs` says (``0``), and an engine runs no micro-batch of no request. A step
        of no request at all (``IDLE``) runs every child on nothing, as engines run it."""
        size = int(batch["req_pool_indices"].shape[0])
        ranges = request_ranges(size, len(self.micro))
        return [(label, child, part, span) for (label, child), part, span
                in zip(self.micro, split_batch(batch, mode, len(self.micro)), ranges) if span[1] > span[0] or not size]

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        meta = _namespaced("primary", self.primary.prepare_out_graph(mode, shared, batch))
        if self.micro:
            for label, child, part, _ in self._parts(mode, batch):
                meta.update(_namespaced(label, child.prepare_out_graph(mode, shared, part)))
        return meta

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        out = _namespaced("primary", self.primary.prepare_in_graph(mode, shared, batch, _own("primary", meta)))
        if self.micro:
            for label, child, part, _ in self._parts(mode, batch):
                out.update(_namespaced(label, child.prepare_in_graph(mode, shared, part, _own(label, meta))))
        return out

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        if not self.micro:
            return self.primary.attend(mode, layer, q, k, v, pools, shared, batch, _own("primary", meta))
        n = tokens_per_request(mode)
        outs = []
        for label, child, part, (lo, hi) in self._parts(mode, batch):
            q_part, k_part, v_part = (x.narrow(0, lo * n, (hi - lo) * n) for x in (q, k, v))
            outs.append(child.attend(mode, layer, q_part, k_part, v_part, pools, shared, part, _own(label, meta)))
        return torch.cat(outs, dim=0)


def tbo(primary: Backend, *children: Backend) -> Tbo:
    """Two-batch overlap of ``children`` (one micro-batch each), prepared also by ``primary``.

    >>> from readfence.backends import deepseek_v4, paged
    >>> tbo(deepseek_v4(), paged()).read_end(ForwardMode.TARGET_VERIFY)
    <ReadEnd.POST_REPLAY: 3>
    """
    _check_backends("tbo", [primary, *children])
    return Tbo("tbo", (("primary", primary), *_indexed("children", children)))


@attrs.frozen(eq=False, repr=False)
class PerStream(_JoinBase):
    """One member per forward stream. Run directly, it is stream 0's member; lowering replays
    ``members[s]`` on stream ``s``. The effect is the join over members, so a fence derived
    from it covers every stream."""

    @property
    def members(self) -> tuple[Backend, ...]:
        return self.backends

    def child_runs(self, mode: ForwardMode, batch_size: int) -> tuple[ChildRun, ...]:
        """Every member at the size of its share of the batch (``0``: a batch smaller than the
        group hands it no request), as lowering splits a step over the streams; each places its
        own stream's fence from its own declaration (the audit refuses a member whose
        declaration is below its reads at a size it runs).

        >>> from readfence.backends import paged, trtllm_mha
        >>> [(r.label, r.batch_size) for r in per_stream(paged(), trtllm_mha()).child_runs(ForwardMode.DECODE, 3)]
        [('members[0]', 2), ('members[1]', 1)]
        """
        check_mode(mode)
        ranges = request_ranges(batch_size, len(self.arms))
        return tuple(ChildRun(label, child, hi - lo, placed=True) for (label, child), (lo, hi) in zip(self.arms, ranges))

    def runs_as(self, mode: ForwardMode) -> Backend:
        """What stream 0's member runs as: run directly, the step forwards each stage to it."""
        return self.members[0].runs_as(mode)

    def prepare_out_graph(self, mode: M, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        return self.members[0].prepare_out_graph(mode, shared, batch)

    def prepare_in_graph(self, mode: M, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return self.members[0].prepare_in_graph(mode, shared, batch, meta)

    def attend(self, mode: M, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        return self.members[0].attend(mode, layer, q, k, v, pools, shared, batch, meta)


def per_stream(*backends: Backend) -> PerStream:
    """One member per forward stream (``.members``); the effect is their join.

    >>> from readfence.backends import paged, trtllm_mha
    >>> ps = per_stream(paged(), trtllm_mha())
    >>> len(ps.members), ps.read_end(ForwardMode.DECODE)
    (2, <ReadEnd.IN_REPLAY: 2>)
    """
    return PerStream("per_stream", _indexed("members", _check_backends("per_stream", backends)))
