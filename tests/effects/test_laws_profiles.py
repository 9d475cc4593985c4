"""The law kit runs under the user's hypothesis profile: its examples, its database, its deadline."""

from __future__ import annotations

import operator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase

from readfence.effects import laws


@pytest.fixture
def profile():
    """``profile(name, **kw)`` registers and loads a profile; the one active before comes back."""
    was = settings.get_current_profile_name()

    def load(name: str, **kw):
        settings.register_profile(name, **kw)
        settings.load_profile(name)

    yield load
    settings.load_profile(was)


def _counting_suite(max_examples=None):
    calls = []

    def idem(a):
        calls.append(a)
        return None

    suite = laws.LawSuite("counted", st.integers(), (laws.Law("idem", "a == a", 1, idem),), max_examples)
    return suite, calls


def test_a_profile_sets_how_many_examples_a_law_runs(profile):
    profile("laws_ci", max_examples=7, database=None)
    suite, calls = _counting_suite()
    suite.check_law("idem")
    assert len(calls) == 7


def test_without_a_profile_setting_the_kit_runs_its_own_200(profile):
    profile("laws_stock", database=None)  # hypothesis' defaults otherwise (100 examples, a deadline)
    suite, calls = _counting_suite()
    suite.check_law("idem")
    assert len(calls) == 200
    assert laws.law_settings().deadline is None


def test_max_examples_given_to_the_suite_wins_over_the_profile(profile):
    profile("laws_many", max_examples=50, database=None)
    suite, calls = _counting_suite(max_examples=3)
    suite.check_law("idem")
    assert len(calls) == 3


def test_the_profile_database_keeps_a_failing_example(profile):
    db = InMemoryExampleDatabase()
    profile("laws_db", database=db, max_examples=50)

    def broken(a, b):
        return a | b if a > b else b  # not commutative

    suite = laws.join_semilattice_laws(st.integers(0, 9), join=broken, leq=operator.le, name="broken")
    with pytest.raises(laws.LawViolation, match="commutativity"):
        suite.check_law("commutativity")
    assert db.data, "the failing example was not saved to the profile's database"


def test_a_profile_deadline_applies(profile):
    import datetime

    profile("laws_deadline", deadline=datetime.timedelta(milliseconds=5), database=None)
    assert laws.law_settings().deadline == datetime.timedelta(milliseconds=5)
