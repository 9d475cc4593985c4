"""What readfence's results (``parse``, ``audit``, ``verify``...) are: ``returns`` containers that
equal ``returns``' own, match as them, and refuse to be used as a bool (``if audit(...)`` would
otherwise pass on a failure)."""

from __future__ import annotations

import pytest
import returns.result
from returns.pipeline import is_successful

from readfence.backends import paged, parse, redeclare
from readfence.core import ForwardMode, audit
from readfence.effects import NOT_A_BOOL, Failure, ReadEffect, ReadEnd, Success


def _unsound():
    early = redeclare(paged(), lambda mode: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY}))
    return audit(early, ForwardMode.DECODE, batch_sizes=[2])


@pytest.mark.parametrize("result", [Success(1), Failure("why")], ids=["success", "failure"])
def test_a_result_is_neither_true_nor_false_and_says_what_to_ask(result):
    for use in (bool, lambda r: 1 if r else 0, lambda r: not r, lambda r: r and 1):
        with pytest.raises(TypeError, match="neither true nor false") as info:
            use(result)
        assert str(info.value) == NOT_A_BOOL
    assert "is_successful" in NOT_A_BOOL and "case Success(value)" in NOT_A_BOOL and "unwrap()" in NOT_A_BOOL


def test_what_readfence_returns_refuses_bool_whatever_its_verdict():
    for result in (audit(paged(), ForwardMode.DECODE, batch_sizes=[2]), _unsound(), parse("paged"), parse("pagd")):
        with pytest.raises(TypeError, match="neither true nor false"):
            bool(result)


def test_it_is_still_a_returns_result_equal_to_returns_own_and_matched_as_one():
    good, bad = audit(paged(), ForwardMode.DECODE, batch_sizes=[2]), _unsound()
    assert is_successful(good) and not is_successful(bad)
    assert isinstance(good, returns.result.Success) and isinstance(bad, returns.result.Failure)
    assert Success(3) == returns.result.Success(3) and hash(Success(3)) == hash(3)
    assert parse("paged") == returns.result.Success(paged())
    match bad:
        case returns.result.Success(_):
            pytest.fail("an unsound declaration matched Success")
        case returns.result.Failure(why):
            assert why.buffer == "req_to_token"
    assert good.map(lambda r: r.sound).value_or(False) is True  # map, value_or: as returns' own


def test_short_reprs_of_a_failure_and_a_loop_result():
    from readfence.graph import CpuDevice, Policy, run_overlapped

    why = _unsound().failure()
    assert repr(why) == "<Unsound paged in DECODE: 'req_to_token' declared PRE_REPLAY, read until IN_REPLAY>"
    with CpuDevice() as dev:
        run = run_overlapped(paged(), steps=2, policy=Policy.EXACT, device=dev, batch_size=2)
    shown = repr(run)
    assert shown.startswith("<LoopResult EXACT: 2 steps, ") and shown.endswith(" steps/s, 0 violations>"), shown
    assert "tensor" not in shown and len(shown) < 100


def test_audit_counts_are_keyed_by_plain_strings():
    report = _unsound().failure().report
    counts = report.counts()
    assert all(type(k) is str for k in counts), [type(k) for k in counts]
    assert list(counts) == ["exact", "conservative", "unsound", "latent", "post_replay", "not_audited"]
    assert counts["unsound"] == len(report.unsound()) > 0 and counts["latent"] == len(report.latent())
