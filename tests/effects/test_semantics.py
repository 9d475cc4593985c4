"""Example tests of the lattice semantics the API contract promises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from readfence.effects import Capabilities, ReadEffect, ReadEnd, degrade, resolve

NO_IGE = Capabilities(in_graph_events=False, graphs=True)


def test_chain_order_and_join():
    chain = [ReadEnd.NONE, ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN]
    assert sorted(reversed(chain)) == chain
    assert ReadEnd.join(ReadEnd.IN_REPLAY, ReadEnd.PRE_REPLAY) is ReadEnd.IN_REPLAY
    assert ReadEnd.IN_REPLAY | ReadEnd.PRE_REPLAY is ReadEnd.IN_REPLAY  # not bitwise-or
    assert ReadEnd.join_all(()) is ReadEnd.NONE
    assert ReadEnd.join_all(iter(chain)) is ReadEnd.UNKNOWN


def test_join_rejects_non_ends():
    with pytest.raises(TypeError, match="expected a ReadEnd, got 2"):
        ReadEnd.join(ReadEnd.NONE, 2)


def test_effect_lookup_join_and_end():
    a = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY})
    b = ReadEffect.of({"swa_map": ReadEnd.PRE_REPLAY, "req_to_token": ReadEnd.POST_REPLAY})
    j = a | b
    assert j["req_to_token"] is ReadEnd.POST_REPLAY and j["swa_map"] is ReadEnd.PRE_REPLAY
    assert j["seq_lens"] is ReadEnd.NONE
    assert j.end is ReadEnd.POST_REPLAY
    assert a <= j and b <= j and not j <= a
    assert ReadEffect.none().end is ReadEnd.NONE
    assert ReadEffect.unknown()["anything"] is ReadEnd.UNKNOWN
    assert ReadEffect.of({}, default=ReadEnd.PRE_REPLAY).end is ReadEnd.PRE_REPLAY


def test_equality_is_semantic_and_hashable():
    assert ReadEffect.of({"a": ReadEnd.NONE}) == ReadEffect.none()
    assert ReadEffect.of({"a": ReadEnd.UNKNOWN}, default=ReadEnd.UNKNOWN) == ReadEffect.unknown()
    assert hash(ReadEffect.of({"a": ReadEnd.NONE})) == hash(ReadEffect.none())
    assert ReadEffect.of({"x": ReadEnd.IN_REPLAY, "y": ReadEnd.PRE_REPLAY}) == ReadEffect.of(
        {"y": ReadEnd.PRE_REPLAY, "x": ReadEnd.IN_REPLAY})
    assert len({ReadEffect.none(), ReadEffect.of({"a": ReadEnd.NONE})}) == 1


def test_default_participates_in_order():
    named = ReadEffect.of({"a": ReadEnd.UNKNOWN})
    assert not ReadEffect.of({}, default=ReadEnd.PRE_REPLAY) <= named  # buffer "b" is above
    assert named <= ReadEffect.unknown()


def test_immutable():
    e = ReadEffect.none()
    with pytest.raises(AttributeError):
        e.default = ReadEnd.UNKNOWN


@pytest.mark.parametrize(
    ("ends", "pattern"),
    [
        ({3: ReadEnd.NONE}, r"key 3 \(int\) with value <ReadEnd.NONE: 0>"),
        ({"req_to_token": 2}, r"buffer 'req_to_token' has value 2 \(int\)"),
        ({"req_to_token": "IN_REPLAY"}, r"buffer 'req_to_token' has value 'IN_REPLAY'"),
    ],
)
def test_bad_effect_input_names_key_and_value(ends, pattern):
    with pytest.raises(TypeError, match=pattern):
        ReadEffect.of(ends)


def test_bad_default_and_mapping():
    with pytest.raises(TypeError, match="default must be a ReadEnd"):
        ReadEffect.of({}, default=0)
    with pytest.raises(TypeError, match="expects a mapping"):
        ReadEffect.of([("a", ReadEnd.NONE)])


@given(st.from_type(ReadEnd), st.from_type(Capabilities))
def test_degrade_never_lowers(end, caps):
    assert degrade(end, caps) >= end


def test_degrade_without_in_graph_events_goes_later():
    assert degrade(ReadEnd.IN_REPLAY, NO_IGE) is ReadEnd.POST_REPLAY
    assert degrade(ReadEnd.PRE_REPLAY, NO_IGE) is ReadEnd.PRE_REPLAY
    eager = Capabilities(in_graph_events=False, graphs=False)
    assert degrade(ReadEnd.IN_REPLAY, eager) is ReadEnd.IN_REPLAY
    eff = ReadEffect.of({"a": ReadEnd.IN_REPLAY}, default=ReadEnd.IN_REPLAY)
    assert degrade(eff, NO_IGE) == ReadEffect.of({}, default=ReadEnd.POST_REPLAY)


def test_degrade_rejects_bad_input():
    with pytest.raises(TypeError, match="ReadEnd or a ReadEffect"):
        degrade("IN_REPLAY", NO_IGE)
    with pytest.raises(TypeError, match="needs Capabilities"):
        degrade(ReadEnd.NONE, None)


def test_resolve():
    caps = Capabilities()
    assert resolve(ReadEnd.PRE_REPLAY, owns_publish=False, caps=caps) is ReadEnd.UNKNOWN
    assert resolve(ReadEnd.IN_REPLAY, owns_publish=True, caps=NO_IGE) is ReadEnd.POST_REPLAY
    assert resolve(ReadEnd.IN_REPLAY, owns_publish=True, caps=caps) is ReadEnd.IN_REPLAY
    eff = ReadEffect.of({"a": ReadEnd.PRE_REPLAY, "b": ReadEnd.IN_REPLAY})
    assert resolve(eff, owns_publish=True, caps=caps) is ReadEnd.IN_REPLAY
    assert resolve(eff, owns_publish=True, caps=NO_IGE) is ReadEnd.POST_REPLAY


def test_parse_read_end():
    assert ReadEnd.parse(" post_replay ") is ReadEnd.POST_REPLAY
    with pytest.raises(ValueError, match="expected one of NONE, PRE_REPLAY"):
        ReadEnd.parse("later")
