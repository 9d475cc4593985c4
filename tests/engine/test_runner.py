"""The engine's runner model on readfence's loop: publish points, the marker rule, the kill switch,
per-batch prefill resolution and the one-slot mailbox (a stale event is never consumed)."""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode
from readfence.effects import ReadEnd
from readfence.engine import EngineRunner, Mailbox, RunnerModel, adapt, runner_model
from readfence.engine.reference import deepseek_v4_engine, triton_engine
from readfence.graph import LowerOptions, Policy, decode_loop, run_overlapped, run_serial
from readfence.graph.lowering import RingWrapError

from .classes import Ends, KeptCopies
from .conftest import CFG

M = ForwardMode
PRE, IN, POST, UNKNOWN = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN


def _loop(engine, dev, model, mode=M.DECODE, policy=Policy.JOINED, steps=4, lowering=None):
    serial = run_serial(engine, mode, steps=steps, batch_size=2, cfg=CFG, state=engine.state)
    target = runner_model(engine, model)
    run = run_overlapped(target, mode, steps=steps, policy=policy, device=dev, batch_size=2, cfg=CFG,
                         state=engine.state, lowering=lowering)
    return run, serial


def _runner(engine, dev, model, mode=M.DECODE, policy=Policy.JOINED) -> EngineRunner:
    loop = decode_loop(runner_model(engine, model), mode, policy=policy, device=dev, batch_size=2, cfg=CFG,
                       state=engine.state)
    loop.run(4)
    return loop.lowered


def test_the_mailbox_is_taken_and_cleared_unless_told_otherwise():
    box = Mailbox()
    box.put(3, "e3")
    assert box.take() == (3, "e3") and box.take() is None
    stale = Mailbox(clear_on_take=False)
    stale.put(3, "e3")
    assert stale.take() == stale.take() == (3, "e3")


@pytest.mark.parametrize("marker, point", [(True, IN), (False, POST)])
def test_in_replay_without_an_in_graph_marker_is_published_after_the_replay(marker, point, dev):
    engine = triton_engine(CFG)
    runner = _runner(engine, dev, RunnerModel(in_graph_marker=marker))
    assert runner.point is point
    assert {p.end for p in runner.plan.placements.values()} == {point}
    assert [end for _, end in runner.published] == [point] * 4


def test_the_kill_switch_publishes_nothing_and_the_scheduler_waits_for_the_whole_forward(dev):
    engine = triton_engine(CFG)
    run, serial = _loop(engine, dev, RunnerModel(kill_switch=True))
    assert run.matches(serial) and run.violations == ()
    runner = _runner(engine, dev, RunnerModel(kill_switch=lambda step: step >= 2))
    assert [end for _, end in runner.published] == [IN, IN, UNKNOWN, UNKNOWN]
    # Policy.COARSE is the runner with its kill switch on
    coarse = _runner(engine, dev, RunnerModel(), policy=Policy.COARSE)
    assert {end for _, end in coarse.published} == {UNKNOWN}


def test_a_declaration_asked_again_each_step_that_moved_later_publishes_nothing(dev):
    engine = adapt(KeptCopies, cfg=CFG)
    runner = _runner(engine, dev, RunnerModel())
    assert runner.point is PRE and {end for _, end in runner.published} == {PRE}
    engine.object.shared_read_ends = lambda mode: Ends.POST_REPLAY  # its own state changed its mind
    run, serial = _loop(engine, dev, RunnerModel())
    assert run.matches(serial) and run.violations == ()
    assert {end for _, end in _runner(engine, dev, RunnerModel()).published} == {POST}


def test_prefill_publishes_per_batch_and_a_stale_event_is_never_consumed(dev):
    engine = deepseek_v4_engine(CFG)
    every_other = RunnerModel(prefill_read_done=lambda step: step % 2 == 0)
    runner = _runner(engine, dev, every_other, mode=M.EXTEND)
    assert runner.point is PRE and [end for _, end in runner.published] == [PRE, UNKNOWN, PRE, UNKNOWN]
    run, serial = _loop(engine, dev, every_other, mode=M.EXTEND, steps=6)
    assert run.matches(serial) and run.violations == ()
    # the bug the mailbox rule exists for: a step that publishes nothing hands out the last event.
    # With one event per graph, readfence refuses to bind a wait to a generation recorded again;
    # with two, the wait binds to the old step's record, and the sanitizer sees the race
    kept = RunnerModel(prefill_read_done=lambda step: step % 2 == 0, clear_mailbox=False)
    with pytest.raises(RingWrapError, match="was recorded again"):
        _loop(engine, dev, kept, mode=M.EXTEND, steps=6)
    stale, _ = _loop(engine, dev, kept, mode=M.EXTEND, steps=6, lowering=LowerOptions(ring_size=2))
    assert stale.violations, "the sanitizer must see the scheduler's write racing the step that published nothing"


def test_prefill_past_its_snapshot_limit_is_coarse(dev):
    engine = deepseek_v4_engine(CFG)
    loop = decode_loop(runner_model(engine), M.EXTEND, policy=Policy.JOINED, device=dev, batch_size=4, cfg=CFG,
                       state=engine.state)
    loop.run(2)
    assert loop.lowered.point is UNKNOWN and {end for _, end in loop.lowered.published} == {UNKNOWN}


def test_the_runner_runs_only_its_own_publishing(dev):
    with pytest.raises(ValueError, match="run it with Policy.JOINED .* not EXACT"):
        run_overlapped(runner_model(triton_engine(CFG)), steps=1, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG)
    with pytest.raises(TypeError, match=r"^engine must be an adapted backend, got 'triton' \(str\)"):
        runner_model("triton")  # type: ignore[arg-type]
