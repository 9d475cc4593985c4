"""The law kit run on readfence's own lattices: one named test per law, per instance."""

import operator

import pytest
from hypothesis import find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from readfence.effects import Capabilities, ReadEffect, ReadEnd, degrade, laws
from readfence.effects.strategies import BUFFERS

laws.check_join_semilattice(
    st.from_type(ReadEnd), join=ReadEnd.join, leq=operator.le,
    bottom=ReadEnd.NONE, top=ReadEnd.UNKNOWN, name="read_end",
)
laws.check_join_semilattice(
    st.from_type(ReadEffect), join=operator.or_, leq=operator.le,
    bottom=ReadEffect.none(), top=ReadEffect.unknown(), name="read_effect",
)
for _caps in (Capabilities(), Capabilities(in_graph_events=False), Capabilities(graphs=False),
              Capabilities(in_graph_events=False, graphs=False)):
    _tag = f"{'ige' if _caps.in_graph_events else 'noige'}_{'graphs' if _caps.graphs else 'eager'}"
    laws.check_closure(st.from_type(ReadEnd), lambda x, c=_caps: degrade(x, c),
                       join=ReadEnd.join, leq=operator.le, name=f"degrade_end_{_tag}")
    laws.check_closure(st.from_type(ReadEffect), lambda x, c=_caps: degrade(x, c),
                       join=operator.or_, leq=operator.le, name=f"degrade_effect_{_tag}")


def test_registered_tests_exist():
    names = {n for n in globals() if n.startswith("test_read_end_")}
    assert names == {
        "test_read_end_associativity", "test_read_end_commutativity", "test_read_end_idempotence",
        "test_read_end_order_is_join", "test_read_end_join_is_upper_bound",
        "test_read_end_bottom_identity", "test_read_end_top_absorbs",
    }


def _draws_the_registered_effects(strategy) -> bool:
    # readfence's strategy draws effects over its four buffer names with any default: a
    # strategy that hypothesis built from ReadEffect's constructor would not name them
    found = find(strategy, lambda e: set(e.buffers) == set(BUFFERS) and e.default is not ReadEnd.NONE,
                 settings=settings(database=None, derandomize=True, max_examples=2000))
    return isinstance(found, ReadEffect)


def test_from_type_uses_registered_strategies():
    assert _draws_the_registered_effects(st.from_type(ReadEffect))
    assert {find(st.from_type(Capabilities), lambda c, v=v: c == v, settings=settings(database=None))
            for v in (Capabilities(in_graph_events=a, graphs=b) for a in (False, True) for b in (False, True))} \
        == {Capabilities(in_graph_events=a, graphs=b) for a in (False, True) for b in (False, True)}


def test_the_registration_check_fails_on_another_strategy():
    with pytest.raises(NoSuchExample):
        _draws_the_registered_effects(st.builds(ReadEffect.none))
