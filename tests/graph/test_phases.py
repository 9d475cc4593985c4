"""Multi-phase steps, per-stream groups, event rings and the eager prefill path."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readfence.backends import deepseek_v4, linear, paged, per_stream, redeclare, trtllm_mha
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.effects import Position, ReadEffect, ReadEnd, laws
from readfence.graph import (
    CpuDevice,
    DecodeLoop,
    FaultInjector,
    LoopOptions,
    LowerOptions,
    Policy,
    Sanitizer,
    Scheduler,
    StepShape,
    decode_loop,
    eagle,
    lower,
    make_state,
    parse_step,
    run_overlapped,
    run_serial,
)
from readfence.graph.lowering import Bound, RingWrapError
from readfence.graph.steps import Phase, StreamGroup

laws.check_join_semilattice(
    st.builds(Position.of, st.integers(0, 3), st.sampled_from(list(ReadEnd))),
    join=lambda a, b: a | b, leq=lambda a, b: a <= b, bottom=Position.bottom(), name="position",
)

MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]
# The overlapped runs: two layers (each arm of a composite and both kinds of trtllm_mha's layers
# attend) and eight rows; the races are between streams and steps, not between layers.
SMALL = ModelConfig(layers=2, max_reqs=8, max_ctx=16)
effects = st.dictionaries(st.sampled_from(SHARED_BUFFERS), st.sampled_from(list(ReadEnd))).map(ReadEffect.of)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MODES), effects), min_size=1, max_size=5))
def test_published_position_is_the_maximum(phases):
    shape = StepShape("random", tuple(
        Phase(f"p{i}", redeclare(paged(), lambda m, e=e: e), mode, f"r{i}") for i, (mode, e) in enumerate(phases)
    ), "random")
    positions = shape.positions()
    for b in SHARED_BUFFERS:
        candidates = [(i, e[b]) for i, (_, e) in enumerate(phases) if e[b] is not ReadEnd.NONE]
        expected = max(candidates, key=lambda c: (c[0], c[1].value), default=None)
        if expected is None:
            assert positions[b] == Position.bottom() and shape.publisher(b) is None
        else:
            assert (positions[b].phase, positions[b].end) == expected
            assert shape.publisher(b) is shape.phases[expected[0]]


@functools.cache
def _serial(spec: str, steps: int):
    return run_serial(parse_step(spec).unwrap(), steps=steps, batch_size=2, cfg=SMALL)


@settings(max_examples=4, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MODES), effects), min_size=1, max_size=3), st.integers(0, 1000))
def test_random_phase_sequences_overlap_like_serial(phases, seed):
    # Declarations are random but sound: joined with what paged really reads in each mode.
    from readfence.core import trace
    ph = []
    for i, (mode, e) in enumerate(phases):
        sound = e | trace(paged(), mode).traced()
        ph.append(Phase(f"p{i}", redeclare(paged(), lambda m, s=sound: s), mode, f"r{i}"))
    shape = StepShape("random", tuple(ph), "random")
    ref = run_serial(shape, steps=12, batch_size=2, cfg=SMALL, options=LoopOptions(seed=seed))
    with CpuDevice(faults=FaultInjector(seed=seed, max_delay_s=0.002)) as dev:
        res = run_overlapped(shape, steps=12, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=SMALL,
                             options=LoopOptions(seed=seed))
    assert res.matches(ref) and res.violations == ()


P, IN, Q = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY


@pytest.mark.parametrize(("spec", "publishers"), [
    # EAGLE: the draft extend reads last (its PRE_REPLAY beats the verify's IN_REPLAY: later phase)
    ("eagle(paged, trtllm_mha)", {"req_to_token": ("draft_extend", Q), "seq_lens": ("draft_extend", P),
                                  "swa_map": ("draft_extend", P), "state_slots": None}),
    # multi-layer EAGLE: the last draft runner reads last
    ("multi_eagle(paged, trtllm_mha, trtllm_mha)", {"req_to_token": ("draft_extend[1]", Q),
                                                    "seq_lens": ("draft_extend[1]", P), "state_slots": None}),
    # n-gram: verify is the only phase
    ("ngram(deepseek_v4)", {"req_to_token": ("target_verify", Q), "seq_lens": ("target_verify", IN),
                            "swa_map": None}),
])
def test_speculative_step_shapes_and_their_publisher(spec, publishers):
    shape = parse_step(spec).unwrap()
    for buffer, expected in publishers.items():
        phase = shape.publisher(buffer)
        got = None if phase is None else (phase.name, shape.positions()[buffer].end)
        assert got == expected, buffer
    ref = _serial(spec, 20)
    with CpuDevice(faults=FaultInjector(seed=3, max_delay_s=0.002)) as dev:
        res = run_overlapped(shape, steps=20, policy=Policy.EXACT, device=dev, batch_size=2, cfg=SMALL)
    assert res.matches(ref) and res.violations == ()


def test_eagle_the_owner_graph_publishes():
    with CpuDevice() as dev:
        loop = decode_loop(eagle(paged(), trtllm_mha()), policy=Policy.PER_BUFFER, device=dev, batch_size=2)
        step = loop.lowered
        graphs = step.graphs
        owner = step.shape.phases[step.owner["req_to_token"]]
        assert owner.graph_key == ("draft", ForwardMode.DRAFT_EXTEND)  # the last phase that reads it
        assert graphs[owner.graph_key].plan.placements["req_to_token"].waits
        # the draft DECODE graph is replayed twice per step: its ring holds two slots
        assert graphs[("draft", ForwardMode.DECODE)].ring_size == 2


# -- per-stream groups ------------------------------------------------------------------------
GROUP = per_stream(paged(), trtllm_mha())


def test_two_forward_streams_bit_identical_and_clean():
    ref = run_serial(GROUP, steps=200, batch_size=4, cfg=SMALL, options=LoopOptions(seed=5))
    with CpuDevice(faults=FaultInjector(seed=5, max_delay_s=0.001)) as dev:
        res = run_overlapped(GROUP, steps=200, policy=Policy.PER_BUFFER, device=dev, batch_size=4, cfg=SMALL,
                             options=LoopOptions(seed=5))
    assert res.matches(ref)
    assert res.violations == ()


def test_each_stream_fence_comes_from_its_own_member():
    with CpuDevice() as dev:
        loop = decode_loop(GROUP, policy=Policy.PER_BUFFER, device=dev, batch_size=4)
        a, b = loop.lowered.lowered
        assert (a.stream.name, b.stream.name) == ("forward[0]", "forward[1]")
        assert a.backend == paged() and b.backend == trtllm_mha()
        assert a.plan.end("req_to_token") is ReadEnd.IN_REPLAY
        assert b.plan.end("req_to_token") is ReadEnd.PRE_REPLAY
        events_a = {id(e) for s in a._slots for e in [*s.events.values(), s.done]}
        events_b = {id(e) for s in b._slots for e in [*s.events.values(), s.done]}
        assert events_a and events_b and not events_a & events_b


def _shared_event_group(dev):
    """BROKEN fixture: both streams are handed one shared event."""
    event = dev.event("the-one-event")
    cfg = ModelConfig()
    return StreamGroup(GROUP.members, ForwardMode.DECODE, device=dev, policy=Policy.PER_BUFFER, batch_size=4,
                       cfg=cfg, state=make_state(cfg, dev),
                       lowering=LowerOptions(new_event=lambda name: event))


def _drive(group, dev, steps=30):
    sched = Scheduler(ModelConfig(), ForwardMode.DECODE, 4, seed=1)
    order = tuple(sorted(SHARED_BUFFERS, key=group.write_key))
    return DecodeLoop(group, sched, dev, dev.stream("schedule"), dev.event("written"), None, None, order).run(steps)


def test_shared_event_between_streams_is_caught_by_generation_check():
    with CpuDevice(faults=FaultInjector(seed=2, max_delay_s=0.001)) as dev:
        with pytest.raises(RingWrapError, match="recorded again"):
            _drive(_shared_event_group(dev), dev)


def test_shared_event_between_streams_races_without_the_check(monkeypatch):
    # An engine that waits on "the event" without binding generations: the sanitizer catches it.
    monkeypatch.setattr(Bound, "check", lambda self, what: self.event)
    san = Sanitizer()
    with CpuDevice(faults=FaultInjector(seed=2, max_delay_s=0.001), observers=[san]) as dev:
        _drive(_shared_event_group(dev), dev)
    assert san.violations, "one event shared by two streams must race"
    assert any(v.buffer in SHARED_BUFFERS for v in san.violations)


# -- event rings ------------------------------------------------------------------------------
def test_ring_too_small_for_steps_in_flight_is_refused():
    with CpuDevice() as dev:
        with pytest.raises(ValueError, match=r"event ring of size 1 is too small for 3 steps in flight"):
            lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, steps_in_flight=3,
                  lowering=LowerOptions(ring_size=1))
        low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER,
                    steps_in_flight=3)
        assert low.ring_size == 3


@pytest.mark.parametrize("cuda_events", [False, True], ids=["cpu-events", "cuda-events"])
def test_ring_slots_keep_in_flight_fences_bound(cuda_events):
    from readfence.core.internal import example_step
    with CpuDevice(cuda_events=cuda_events) as dev:
        for ring, wraps in ((1, True), (2, False)):
            low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER,
                        lowering=LowerOptions(ring_size=ring))
            batch = example_step(low.cfg, ForwardMode.DECODE, 2).batch
            first = low.run(batch, step=0)
            low.run(batch, step=1)  # a second step in flight before the first fence is waited on
            if wraps:
                with pytest.raises(RingWrapError, match="larger ring_size"):
                    first.fence.wait(dev.stream("schedule"), ["seq_lens"])
            else:
                first.fence.wait(dev.stream("schedule"), ["seq_lens"])
            dev.synchronize(timeout=10)


# -- prefill / extend: eager, no graph ----------------------------------------------------------
@pytest.mark.parametrize(("backend", "end"), [(deepseek_v4(), ReadEnd.PRE_REPLAY), (paged(), ReadEnd.UNKNOWN),
                                              (linear(), ReadEnd.UNKNOWN)])
def test_extend_runs_eagerly_and_publishes_pre_replay_only_with_a_snapshot(backend, end):
    with CpuDevice() as dev:
        low = lower(backend, ForwardMode.EXTEND, batch_size=2, device=dev, policy=Policy.PER_BUFFER)
        assert not low.graphed and all(s.graph is None for s in low._slots)
        assert low.plan.end("req_to_token") is end
    ref = run_serial(backend, ForwardMode.EXTEND, steps=15, batch_size=2)
    with CpuDevice(faults=FaultInjector(seed=4, max_delay_s=0.002)) as dev:
        res = run_overlapped(backend, ForwardMode.EXTEND, steps=15, policy=Policy.PER_BUFFER, device=dev,
                             batch_size=2)
    assert res.matches(ref) and res.violations == ()


# -- a step shape ranks its phases from what each lowered graph places --------------------------
def _keeping_draft():
    """A draft model that reads no shared buffer but keeps a weight of its own (a closure), which
    the step reads again on every call and whose memory is no state's: its own constant."""
    import torch

    from readfence.backends import leaf

    weight = torch.linspace(0.5, 1.5, 8)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return q * weight[: q.shape[-1]].sum()

    return leaf("keeps_a_weight", attend, reads=())


def test_a_draft_that_keeps_a_tensor_does_not_take_the_page_table_from_the_target(dev):
    from readfence.core import trace

    shape = eagle(paged(), _keeping_draft())
    draft_extend = shape.phases[-1]
    assert trace(draft_extend.backend, draft_extend.mode).traced()["req_to_token"] is ReadEnd.NONE  # unbound too
    ref = run_serial(shape, steps=6, batch_size=2)
    with CpuDevice(timeout=10.0, faults=FaultInjector(seed=3, max_delay_s=0.002, streams=["forward"])) as dev:
        loop = decode_loop(shape, policy=Policy.EXACT, device=dev, batch_size=2)
        owner = loop.lowered.shape.phases[loop.lowered.owner["req_to_token"]]
        res = run_overlapped(shape, steps=6, policy=Policy.EXACT, device=dev, batch_size=2)
    assert owner.name == "target_verify"  # the bound trace: the draft reads none of it
    assert res.matches(ref) and res.violations == ()


def test_ranked_from_a_wrong_effect_verify_catches_the_early_release(dev, monkeypatch):
    # broken on purpose: the draft phase ranked as if it read every buffer until the forward's
    # end (what a trace that took its own weight for live state would say). The draft takes the
    # page table and, reading none of it, releases it as the step starts; check mode poisons it
    # there, where the scheduler may really write it, so verify catches target-verify's read
    from readfence.effects import ReadEffect
    from readfence.graph import verify

    shape = eagle(paged(), _keeping_draft())
    ranked = StepShape.positions_under
    monkeypatch.setattr(StepShape, "positions_under", lambda self, policy, observed: ranked(
        self, policy, [ReadEffect.unknown() if ph.name == "draft_extend" else o
                       for ph, o in zip(self.phases, observed)]))
    with CpuDevice(timeout=10.0) as dev:
        loop = decode_loop(shape, policy=Policy.EXACT, device=dev, batch_size=2)
        assert loop.lowered.shape.phases[loop.lowered.owner["req_to_token"]].name == "draft_extend"
        finding = verify(shape, policy=Policy.EXACT, steps=4, batch_size=2, device=dev).failure()
    assert (finding.kind, finding.buffer) == ("late read", "req_to_token"), str(finding)
