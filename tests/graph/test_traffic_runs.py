"""The traffic-dependent backends (``tests/traffic.py``) caught at run time, by checks that trust no analysis.

Each early declaration is refused before anything runs (``verify`` reports the audit's refusal),
and the read it hides is real: lowered anyway (``UNSAFE_skip_soundness_check``), the loop's own
traffic (requests at their first token, finished rows reused, a mixed batch, the longest context)
takes the path, and the runtime read observer or poison on release names the late read. A value
baked into a capture is refused under every policy, COARSE included, and, with the validation
switched off, the lowered loop's logits differ from the serial run's. The same code honestly
declared runs clean.
"""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode, NotGraphSafe
from readfence.graph import CpuDevice, LoopOptions, Policy, lower, make_state, run_overlapped, run_serial, verify
from tests import traffic
from tests.conftest import SMALL as CFG

M = ForwardMode
OUT_OF_GRAPH = traffic.out_of_graph_cases(CFG.max_ctx)
#: Each spelling's loop: the traffic that takes its path (the longest context needs requests that live
#: that long: none finishes early), and the buffer it reads late.
RUNS = {
    "first_token": ({"steps": 3}, "seq_lens"),
    "mixed_batch": ({"steps": 8, "finish_prob": 0.3}, "seq_lens"),
    "longest_context": ({"steps": CFG.max_ctx, "finish_prob": 0.0, "batch_size": 2}, "seq_lens"),
    "reused_slot": ({"steps": 8, "finish_prob": 0.3}, "state_slots"),
    "middle_length": ({"steps": 8, "finish_prob": 0.3}, "seq_lens"),
    "pad_token": ({"steps": 8, "finish_prob": 0.3}, "state_slots"),
}


@pytest.fixture
def dev():
    with CpuDevice(timeout=60.0) as device:
        yield device


def _verify(backend, mode, dev, *, policy, steps=8, batch_size=4, finish_prob=0.3, **options):
    # the run's keywords are verify's; the workload and the checks are its loop's record
    state = make_state(CFG)
    return verify(backend, mode, device=dev, cfg=CFG, state=state, policy=policy, steps=steps, batch_size=batch_size,
                  options=LoopOptions(finish_prob=finish_prob, **options))


def _slow_but_first(names):
    # (each runs several loops: the quick tier keeps the first spelling of each class)
    return [pytest.param(n, marks=[] if i == 0 else [pytest.mark.slow]) for i, n in enumerate(names)]


@pytest.mark.parametrize("name", _slow_but_first(list(OUT_OF_GRAPH)))
def test_the_out_of_graph_stage_s_read_on_some_traffic_is_refused_and_real(name, dev) -> None:
    make, (run, buffer) = OUT_OF_GRAPH[name], RUNS[name]
    refused = _verify(make(False), M.DECODE, dev, policy=Policy.PER_BUFFER, **run).failure()
    assert (refused.kind, refused.evidence, refused.buffer, refused.stage) == (
        "unsound declaration", "audit", buffer, "prepare_out_graph"), str(refused)
    late = _verify(make(False), M.DECODE, dev, policy=Policy.PER_BUFFER, UNSAFE_skip_soundness_check=True,
                   **run).failure()
    assert (late.kind, late.buffer, late.stage, late.evidence) == (
        "late read", buffer, "prepare_out_graph", "observer"), str(late)
    poisoned = _verify(make(False), M.DECODE, dev, policy=Policy.PER_BUFFER, UNSAFE_skip_soundness_check=True,
                       checks={"poison"}, **run).failure()
    assert (poisoned.kind, poisoned.buffer, poisoned.evidence) == ("late read", buffer, "poison"), str(poisoned)
    honest = _verify(make(True), M.DECODE, dev, policy=[Policy.PER_BUFFER, Policy.EXACT], **run)
    assert honest.map(lambda r: len(r.checks)).value_or(None) == 2, honest


@pytest.mark.parametrize("name", _slow_but_first(traffic.KEPT))
def test_a_custom_op_reading_the_live_lengths_it_keeps_is_refused_by_lower_and_real(name, dev) -> None:
    state = make_state(CFG)
    stage = "prepare_in_graph" if name == "in_graph" else "body"
    for policy in (Policy.PER_BUFFER, Policy.EXACT):  # EXACT's rehearsal saw it too: one verdict, refused by both
        refused = verify(traffic.kept(name, state), M.DECODE, device=dev, cfg=CFG, state=state, steps=3,
                         batch_size=2, policy=policy).failure()
        assert (refused.kind, refused.evidence, refused.buffer, refused.stage) == (
            "unsound declaration", "audit", "seq_lens", stage), str(refused)
    late = verify(traffic.kept(name, state), M.DECODE, device=dev, cfg=CFG, state=state, steps=3, batch_size=2,
                  policy=Policy.PER_BUFFER, options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    assert (late.kind, late.buffer, late.evidence) == ("late read", "seq_lens", "observer"), str(late)
    assert late.stage == stage and "aten.index_select" in late.op, str(late)
    honest = verify(traffic.kept(name, state, honest=True), M.DECODE, device=dev, cfg=CFG, state=state, steps=3,
                    batch_size=2, policy=[Policy.PER_BUFFER, Policy.EXACT])
    assert honest.map(lambda r: len(r.checks)).value_or(None) == 2, honest


@pytest.mark.parametrize("name", _slow_but_first(traffic.BAKED))
def test_a_count_baked_into_a_capture_is_refused_under_every_policy_and_differs_from_serial(name, dev,
                                                                                            monkeypatch) -> None:
    backend, size = traffic.baked(name, CFG.max_ctx), traffic.BAKED_AT.get(name, 4)
    for policy in Policy:
        with pytest.raises(NotGraphSafe, match="stage prepare_in_graph is not graph-safe"):
            lower(backend, M.DECODE, batch_size=size, device=dev, policy=policy, cfg=CFG)
    refused = _verify(backend, M.DECODE, dev, policy=Policy.COARSE, batch_size=size).failure()
    assert (refused.kind, refused.evidence, refused.stage) == ("refused", "replay", "prepare_in_graph"), str(refused)
    # the check that shares nothing with the validation: the serial run, on the loop's own traffic
    import readfence.graph.lowering._lower as lowering

    monkeypatch.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)
    state = make_state(CFG)
    reference = run_serial(backend, M.DECODE, steps=8, batch_size=size, cfg=CFG, state=state,
                           options=LoopOptions(finish_prob=0.3))
    run = run_overlapped(backend, M.DECODE, steps=8, policy=Policy.COARSE, device=dev, batch_size=size, cfg=CFG,
                         state=make_state(CFG), options=LoopOptions(finish_prob=0.3))
    assert not run.matches(reference)


@pytest.mark.parametrize("name", _slow_but_first(traffic.EXTEND_BRANCHES))
def test_a_branch_on_a_mixed_batch_in_extend_is_refused_and_real(name, dev) -> None:
    stage = "prepare_in_graph" if name == "in_graph" else "body"
    refused = _verify(traffic.extend_branch(name, CFG.max_ctx), M.EXTEND, dev, policy=Policy.PER_BUFFER).failure()
    assert (refused.kind, refused.evidence, refused.buffer, refused.stage) == (
        "unsound declaration", "audit", "req_to_token", stage), str(refused)
    late = _verify(traffic.extend_branch(name, CFG.max_ctx), M.EXTEND, dev, policy=Policy.PER_BUFFER,
                   UNSAFE_skip_soundness_check=True).failure()
    assert (late.kind, late.buffer, late.stage, late.evidence) == ("late read", "req_to_token", stage, "observer"), \
        str(late)
    honest = _verify(traffic.extend_branch(name, CFG.max_ctx, honest=True), M.EXTEND, dev,
                     policy=[Policy.PER_BUFFER, Policy.EXACT])
    assert honest.map(lambda r: len(r.checks)).value_or(None) == 2, honest


@pytest.mark.slow
def test_poison_alone_names_the_reader_the_step_s_ledger_saw_or_says_none_saw_it(dev) -> None:
    # verify's attribution is the ledger's: a kernel's read of the live lengths it keeps, which the
    # audit's observer saw, is named; a read through memory kept before anything watched is not
    from tests.adversarial import CASES

    state = make_state(CFG)
    common = dict(device=dev, cfg=CFG, state=state, steps=3, batch_size=2, policy=Policy.PER_BUFFER,
                  options=LoopOptions(checks={"poison"}, UNSAFE_skip_soundness_check=True))
    seen = verify(traffic.kept("custom_op", state), M.DECODE, **common).failure()
    assert (seen.kind, seen.evidence, seen.buffer, seen.stage) == ("late read", "poison", "seq_lens", "body"), str(seen)
    assert "kept_lens" in seen.op and "the step's ledger saw" in seen.detail, str(seen)
    unseen = verify(CASES["kept_pointer"].build(state), M.DECODE, **common).failure()
    assert (unseen.kind, unseen.evidence, unseen.buffer, unseen.stage) == ("late read", "poison", "seq_lens", None)
    assert "no run of the step saw it read after its release" in unseen.detail, str(unseen)


def test_check_mode_records_what_it_watched_in_the_step_s_ledger(dev) -> None:
    # check mode is a run of the lowered step like any other: what its observer saw on the live
    # state joins the step's ledger, through the one entry (a run of kind ``check``)
    from readfence.backends import paged
    from readfence.core.internal import RunKind
    from readfence.graph import CheckState, decode_loop
    from readfence.graph.verification._verify import LateReadWatch

    state = make_state(CFG)
    watch = LateReadWatch(state["shared"])
    loop = decode_loop(paged(), policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG, state=state,
                       options=LoopOptions(check=CheckState(state["shared"], CFG, watcher=watch)))
    loop.run(2)
    (check,) = loop.lowered.ledger.runs(RunKind.CHECK)
    assert {(a.buffer, a.stage) for a in check.reads()} >= {("req_to_token", "prepare_in_graph"),
                                                             ("seq_lens", "prepare_in_graph")}
    assert loop.lowered.ledger.effect(RunKind.CHECK, traced=False) <= loop.lowered.observed
