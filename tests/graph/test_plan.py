"""Fence planning: where each policy publishes each buffer's release.

* COARSE: every buffer after the whole forward; JOINED: every buffer at the join of the
  declared ends; PER_BUFFER: each buffer at its own declared end (unread buffers: no wait);
  EXACT: right after the traced node that last reads the buffer.
* Without in-graph events no point is ever placed inside the graph: IN_REPLAY goes to
  POST_REPLAY (later, never earlier), EXACT node records inside the graph move after the replay.
* One event per distinct placement.
"""

from __future__ import annotations

import pytest

from readfence.backends import deepseek_v4, dense, hybrid_linear, linear, minimax, paged, sparse, tbo, trtllm_mha
from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.effects import Capabilities, ReadEffect, ReadEnd, degrade, resolve
from readfence.graph import CpuDevice, LowerOptions, Policy, lower
from readfence.graph.lowering import Placement, plan_fences
from readfence.graph.lowering._plan import IN_GRAPH_STAGES, LastRead

M = ForwardMode
NONE, PRE, IN, POST, UNKNOWN = (ReadEnd.NONE, ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY,
                                ReadEnd.UNKNOWN)
NO_IN_GRAPH = Capabilities(in_graph_events=False)
# The lowered cases: two layers, so that each arm of a composite attends and a body read has an
# earlier and a later reading node; more layers repeat the same nodes.
CFG = ModelConfig(layers=2, max_reqs=8, max_ctx=16)




# -- pure planning -------------------------------------------------------------------------------

MIXED = ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE, "swa_map": PRE, "state_slots": IN})
LAST = {
    "req_to_token": LastRead(PREPARE_OUT_GRAPH, "index_select", 3),
    "seq_lens": LastRead(PREPARE_OUT_GRAPH, "index_select_1", 5),
    "swa_map": LastRead(PREPARE_OUT_GRAPH, "index_select_3", 9),
    "state_slots": LastRead(PREPARE_IN_GRAPH, "index_select", 2),
}


FULL_CAPS = Capabilities()


def _plan(policy, declared=MIXED, caps=FULL_CAPS, **kw):
    return plan_fences(buffers=SHARED_BUFFERS, declared=declared, caps=caps, policy=policy,
                       last_reads=LAST, observed=declared, **kw)


def test_coarse_places_everything_after_the_forward():
    plan = _plan(Policy.COARSE)
    assert set(plan.placements.values()) == {Placement(UNKNOWN)}
    assert plan.points() == (Placement(UNKNOWN),)


def test_joined_places_every_buffer_at_the_join():
    plan = _plan(Policy.JOINED)
    assert set(plan.placements.values()) == {Placement(IN)}
    assert plan.points() == (Placement(IN),)
    # what SGLang does: resolve() of the joined declaration
    assert plan.end("req_to_token") is resolve(MIXED, owns_publish=True, caps=Capabilities())


def test_per_buffer_places_each_buffer_at_its_declared_end():
    plan = _plan(Policy.PER_BUFFER)
    assert {b: plan.end(b) for b in SHARED_BUFFERS} == {
        "req_to_token": PRE, "seq_lens": PRE, "swa_map": PRE, "state_slots": IN}
    assert plan.points() == (Placement(PRE), Placement(IN))  # one event per distinct end, in order
    assert plan.buffers_at(Placement(PRE)) == ("req_to_token", "seq_lens", "swa_map")


def test_per_buffer_unread_buffers_need_no_wait():
    plan = _plan(Policy.PER_BUFFER, declared=ReadEffect.of({"state_slots": IN}))
    assert plan.end("req_to_token") is NONE and not plan.placements["req_to_token"].waits
    assert plan.points() == (Placement(IN),)


def test_exact_places_each_buffer_after_its_last_reading_node():
    plan = _plan(Policy.EXACT)
    for b, last in LAST.items():
        assert plan.placements[b].after == last
    assert plan.end("state_slots") is IN and plan.end("req_to_token") is PRE
    # one event per node, in execution order (node order inside a stage)
    assert [p.after.node for p in plan.points()] == ["index_select", "index_select_1", "index_select_3",
                                                     "index_select"]
    assert [p.after.stage for p in plan.points()][-1] == PREPARE_IN_GRAPH


def test_exact_needs_the_trace():
    with pytest.raises(ValueError, match="EXACT"):
        plan_fences(buffers=SHARED_BUFFERS, declared=MIXED, caps=Capabilities(), policy=Policy.EXACT)


@pytest.mark.parametrize("policy", list(Policy), ids=str)
def test_no_in_graph_events_never_places_an_in_graph_point(policy):
    last = dict(LAST, req_to_token=LastRead(BODY, "index_select_9", 40))
    declared = MIXED | ReadEffect.of({"req_to_token": POST})
    plan = plan_fences(buffers=SHARED_BUFFERS, declared=declared, caps=NO_IN_GRAPH, policy=policy,
                       last_reads=last, observed=declared)
    for b, p in plan.placements.items():
        assert p.end is not IN, (b, p)
        assert p.after is None or p.after.stage not in IN_GRAPH_STAGES, (b, p)
        assert p.end >= declared[b] or policy is Policy.COARSE  # later is sound, earlier is not
    if policy is not Policy.COARSE:
        assert plan.end("state_slots") is POST  # IN_REPLAY -> POST_REPLAY, never PRE_REPLAY
    if policy in (Policy.PER_BUFFER, Policy.EXACT):
        assert plan.end("seq_lens") is PRE  # out-of-graph points stay where they are


def test_eager_phase_places_points_between_launches_on_any_platform():
    # graphed=False (e.g. EXTEND): every stage is an eager launch; in-graph events are not needed.
    plan = _plan(Policy.PER_BUFFER, caps=NO_IN_GRAPH, graphed=False)
    assert plan.end("state_slots") is IN


# -- placements of real lowerings ----------------------------------------------------------------

BACKENDS = {
    "hybrid_linear(trtllm_mha,linear)": lambda: hybrid_linear(trtllm_mha(), linear()),
    "minimax(sparse,dense)": lambda: minimax(sparse(), dense()),
    "tbo(deepseek_v4,paged)": lambda: tbo(deepseek_v4(), paged()),
    "paged": paged,
}


@pytest.fixture(scope="module")
def dev_no_in_graph():
    with CpuDevice(in_graph_events=False) as d:
        yield d


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY], ids=str)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_lowered_placements_follow_the_policy(dev, name, mode):
    backend = BACKENDS[name]()
    declared = backend.read_effect(mode)
    lowered = {p: lower(backend, mode, batch_size=2, cfg=CFG, device=dev, policy=p) for p in Policy}
    plans = {p: low.plan for p, low in lowered.items()}
    program = lowered[Policy.EXACT].program
    observed = program.traced()
    assert observed <= declared  # the reference backends are sound
    for b in SHARED_BUFFERS:
        assert plans[Policy.COARSE].placements[b] == Placement(UNKNOWN)
        assert plans[Policy.JOINED].end(b) is declared.end  # the join of all buffers
        assert plans[Policy.PER_BUFFER].end(b) is declared[b]  # its own declared end
        exact = plans[Policy.EXACT].placements[b]
        last = program.last_reader(b)
        if last is None:
            assert not exact.waits
        elif program.stage(last[0]).runs_python:  # the out-of-graph stage runs as Python: after it
            assert exact.after is None and exact.end is observed[b]
        else:
            assert (exact.after.stage, exact.after.node) == last  # after the last-reading node
            assert exact.end is observed[b]
        # EXACT is never later than PER_BUFFER, which is never later than JOINED, then COARSE
        assert exact.end <= plans[Policy.PER_BUFFER].end(b) <= plans[Policy.JOINED].end(b) <= UNKNOWN


def test_composition_with_buffers_ending_at_different_stages(dev):
    # hybrid_linear(trtllm_mha, linear): page table, lengths and swa map end before the replay,
    # state slots inside it. JOINED publishes all of them inside the graph.
    backend = hybrid_linear(trtllm_mha(), linear())
    joined = lower(backend, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.JOINED).plan
    per_buffer = lower(backend, M.DECODE, batch_size=2, cfg=CFG, device=dev, policy=Policy.PER_BUFFER).plan
    assert {b: joined.end(b) for b in SHARED_BUFFERS} == dict.fromkeys(SHARED_BUFFERS, IN)
    assert {b: per_buffer.end(b) for b in SHARED_BUFFERS} == {
        "req_to_token": PRE, "seq_lens": PRE, "swa_map": PRE, "state_slots": IN}
    assert len(per_buffer.points()) == 2 and len(joined.points()) == 1
    rows = {r["buffer"]: r for r in per_buffer.describe()}
    assert rows["state_slots"]["placement"] == "inside the graph, after prepare_in_graph"
    assert rows["req_to_token"]["placement"] == "after prepare_out_graph, before replay"


@pytest.mark.parametrize("policy", list(Policy), ids=str)
@pytest.mark.parametrize("name", ["minimax(sparse,dense)", "hybrid_linear(trtllm_mha,linear)"])
def test_lowering_without_in_graph_events(dev_no_in_graph, name, policy):
    backend = BACKENDS[name]()
    low = lower(backend, M.DECODE, batch_size=2, cfg=CFG, device=dev_no_in_graph, policy=policy,
                lowering=LowerOptions(measure=True))
    declared = backend.read_effect(M.DECODE)
    for b, p in low.plan.placements.items():
        assert p.end is not IN
        assert p.after is None or p.after.stage not in IN_GRAPH_STAGES
        if policy is Policy.PER_BUFFER:
            assert p.end is degrade(declared[b], NO_IN_GRAPH)
    moved = {"minimax(sparse,dense)": "seq_lens", "hybrid_linear(trtllm_mha,linear)": "state_slots"}[name]
    assert declared[moved] is IN
    if policy is not Policy.COARSE:
        assert low.plan.end(moved) is POST  # declared/observed IN_REPLAY, moved later
