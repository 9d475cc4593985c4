"""Laws over random backend trees: wrappers are sound, least, monotone; select is exact."""

from __future__ import annotations

import operator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readfence.backends import MODES, Backend, Select, join, paged, parse, redeclare, tbo
from readfence.backends.strategies import (
    declarations,
    effect_table,
    leaf_paths,
    reference_leaves,
    trees,
    with_declaration,
)
from readfence.effects import ReadEffect, ReadEnd, laws

SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _nodes(tree: Backend):
    return [node for _, node in tree.walk()]


def _recomputed(tree: Backend, mode) -> ReadEffect:
    """Independent reference: recurse over the tree, joining with ``|`` (small trees)."""
    kids = tree.children()
    if not kids:
        return tree.read_effect(mode)
    if isinstance(tree, Select):
        return _recomputed(tree.selected(mode), mode)
    out = ReadEffect.none()
    for _, child in kids:
        out = out | _recomputed(child, mode)
    return out


@SETTINGS
@given(trees())
def test_wrapper_is_sound_for_every_active_child(tree):
    for node in _nodes(tree):
        for mode in MODES:
            for _, child in node.active_children(mode):
                assert child.read_effect(mode) <= node.read_effect(mode), (str(node), mode)


@SETTINGS
@given(trees())
def test_wrapper_is_the_least_sound_effect(tree):
    for node in _nodes(tree):
        for mode in MODES:
            active = [c.read_effect(mode) for _, c in node.active_children(mode)]
            if active:
                assert node.read_effect(mode) == ReadEffect.join_all(active), (str(node), mode)
    for mode in MODES:
        assert tree.read_effect(mode) == _recomputed(tree, mode)


@SETTINGS
@given(trees())
def test_select_is_exact(tree):
    for node in _nodes(tree):
        if isinstance(node, Select):
            for mode in MODES:
                assert node.read_effect(mode) == node.selected(mode).read_effect(mode)


@SETTINGS
@given(trees(), st.data())
def test_monotone_in_a_childs_declaration(tree, data):
    path = data.draw(st.sampled_from(leaf_paths(tree)))
    low, extra = data.draw(declarations()), data.draw(declarations())
    high = {m: low[m] | extra[m] for m in MODES}
    lo, hi = with_declaration(tree, path, low), with_declaration(tree, path, high)
    for a, b in zip(effect_table(lo), effect_table(hi)):
        assert a <= b


@SETTINGS
@given(trees(reference_leaves()))
def test_spec_round_trip(tree):
    assert parse(str(tree)).unwrap() == tree


# The join combinator on backends is a join-semilattice up to effect equivalence
# (one named test per law), and every combinator is monotone in a leaf's declaration.
def _same(a: Backend, b: Backend) -> bool:
    return effect_table(a) == effect_table(b)


def _leq(a: Backend, b: Backend) -> bool:
    return all(x <= y for x, y in zip(effect_table(a), effect_table(b)))


laws.check_join_semilattice(trees(max_leaves=4), join=join, leq=_leq, eq=_same, name="backend_join",
                            max_examples=40)


def _under_tbo(table: dict) -> tuple[ReadEffect, ...]:
    return effect_table(tbo(paged(), redeclare(paged(), table.__getitem__)))


laws.check_monotone(
    declarations(), _under_tbo,
    join=lambda a, b: {m: a[m] | b[m] for m in MODES},
    leq_in=lambda a, b: all(a[m] <= b[m] for m in MODES),
    leq_out=lambda a, b: all(map(operator.le, a, b)),
    name="tbo_in_child_declaration", max_examples=100,
)


def _children_below_wrapper(effects_of):
    """The law that every child's effect lies below its wrapper's, in every mode, on trees
    whose last child's declaration is drawn: ``effects_of(tree, mode)`` is the wrapper's."""

    def holds(table):
        tree = tbo(paged(), redeclare(paged(), table.__getitem__))
        for mode in MODES:
            for label, child in tree.children():
                if not child.read_effect(mode) <= effects_of(tree, mode):
                    return f"{label}'s effect in {mode.name} is not below the wrapper's"
        return None

    law = laws.Law("children_below_wrapper", "child.read_effect(m) <= wrapper.read_effect(m)", 1, holds)
    return laws.LawSuite("wrapper", declarations(), (law,), 60)


def test_laws_catch_a_wrapper_that_forgets_a_child():
    """A law of the kit, run on a wrapper that drops its last child's effect, fails naming
    the law and the declaration; the same law holds for tbo as it is."""

    def forgetful(tree, mode):
        return ReadEffect.join_all([c.read_effect(mode) for _, c in tree.children()[:-1]])

    _children_below_wrapper(lambda tree, mode: tree.read_effect(mode)).check()
    with pytest.raises(laws.LawViolation, match=r"wrapper\.children_below_wrapper failed") as info:
        _children_below_wrapper(forgetful).check()
    (table,) = info.value.inputs
    assert any(table[m] is not ReadEnd.NONE for m in MODES)  # a declaration the wrapper forgot
