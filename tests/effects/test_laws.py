"""What the law kit feeds its laws: ordered pairs for order premises, and seeds that vary runs."""

import operator

import pytest
from hypothesis import strategies as st

from readfence.effects import ReadEffect, laws

EFFECTS = st.from_type(ReadEffect)
# Each seed is a whole run of the kit's 200 examples, whose pairs are counted: four runs show the
# ordered-pair construction holds whatever hypothesis draws (tests/effects/test_laws_catch_broken.py
# runs eight seeds against broken structures).
SEEDS = range(4)

# A product of three effect lattices (like a declaration: one effect per mode). Two values
# drawn independently are seldom comparable here, so a law with an order premise is vacuous
# unless its pairs are built ordered.
TRIPLES = st.tuples(EFFECTS, EFFECTS, EFFECTS)


def join3(a, b):
    return tuple(map(operator.or_, a, b))


def leq3(a, b):
    return all(map(operator.le, a, b))


class PairCounter:
    """An order that counts the pairs it is asked about: all, ordered, strictly ordered."""

    def __init__(self, leq):
        self.leq, self.total, self.ordered, self.strict = leq, 0, 0, 0

    def __call__(self, a, b):
        le = self.leq(a, b)
        self.total += 1
        self.ordered += le
        self.strict += le and a != b
        return le


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("strategy", "join", "leq", "min_strict"),
    [(EFFECTS, operator.or_, operator.le, 0.3), (TRIPLES, join3, leq3, 0.6)],
    ids=["read_effect", "triple"],
)
def test_monotone_law_sees_ordered_and_mostly_strict_pairs(seed, strategy, join, leq, min_strict):
    count = PairCounter(leq)
    laws.monotone_laws(strategy, lambda x: x, join=join, leq_in=count, leq_out=leq).check(seed=seed)
    assert count.total >= 100
    assert count.ordered == count.total
    assert count.strict >= min_strict * count.total, (count.strict, count.total)


@pytest.mark.parametrize("seed", SEEDS)
def test_order_is_join_sees_strictly_ordered_pairs(seed):
    count = PairCounter(leq3)
    suite = laws.join_semilattice_laws(TRIPLES, join=join3, leq=count, name="triple")
    suite.check_law("order_is_join", seed=seed)
    assert count.strict >= 0.25 * count.total, (count.strict, count.total)
    assert count.ordered < count.total  # independent pairs too: "not a <= b" is tested as well


def _drawn(seed):
    seen = []
    suite = laws.monotone_laws(EFFECTS, lambda x: x, join=operator.or_,
                               leq_in=lambda a, b: seen.append((a, b)) or a <= b,
                               leq_out=operator.le, max_examples=30)
    suite.check(seed=seed)
    return seen


def test_seed_reproduces_and_varies_a_run():
    assert _drawn(0) == _drawn(0)
    assert _drawn(0) != _drawn(1)
