"""Hypothesis strategies for backends: reference leaves, redeclared leaves, random trees.

Reuse them to property-test your own combinators or declarations::

    from hypothesis import given
    from readfence.backends.strategies import trees

    @given(trees())
    def test_round_trip(b): ...

>>> from hypothesis import given, settings
>>> @settings(max_examples=5, database=None)
... @given(trees())
... def check(tree):
...     assert all(tree.read_effect(m) == tree.effects()[m] for m in MODES)
>>> check()
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from readfence.effects import ReadEffect
from readfence.effects.strategies import read_effects

from ._backend import MODES, Backend, Leaf, redeclare
from ._combinators import hybrid, hybrid_linear, join, minimax, per_stream, select, tbo
from ._leaves import deepseek_v4, dense, linear, paged, sparse, trtllm_mha


def reference_leaves() -> st.SearchStrategy[Leaf]:
    """Any reference leaf, with random options."""
    return st.one_of(
        st.builds(paged),
        st.builds(trtllm_mha, window=st.integers(1, 16)),
        st.builds(deepseek_v4, dspark=st.booleans()),
        st.builds(linear, decay=st.sampled_from([0.5, 0.9, 1.0])),
        st.builds(sparse, top_k=st.integers(1, 4), page_size=st.sampled_from([4, 8])),
        st.builds(dense),
    )


def declarations() -> st.SearchStrategy[dict]:
    """A declaration: ``{mode: ReadEffect}`` for every mode."""
    return st.fixed_dictionaries({m: read_effects() for m in MODES})


def redeclared_leaves() -> st.SearchStrategy[Leaf]:
    """A reference leaf redeclared to a random effect table."""
    return st.builds(lambda b, d: redeclare(b, d.__getitem__), reference_leaves(), declarations())


def _extend(children: st.SearchStrategy[Backend]) -> st.SearchStrategy[Backend]:
    some = st.lists(children, min_size=1, max_size=3)
    return st.one_of(
        some.map(lambda xs: join(*xs)),
        some.map(lambda xs: tbo(*xs)),
        st.tuples(some, st.text("01", min_size=1, max_size=4)).map(
            lambda t: hybrid_linear(*t[0], pattern="".join(str(int(c) % len(t[0])) for c in t[1]))
        ),
        st.builds(minimax, children, children),
        st.builds(hybrid, decode=children, prefill=children,
                  verify=st.none() | children, draft_extend=st.none() | children),
        st.builds(select, st.dictionaries(st.sampled_from(MODES), children, max_size=3), default=children),
    )


def trees(
    leaves: st.SearchStrategy[Backend] | None = None, *, max_leaves: int = 10, groups: bool = False
) -> st.SearchStrategy[Backend]:
    """Random backend trees of ``leaves`` (reference and redeclared leaves by default) under
    every combinator; with ``groups``, some are ``per_stream`` groups of such trees (a group is a
    whole step's streams, only ever at the root: no backend, ``join`` included, takes one as its
    child, so the default draws none and the trees can be joined)."""
    base = leaves if leaves is not None else st.one_of(reference_leaves(), redeclared_leaves())
    tree = st.recursive(base, _extend, max_leaves=max_leaves)
    if not groups:
        return tree
    return st.one_of(tree, st.lists(tree, min_size=1, max_size=3).map(lambda xs: per_stream(*xs)))


def leaf_paths(tree: Backend) -> list[tuple[int, ...]]:
    """Child-index paths of every leaf of ``tree`` (for :func:`replace_at`)."""
    out: list[tuple[int, ...]] = []
    stack: list[tuple[tuple[int, ...], Backend]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        kids = node.children()
        if not kids:
            out.append(path)
        stack.extend((path + (i,), c) for i, (_, c) in enumerate(kids))
    return sorted(out)


def replace_at(tree: Backend, path: tuple[int, ...], f: Callable[[Backend], Backend]) -> Backend:
    """``tree`` with the node at ``path`` replaced by ``f(node)``, ancestors rebuilt.

    >>> t = tbo(paged(), linear())
    >>> str(replace_at(t, (1,), lambda _: dense()))
    'tbo(paged, dense)'
    """
    spine = [tree]
    for i in path:
        spine.append(spine[-1].children()[i][1])
    node = f(spine[-1])
    for parent, i in zip(reversed(spine[:-1]), reversed(path)):
        kids = [c for _, c in parent.children()]
        kids[i] = node
        node = parent.with_children(kids)
    return node


def with_declaration(tree: Backend, path: tuple[int, ...], table: dict) -> Backend:
    """``tree`` with the leaf at ``path`` redeclared to ``table`` (``{mode: ReadEffect}``)."""
    return replace_at(tree, path, lambda b: redeclare(b, table.__getitem__))


def effect_table(tree: Backend) -> tuple[ReadEffect, ...]:
    """``tree``'s effect for every mode, in ``MODES`` order."""
    return tuple(tree.read_effect(m) for m in MODES)
