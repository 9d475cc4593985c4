"""Adversarial backends through ``lower`` and the overlapped loop: each is refused, or it runs
bit-identical to the serial run under PER_BUFFER and EXACT with delays injected on the
forward stream. Never accepted and different from serial.

The backends live in ``tests/adversarial.py``; ``tests/core/test_adversarial_audit.py`` checks
the audit's verdicts on the same cases.
"""

from __future__ import annotations

import functools

import pytest
import torch

from readfence.core import CapturedStateError, ForwardMode, StageWriteError
from readfence.graph import (
    CpuDevice,
    FaultInjector,
    LoopOptions,
    LowerOptions,
    Policy,
    UnsoundLowering,
    lower,
    make_state,
    run_overlapped,
    run_serial,
)
from tests.adversarial import CASES
from tests.conftest import SMALL as CFG
from tests.conftest import first_of_each

STEPS, BATCH = 5, 4  # batch 4 takes the batch-size-dependent branches


def _state_for(case):
    return make_state(CFG) if case.captures else None


@pytest.mark.parametrize("name", first_of_each([n for n, c in CASES.items() if c.verdict == "refused"], lambda n: CASES[n].klass))
def test_refused_cases_cannot_be_lowered_with_an_early_fence(name) -> None:
    case = CASES[name]
    state = make_state(CFG)
    backend = case.build(state)
    with CpuDevice(timeout=10.0) as dev:
        for policy in (Policy.PER_BUFFER, Policy.EXACT, Policy.JOINED):
            with pytest.raises((UnsoundLowering, StageWriteError, CapturedStateError)) as info:
                lower(backend, case.mode, batch_size=case.batch_size or BATCH, device=dev, policy=policy, cfg=CFG,
                      state=state)
            assert backend.name in str(info.value)
        if case.klass == "baked":
            # trace-time state is stale whatever the fence: even COARSE refuses it
            with pytest.raises(CapturedStateError, match="trace-time state baked into the graph"):
                lower(backend, case.mode, batch_size=case.batch_size or BATCH, device=dev, policy=Policy.COARSE, cfg=CFG,
                      state=state)


@functools.cache
def _serial(name: str):
    # the serial run of an accepted case, shared by both policies' runs of it
    case = CASES[name]
    state = _state_for(case)
    return run_serial(case.build(state), case.mode, steps=STEPS, batch_size=BATCH, cfg=CFG, state=state)


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT], ids=str)
@pytest.mark.parametrize("name", first_of_each([n for n, c in CASES.items() if c.verdict == "accepted"], lambda n: CASES[n].klass))
def test_accepted_cases_run_bit_identical_to_serial_with_forward_delays(name, policy) -> None:
    case = CASES[name]
    live_state = _state_for(case)
    ref = _serial(name)
    faults = FaultInjector(seed=sum(map(ord, name + policy.name)), max_delay_s=0.002, streams=["forward"])
    with CpuDevice(timeout=30.0, faults=faults) as dev:
        res = run_overlapped(case.build(live_state), case.mode, steps=STEPS, policy=policy, device=dev,
                             batch_size=BATCH, cfg=CFG, state=live_state)
    assert res.matches(ref), f"{name} under {policy.name}: accepted but differs from the serial run"
    assert res.violations == (), "\n".join(map(str, res.violations[:3]))


def test_a_captured_live_buffer_is_refused_against_another_state() -> None:
    # the backend captured state A; lowering it on state B would read A's buffer: refused
    case = CASES["closure_declared_post"]
    backend = case.build(make_state(CFG))
    with CpuDevice(timeout=10.0) as dev, pytest.raises(CapturedStateError, match="shared buffer 'seq_lens' of another state"):
        lower(backend, case.mode, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG, state=make_state(CFG))


def test_the_sanitizer_sees_a_read_no_static_analysis_can_see() -> None:
    # The plan/run kernel reads the live lengths it keeps: the trace cannot see it, the runs of
    # the step's ledger do (the audit's observer on the live state, the lowering's rehearsal), so
    # lower refuses the early declaration; lowered anyway, the sanitizer names the read where the
    # fence follows the declaration (PER_BUFFER: in the graph, too early) ...
    case = CASES["plan_run"]
    state = make_state(CFG)
    with CpuDevice(timeout=30.0) as dev:
        with pytest.raises(UnsoundLowering, match="a read only the observer sees"):
            lower(case.build(state), case.mode, batch_size=BATCH, device=dev, policy=Policy.PER_BUFFER, cfg=CFG,
                  state=state)
        res = run_overlapped(case.build(state), case.mode, steps=STEPS, policy=Policy.PER_BUFFER, device=dev,
                             batch_size=BATCH, cfg=CFG, state=state,
                             options=LoopOptions(UNSAFE_skip_soundness_check=True))
    races = [v for v in res.violations if v.buffer == "seq_lens"]
    assert races and all(v.reading_node.startswith("body:plan_run") for v in races), res.violations[:3]


def test_exact_places_a_read_only_a_run_saw_after_its_node() -> None:
    # ... and EXACT, which places from the bound trace joined with what the runs saw, waits for
    # that read (lowered with the unsafe flag: its declaration is refused too): the plan/run node,
    # never "no wait", and the run is race-free
    case = CASES["plan_run"]
    state = make_state(CFG)
    backend = case.build(state)
    reference = run_serial(backend, case.mode, steps=STEPS, batch_size=BATCH, cfg=CFG, state=state)
    with CpuDevice(timeout=30.0) as dev:
        low = lower(backend, case.mode, batch_size=BATCH, device=dev, policy=Policy.EXACT, cfg=CFG, state=state,
                    lowering=LowerOptions(UNSAFE_skip_soundness_check=True))
        placement = {r["buffer"]: r["placement"] for r in low.describe()}["seq_lens"]
        assert placement.startswith("after node body:plan_run"), placement
        res = run_overlapped(backend, case.mode, steps=STEPS, policy=Policy.EXACT, device=dev, batch_size=BATCH,
                             cfg=CFG, state=state, options=LoopOptions(UNSAFE_skip_soundness_check=True))
    assert res.matches(reference) and not [v for v in res.violations if v.buffer == "seq_lens"], res.violations[:3]


def test_weights_a_backend_keeps_are_a_constant_not_trace_time_state() -> None:
    # an indexer's weight matrix in a closure is read again on every call: lowering uses it
    import torch

    from readfence.backends import leaf, page_meta, softmax_attention, store_kv
    from readfence.core import ForwardMode

    weight = torch.randn(8, 8)

    def prep(mode, shared, batch, meta):
        return {**page_meta(shared, batch), "score": (weight @ weight).sum()}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + 0 * meta["score"]

    keeps = leaf("keeps_weights", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])
    ref = run_serial(keeps, ForwardMode.DECODE, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        res = run_overlapped(keeps, ForwardMode.DECODE, steps=STEPS, policy=Policy.EXACT, device=dev,
                             batch_size=BATCH, cfg=CFG)
    assert res.matches(ref) and res.violations == ()


def test_a_per_stream_member_judged_at_its_share_runs_bit_identical_and_its_racing_variant_races() -> None:
    # at the model's largest batch: the member that reads late on more than 3 requests gets 3 of 8
    # in a group of three (accepted, and every policy's outputs equal the serial run's), 4 in a
    # group of two (refused; lowered anyway, its late read is caught)
    from readfence.graph import verify

    with CpuDevice(timeout=30.0) as dev:
        common = dict(batch_size=CFG.max_reqs, steps=3, cfg=CFG, device=dev, policy=[Policy.PER_BUFFER, Policy.EXACT])
        fine = verify(CASES["per_stream_share_member"].build(None), **common)
        assert [c.policy for c in fine.unwrap().checks] == [Policy.PER_BUFFER, Policy.EXACT], fine
        racing = CASES["per_stream_half_batch_member"].build(None)
        refused = verify(racing, **common).failure()
        assert refused.evidence == "audit" and refused.buffer == "seq_lens", refused
        late = verify(racing, **common, options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
        assert late.buffer == "seq_lens" and late.evidence != "audit", late


_ARENAS: dict[int, tuple] = {}


def _arena_rebinder(state):
    # the live ``seq_lens`` is the front of an arena the backend keeps (plan/run): its body's
    # kernel points a fresh tensor at the arena's back (no element of a buffer: the alias check
    # after an opaque op passes it), and the body then reaches the front through a strided view
    # of that tensor's storage: a read of ``seq_lens`` after the kernel, by memory alone
    from readfence.backends import leaf, page_meta, softmax_attention, store_kv
    from readfence.backends.fuzz import keep, planned_gather
    from readfence.effects import ReadEffect, ReadEnd

    lens = state["shared"]["seq_lens"]
    n = lens.numel()
    arena = torch.zeros(2 * n, dtype=lens.dtype)
    arena[:n].copy_(lens)
    state["shared"]["seq_lens"] = arena[:n]
    handle = keep(state["shared"]["seq_lens"])
    _ARENAS[handle] = (arena, n)
    name = f"rf_adversarial_bind_back_{handle}"

    @torch.library.custom_op(f"rf_adversarial::{name}", mutates_args=())
    def bind_back(x: torch.Tensor) -> torch.Tensor:
        x.set_(arena[n:])
        return torch.zeros(1)

    @bind_back.register_fake
    def _(x):
        return x.new_empty(1, dtype=torch.float32)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        got = planned_gather(batch["req_pool_indices"], handle)  # a read of seq_lens the rehearsal sees
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        x = torch.zeros(0, dtype=torch.int32)
        z = bind_back(x)
        late = torch.as_strided(x, (n,), (1,), 0).float().sum()  # the last read of seq_lens
        return out + 1e-3 * (late + got.float().sum() + z.sum())

    declared = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.POST_REPLAY})
    return leaf("arena_rebinder", attend, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                declare={ForwardMode.DECODE: declared})


def test_exact_waits_for_a_read_through_a_tensor_a_kernel_re_pointed() -> None:
    # the rehearsal's node loop takes a value made clean as clean no more once an op not torch's
    # own ran (its kernel may re-point any tensor): EXACT's event for seq_lens follows the strided
    # read, and poison on release (which shares no rule with the loop) finds the step clean
    from readfence.graph import verify

    cfg = CFG
    state = make_state(cfg)
    backend = _arena_rebinder(state)
    with CpuDevice(timeout=30.0) as dev:
        low = lower(backend, ForwardMode.DECODE, batch_size=BATCH, device=dev, policy=Policy.EXACT, cfg=cfg, state=state)
        placement = {r["buffer"]: r["placement"] for r in low.describe()}["seq_lens"]
        assert not placement.startswith("after node body:plan_run"), placement
        result = verify(backend, ForwardMode.DECODE, steps=4, batch_size=BATCH, device=dev, cfg=cfg, state=state,
                        policy=Policy.EXACT, options=LoopOptions(checks={"poison"}))
    assert result.map(lambda _: True).value_or(False), result
