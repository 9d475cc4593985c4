"""Programs as data: a :class:`FuzzTree` of combinators over generated leaves, and a
:class:`FuzzProgram` (a leaf or a tree, and the mode it runs in) that builds the backend.

>>> from readfence.backends.fuzz import VOCABULARY, FuzzLeaf, Placement, declared
>>> p = Placement(VOCABULARY["clone"], "attend", "seq_lens", via="closure")
>>> FuzzProgram(FuzzLeaf("f0", (p,), declared(POST_REPLAY=["seq_lens"]))).needs_state()
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs

from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEnd

from .._backend import Backend
from .._combinators import hybrid_linear, join, select, tbo
from ._axes import _LIVE_VIAS, COMBINATORS, OUT, STAGE_END, M, State
from ._build import _build_leaf
from ._leaf import FuzzLeaf, Placement


@attrs.frozen(repr=False)
class FuzzTree:
    """A combinator over generated nodes. ``option``: the layer pattern of ``hybrid_linear``
    (child indices), the primary's child index for ``tbo`` (``tbo(children[i], *children)``),
    the mode that selects ``children[0]`` for ``select`` (``children[1]`` is the default)."""

    combinator: str
    children: tuple[Node, ...]
    option: Any = None

    def __attrs_post_init__(self) -> None:
        if self.combinator not in COMBINATORS:
            raise ValueError(f"unknown combinator {self.combinator!r}; one of {list(COMBINATORS)}")
        if len(self.children) < (2 if self.combinator == "select" else 1):
            raise ValueError(f"{self.combinator} needs more children, got {len(self.children)}")

    def selected(self, mode: ForwardMode) -> tuple[int, ...]:
        """Indices of the children that run in ``mode``."""
        if self.combinator == "select":
            return (0,) if self.option is mode else (1,)
        return tuple(range(len(self.children)))

    def __repr__(self) -> str:
        opt = "" if self.option is None else f"[{getattr(self.option, 'name', self.option)}]"
        return f"{self.combinator}{opt}({', '.join(_head(c) for c in self.children)})"


Node = FuzzLeaf | FuzzTree


def _head(node: Node) -> str:
    return node.name if isinstance(node, FuzzLeaf) else repr(node)


def _layers(node: Node) -> int:
    if isinstance(node, FuzzLeaf):
        return 1
    own = 1
    if node.combinator == "join":
        own = len(node.children)  # round-robin: child i attends layer i
    elif node.combinator == "hybrid_linear":
        own = len(node.option)
    return max(own, *(_layers(c) for c in node.children))


@attrs.frozen(repr=False)
class FuzzProgram:
    """A generated backend (a leaf or a tree of them) and the mode it runs in."""

    root: Node
    mode: ForwardMode = M.DECODE

    @property
    def layers(self) -> int:
        """Layers the model needs so that every child of a layer-splitting combinator attends."""
        return _layers(self.root)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with at least :attr:`layers` layers."""
        return cfg if cfg.layers >= self.layers else attrs.evolve(cfg, layers=self.layers)

    def leaves(self) -> tuple[FuzzLeaf, ...]:
        """Every distinct leaf, pre-order."""
        return tuple(dict.fromkeys(self._walk(False)))

    def active_leaves(self) -> tuple[FuzzLeaf, ...]:
        """The leaves that run in :attr:`mode` (a ``select`` runs one child)."""
        return tuple(dict.fromkeys(self._walk(True)))

    def _walk(self, active: bool) -> Iterator[FuzzLeaf]:
        stack: list[Node] = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, FuzzLeaf):
                yield node
                continue
            picks = node.selected(self.mode) if active else range(len(node.children))
            stack.extend(node.children[i] for i in reversed(tuple(picks)))

    def placements(self) -> tuple[Placement, ...]:
        """Every placement of every leaf."""
        return tuple(p for node in self.leaves() for p in node.placements)

    def invisible_reads(self) -> dict[str, ReadEnd]:
        """Per buffer, the latest end of a read no static analysis can see, in the leaves that
        run (a plan/run kernel reads in the stage it is placed in)."""
        out: dict[str, ReadEnd] = {}
        for node in self.active_leaves():
            for p in node.placements:
                if p.pattern.invisible:
                    out[p.buffer] = out.get(p.buffer, ReadEnd.NONE) | STAGE_END[p.stage]
        return out

    def thread_reads(self) -> frozenset[str]:
        """The buffers read on a thread a stage starts, in the leaves that run: whatever the
        declaration, no fence covers such a read, so the checks must refuse or catch it."""
        return frozenset(p.buffer for node in self.active_leaves() for p in node.placements if p.pattern.threaded)

    def uncapturable(self) -> tuple[Placement, ...]:
        """The placements, in the leaves that run, that bring a device value to the host inside
        the captured graph (``prepare_in_graph`` or ``attend``). CUDA forbids a device-to-host
        copy while a stream is captured (the capture fails), so no CUDA engine runs such a
        backend: only the CPU device, which runs that stage's Python in the step, does. A host
        read in ``prepare_out_graph`` runs every step before the replay on CUDA too."""
        return tuple(p for node in self.active_leaves() for p in node.placements
                     if p.pattern.host_read and p.stage != OUT)

    def needs_state(self) -> bool:
        """Whether building it needs the live state (a pattern keeps a reference to a buffer)."""
        return any(p.via in _LIVE_VIAS or p.pattern.invisible for p in self.placements())

    def build(self, state: State | None = None) -> Backend:
        """The backend, built against ``state`` (``shared``, ...: the live tensors the checks
        will run on; needed when :meth:`needs_state`)."""
        if state is None and self.needs_state():
            raise ValueError("this program keeps references to live buffers: build it with the state "
                             "you pass to audit(state=...) and verify(state=...)")
        live = None if state is None else state["shared"]
        built: dict[int, Backend] = {}

        def make(node: Node) -> Backend:
            hit = built.get(id(node))
            if hit is None:
                hit = built[id(node)] = _build_leaf(node, live) if isinstance(node, FuzzLeaf) else _combine(node, make)
            return hit

        return make(self.root)

    def __str__(self) -> str:
        lines = [f"{_head(self.root)} in {self.mode.name}"]
        for node in self.leaves():
            lines += ["  " + line for line in repr(node).splitlines()]
        return "\n".join(lines)

    __repr__ = __str__


def _combine(node: FuzzTree, make: Callable[[Node], Backend]) -> Backend:
    kids = [make(c) for c in node.children]
    if node.combinator == "join":
        return join(*kids)
    if node.combinator == "hybrid_linear":
        return hybrid_linear(*kids, pattern="".join(map(str, node.option)))
    if node.combinator == "tbo":
        return tbo(kids[node.option], *kids)
    return select({node.option: kids[0]}, default=kids[1])
