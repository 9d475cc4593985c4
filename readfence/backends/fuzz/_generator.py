"""The generator of programs over one vocabulary, written once against ``pick`` (a choice point ->
one of its options) so that hypothesis and a seeded deck draw the same programs' shapes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import attrs
from hypothesis import strategies as st

from readfence.core import SHARED_BUFFERS, ForwardMode
from readfence.effects import ReadEnd

from ._axes import _LAYER_SPLITTING, _STASH_VIAS, ATTEND, COMBINATORS, FUZZ_MODES, IN, OUT, RETURN_SHAPES, STAGE_NAMES, VIAS
from ._leaf import FuzzLeaf, Placement
from ._program import FuzzProgram, FuzzTree, Node
from ._vocabulary import VOCABULARY, Pattern

#: How often each class of pattern is drawn, relative to the others (a class not listed: 1).
#: Writes and threads are refused while tracing, whatever else the leaf does: drawn often,
#: they would hide the rest of the program from the checks.
CLASS_WEIGHTS: dict[str, int] = {"view": 6, "list_view": 6, "copy": 4, "conditional": 4, "custom_op": 3, "host": 2,
                                  "relation": 2, "view_claim": 2}


T = TypeVar("T")


@attrs.frozen(eq=False)
class _Choice(Generic[T]):
    """One choice point of the generator: its options, and the strategy drawing one."""

    options: tuple[T, ...]
    strategy: st.SearchStrategy[T] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "strategy", st.sampled_from(self.options))


Pick = Callable[[_Choice[Any]], Any]

#: Declared ends, weighted towards the later ones so that about half of the programs are
#: accepted. The first (what hypothesis draws most, and shrinks to) is POST_REPLAY, sound for
#: any traced read.
_ENDS = (ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN,
         ReadEnd.IN_REPLAY, ReadEnd.PRE_REPLAY, ReadEnd.NONE, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN)


class _Generator:
    """The generator of one vocabulary, written once against ``pick`` (a choice -> one of its
    options): hypothesis draws the choices in :func:`programs` (and shrinks them), a seeded
    ``random.Random`` in :func:`random_programs` (uniformly: long runs cover the vocabulary
    evenly). The choice points are built once: building hypothesis strategies inside each
    draw costs more than the draw."""

    def __init__(self, vocabulary: Mapping[str, Pattern]) -> None:
        if not vocabulary:
            raise ValueError("the vocabulary is empty: give at least one Pattern")
        by_class: dict[str, list[Pattern]] = {}
        for name in sorted(vocabulary, key=lambda n: (vocabulary[n].klass, n)):
            by_class.setdefault(vocabulary[name].klass, []).append(vocabulary[name])
        weighted = sorted(by_class, key=lambda k: -CLASS_WEIGHTS.get(k, 1))
        self.klass = _Choice(tuple(k for k in weighted for _ in range(CLASS_WEIGHTS.get(k, 1))))
        self.pattern = {k: _Choice(tuple(ps)) for k, ps in by_class.items()}
        self.stage = {p.name: _Choice(p.stages) for ps in by_class.values() for p in ps}
        self.buffer = _Choice(SHARED_BUFFERS)
        self.via = {stage: _Choice(tuple(v for v in VIAS if stage != OUT or v not in _STASH_VIAS)) for stage in STAGE_NAMES}
        self.flip = _Choice((False, True))
        self.count = _Choice((1, 1, 2, 2, 0, 3))  # one or two placements mostly
        self.meta = _Choice((IN, OUT, ATTEND, None))
        self.returns = _Choice(RETURN_SHAPES)
        self.end = _Choice(_ENDS)
        self.uniform = _Choice((False, False, True))  # one end for every buffer a third of the time
        self.is_tree = _Choice((False, False, False, True, True))  # trees 40% of the time
        self.nest = _Choice((False, False, True))
        self.width = _Choice((2, 2, 2, 3))
        self.combinator = {ok: _Choice(tuple(c for c in COMBINATORS if ok or c not in _LAYER_SPLITTING))
                           for ok in (True, False)}
        self.layers = {n: _Choice(tuple(itertools.permutations(range(n)))) for n in (2, 3)}
        self.index = {n: _Choice(tuple(range(n))) for n in (2, 3)}
        self.mode = _Choice(FUZZ_MODES)

    def placement(self, pick: Pick) -> Placement:
        pattern = pick(self.pattern[pick(self.klass)])
        stage = pick(self.stage[pattern.name])
        buffer = pick(self.buffer)
        # the argument half the time: the kept references are the rarer, deliberate case
        via = "argument" if pattern.invisible or not pick(self.flip) else pick(self.via[stage])
        carry = stage != ATTEND and pick(self.flip)
        return Placement(pattern, stage, buffer, via, carry)

    def declared(self, pick: Pick) -> tuple[tuple[str, ReadEnd], ...]:
        if pick(self.uniform):
            end = pick(self.end)
            return tuple((b, end) for b in SHARED_BUFFERS)
        return tuple((b, pick(self.end)) for b in SHARED_BUFFERS)

    def leaf(self, pick: Pick, max_placements: int) -> FuzzLeaf:
        n = min(pick(self.count), max_placements)
        placed = tuple(self.placement(pick) for _ in range(n))
        return FuzzLeaf("leaf", placed, self.declared(pick), pick(self.meta), pick(self.returns))

    def tree(self, pick: Pick, budget: int, split_ok: bool, max_placements: int) -> Node:
        if budget < 2 or not pick(self.is_tree):
            return self.leaf(pick, max_placements)
        # at most one layer-splitting combinator on a path, so that every child attends a layer
        combinator = pick(self.combinator[split_ok])
        n = 2 if combinator == "select" or budget < 3 else pick(self.width)
        inner_ok = split_ok and combinator not in _LAYER_SPLITTING
        children: list[Node] = []
        left = budget
        for i in range(n):
            share = left - (n - i - 1)  # keep one leaf for each later child
            nested = i == 0 and share >= 2 and pick(self.nest)
            children.append(self.tree(pick, 2, inner_ok, max_placements) if nested else self.leaf(pick, max_placements))
            left -= _count(children[-1])
        option: Any = {"hybrid_linear": lambda: pick(self.layers[n]), "tbo": lambda: pick(self.index[n]),
                       "select": lambda: pick(self.mode), "join": lambda: None}[combinator]()
        return FuzzTree(combinator, tuple(children), option)

    def program(self, pick: Pick, modes: _Choice[ForwardMode], max_leaves: int, max_placements: int) -> FuzzProgram:
        mode = pick(modes)
        root = self.tree(pick, max_leaves, True, max_placements)
        return FuzzProgram(_renamed(root, (f"f{i}" for i in itertools.count())), mode)


_GENERATORS: dict[tuple[tuple[str, Pattern], ...], _Generator] = {}


def _generator(vocabulary: Mapping[str, Pattern] | None) -> _Generator:
    vocabulary = VOCABULARY if vocabulary is None else vocabulary
    key = tuple(sorted(vocabulary.items()))
    hit = _GENERATORS.get(key)
    if hit is None:
        hit = _GENERATORS[key] = _Generator(vocabulary)
    return hit


def _count(node: Node) -> int:
    return 1 if isinstance(node, FuzzLeaf) else sum(_count(c) for c in node.children)


def _renamed(node: Node, names: Iterator[str]) -> Node:
    if isinstance(node, FuzzLeaf):
        return attrs.evolve(node, name=next(names))
    return attrs.evolve(node, children=tuple(_renamed(c, names) for c in node.children))
