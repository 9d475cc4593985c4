"""The race suite's quick subset, scored for real: every buggy version caught, naming its buffer, and
shown racing on the CPU device; every fixed version accepted. (The whole suite is
``readfence bench races``: minutes.)"""

from __future__ import annotations

import pytest

from readfence.races import CASES, score
from readfence.races.internal import import_sglang

QUICK = [c for c in CASES if c.quick]
NEEDS_SGLANG = {"sglang-tbo-forgets", "sglang-hybrid-linear-forgets", "sglang-dots-hybrid", "sglang-eagle-draft-extend"}


@pytest.mark.slow
@pytest.mark.parametrize("case", QUICK, ids=[c.name for c in QUICK])
def test_a_quick_case_is_caught_naming_its_buffer_races_and_its_fix_is_accepted(case):
    if case.name in NEEDS_SGLANG:
        modules, reason = import_sglang()  # imported here, not when the tests are collected: it takes seconds
        if not modules:
            pytest.skip(reason)
    (scored,) = score([case]).cases
    buggy, fixed = scored.buggy, scored.fixed
    assert not buggy.errors and not fixed.errors, (buggy.errors, fixed.errors)
    assert buggy.detected and buggy.first is not None and buggy.first.buffer, buggy
    assert buggy.audit is not None, "each quick case is caught before anything runs"
    assert buggy.race is not None, "the buggy version must race on the CPU device"
    assert not fixed.detected, fixed


def test_the_quick_subset_covers_each_kind_of_race():
    kinds = {type(c.buggy()).__name__ for c in QUICK if c.name not in NEEDS_SGLANG}
    assert kinds == {"EngineSubject", "StagingSubject"}
    assert {c.name for c in QUICK} & NEEDS_SGLANG, "SGLang's own classes are in the quick subset"
