"""The serving loop: changing batches, a graph per captured size, prefill between decodes.

* its outputs are bit-identical to the serial reference request by request, and that
  comparison can fail (a perturbed output is found, with its step and request);
* the run really is mixed: several padded sizes and several prefill steps, counted from the
  run's own records;
* each graph keeps its own event ring: an event shared across batch sizes, a wait bound to
  the fence of another graph's step and a ring too small for the steps in flight are refused,
  naming the graphs;
* a declaration one stage too early is caught on this loop, by the sanitizer and by ``verify``.

The matrix over every reference backend, combinator and step shape under every policy is in
the slow tier (``test_serve_matrix``).
"""

from __future__ import annotations

import re

import pytest
import torch

from readfence.backends import paged, per_stream, redeclare, trtllm_mha
from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import (
    CpuDevice,
    FaultInjector,
    LowerOptions,
    Policy,
    ServeOptions,
    ServeResult,
    Traffic,
    eagle,
    run_serve,
    run_serve_serial,
    serve_loop,
    verify_serve,
)
from readfence.graph.lowering import ForeignEventError, RingWrapError
from readfence.graph.runtime import ServeScheduler

CFG = ModelConfig(layers=1, max_reqs=8, max_ctx=32)
SIZES = (1, 2, 4, 8)
TRAFFIC = Traffic(rate=0.5, prompt=(4, 12), output=(2, 6), seed=4)
STEPS = 60


def _serve(target, policy, steps=STEPS, faults=None, **kw) -> ServeResult:
    with CpuDevice(timeout=30, faults=faults) as dev:
        return run_serve(target, steps=steps, policy=policy, device=dev, traffic=kw.pop("traffic", TRAFFIC),
                         capture_sizes=kw.pop("capture_sizes", SIZES), cfg=CFG, **kw)


def _serial(target, steps=STEPS, traffic=TRAFFIC) -> ServeResult:
    return run_serve_serial(target, steps=steps, traffic=traffic, capture_sizes=SIZES, cfg=CFG)


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT])
def test_serve_is_bit_identical_to_serial_and_mixed(policy):
    ref = _serial(paged())
    res = _serve(paged(), policy, faults=FaultInjector(seed=5, max_delay_s=0.0005))
    assert res.violations == (), "\n".join(map(str, res.violations[:5]))
    assert res.first_difference(ref) is None
    assert res.matches(ref)
    # the traffic really is mixed, by the run's own counts
    assert len(res.batch_sizes) >= 3, res.batch_sizes
    assert res.prefill_steps >= 5 and res.decode_steps >= 5, (res.prefill_steps, res.decode_steps)
    assert res.steps == STEPS == len(res.logits)
    assert [r.requests for r in res.records] == [r.requests for r in ref.records]
    # each decode step ran in the smallest captured size that fits, and the batch changed
    for r in res.records:
        if r.kind == "decode":
            assert r.padded == min(s for s in SIZES if s >= r.batch_size) and r.graph == f"decode b{r.padded}"
        else:
            assert r.padded == r.batch_size and not r.graphed
    assert len({r.batch_size for r in res.records}) >= 3
    assert all(s >= 0 for s in res.slack.values()), res.slack


def test_comparison_with_serial_can_fail_and_names_the_request():
    ref = _serial(paged(), steps=30)
    i = next(k for k, r in enumerate(ref.records) if r.kind == "decode" and r.batch_size >= 2)
    logits = list(ref.logits)
    broken = logits[i].clone()
    broken[1, 0] += 1.0  # the second request's row
    logits[i] = broken
    bad = ServeResult(None, ref.records, logits, 0.0)
    assert bad.first_difference(ref) == (i, ref.records[i].requests[1])
    assert not bad.matches(ref)
    # ... and another traffic gives another schedule
    other = _serial(paged(), steps=30, traffic=Traffic(rate=0.5, prompt=(4, 12), output=(2, 6), seed=5))
    assert not other.matches(ref)


def test_padding_rows_never_reach_a_request():
    # a decode step of 3 requests runs in the graph for 4: the padding request's row, state slot
    # and KV slots are its own, so the three requests' logits equal the exact batch's
    sched = ServeScheduler(CFG, 1, TRAFFIC, max_batch=7)
    step = next(s for s in iter(sched.next_step, None) if s.kind == "decode" and s.batch_size == 3)
    padded = sched.pad(step, 4)
    assert padded["req_pool_indices"].tolist()[-1] == sched.pad_row
    assert sched.pad_row not in step.batch["req_pool_indices"].tolist()
    assert not set(padded["out_cache_loc"].tolist()[-1:]) & set(step.batch["out_cache_loc"].tolist())


def test_per_stream_and_step_shapes_serve_bit_identical():
    for target in (per_stream(paged(), trtllm_mha()), eagle(paged(), trtllm_mha())):
        ref = _serial(target, steps=30)
        res = _serve(target, Policy.PER_BUFFER, steps=30, faults=FaultInjector(seed=2, max_delay_s=0.0005))
        assert res.violations == () and res.matches(ref), (str(target), res.first_difference(ref))
        assert res.prefill_steps >= 3 and len(res.batch_sizes) >= 2


# -- each graph keeps its own events ---------------------------------------------------------------


def test_an_event_shared_across_batch_sizes_is_refused_naming_both_graphs():
    # BROKEN on purpose: one event per release point, reused by the graph of every batch size
    # (what an engine does with "one reusable event"): the first wait is refused
    with CpuDevice(timeout=30) as dev:
        shared: dict[str, object] = {}

        def one_per_point(name: str):
            point = name.rsplit("/", 1)[-1]  # "IN_REPLAY#0", "done#0": the same for every graph
            return shared.setdefault(point, dev.event(f"shared/{point}"))

        loop = serve_loop(paged(), policy=Policy.PER_BUFFER, device=dev, traffic=TRAFFIC, capture_sizes=SIZES,
                          cfg=CFG, lowering=LowerOptions(new_event=one_per_point))
        with pytest.raises(ForeignEventError) as err:
            loop.run(10)
    msg = str(err.value)
    graphs = re.findall(r"graph '([^']+)'", msg)
    assert len(graphs) == 2 and graphs[0] != graphs[1], msg
    assert all(g.startswith("paged/") for g in graphs) and "shared/" in msg and "own event ring" in msg


def test_a_wait_bound_to_another_graphs_fence_is_refused():
    with CpuDevice(timeout=30) as dev:
        loop = serve_loop(paged(), policy=Policy.EXACT, device=dev, traffic=TRAFFIC, capture_sizes=SIZES, cfg=CFG)
        runs, records, *_ = loop.run(12)
        i = next(k for k in range(1, len(records)) if records[k].graph != records[k - 1].graph)
        replayed = loop.decode[records[i].padded] if records[i].kind == "decode" else loop.prefill[records[i].padded]
        previous = loop.decode[records[i - 1].padded] if records[i - 1].kind == "decode" else \
            loop.prefill[records[i - 1].padded]
        loop.check_binding(runs[i], replayed)  # the fence of the graph it replayed: bound
        with pytest.raises(ForeignEventError) as err:
            loop.check_binding(runs[i - 1], replayed)  # a fence of the step before, another graph
        # a fence kept until its graph replayed again (a ring of one slot wrapped): refused too
        j, k = next((a, b) for a in range(len(records)) for b in range(a + 1, len(records))
                    if records[a].graph == records[b].graph)
        with pytest.raises(RingWrapError, match="recorded again"):
            runs[j].fence.wait(dev.stream("schedule"))
        runs[k].fence.wait(dev.stream("schedule"))  # the latest replay's fence binds
    msg = str(err.value)
    assert replayed.label in msg and previous.label in msg, msg


def test_a_ring_too_small_for_the_steps_in_flight_is_refused():
    # the draft's decode graph replays twice per eagle step: two steps of it in flight
    with CpuDevice(timeout=30) as dev:
        with pytest.raises(ValueError, match=r"paged in DECODE at batch size 1: event ring of size 1 is too small for 2 steps in flight"):
            serve_loop(eagle(paged(), paged(), draft_steps=2), policy=Policy.PER_BUFFER, device=dev, traffic=TRAFFIC,
                       capture_sizes=SIZES, cfg=CFG, lowering=LowerOptions(ring_size=1))
        loop = serve_loop(eagle(paged(), paged(), draft_steps=2), policy=Policy.PER_BUFFER, device=dev,
                          traffic=TRAFFIC, capture_sizes=SIZES, cfg=CFG)
        draft = next(g for k, g in loop.decode[4].graphs.items() if k[1] is ForwardMode.DECODE)
        assert draft.ring_size == 2


def test_every_graph_owns_its_events():
    with CpuDevice(timeout=30) as dev:
        loop = serve_loop(per_stream(paged(), trtllm_mha()), policy=Policy.PER_BUFFER, device=dev, traffic=TRAFFIC,
                          capture_sizes=SIZES, cfg=CFG)
        loop.prepare(30)
        seen: dict[int, str] = {}
        for step in loop.lowered_steps():
            for low in step.lowered:
                for slot in low._slots:
                    for e in (*slot.events.values(), slot.done):
                        assert seen.setdefault(id(e), low.label) == low.label
        assert len(loop.prefill) >= 2 and sorted(loop.decode) == [2, 4, 8]


# -- one stage too early, on this loop ------------------------------------------------------------


def _early_seq_lens():
    """paged, redeclared so that ``seq_lens`` ends at PRE_REPLAY in DECODE (it is read in graph)."""
    def declare(mode):
        e = paged().read_effect(mode)
        return ReadEffect.of({**e.as_dict(), "seq_lens": ReadEnd.PRE_REPLAY}, default=e.default) \
            if mode is ForwardMode.DECODE else e
    return redeclare(paged(), declare)


@pytest.mark.parametrize("seed", [4, 21, 99])
def test_one_step_early_declaration_is_caught_by_verify_in_every_run(seed):
    traffic = Traffic(rate=0.5, prompt=(4, 12), output=(2, 6), seed=seed)
    with CpuDevice(timeout=30) as dev:
        found = verify_serve(_early_seq_lens(), steps=20, device=dev, policy=Policy.PER_BUFFER, cfg=CFG,
                             traffic=traffic, capture_sizes=SIZES,
                             options=ServeOptions(UNSAFE_skip_soundness_check=True)).failure()
    assert (found.kind, found.buffer, found.evidence, found.stage) == ("late read", "seq_lens", "observer",
                                                                       "prepare_in_graph")


def test_one_step_early_declaration_is_caught_by_the_sanitizer_and_by_verify():
    early = _early_seq_lens()
    res = _serve(early, Policy.PER_BUFFER, steps=40, options=ServeOptions(UNSAFE_skip_soundness_check=True))
    assert res.violations and {v.buffer for v in res.violations} == {"seq_lens"}
    with CpuDevice(timeout=30) as dev:
        found = verify_serve(early, steps=30, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, traffic=TRAFFIC,
                             capture_sizes=SIZES, options=ServeOptions(UNSAFE_skip_soundness_check=True)).failure()
        assert (found.kind, found.buffer, found.evidence) == ("late read", "seq_lens", "observer")
        # without the observer, poison alone catches it from the outputs
        found = verify_serve(early, steps=30, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, traffic=TRAFFIC,
                             capture_sizes=SIZES,
                             options=ServeOptions(checks={"poison"}, UNSAFE_skip_soundness_check=True)).failure()
        assert (found.kind, found.buffer, found.evidence) == ("late read", "seq_lens", "poison")
        # and lowering refuses it without the unsafe flag
        refused = verify_serve(early, steps=5, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, traffic=TRAFFIC,
                               capture_sizes=SIZES).failure()
        assert refused.kind == "unsound declaration"


def test_verify_on_the_serving_loop_is_clean():
    with CpuDevice(timeout=30) as dev:
        report = verify_serve(paged(), steps=30, device=dev, cfg=CFG, traffic=TRAFFIC, capture_sizes=SIZES).unwrap()
    assert [c.policy for c in report.checks] == list(Policy)
    assert report.ran() == ["poison", "guard", "observer"] and "serving" in str(report)


# -- outputs that depend on the padding rows ----------------------------------------------------------


def _padding_dependent(how: str):
    """A paged leaf, declared honestly, whose requests' outputs depend on every row of the batch
    the graph runs: the padding rows of a larger captured size change them."""
    from readfence.backends import leaf, page_meta, softmax_attention, store_kv

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        if how == "mean_length":
            return out + 1e-2 * meta["kv_lens"].float().mean()
        if how == "batch_norm":  # normalised over the whole batch's queries
            return out / (1.0 + q.float().abs().sum())
        return out + 1e-3 * float(q.shape[0])  # the number of rows, a Python value

    pre = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})
    return leaf(f"padding_{how}", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch),
                declare={ForwardMode.DECODE: pre, ForwardMode.EXTEND: pre})


@pytest.mark.parametrize("how", ["mean_length", "batch_norm", "rows"])
def test_outputs_that_depend_on_the_padding_are_named_padding_not_a_nondeterministic_backend(how):
    backend, traffic = _padding_dependent(how), Traffic(rate=1.0, prompt=(4, 8), output=(2, 6), seed=1)
    kw = dict(steps=14, traffic=traffic, capture_sizes=[1, 2, 4], cfg=CFG)
    # the independent check, without verify: the loop matches the serial run padded as it pads,
    # and not the serial run at each batch's own size
    with CpuDevice(timeout=30) as dev:
        loop = run_serve(backend, policy=Policy.PER_BUFFER, device=dev, **kw)
    assert any(r.kind == "decode" and r.padded > len(r.requests) for r in loop.records)  # some batch padded
    assert not loop.matches(run_serve_serial(backend, **kw))
    assert loop.matches(run_serve_serial(backend, padded=True, **kw))
    with CpuDevice(timeout=30) as dev:
        found = verify_serve(backend, device=dev, policy=Policy.PER_BUFFER, **kw).failure()
    assert (found.kind, found.evidence, found.buffer) == ("padding", "rerun", None), str(found)
    assert "padded=True" in found.detail


def test_a_backend_that_keeps_state_still_differs_and_is_not_blamed_on_the_padding():
    from readfence.backends import leaf, page_meta, softmax_attention, store_kv

    calls = []

    def out_graph(mode, shared, batch):  # a counter kept in Python: every run of the step moves it on
        calls.append(1)
        return {**page_meta(shared, batch), "bias": torch.full((1,), 1e-3 * len(calls))}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + meta["bias"]

    pre = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})
    backend = leaf("counter", attend, prepare_out_graph=out_graph, declare={ForwardMode.DECODE: pre,
                                                                           ForwardMode.EXTEND: pre})
    with CpuDevice(timeout=30) as dev:
        found = verify_serve(backend, steps=10, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, capture_sizes=[1, 2, 4],
                             traffic=Traffic(rate=1.0, prompt=(4, 8), output=(2, 6), seed=1)).failure()
    assert (found.kind, found.evidence) == ("differs", "output"), str(found)


def test_the_padded_serial_reference_of_a_correct_backend_is_the_unpadded_one():
    kw = dict(steps=20, traffic=TRAFFIC, capture_sizes=SIZES, cfg=CFG)
    assert run_serve_serial(paged(), padded=True, **kw).matches(run_serve_serial(paged(), **kw))
    with pytest.raises(ValueError, match="per_stream group"):
        run_serve_serial(per_stream(paged(), paged()), padded=True, **kw)


# -- the scheduler ------------------------------------------------------------------------------------


def test_admission_follows_the_model_limits_and_prefill_comes_between_decodes():
    sched = ServeScheduler(CFG, 1, Traffic(rate=3.0, prompt=(4, 12), output=(2, 8), seed=0), max_batch=4)
    kinds = []
    for _ in range(80):
        step = sched.next_step()
        assert len(sched.running) <= 4 and step.batch_size <= 4
        assert torch.equal(step.batch["positions"], step.batch["positions"])  # fresh tensors each step
        kinds.append(step.kind)
    # a prefill never follows a prefill while something can decode
    assert "prefill" in kinds and "decode" in kinds
    assert sched.finished > 0


def test_traffic_that_cannot_fit_the_model_is_refused():
    with pytest.raises(ValueError, match="cfg.max_ctx=32"):
        ServeScheduler(CFG, 3, Traffic(prompt=(4, 24), output=(1, 8)), max_batch=4)
    with pytest.raises(ValueError, match="max_batch"):
        ServeScheduler(CFG, 1, TRAFFIC, max_batch=8)  # one of the 8 rows is the padding request's
    with pytest.raises(ValueError, match="Traffic.prompt"):
        Traffic(prompt=(5, 2))


def test_per_stream_steps_wait_for_the_other_streams_whatever_graph_ran_before():
    # the members share the pools, and consecutive steps run in the graphs of different batch
    # sizes: each stream's step must wait for the other stream's latest step, whichever graph it
    # was (with an order per graph, the delayed stream's step 9 read a slot already reused)
    target = per_stream(paged(), trtllm_mha())
    ref = _serial(target, steps=40)
    res = _serve(target, Policy.EXACT, steps=40, faults=FaultInjector(seed=0, max_delay_s=0.002, streams=["forward[0]"]))
    assert res.first_difference(ref) is None and res.violations == ()


def test_a_step_shape_whose_target_is_a_per_stream_group_pads_a_lone_prefill_to_its_members() -> None:
    # every stream of the group gets a request: a one-request prefill is padded to two, as for the group alone

    target = eagle(per_stream(paged(), paged()), paged())
    traffic = Traffic(rate=0.3, prompt=(4, 8), output=(2, 4), seed=0)
    serial = run_serve_serial(target, steps=4, traffic=traffic, capture_sizes=[2, 4])
    with CpuDevice(timeout=60.0) as dev:
        res = run_serve(target, steps=4, policy=Policy.COARSE, device=dev, traffic=traffic, capture_sizes=[2, 4])
    assert res.records[0].kind == "prefill" and len(res.records[0].requests) == 1 and res.records[0].padded == 2
    assert res.matches(serial)


@pytest.mark.parametrize("policy", [Policy.EXACT, Policy.PER_BUFFER], ids=str)
def test_a_step_shape_s_decode_waits_for_its_target_group_s_prefill_on_the_other_streams(policy) -> None:
    # the group's prefills run on forward[0] and forward[1], the shape's decode steps on forward: they
    # share the pools, so each waits for the others' latest step (the draft read a half-written cache)
    target = eagle(per_stream(paged(), paged()), paged())
    traffic = Traffic(rate=6.0, prompt=(4, 8), output=(4, 6), seed=0)
    serial = run_serve_serial(target, steps=3, traffic=traffic, capture_sizes=[2, 4, 8, 16])
    slow_members = FaultInjector(seed=7, max_delay_s=0.02, streams=["forward[0]", "forward[1]"])
    with CpuDevice(timeout=60.0, faults=slow_members) as dev:
        res = run_serve(target, steps=3, policy=policy, device=dev, traffic=traffic, capture_sizes=[2, 4, 8, 16])
    assert [r.kind for r in res.records] == ["prefill", "prefill", "decode"]
    assert res.matches(serial), res.first_difference(serial)
