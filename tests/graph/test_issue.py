"""The generated step issuer: the device calls one ``Lowered.run`` makes, in stream order.

The expected sequence is written out here from the lowering's plan (which events end where,
what check mode adds), not read from the issuer: a call the generator drops, duplicates or
moves shows up as a difference.
"""

import traceback

import pytest
import torch

from readfence.backends import hybrid_linear, linear, trtllm_mha
from readfence.core import ForwardMode as M
from readfence.effects import ReadEnd
from readfence.graph import CheckState, CpuDevice, LowerOptions, Policy, Scheduler, lower, make_state
from readfence.graph.devices import DeviceObserver
from tests.conftest import DEFAULT as CFG

T = 30.0


class _Calls(DeviceObserver):
    def __init__(self, stream):
        self.stream, self.calls = stream, []

    def on_launch(self, stream, label, ops):
        if stream == self.stream:
            self.calls.append(("launch", label))

    def on_record(self, stream, event):
        if stream == self.stream:
            self.calls.append(("record", event.name))

    def on_wait(self, stream, event):
        if stream == self.stream:
            self.calls.append(("wait", event.name))


def _expected(low, slot, written, *, check, first, last):
    """The step's calls as the plan and the check mode say they go."""
    L = low.label
    ends = {end: [e.name for p, e in slot.events.items() if p.after is None and p.end is end] for end in ReadEnd}
    # check mode poisons what each release point inside the step releases (after the forward: nothing)
    poisoned = {p.end for p in low.plan.placements.values()
                if p.after is None and p.end is not ReadEnd.UNKNOWN} if check else set()
    calls = [("wait", written.name), ("launch", f"{L}/load_batch")]
    if check:
        calls += [("launch", f"{L}/check")] if first else []
        calls.append(("launch", f"{L}/arm"))
        if ReadEnd.NONE in poisoned:
            calls.append(("launch", f"{L}/poison@NONE"))
    calls.append(("launch", f"{L}/prepare_out_graph"))

    def release(end):
        calls.extend(("record", name) for name in ends[end])
        if end in poisoned:
            calls.append(("launch", f"{L}/poison@{end.name}"))

    release(ReadEnd.PRE_REPLAY)
    if low.graphed:
        calls.append(("launch", slot.graph.label))
    else:
        calls.append(("launch", f"{L}/prepare_in_graph"))
        release(ReadEnd.IN_REPLAY)
        calls.append(("launch", f"{L}/body"))
    release(ReadEnd.POST_REPLAY)
    calls.append(("launch", f"{L}/outputs"))
    release(ReadEnd.UNKNOWN)
    if check and last:
        calls += [("launch", f"{L}/restore"), ("launch", f"{L}/check")]
    calls.append(("record", slot.done.name))
    return calls


@pytest.mark.parametrize("check", [False, True], ids=["plain", "check"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
@pytest.mark.parametrize("policy", [Policy.COARSE, Policy.PER_BUFFER, Policy.EXACT], ids=str)
def test_a_step_makes_the_calls_its_plan_says_in_stream_order(policy, graphs, check):
    with CpuDevice(timeout=T, graphs=graphs) as dev:
        state = make_state(CFG, dev)
        low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, device=dev, policy=policy,
                    state=state,
                    lowering=LowerOptions(ring_size=2, check=CheckState(state["shared"], CFG) if check else None))
        assert low.graphed is graphs
        sched, written = dev.stream("schedule"), dev.event("written")
        sched.record(written)
        batch = Scheduler(CFG, M.DECODE, 2).next_step().batch
        obs = _Calls(low.stream.name)
        dev.add_observer(obs)
        # one step, then one in two replays (as a composite step issues its phases)
        for step, (first, last) in enumerate([(True, True), (True, False), (False, True)]):
            obs.calls.clear()
            run = low.run(batch, step=step, after=[written], first=first, last=last)
            slot = low._slots[step % 2]  # the ring's slots take turns
            assert obs.calls == _expected(low, slot, written, check=check, first=first, last=last)
            assert run.step == step and run.fence.done.event is slot.done
            run.result(T)


def test_the_run_counter_gives_the_default_step_and_picks_the_slot():
    with CpuDevice(timeout=T) as dev:
        low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, device=dev,
                    policy=Policy.PER_BUFFER, lowering=LowerOptions(ring_size=3))
        batch = Scheduler(CFG, M.DECODE, 2).next_step().batch
        runs = [low.run(batch) for _ in range(4)]
        assert [r.step for r in runs] == [0, 1, 2, 3]
        assert [r.fence.done.event for r in runs] == [low._slots[i % 3].done for i in range(4)]
        with pytest.raises(ValueError, match="has shape"):
            low.run({**batch, "input_ids": torch.zeros(1, dtype=torch.int64)})
        assert low.run(batch).step == 4  # a refused batch is not a run
        for r in runs:
            r.result(T)


def test_a_failure_inside_the_issuer_shows_the_generated_line_in_its_traceback():
    dev = CpuDevice(timeout=T)
    low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, device=dev,
                policy=Policy.PER_BUFFER, lowering=LowerOptions(ring_size=2))
    batch = Scheduler(CFG, M.DECODE, 2).next_step().batch
    low.run(batch).result(T)
    dev.close()
    with pytest.raises(Exception) as info:
        low.run(batch)  # slot 1: the device is closed under it
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename.startswith("<step issuer of")]
    assert [f.filename.endswith("slot 1>") for f in frames] == [True]
    assert frames[0].line and frames[0].line in low.step_source(1)


def test_step_source_is_each_slots_own_code_and_refuses_a_slot_out_of_range():
    with CpuDevice(timeout=T) as dev:
        state = make_state(CFG, dev)
        low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, device=dev,
                    policy=Policy.PER_BUFFER, state=state,
                    lowering=LowerOptions(ring_size=2, check=CheckState(state["shared"], CFG)))
        first, second = low.step_source(0), low.step_source(1)
        assert first == second  # the same code; the globals bound to it are the slot's own
        assert low._issuers[0].__globals__["done"] is low._slots[0].done
        assert low._issuers[1].__globals__["done"] is low._slots[1].done
        assert "check.restorer()" in first and "seam.check_start(" in first
        for bad in (2, -1, "0"):
            with pytest.raises(ValueError, match=r"slot must be an int in range\(2\)"):
                low.step_source(bad)
