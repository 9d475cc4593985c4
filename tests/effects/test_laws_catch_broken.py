"""The law kit must FAIL on deliberately broken structures, naming the law."""

import operator

import pytest
from hypothesis import strategies as st

from readfence.effects import ReadEffect, ReadEnd, laws
from readfence.effects.laws import LawViolation

ENDS = st.from_type(ReadEnd)
EFFECTS = st.from_type(ReadEffect)
SEEDS = range(8)


def left_biased(a, b):
    """Not commutative: keeps the left operand unless it is NONE."""
    return b if a is ReadEnd.NONE else a


def test_non_commutative_join_is_caught():
    suite = laws.join_semilattice_laws(ENDS, join=left_biased, leq=operator.le, name="left")
    with pytest.raises(LawViolation, match=r"left\.commutativity failed: a \| b == b \| a") as info:
        suite.check_law("commutativity")
    a, b = info.value.inputs
    assert left_biased(a, b) != left_biased(b, a)


def test_non_associative_join_is_caught():
    # Rock-paper-scissors "join": commutative and idempotent, but not associative.
    beats = {(0, 1): 1, (1, 2): 2, (0, 2): 0}

    def rps(a, b):
        return a if a == b else beats[(min(a, b), max(a, b))]

    suite = laws.join_semilattice_laws(st.integers(0, 2), join=rps, leq=lambda a, b: rps(a, b) == b,
                                       name="rps")
    suite.check_law("commutativity")
    suite.check_law("idempotence")
    with pytest.raises(LawViolation, match=r"rps\.associativity failed") as info:
        suite.check_law("associativity")
    a, b, c = info.value.inputs
    assert rps(rps(a, b), c) != rps(a, rps(b, c))


def test_wrong_order_is_caught():
    suite = laws.join_semilattice_laws(ENDS, join=ReadEnd.join, leq=operator.ge, name="flipped")
    with pytest.raises(LawViolation, match="order_is_join"):
        suite.check_law("order_is_join")


def test_wrong_bottom_and_top_are_caught():
    suite = laws.join_semilattice_laws(ENDS, join=ReadEnd.join, leq=operator.le,
                                       bottom=ReadEnd.PRE_REPLAY, top=ReadEnd.POST_REPLAY, name="bounds")
    with pytest.raises(LawViolation, match="bottom_identity"):
        suite.check_law("bottom_identity")
    with pytest.raises(LawViolation, match="top_absorbs"):
        suite.check_law("top_absorbs")


def test_non_idempotent_closure_is_caught():
    def bump(x):  # extensive and monotone, never idempotent below the top
        return ReadEnd(min(x.value + 1, ReadEnd.UNKNOWN.value))

    suite = laws.closure_laws(ENDS, bump, join=ReadEnd.join, leq=operator.le, name="bump")
    suite.check_law("extensive")
    suite.check_law("monotone")
    with pytest.raises(LawViolation, match=r"bump\.idempotent failed: f\(f\(a\)\) == f\(a\)"):
        suite.check_law("idempotent")


def test_unsound_degrade_is_caught():
    # The real-world bug: falling back to an EARLIER end when in-graph events are missing.
    def early(x):
        return ReadEnd.PRE_REPLAY if x is ReadEnd.IN_REPLAY else x

    with pytest.raises(LawViolation, match="extensive") as info:
        laws.closure_laws(ENDS, early, join=ReadEnd.join, leq=operator.le,
                          name="early").check_law("extensive")
    assert info.value.inputs == (ReadEnd.IN_REPLAY,)


def test_non_monotone_map_is_caught():
    def flip(x):
        return ReadEnd.NONE if x is ReadEnd.UNKNOWN else x

    with pytest.raises(LawViolation, match="monotone"):
        laws.monotone_laws(ENDS, flip, join=ReadEnd.join, leq_in=operator.le,
                           leq_out=operator.le).check()


def reverse_end(x):
    """Order-reversing on the chain: NONE <-> UNKNOWN, PRE_REPLAY <-> POST_REPLAY."""
    return ReadEnd(ReadEnd.UNKNOWN.value - x.value)


def reverse_effect(e):
    return e.map(reverse_end)


def _assert_monotonicity_counterexample(info, f):
    a, b = info.value.inputs
    assert a <= b and a != b
    assert not f(a) <= f(b)
    assert "a <= b  implies  f(a) <= f(b)" in str(info.value)
    assert f"with a={a!r}, b={b!r}" in str(info.value)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("strategy", "join", "f"),
    [(ENDS, ReadEnd.join, reverse_end), (EFFECTS, operator.or_, reverse_effect)],
    ids=["read_end", "read_effect"],
)
def test_order_reversing_map_fails_monotone_laws_for_every_seed(seed, strategy, join, f):
    suite = laws.monotone_laws(strategy, f, join=join, leq_in=operator.le, leq_out=operator.le,
                               name="reversed")
    with pytest.raises(LawViolation, match=r"reversed\.monotone failed") as info:
        suite.check(seed=seed)
    _assert_monotonicity_counterexample(info, f)


def jump_pre_replay(e):
    """Extensive and idempotent, but not monotone: PRE_REPLAY jumps above IN_REPLAY."""
    return e.map(lambda x: ReadEnd.UNKNOWN if x is ReadEnd.PRE_REPLAY else x)


def _jump_laws():
    return laws.closure_laws(EFFECTS, jump_pre_replay, join=operator.or_, leq=operator.le, name="jump")


def test_the_non_monotone_closure_keeps_the_other_closure_laws():
    # what jump_pre_replay is does not depend on the seed: its other two laws hold, once
    suite = _jump_laws()
    suite.check_law("extensive")
    suite.check_law("idempotent")


@pytest.mark.parametrize("seed", SEEDS)
def test_non_monotone_closure_fails_for_every_seed(seed):
    suite = _jump_laws()
    with pytest.raises(LawViolation, match=r"jump\.monotone failed") as info:
        suite.check_law("monotone", seed=seed)
    _assert_monotonicity_counterexample(info, jump_pre_replay)


def test_a_join_that_is_not_a_join_fails_loudly():
    # A right-biased merge (dict's |) gives pairs that are not ordered: the law must say so
    # rather than skip them and pass.
    suite = laws.monotone_laws(ENDS, lambda x: x, join=lambda a, c: c, leq_in=operator.le,
                               leq_out=operator.le, name="merge")
    with pytest.raises(LawViolation, match="join and the order disagree") as info:
        suite.check()
    a, b = info.value.inputs
    assert not a <= b


@pytest.mark.parametrize("seed", SEEDS)
def test_order_too_strict_for_the_join_is_caught(seed):
    # Equality as the order: "a | b == b implies a <= b" fails on every strictly ordered pair.
    suite = laws.join_semilattice_laws(EFFECTS, join=operator.or_, leq=operator.eq, name="eq")
    with pytest.raises(LawViolation, match=r"eq\.order_is_join failed") as info:
        suite.check_law("order_is_join", seed=seed)
    a, b = info.value.inputs
    assert a | b == b and a != b


def test_register_refuses_duplicate_names():
    ns = {"__name__": "fake"}
    suite = laws.join_semilattice_laws(ENDS, join=ReadEnd.join, leq=operator.le, name="x")
    suite.register(ns)
    with pytest.raises(ValueError, match="test_x_associativity is already defined"):
        suite.register(ns)
