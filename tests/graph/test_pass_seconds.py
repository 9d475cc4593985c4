"""``Lowered.pass_seconds``: where a lowering's time went, each pass's seconds under its own name."""

from __future__ import annotations

import time

import pytest

import readfence.graph.lowering._lower as lowering
from readfence.backends import hybrid_linear, linear, paged, trtllm_mha
from readfence.core import ForwardMode, clear_trace_cache
from readfence.graph import Policy, lower
from readfence.graph.lowering._pass_clock import PASSES, PassClock
from tests.conftest import SMALL as CFG

M = ForwardMode

#: Added to one pass: long beside the gaps ``lower`` leaves untimed (argument checks, a fresh state).
PAUSE = 0.1


def _lowered(dev, backend, mode=M.DECODE, policy=Policy.EXACT):
    clear_trace_cache()  # every pass runs (a cached trace binds in no time)
    start = time.perf_counter()
    low = lower(backend, mode, batch_size=2, cfg=CFG, device=dev, policy=policy)
    return low, time.perf_counter() - start


def test_every_pass_in_order_and_together_no_more_than_the_lowering(dev):
    low, wall = _lowered(dev, hybrid_linear(trtllm_mha(), linear()))
    assert tuple(low.pass_seconds) == PASSES
    assert all(isinstance(s, float) and s >= 0 for s in low.pass_seconds.values())
    for name in ("trace", "compile", "validate", "verdict", "rehearse"):
        assert low.pass_seconds[name] > 0, name
    assert sum(low.pass_seconds.values()) <= wall


def test_a_pass_that_does_not_run_takes_no_time(dev):
    # COARSE asks no verdict: nothing is timed under its name
    low, _ = _lowered(dev, paged(), policy=Policy.COARSE)
    assert low.pass_seconds["verdict"] == 0.0
    assert low.pass_seconds["rehearse"] > 0


def test_a_step_that_is_not_replayed_times_its_python_on_the_generated_states(dev):
    low, wall = _lowered(dev, paged(), mode=M.EXTEND)
    assert low.pass_seconds["validate"] > 0  # the stages' Python observed on the generated states
    assert sum(low.pass_seconds.values()) <= wall


@pytest.mark.parametrize(("name", "function"), [("trace", "_checked_program"), ("compile", "compile_stages"),
                                                ("validate", "_validate_code"), ("verdict", "audit_verdict"),
                                                ("rehearse", "rehearse"), ("plan", "plan_fences"),
                                                ("capture", "build_slot")])
def test_a_slower_pass_is_counted_under_its_name_once(dev, monkeypatch, name, function):
    # the pause is in the named pass, and in no other: counted twice, the passes would add up
    # to more than the whole lowering
    slow = getattr(lowering, function)
    paused = []

    def slowed(*args, **kwargs):
        if not paused:  # (once: a pass its lowering runs twice pauses in the first)
            paused.append(True)
            time.sleep(PAUSE)
        return slow(*args, **kwargs)

    monkeypatch.setattr(lowering, function, slowed)
    low, wall = _lowered(dev, hybrid_linear(trtllm_mha(), linear()))
    assert paused
    assert low.pass_seconds[name] >= PAUSE
    assert sum(low.pass_seconds.values()) <= wall


def test_the_clock_names_only_lowering_passes():
    with pytest.raises(ValueError, match=r"unknown lowering pass 'bind': one of trace, compile"):
        with PassClock().timing("bind"):
            pass
