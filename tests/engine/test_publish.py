"""Where an engine's runners publish: the no-marker fallback, publish points, the runner the
scheduler waits on and a mailbox left uncleared, each checked before anything runs
(``audit_runner``) and shown racing by poison when run (``runner_step``, check mode)."""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode
from readfence.effects import ReadEnd
from readfence.engine import RunnerModel, RunnerPhase, adapt, audit_runner, runner_model, runner_step
from readfence.engine.reference import TritonBackend, TrtllmMhaBackend
from readfence.graph import LoopOptions, Policy, UnsoundLowering, lower_step, run_overlapped, run_serial

from .conftest import CFG

M = ForwardMode
PRE, IN, POST, UNKNOWN = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN


def _poisoned_differs(target, mode, dev, state, steps=3, unsafe=False):
    serial = run_serial(target, mode, steps=steps, batch_size=2, cfg=CFG, state=state)
    checked = run_overlapped(target, mode, steps=steps, policy=Policy.JOINED, device=dev, batch_size=2, cfg=CFG,
                             state=state, options=LoopOptions(check=True, sanitize=False,
                                                              UNSAFE_skip_soundness_check=unsafe))
    return not checked.matches(serial)


def test_the_runner_model_places_its_events_where_its_code_records_them():
    assert RunnerModel().placed(IN) is IN and RunnerModel().no_marker is POST
    early = RunnerModel(places={IN: PRE, POST: PRE})
    assert (early.placed(IN), early.placed(POST), early.placed(PRE)) == (PRE, PRE, PRE)
    with pytest.raises(TypeError, match="maps a ReadEnd to the ReadEnd the runner records its event at"):
        RunnerModel(places={"in_replay": PRE})
    with pytest.raises(TypeError, match="no_marker must be a ReadEnd, got 'pre'"):
        RunnerModel(no_marker="pre")


@pytest.mark.slow
@pytest.mark.parametrize("fallback, sound", [(POST, True), (PRE, False)])
def test_the_no_marker_fallback_is_audited_and_races_only_when_earlier_than_declared(fallback, sound, dev):
    engine = adapt(TritonBackend, cfg=CFG)  # builds its metadata inside the graph: IN_REPLAY
    model = RunnerModel(in_graph_marker=False, no_marker=fallback)
    result = audit_runner(engine, model=model)
    if sound:
        (row,) = [r for r in result.unwrap().rows if r.buffer == "req_to_token"]
        assert (row.published, row.truth, row.sound) == (POST, IN, True)
    else:
        failed = result.failure()
        assert (failed.row.buffer, failed.row.published, failed.row.truth, failed.row.method) == (
            "req_to_token", PRE, IN, "init_forward_metadata_in_graph")
        assert "recorded in phase 'decode' at PRE_REPLAY (declared IN_REPLAY)" in failed.message
    assert _poisoned_differs(runner_model(engine, model), M.DECODE, dev, engine.state) is not sound


def _phases(waits_on_final: bool):
    target = adapt(TrtllmMhaBackend, cfg=CFG)
    draft = adapt(TritonBackend, cfg=CFG, state=target.state)
    final = RunnerModel(places={UNKNOWN: POST}) if waits_on_final else RunnerModel()
    return [RunnerPhase("target_verify", target, M.TARGET_VERIFY), RunnerPhase("draft_extend", draft, M.DRAFT_EXTEND,
                                                                                final)]


@pytest.mark.slow
@pytest.mark.parametrize("waits_on", ["target_verify", "draft_extend"])
def test_the_runner_the_scheduler_waits_on_must_be_the_last_to_read(waits_on, dev):
    phases = _phases(waits_on == "draft_extend")
    result = audit_runner(phases, publisher=waits_on)
    sound = waits_on == "draft_extend"
    if sound:
        assert result.unwrap().sound
    else:
        row = result.failure().row
        assert (row.buffer, row.phase, row.publisher, row.published) == ("req_to_token", "draft_extend",
                                                                         "target_verify", PRE)
    step = runner_step(phases, waits_on)
    assert step.waits_on == waits_on
    assert _poisoned_differs(step, M.DECODE, dev, phases[0].engine.state, unsafe=True) is not sound


def test_a_step_shape_waiting_on_an_earlier_phase_is_refused_unless_trusted(dev):
    step = runner_step(_phases(False), "target_verify")
    with pytest.raises(UnsoundLowering, match="phase 'draft_extend' reads 'req_to_token' after it"):
        lower_step(step, M.DECODE, device=dev, policy=Policy.JOINED, batch_size=2, cfg=CFG,
                   state=step.phases[0].backend.engine.state)


def test_phases_must_share_one_state_and_name_their_runners():
    a, b = adapt(TritonBackend, cfg=CFG), adapt(TritonBackend, cfg=CFG)
    with pytest.raises(ValueError, match="bound to the same state"):
        runner_step([RunnerPhase("one", a, M.DECODE), RunnerPhase("two", b, M.DRAFT_EXTEND)])
    with pytest.raises(ValueError, match="phase names must differ"):
        runner_step([RunnerPhase("one", a, M.DECODE), RunnerPhase("one", a, M.DRAFT_EXTEND)])
    with pytest.raises(ValueError, match="publisher 'three' is not a phase"):
        audit_runner([RunnerPhase("one", a, M.DECODE)], publisher="three")


@pytest.mark.slow
@pytest.mark.parametrize("clear", [True, False])
def test_a_mailbox_left_uncleared_hands_a_later_step_an_earlier_event(clear, dev):
    engine = adapt(TrtllmMhaBackend, cfg=CFG)
    model = RunnerModel(prefill_read_done=lambda step: step % 2 == 0, clear_mailbox=clear)
    result = audit_runner(engine, M.EXTEND, model=model)
    if clear:
        assert result.unwrap().sound
    else:
        failed = result.failure()
        assert failed.row is None and "step 1 publishes nothing, and its scheduler is handed step 0's event" in \
            failed.message
    # check mode poisons, at the start of a step handed an earlier step's event, what it releases
    assert _poisoned_differs(runner_model(engine, model), M.EXTEND, dev, engine.state, steps=4) is not clear
