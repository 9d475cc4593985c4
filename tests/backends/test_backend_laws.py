"""Laws over random backend trees: wrappers are sound, least, monotone; select is exact."""

from __future__ import annotations

import operator

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
from readfence.effects import ReadEffect, laws

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


def test_laws_catch_a_wrapper_that_forgets_a_child():
    """The least-join property fails on a combinator that drops its last child's effect."""
    from readfence.backends import deepseek_v4
    from readfence.core import ForwardMode

    tree = tbo(paged(), deepseek_v4())
    forgetful = ReadEffect.join_all([c.read_effect(ForwardMode.TARGET_VERIFY) for _, c in tree.children()[:-1]])
    assert forgetful != tree.read_effect(ForwardMode.TARGET_VERIFY)
    assert not (tree.children()[-1][1].read_effect(ForwardMode.TARGET_VERIFY) <= forgetful)
