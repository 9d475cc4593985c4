"""The law kit must FAIL on deliberately broken structures, naming the law."""

import operator

import pytest
from hypothesis import strategies as st

from readfence.effects import ReadEnd, laws
from readfence.effects.laws import LawViolation

ENDS = st.from_type(ReadEnd)


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

    suite = laws.closure_laws(ENDS, bump, leq=operator.le, name="bump")
    suite.check_law("extensive")
    suite.check_law("monotone")
    with pytest.raises(LawViolation, match=r"bump\.idempotent failed: f\(f\(a\)\) == f\(a\)"):
        suite.check_law("idempotent")


def test_unsound_degrade_is_caught():
    # The real-world bug: falling back to an EARLIER end when in-graph events are missing.
    def early(x):
        return ReadEnd.PRE_REPLAY if x is ReadEnd.IN_REPLAY else x

    with pytest.raises(LawViolation, match="extensive") as info:
        laws.closure_laws(ENDS, early, leq=operator.le, name="early").check_law("extensive")
    assert info.value.inputs == (ReadEnd.IN_REPLAY,)


def test_non_monotone_map_is_caught():
    def flip(x):
        return ReadEnd.NONE if x is ReadEnd.UNKNOWN else x

    with pytest.raises(LawViolation, match="monotone"):
        laws.monotone_laws(ENDS, flip, leq_in=operator.le, leq_out=operator.le).check()


def test_register_refuses_duplicate_names():
    ns = {"__name__": "fake"}
    suite = laws.join_semilattice_laws(ENDS, join=ReadEnd.join, leq=operator.le, name="x")
    suite.register(ns)
    with pytest.raises(ValueError, match="test_x_associativity is already defined"):
        suite.register(ns)
