"""Speculative step shapes x reference backends in every role x every policy, generated.

Each case runs a few overlapped steps and asks for outputs bit-identical to ``run_serial``
and a sanitizer with nothing to report. Which phase publishes a buffer depends on what every
phase of the step reads, so every backend takes every role of every shape kind, next to
partners that differ from kind to kind. The broken cases at the end show that these checks
fail when a fence is early.
"""

import functools
import itertools

import pytest

from readfence.backends import REFERENCE_LEAVES, hybrid_linear, linear, paged, redeclare, trtllm_mha
from readfence.core import PREPARE_IN_GRAPH, SHARED_BUFFERS, ForwardMode
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import (
    CpuDevice,
    FaultInjector,
    LoopOptions,
    Policy,
    StepShape,
    decode_loop,
    eagle,
    multi_eagle,
    ngram,
    run_overlapped,
    run_serial,
)
from readfence.graph.steps import Phase
from tests.conftest import SINGLE_LAYER as CFG

from ._live_state import LiveState

STEPS, BATCH = 3, 2
BACKENDS = [*(make() for make in REFERENCE_LEAVES.values()), hybrid_linear(trtllm_mha(), linear())]

# Shape kinds with their parameters: (roles, stride, make). Shape i puts BACKENDS[i + k * stride]
# (cyclically) in role k, so over i every backend takes every role; the strides differ so
# that the kinds pair the backends differently.
KINDS = {
    "eagle(draft_steps=1)": (2, 2, lambda target, draft: eagle(target, draft, draft_steps=1)),
    "eagle(draft_steps=2)": (2, 1, lambda target, draft: eagle(target, draft, draft_steps=2)),
    "multi_eagle": (3, 1, multi_eagle),  # a target and two draft runners
    "ngram": (1, 1, ngram),
}


def _roles(kind: str, i: int) -> list:
    n_roles, stride, _ = KINDS[kind]
    return [BACKENDS[(i + k * stride) % len(BACKENDS)] for k in range(n_roles)]


CASES = {
    f"{shape}-{policy.name}": (shape, policy)
    for kind, i, policy in itertools.product(KINDS, range(len(BACKENDS)), Policy)
    for shape in [KINDS[kind][2](*_roles(kind, i))]
}


def test_every_backend_takes_every_role_of_every_shape_kind():
    for kind, (n_roles, _, _) in KINDS.items():
        for role in range(n_roles):
            assert {str(_roles(kind, i)[role]) for i in range(len(BACKENDS))} == {str(b) for b in BACKENDS}
    assert len(CASES) == len(KINDS) * len(BACKENDS) * len(Policy)


@functools.cache
def _serial(shape):
    return run_serial(shape, steps=STEPS, batch_size=BATCH, cfg=CFG)


# One shape of each kind again under CUDA's event semantics (an event is only its latest
# record): a phase replaying a runner's graph twice in one step leans on its ring slots.
CUDA_EVENT_CASES = {f"{shape}-{Policy.EXACT.name}-cuda-events": (shape, Policy.EXACT, True)
                    for kind in KINDS for shape in [KINDS[kind][2](*_roles(kind, 0))]}


@functools.cache
def _live(shape: str) -> LiveState:
    # one live state per shape, shared by its policies' runs (see ``_live_state``)
    return LiveState(CFG)


@pytest.mark.parametrize(("shape", "policy", "cuda_events"),
                         [(*case, False) for case in CASES.values()] + list(CUDA_EVENT_CASES.values()),
                         ids=list(CASES) + list(CUDA_EVENT_CASES))
def test_overlapped_step_matches_serial_and_is_race_free(shape, policy, cuda_events):
    with CpuDevice(timeout=10.0, cuda_events=cuda_events) as dev:
        res = run_overlapped(shape, steps=STEPS, policy=policy, device=dev, batch_size=BATCH, cfg=CFG,
                             state=_live(str(shape)).fresh())
    assert res.violations == (), "\n".join(map(str, res.violations[:4]))
    assert res.matches(_serial(shape))


# The target reads swa_map and state_slots in prepare_in_graph; the draft extend only
# declares reading them (a leaf's default UNKNOWN) and never does.
REPORTED = [eagle(hybrid_linear(trtllm_mha(), linear()), paged(), draft_steps=2),
            multi_eagle(trtllm_mha(), paged(), paged())]


def test_exact_publishes_each_buffer_from_its_traced_last_reader(dev):
    shape = REPORTED[0]
    exact = decode_loop(shape, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG).lowered
    per_buffer = decode_loop(shape, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=CFG).lowered
    names = [p.name for p in shape.phases]
    assert {b: names[k] for b, k in exact.owner.items()} == {
        "req_to_token": "draft_extend", "seq_lens": "draft_extend",
        "swa_map": "target_verify", "state_slots": "target_verify"}
    target = exact.graphs[("target", ForwardMode.TARGET_VERIFY)].plan.placements  # of the buffers it owns:
    owned = {b for b, k in exact.owner.items() if names[k] == "target_verify"}
    assert {b: (p.after.stage, p.end) for b, p in target.items() if b in owned} == {
        "swa_map": (PREPARE_IN_GRAPH, ReadEnd.IN_REPLAY), "state_slots": (PREPARE_IN_GRAPH, ReadEnd.IN_REPLAY)}
    # the declarations rank the phases for PER_BUFFER: the draft extend declares UNKNOWN
    assert {names[k] for k in per_buffer.owner.values()} == {"draft_extend"}
    coarse = decode_loop(shape, policy=Policy.COARSE, device=dev, batch_size=BATCH, cfg=CFG).lowered
    assert coarse.owner == dict.fromkeys(SHARED_BUFFERS, len(shape.phases) - 1)


@pytest.mark.parametrize("shape", REPORTED, ids=str)
def test_reported_shapes_exact_under_forward_faults(shape):
    ref = run_serial(shape, steps=8, batch_size=BATCH, cfg=CFG, options=LoopOptions(finish_prob=0.5))
    for seed in (1, 2):
        with CpuDevice(timeout=10.0, faults=FaultInjector(seed, max_delay_s=0.002, streams=["forward"])) as dev:
            res = run_overlapped(shape, steps=8, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG,
                                 options=LoopOptions(finish_prob=0.5))
        assert res.violations == (), "\n".join(map(str, res.violations[:4]))
        assert res.matches(ref)


def _one_step_early(effect: ReadEffect) -> ReadEffect:
    ends = list(ReadEnd)
    return ReadEffect.of({b: ends[max(effect[b].rank - 1, 0)] for b in SHARED_BUFFERS})


def test_a_declaration_one_step_early_races(dev):
    # BROKEN on purpose: linear's state_slots lowered at PRE_REPLAY while prepare_in_graph
    # reads it; the draft (trtllm_mha) never reads state_slots, so the target publishes it.
    early = redeclare(linear(), lambda mode: _one_step_early(linear().read_effect(mode)))
    shape = eagle(hybrid_linear(trtllm_mha(), early), trtllm_mha(), draft_steps=1)
    res = run_overlapped(shape, steps=STEPS, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=CFG,
                         options=LoopOptions(UNSAFE_skip_soundness_check=True))
    assert {(v.kind, v.buffer) for v in res.violations} == {("write-after-read", "state_slots")}
    # EXACT places from the trace, not the declaration: the same lowering is clean
    res = run_overlapped(shape, steps=STEPS, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG,
                         options=LoopOptions(UNSAFE_skip_soundness_check=True))
    assert res.violations == () and res.matches(_serial(shape))


def test_exact_ranking_phases_by_declarations_races(dev, monkeypatch):
    # BROKEN on purpose: EXACT publishing from the phase that declares the last read (the
    # draft extend, which never reads swa_map: its traced plan waits for nothing).
    import readfence.graph.steps._shapes as shapes
    monkeypatch.setattr(shapes, "placing_effect", lambda policy, *, declared, observed: declared)
    res = run_overlapped(REPORTED[0], steps=STEPS, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG)
    assert {v.buffer for v in res.violations} == {"swa_map", "state_slots"}


def test_phases_sharing_a_graph_must_share_the_backend():
    # one graph per (runner, mode): a second backend there would replay the first one's code
    phases = (Phase("a", paged(), ForwardMode.DECODE, "draft"), Phase("b", trtllm_mha(), ForwardMode.DECODE, "draft"))
    with pytest.raises(ValueError, match="share runner 'draft' in DECODE"):
        StepShape("mixed", phases, "mixed")
