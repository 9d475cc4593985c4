"""Fences: timeouts with clear errors, stream exceptions with their context, event rings.

Nothing here may hang: every wait has a small timeout, and every blocked stream is released
in ``finally``.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import hybrid_linear, linear, paged, trtllm_mha
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.graph import CpuDevice, DeviceTimeout, Fence, LowerOptions, Policy, Scheduler, lower, make_state
from readfence.graph.devices import DeviceObserver, EventNeverRecorded, StreamError
from readfence.graph.lowering import RingWrapError

from ._gates import make_gate

M = ForwardMode
SHORT = 0.2  # a wait that must time out
T = 10.0  # a wait that must succeed
# Two layers: both arms of a two-arm composite and both kinds of trtllm_mha's layers attend,
# so each step still records an event per released buffer, at half the default model's cost.
CFG = ModelConfig(layers=2, max_reqs=8, max_ctx=16)
EVENT_SEMANTICS = pytest.mark.parametrize("dev", [False, True], ids=["cpu-events", "cuda-events"], indirect=True)


@pytest.fixture
def dev(request):
    """A CpuDevice with per-record handles, or with CUDA's events (only the latest record)."""
    with CpuDevice(timeout=T, cuda_events=getattr(request, "param", False)) as d:
        yield d


def _batch(low, seed=0):
    nxt = Scheduler(low.cfg, low.mode, low.batch_size, seed=seed).next_step()
    for b in SHARED_BUFFERS:
        low.shared[b].copy_(nxt.shared[b])
    return nxt.batch


# -- a fence that never fires --------------------------------------------------------------------


def test_host_wait_on_a_fence_that_never_fires_times_out_clearly(dev):
    low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, cfg=CFG, device=dev,
                policy=Policy.PER_BUFFER)
    batch = _batch(low)
    gate, block = make_gate(T)
    try:
        low.stream.launch(block, label="stuck kernel")  # the forward stream never gets to the step
        run = low.run(batch, step=0)
        for buffers in (["req_to_token"], ["state_slots"], None):
            with pytest.raises(DeviceTimeout) as err:
                run.fence.synchronize(buffers, timeout=SHORT)
            msg = str(err.value)
            assert f"timed out after {SHORT:g} s" in msg
            assert low.label in msg  # which lowered graph's event
            assert "'forward'" in msg  # the stream that should record it
            assert err.value.timeout == SHORT
        assert not run.fence.released("req_to_token")
        with pytest.raises(DeviceTimeout, match="done"):
            run.result(timeout=SHORT)
    finally:
        gate.set()
    # released: everything completes, nothing was lost
    run.fence.synchronize(timeout=T)
    assert run.fence.released("req_to_token") and run.fence.released("state_slots")
    assert run.result(T).shape[0] == 2


def test_device_side_wait_on_a_fence_that_never_fires_times_out(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
    batch = _batch(low)
    sched = dev.stream("schedule")
    gate, block = make_gate(T)
    try:
        low.stream.launch(block, label="stuck kernel")
        run = low.run(batch, step=0)
        run.fence.wait(sched, ["req_to_token"])  # device-side: returns at once
        wrote = []
        sched.launch(wrote.append, 1, label="scheduler/write:req_to_token")
        with pytest.raises(DeviceTimeout) as err:
            sched.synchronize(timeout=SHORT)
        assert "stream 'schedule'" in str(err.value) and "wait(" in str(err.value)
        assert wrote == []  # the write really waited
    finally:
        gate.set()
    sched.synchronize(timeout=T)
    assert wrote == [1]


def test_device_side_wait_gives_up_after_the_device_timeout():
    # The forward stream stays blocked longer than the device timeout: the waiting stream fails
    # with DeviceTimeout (naming the event) instead of hanging, and the error surfaces at the
    # next host wait on that stream.
    with CpuDevice() as dev:
        low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER)
        dev.timeout = SHORT  # after lowering: its eager rehearsal may take longer on a loaded machine
        batch = _batch(low)
        sched = dev.stream("schedule")
        gate, block = make_gate(T)
        try:
            low.stream.launch(block, label="stuck kernel")
            run = low.run(batch, step=0)
            run.fence.wait(sched, ["seq_lens"])
            sched.launch(lambda: None, label="scheduler/write:seq_lens")
            with pytest.raises(StreamError) as err:
                sched.synchronize(timeout=T)
            assert err.value.stream == "schedule"
            assert isinstance(err.value.original, DeviceTimeout)
            assert low.label in str(err.value)
        finally:
            gate.set()


def test_waiting_on_an_unrecorded_event_is_refused(dev):
    ev = dev.event("never")
    with pytest.raises(EventNeverRecorded, match="never"):
        dev.stream("schedule").wait(ev)
    with pytest.raises(EventNeverRecorded):
        ev.synchronize(timeout=SHORT)


# -- exceptions inside a stream ------------------------------------------------------------------


def test_exception_in_a_launched_fn_surfaces_at_the_next_fence_wait(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
    batch = _batch(low)

    def boom():
        raise ValueError("kernel exploded")

    low.stream.launch(boom, label="bad kernel")
    run = low.run(batch, step=0)
    with pytest.raises(StreamError) as err:
        run.fence.synchronize(["req_to_token"], timeout=T)
    e = err.value
    assert (e.stream, e.label) == ("forward", "bad kernel")
    assert isinstance(e.original, ValueError) and isinstance(e.__cause__, ValueError)
    assert "stream 'forward' failed in op 'bad kernel': ValueError: kernel exploded" in str(e)
    with pytest.raises(StreamError, match="kernel exploded"):
        run.result(T)
    # sticky: a later step on the failed stream fails the same way, and so does a stream that
    # waits on its fence; nothing hangs.
    later = low.run(batch, step=1)
    with pytest.raises(StreamError, match="bad kernel"):
        later.fence.synchronize(timeout=T)
    sched = dev.stream("schedule")
    later.fence.wait(sched)
    sched.launch(lambda: None, label="scheduler/write")
    with pytest.raises(StreamError, match="kernel exploded"):
        sched.synchronize(timeout=T)


def _run_rows_out_of_range(dev, backend):
    """A broken step: request rows outside the page table make the stage that maps them fail."""
    low = lower(backend, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER)
    batch = dict(_batch(low))
    batch["req_pool_indices"] = torch.tensor([0, 10_000])
    return low, low.run(batch, step=0)


def test_exception_inside_a_graph_replay_names_the_graph_and_stage(dev):
    low, run = _run_rows_out_of_range(dev, paged())  # paged maps rows in graph
    with pytest.raises(StreamError) as err:
        run.fence.synchronize(["seq_lens"], timeout=T)
    e = err.value
    assert e.stream == "forward"
    assert "/graph#0/" in e.label and "prepare_in_graph" in e.label and low.label in e.label
    assert isinstance(e.original, IndexError)
    with pytest.raises(StreamError):
        run.result(T)


def test_exception_in_the_out_of_graph_stage_surfaces_before_the_replay(dev):
    low, run = _run_rows_out_of_range(dev, trtllm_mha())  # trtllm_mha maps rows out of graph
    with pytest.raises(StreamError) as err:
        run.fence.synchronize(["req_to_token"], timeout=T)
    assert err.value.label.endswith("/prepare_out_graph") and low.label in err.value.label


# -- event rings ---------------------------------------------------------------------------------


@EVENT_SEMANTICS
def test_ring_of_one_wrapped_by_the_next_step_is_an_error(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                lowering=LowerOptions(ring_size=1))
    batch = _batch(low)
    first = low.run(batch, step=0)
    low.run(batch, step=1)  # re-records the same events
    sched = dev.stream("schedule")
    with pytest.raises(RingWrapError) as err:
        first.fence.wait(sched, ["req_to_token"])
    msg = str(err.value)
    assert "ring_size" in msg and "generation" in msg and low.label in msg
    with pytest.raises(RingWrapError):
        first.fence.synchronize(["seq_lens"], timeout=T)
    dev.synchronize(T)


@EVENT_SEMANTICS
def test_ring_of_two_makes_the_same_sequence_fine(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                lowering=LowerOptions(ring_size=2))
    batch = _batch(low)
    first = low.run(batch, step=0)
    second = low.run(batch, step=1)
    sched = dev.stream("schedule")
    first.fence.wait(sched, ["req_to_token"])
    first.fence.synchronize(timeout=T)
    second.fence.synchronize(timeout=T)
    sched.synchronize(timeout=T)
    third = low.run(batch, step=2)  # wraps onto step 0's slot: step 0's fence is now stale
    with pytest.raises(RingWrapError):
        first.fence.wait(sched, ["req_to_token"])
    third.fence.synchronize(timeout=T)
    # the outputs stay waitable after the ring wrapped: step 2's end, on the same stream,
    # comes after step 0's (the only record a CUDA event keeps)
    assert torch.equal(first.result(T), second.result(T))  # same inputs, same outputs


def test_fence_rejects_unknown_buffers_and_skips_unread_ones(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER)
    run = low.run(_batch(low), step=0)
    with pytest.raises(KeyError, match="kv_pool"):
        run.fence.synchronize(["kv_pool"], timeout=T)
    assert run.fence.per_buffer["state_slots"] is None  # paged never reads it: no wait at all
    assert run.fence.released("state_slots")
    run.fence.synchronize(timeout=T)


# -- a fence's generations: its run of the slot ------------------------------------------------


def _generations(low, slot):
    """The events' own counters: the truth a fence's derived generations are checked against."""
    return [e.generation for e in low._slots[slot].fence_events]


def _bound_generations(fence):
    return [b.generation for b in (*fence.distinct, fence.done)]


@pytest.mark.parametrize("mode", [M.DECODE, M.EXTEND], ids=["graphed", "eager"])
@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT])
@pytest.mark.parametrize("measure", [False, True], ids=["", "measured"])
def test_a_fence_is_bound_to_the_records_its_own_run_made(dev, policy, mode, measure):
    # the fence derives its generations from the slot's run count; the events' own counters,
    # read right after each run, are the independent truth, and stay so as later runs go on
    low = lower(hybrid_linear(trtllm_mha(), linear()), mode, batch_size=2, cfg=CFG, device=dev, policy=policy,
                lowering=LowerOptions(ring_size=2, measure=measure))
    assert low.graphed is (mode is M.DECODE)
    batch = _batch(low)
    fences, truth = [], []
    for step in range(5):
        fences.append(low.run(batch, step=step).fence)
        truth.append(_generations(low, step % 2))
    for fence, want in zip(fences, truth):
        assert _bound_generations(fence) == want
    assert len(fences[0].distinct) == len(low.plan.points()) >= (2 if mode is M.DECODE else 1)
    fences[-1].wait(dev.stream("schedule"))  # the latest run of its slot: current
    with pytest.raises(RingWrapError):
        fences[-3].wait(dev.stream("schedule"))  # the same slot, two runs ago
    dev.synchronize(T)


@EVENT_SEMANTICS
def test_an_event_recorded_outside_its_graph_is_caught_at_the_wait(dev):
    # one event recorded by anyone but its graph's runs (here, by hand on another stream):
    # a wait on it would bind to that record, not the step's, so it is refused
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                lowering=LowerOptions(ring_size=2))
    batch = _batch(low)
    run = low.run(batch, step=0)
    dev.stream("elsewhere").record(run.fence.per_buffer["req_to_token"].event)
    with pytest.raises(RingWrapError, match="recorded again"):
        run.fence.wait(dev.stream("schedule"), ["req_to_token"])
    low.run(batch, step=1)  # the other slot is untouched
    later = low.run(batch, step=2)  # the tampered slot again: still one record too many
    with pytest.raises(RingWrapError, match="recorded again"):
        later.fence.wait(dev.stream("schedule"), ["req_to_token"])
    dev.synchronize(T)


def test_a_step_stopped_midway_leaves_the_next_fences_bound(dev, monkeypatch):
    # the replay raises after the step's PRE_REPLAY events were recorded: the slot's count of
    # runs and its events' records disagree from then on, unless the run resynchronises them
    low = lower(trtllm_mha(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                lowering=LowerOptions(ring_size=1))
    batch = _batch(low)
    low.run(batch, step=0).fence.synchronize(timeout=T)
    graph = type(low._slots[0].graph)
    real = graph.replay

    def broken(self, *a, **kw):
        monkeypatch.setattr(graph, "replay", real)
        raise RuntimeError("replay interrupted")

    monkeypatch.setattr(graph, "replay", broken)
    with pytest.raises(RuntimeError, match="replay interrupted"):
        low.run(batch, step=1)
    run = low.run(batch, step=2)
    run.fence.wait(dev.stream("schedule"))  # no RingWrapError: bound to this run's records
    assert _bound_generations(run.fence) == _generations(low, 0)
    dev.synchronize(T)


def test_a_batch_of_the_wrong_shape_or_keys_is_refused_before_anything_is_enqueued(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER)
    batch = _batch(low)
    wrong = {**batch, "positions": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"batch\['positions'\] has shape \(3,\).*captured for \(2,\)"):
        low.run(wrong, step=0)
    with pytest.raises(KeyError, match="missing.*positions"):
        low.run({k: v for k, v in batch.items() if k != "positions"}, step=0)
    one = {**batch, "positions": torch.zeros(1, dtype=torch.int64)}  # copy_ would broadcast it silently
    with pytest.raises(ValueError, match=r"has shape \(1,\)"):
        low.run(one, step=0)
    run = low.run(batch, step=0)  # nothing of the refused steps was enqueued
    run.fence.synchronize(timeout=T)
    assert low._slots[0].clock.runs == 1


@pytest.fixture(scope="module")
def live():
    """One live state for the lowerings below, as an engine's graphs share one: a backend lowered
    again there (another policy) reuses what is known of its program on it (binding, validation,
    compiled code) instead of redoing it on a new state. Each step writes its own batch into it."""
    return make_state(CFG)


@pytest.mark.parametrize("mode", [M.DECODE, M.EXTEND, M.TARGET_VERIFY], ids=["decode", "extend", "verify"])
@pytest.mark.parametrize("policy", [pytest.param(Policy.PER_BUFFER, marks=pytest.mark.slow), Policy.EXACT])
def test_a_steps_events_fire_on_its_stream_in_index_order(dev, live, policy, mode):
    # what lets one wait on the latest event stand for a wait on each: the records' own
    # streams and timestamps (CpuDevice handles), not the plan's order
    from readfence.backends import REFERENCE_LEAVES, deepseek_v4, tbo
    for backend in (hybrid_linear(trtllm_mha(), linear()), tbo(deepseek_v4(), paged()),
                    *(make() for make in REFERENCE_LEAVES.values())):
        low = lower(backend, mode, batch_size=2, cfg=CFG, device=dev, policy=policy, state=live,
                    lowering=LowerOptions(measure=True))
        run = low.run(_batch(low), step=0)
        run.fence.wait_done(T)
        handles = [b.handle for b in (*run.fence.distinct, run.fence.done)]
        assert {h.stream for h in handles} == {low.stream.name}
        times = [h.timestamp for h in handles]
        assert None not in times and times == sorted(times), (backend, [h.label for h in handles])


class _Waits(DeviceObserver):
    def __init__(self):
        self.waits = []

    def on_wait(self, stream, event):
        self.waits.append((stream, event.name))


def test_one_wait_on_the_latest_event_covers_a_lowered_fence_and_each_event_of_a_built_one():
    seen = _Waits()
    with CpuDevice(timeout=T, observers=[seen]) as dev:
        low = lower(hybrid_linear(paged(), linear()), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
        run = low.run(_batch(low), step=0)
        distinct = run.fence.distinct
        assert len(distinct) >= 3
        sched = dev.stream("schedule")
        seen.waits.clear()
        run.fence.wait(sched)
        assert seen.waits == [("schedule", distinct[-1].event.name)]
        first = low.plan.buffers_at(low.plan.points()[0])[0]
        seen.waits.clear()
        run.fence.wait(sched, [first])
        assert seen.waits == [("schedule", distinct[0].event.name)]
        built = Fence("built", 0, run.fence.per_buffer, run.fence.done)  # events could be on any streams
        seen.waits.clear()
        built.wait(sched)
        assert sorted(seen.waits) == sorted(("schedule", b.event.name) for b in distinct)
        dev.synchronize(T)
