"""Lowering: one step on a device, its events, its records inside the graph, its refusals."""

from __future__ import annotations

import re

import pytest
import torch

from readfence.backends import dense, hybrid_linear, linear, minimax, paged, redeclare, sparse, trtllm_mha
from readfence.core import SHARED_BUFFERS, ForwardMode, StepInputs, run_step
from readfence.core.internal import example_step
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, LowerOptions, Policy, Scheduler, UnsoundLowering, lower, make_state
from readfence.graph.devices import DeviceObserver, Read, Record
from readfence.graph.lowering._plan import IN_GRAPH_STAGES
from tests.conftest import SMALL as CFG  # two layers: each arm of hybrid_linear attends

M = ForwardMode
T = 10.0






def _step(low, mode=M.DECODE, seed=0, batch_size=2):
    """One scheduled step written into ``low``'s live buffers; returns its batch."""
    nxt = Scheduler(low.cfg, mode, batch_size, seed=seed).next_step()
    for b in SHARED_BUFFERS:
        low.shared[b].copy_(nxt.shared[b])
    return nxt.batch


def _events(fence):
    evs = {id(b.event): b.event for b in fence.per_buffer.values() if b is not None}
    evs[id(fence.done.event)] = fence.done.event
    return evs


@pytest.mark.parametrize("policy", list(Policy), ids=str)
@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND], ids=str)
def test_one_lowered_step_equals_the_eager_step(dev, mode, policy):
    backend = hybrid_linear(trtllm_mha(), linear())
    low = lower(backend, mode, batch_size=2, cfg=CFG, device=dev, policy=policy)
    batch = _step(low, mode)
    pools_before = {k: v.clone() for k, v in low.pools.items()}
    out = low.run(batch, step=0).result(T)
    expected = run_step(backend, mode, low.cfg, StepInputs(
        shared={k: v.clone() for k, v in low.shared.items()}, batch=batch, pools=pools_before,
        params=low.params))
    assert torch.equal(out, expected)
    assert not torch.equal(out, torch.zeros_like(out))


def test_each_lowered_graph_owns_its_events(dev):
    # different modes, batch sizes (shapes), streams and policies: no event object shared
    lows = [
        lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER),
        lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER),  # same everything
        lower(paged(), M.DECODE, batch_size=3, cfg=CFG, device=dev, policy=Policy.PER_BUFFER),
        lower(paged(), M.TARGET_VERIFY, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER),
        lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER, stream=dev.stream("other")),
        lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT),
    ]
    seen: dict[int, str] = {}
    for i, low in enumerate(lows):
        batch = _step(low, low.mode, batch_size=low.batch_size)
        fence = low.run(batch, step=0).fence
        fence.synchronize(timeout=T)
        for key, ev in _events(fence).items():
            assert key not in seen, f"{ev.name} of lowering {i} is also used by {seen[key]}"
            seen[key] = low.label
    assert len({low.label for low in lows}) == len(lows)


def test_ring_slots_own_their_events_and_ring_one_reuses(dev):
    ring2 = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                  lowering=LowerOptions(ring_size=2))
    batch = _step(ring2)
    f0, f1, f2 = (ring2.run(batch, step=i).fence for i in range(3))
    assert not set(_events(f0)) & set(_events(f1))
    assert set(_events(f0)) == set(_events(f2))  # slot 0 again
    ring1 = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                  lowering=LowerOptions(ring_size=1))
    g0, g1 = (ring1.run(batch, step=i).fence for i in range(2))
    assert set(_events(g0)) == set(_events(g1))
    dev.synchronize(T)


class _Ops(DeviceObserver):
    def __init__(self):
        self.launches = []

    def on_launch(self, stream, label, ops):
        self.launches.append((stream, label, tuple(ops)))


def _replays(obs):
    return [ops for _, label, ops in obs.launches if "/graph#" in label]


@pytest.mark.parametrize("policy", [Policy.JOINED, Policy.PER_BUFFER, Policy.EXACT], ids=str)
def test_without_in_graph_events_the_graph_records_nothing(policy):
    with CpuDevice(timeout=T, in_graph_events=False) as dev:
        backend = minimax(sparse(), dense())
        low = lower(backend, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=policy, lowering=LowerOptions(measure=True))
        obs = _Ops()
        dev.add_observer(obs)
        run = low.run(_step(low), step=0)
        run.fence.synchronize(timeout=T)
        run.result(T)
        replays = _replays(obs)
        assert len(replays) == 1
        assert not [op for op in replays[0] if isinstance(op, Record)]
        assert any(isinstance(op, Read) for op in replays[0])  # the graph does read shared buffers
        for p in low.plan.placements.values():
            assert p.end is not ReadEnd.IN_REPLAY
            assert p.after is None or p.after.stage not in IN_GRAPH_STAGES
        assert run.fence.released("seq_lens")


def test_exact_records_right_after_the_last_read_inside_the_graph(dev):
    backend = minimax(sparse(), dense())
    low = lower(backend, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
    obs = _Ops()
    dev.add_observer(obs)
    low.run(_step(low), step=0).fence.synchronize(timeout=T)
    (ops,) = _replays(obs)
    for b in ("req_to_token", "seq_lens"):
        stage, node = low.program.last_reader(b)
        assert stage in IN_GRAPH_STAGES
        point = low.plan.placements[b]
        reads = [i for i, op in enumerate(ops) if isinstance(op, Read) and op.buffer == b]
        last = reads[-1]
        assert ops[last].node == f"{stage}:{node}"
        # the next Record after the last read is this buffer's release, with no read of b between
        nxt = next(i for i in range(last + 1, len(ops)) if isinstance(ops[i], Record)
                   and point.end.name in ops[i].event.name and node in ops[i].event.name)
        assert not any(isinstance(op, Read) and op.buffer == b for op in ops[last + 1:nxt])


def test_refusal_message_names_backend_mode_buffer_and_ends(dev):
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY,
                                                         "seq_lens": ReadEnd.PRE_REPLAY}))
    with pytest.raises(UnsoundLowering) as err:
        lower(early, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER)
    msg = str(err.value)
    for part in ("paged", "DECODE", "PER_BUFFER", "'seq_lens'", "PRE_REPLAY", "IN_REPLAY",
                 "fix: declare 'seq_lens' ending at IN_REPLAY (or later), or end the read earlier"):
        assert part in msg, (part, msg)
    assert re.search(r"last read by node '\w+' in stage \w+ at \S+\.py:\d+ in \w+: a traced read", msg), msg
    # the unsafe flag lowers it, one step early
    low = lower(early, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER,
                lowering=LowerOptions(UNSAFE_skip_soundness_check=True))
    assert low.plan.end("seq_lens") is ReadEnd.PRE_REPLAY
    # COARSE needs no flag
    assert lower(early, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.COARSE).plan.end("seq_lens") \
        is ReadEnd.UNKNOWN


def test_lower_validates_its_arguments(dev):
    with pytest.raises(TypeError, match="ForwardMode"):
        lower(paged(), "decode", batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
    with pytest.raises(TypeError, match="Policy"):
        lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy="exact")
    with pytest.raises(ValueError, match="batch_size"):
        lower(paged(), M.DECODE, batch_size=0, cfg=CFG, device=dev, policy=Policy.EXACT)
    with pytest.raises(ValueError, match="max_reqs"):
        lower(paged(), M.DECODE, batch_size=CFG.max_reqs + 1, cfg=CFG, device=dev, policy=Policy.EXACT)
    with pytest.raises(ValueError, match="ring_size"):
        lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT, lowering=LowerOptions(ring_size=0))


def test_run_checks_the_batch(dev):
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
    batch = _step(low)
    with pytest.raises(KeyError, match="input_ids"):
        low.run({k: v for k, v in batch.items() if k != "input_ids"})
    wrong = Scheduler(low.cfg, M.DECODE, 3).next_step().batch
    with pytest.raises(ValueError, match="batch_size=2"):
        low.run(wrong)


def test_describe_lists_declared_observed_and_placement(dev):
    low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, cfg=CFG, device=dev,
                policy=Policy.PER_BUFFER)
    rows = {r["buffer"]: r for r in low.describe()}
    assert set(rows) == set(SHARED_BUFFERS)
    assert rows["state_slots"] == {"buffer": "state_slots", "end": "IN_REPLAY", "declared": "IN_REPLAY",
                                   "observed": "IN_REPLAY",
                                   "placement": "inside the graph, after prepare_in_graph"}
    assert rows["req_to_token"]["end"] == rows["req_to_token"]["observed"] == "PRE_REPLAY"


def test_lowering_rehearses_on_a_throwaway_example_not_on_the_live_state(dev):
    # The rehearsal before capture runs every stage once; it must not write live pools/state.
    state = make_state(CFG, dev)
    before = {g: {k: t.clone() for k, t in tensors.items()} for g, tensors in state.items()}
    seen = []

    class Launches(DeviceObserver):
        def on_launch(self, stream, label, ops):
            seen.append(label)

    dev.add_observer(Launches())
    low = lower(hybrid_linear(trtllm_mha(), linear()), M.DECODE, batch_size=2, cfg=CFG, device=dev,
                policy=Policy.EXACT, state=state)
    assert any(label.endswith("/rehearse") for label in seen)  # it did run, on the lowered stream
    for group, tensors in before.items():
        for k, t in tensors.items():
            assert torch.equal(state[group][k], t), f"lowering changed live {group}.{k}"
    assert low.shared is state["shared"]


# -- host to device copies and outputs on the forward stream -----------------------------------------
def _spy_host_copies(monkeypatch) -> list:
    """Record each copy as (to, from, from pinned memory, non_blocking). The meta device stands
    in for CUDA; this build cannot pin memory, so pinning is recorded, not done."""
    seen = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: getattr(self, "_pinned", False))

    def pin_memory(self):
        copy = self.clone()
        copy._pinned = True
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    real = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        seen.append((self.device.type, src.device.type, src.is_pinned(), non_blocking))
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return seen


def test_batch_loads_read_pinned_host_memory_without_blocking_and_host_copies_are_one_plain_call(monkeypatch):
    from readfence.graph.lowering._issue import load_batch

    seen = _spy_host_copies(monkeypatch)
    staged = [torch.arange(4), torch.ones(3)]
    load_batch([torch.empty(4, dtype=torch.int64, device="meta"), torch.empty(3, device="meta")], staged)
    assert seen == [("meta", "cpu", True, True)] * 2
    seen.clear()
    foreach = []
    real_foreach = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dsts, srcs: foreach.append(len(dsts)) or real_foreach(dsts, srcs))
    host = [torch.empty(4, dtype=torch.int64), torch.empty(3)]
    load_batch(host, staged)  # host to host: plain copies, all in one torch call
    assert seen == [] and foreach == [2]
    assert torch.equal(host[0], staged[0]) and torch.equal(host[1], staged[1])


def test_scheduler_writes_read_pinned_host_memory_without_blocking(monkeypatch):
    from readfence.graph.runtime._loop import _write

    seen = _spy_host_copies(monkeypatch)
    _write(torch.empty(5, device="meta"), torch.ones(5), None, torch.empty(5, device="meta"))
    assert seen == [("meta", "cpu", True, True)] * 2


def test_outputs_allocated_by_the_host_are_kept_for_the_stream_that_writes_them(dev, monkeypatch):
    from readfence.graph.devices import CpuStream

    kept = []
    monkeypatch.setattr(CpuStream, "keep", lambda self, tensor: kept.append((self.name, tensor)))
    low = lower(paged(), M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER)
    run = low.run(example_step(low.cfg, M.DECODE, 2).batch, step=0)
    run.result(10)
    assert [(name, t is run.logits) for name, t in kept] == [(low.stream.name, True)]
