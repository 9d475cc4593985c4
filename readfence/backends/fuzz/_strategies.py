"""The strategies that draw generated placements, declarations, leaves and programs: hypothesis
ones (which shrink a failing program) and :func:`random_programs` (a seeded, even deal)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from readfence.core import ForwardMode
from readfence.effects import ReadEnd

from ._axes import FUZZ_MODES
from ._generator import Pick, _Choice, _generator
from ._leaf import FuzzLeaf, Placement
from ._program import FuzzProgram
from ._vocabulary import Pattern


def _drawn(draw: st.DrawFn) -> Pick:
    return lambda choice: draw(choice.strategy)


def placements(vocabulary: Mapping[str, Pattern] | None = None) -> st.SearchStrategy[Placement]:
    """A pattern of ``vocabulary`` (default :data:`VOCABULARY`; classes weighted by
    :data:`CLASS_WEIGHTS`) placed in a stage it allows, on any buffer, via any way of reaching
    it, carried or not.

    >>> from hypothesis import find, settings
    >>> find(placements(), lambda p: p.via == "closure", settings=settings(database=None, derandomize=True))
    chunk(req_to_token) via closure in attend
    """
    gen = _generator(vocabulary)
    return st.composite(lambda draw: gen.placement(_drawn(draw)))()


def declarations() -> st.SearchStrategy[tuple[tuple[str, ReadEnd], ...]]:
    """Per buffer, an end drawn from the lattice (weighted towards the later ends): one end for
    every buffer a third of the time (a stage that escapes the tracer in the graph reads every
    buffer until ``POST_REPLAY``), else one per buffer."""
    gen = _generator(None)
    return st.composite(lambda draw: gen.declared(_drawn(draw)))()


def leaves(vocabulary: Mapping[str, Pattern] | None = None, *, max_placements: int = 3) -> st.SearchStrategy[FuzzLeaf]:
    """A generated leaf (named ``leaf``; :func:`programs` renames them) with up to
    ``max_placements`` placements, one or two mostly."""
    gen = _generator(vocabulary)
    return st.composite(lambda draw: gen.leaf(_drawn(draw), max_placements))()


def _check_sizes(max_leaves: int, max_placements: int, modes: Sequence[ForwardMode]) -> _Choice[ForwardMode]:
    if max_leaves < 1 or max_placements < 0:
        raise ValueError(f"max_leaves must be at least 1 and max_placements at least 0, got {max_leaves} "
                         f"and {max_placements}")
    if not modes or any(m not in FUZZ_MODES for m in modes):
        raise ValueError(f"modes must be some of {[m.name for m in FUZZ_MODES]}, got {list(modes)!r}")
    return _Choice(tuple(modes))


def programs(vocabulary: Mapping[str, Pattern] | None = None, *, max_leaves: int = 3, max_placements: int = 3,
             modes: Sequence[ForwardMode] = FUZZ_MODES) -> st.SearchStrategy[FuzzProgram]:
    """Generated programs: a leaf, or a tree of up to ``max_leaves`` leaves under ``join``,
    ``tbo``, ``hybrid_linear`` and ``select``, run in one of ``modes``; leaves are named
    ``f0``, ``f1``, ... in pre-order. Hypothesis draws (and shrinks) every choice; it favours
    the first option of each, so for long runs that should cover the vocabulary evenly use
    :func:`random_programs`.

    >>> from hypothesis import find, settings
    >>> from readfence.backends.fuzz import FuzzTree
    >>> smallest_tree = find(programs(), lambda p: isinstance(p.root, FuzzTree),
    ...                      settings=settings(database=None, derandomize=True))
    >>> print(str(smallest_tree).splitlines()[0])
    join(f0, f1) in DECODE
    """
    gen, modes_ = _generator(vocabulary), _check_sizes(max_leaves, max_placements, modes)
    return st.composite(lambda draw: gen.program(_drawn(draw), modes_, max_leaves, max_placements))()


def random_programs(n: int, seed: int = 0, vocabulary: Mapping[str, Pattern] | None = None, *, max_leaves: int = 3,
                    max_placements: int = 3, modes: Sequence[ForwardMode] = FUZZ_MODES) -> Iterator[FuzzProgram]:
    """``n`` programs drawn like :func:`programs` but evenly, from ``random.Random(seed)``:
    the same programs for the same seed, every option of every choice equally often. Each
    choice deals from its own shuffled deck of options, reshuffled when empty, so a short run
    already covers the vocabulary (independent uniform draws leave a third of it out in fifty
    programs).

    >>> [str(p).splitlines()[0] for p in random_programs(2, seed=1)]
    ['select[DECODE](f0, f1) in DECODE', 'f0 in TARGET_VERIFY']
    """
    gen, modes_ = _generator(vocabulary), _check_sizes(max_leaves, max_placements, modes)
    rng = random.Random(seed)
    decks: dict[int, tuple[_Choice[Any], list[Any]]] = {}

    def pick(choice: _Choice[Any]) -> Any:
        _, deck = decks.setdefault(id(choice), (choice, []))
        if not deck:
            deck.extend(choice.options)
            rng.shuffle(deck)
        return deck.pop()

    for _ in range(n):
        yield gen.program(pick, modes_, max_leaves, max_placements)
