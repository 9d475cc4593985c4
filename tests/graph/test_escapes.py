"""Stages that escape the tracer (host reads, branches on data) run their Python in the step on the
CPU device. In the graph every buffer is read until POST_REPLAY; out of it an escape counts for the
buffers it reaches, until PRE_REPLAY (``tests/core/test_escape_precision.py``). Declared so, they are lowered
under PER_BUFFER and EXACT and verify clean; declared earlier, they are refused naming the stage
and the escape, and the unsafe flag shows the race caught at run time. On CUDA an in-graph stage
that escapes cannot be captured: lowering refuses it.

The backends are written through the public ``leaf`` API; the shared ones live in
``tests/adversarial.py`` (where ``test_adversarial_runs`` and ``test_adversarial_audit`` also run them).
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import page_meta
from readfence.core import ForwardMode, StageWriteError, audit, clear_trace_cache
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, LoopOptions, Policy, UncapturableStage, lower, make_state, run_overlapped, run_serial, verify
from tests.adversarial import CASES, _every, _host_read, body_reader
from tests.conftest import SMALL as CFG

M = ForwardMode
STEPS, BATCH = 5, 4
POST = ReadEnd.POST_REPLAY
EVERY = ("req_to_token", "seq_lens", "state_slots", "swa_map")


def _placements(backend, policy, dev) -> dict[str, str]:
    low = lower(backend, M.DECODE, batch_size=BATCH, device=dev, policy=policy, cfg=CFG)
    return {row["buffer"]: row["placement"] for row in low.describe()}


@pytest.mark.parametrize("name", ["host_read_declared_post", "branch_on_content_declared_post"])
def test_a_body_escape_declared_post_replay_is_lowered_and_verifies_clean_under_every_policy(name, dev) -> None:
    backend = CASES[name].build(None)
    report = audit(backend, M.DECODE, cfg=CFG).unwrap()
    assert report.observed == ReadEffect.uniform(EVERY, POST)  # every buffer, not only the one it reads
    (stage, _, why), *_ = report.opaque
    assert stage == "body" and why.startswith("escape: ") and "a CUDA graph cannot capture it" in why
    # the stage runs as Python: its reads end with it, so every event waits for the replay's end
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        assert set(_placements(backend, policy, dev).values()) == {"after the replay"}
    result = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG)
    assert [c.policy for c in result.unwrap().checks] == list(Policy), result
    assert all(c.poisoned == EVERY for c in result.unwrap().checks if c.policy is not Policy.COARSE)


@pytest.mark.parametrize(("name", "stage", "escape"), [
    ("host_read", "body", "escape: tolist()"),
    ("host_read_declared_pre", "body", "escape: tolist()"),
    ("in_graph_escape_view", "prepare_in_graph", "escape: __int__()"),
])
def test_an_escape_declared_before_its_end_is_refused_naming_stage_and_escape_and_caught_unsafe(
        name, stage, escape, dev) -> None:
    backend = CASES[name].build(None)
    bad = audit(backend, M.DECODE, cfg=CFG).failure()
    assert bad.observed is POST and f"stage {stage}, node " in bad.message and escape in bad.message, bad.message
    refused = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                     policy=[Policy.PER_BUFFER, Policy.EXACT]).failure()
    assert (refused.kind, refused.evidence) == ("unsound declaration", "audit") and escape in refused.detail
    caught = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                    policy=[Policy.PER_BUFFER, Policy.EXACT],
                    options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    assert (caught.kind, caught.buffer, caught.step, caught.stage) == ("late read", "seq_lens", 0, "body"), str(caught)


def test_an_in_graph_escape_hands_the_body_views_of_any_buffer_and_exact_follows_them(dev) -> None:
    backend = CASES["in_graph_branch_view_declared_post"].build(None)
    # the traced path hands over a copy; the others a view of the live lengths, read in the last
    # layer, after the body's traced read of them in layer 0: EXACT releases after that last layer
    exact = _placements(backend, Policy.EXACT, dev)
    assert len(set(exact.values())) == 1 and exact["seq_lens"].startswith("after node body:")
    result = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                    policy=[Policy.PER_BUFFER, Policy.EXACT])
    assert result.map(lambda r: len(r.checks)).value_or(None) == 2, result


def test_exact_releasing_at_the_traced_path_s_last_read_is_caught_by_verify(dev, monkeypatch) -> None:
    # break the analysis on purpose: the body's inputs an escaping stage hands over alias only
    # what they aliased on the traced path. The rehearsal's observed reads still hold the lengths
    # until the last layer; with those dropped too, EXACT releases the lengths after layer 0, and
    # the run, which trusts no analysis, catches the read through the view in the last layer
    import readfence.core.tracing._analysis as analysis
    from readfence.core.internal import Ledger

    monkeypatch.setattr(analysis, "_handed_over", lambda *args: {})
    clear_trace_cache()
    try:
        backend = CASES["in_graph_branch_view_declared_post"].build(None)
        assert audit(backend, M.DECODE, cfg=CFG).map(lambda r: r.sound).value_or(None)  # still sound per stage
        observed = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.EXACT)
        assert observed.map(lambda r: len(r.checks)).value_or(None) == 1, observed  # placed after what it saw
        monkeypatch.setattr(Ledger, "record", lambda self, run: None)  # every run's reads forgotten
        caught = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                        policy=Policy.EXACT).failure()
        assert (caught.kind, caught.buffer, caught.stage, caught.evidence) == (
            "late read", "seq_lens", "body", "observer"), str(caught)
    finally:
        clear_trace_cache()


def test_exact_never_releases_before_a_later_stage_that_runs_its_python(dev, monkeypatch) -> None:
    # the body reads the lengths only on steps the trace did not take; their last traced read is
    # prepare_in_graph's, but the body runs as Python after it: EXACT waits for the replay's end
    backend = CASES["branch_on_position_declared_post"].build(None)
    assert _placements(backend, Policy.EXACT, dev)["seq_lens"] == "after the replay"
    exact = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.EXACT)
    assert exact.map(lambda r: len(r.checks)).value_or(None) == 1, exact
    # broken on purpose: the last reader is the last traced node, whatever runs after it
    from readfence.core import Program

    def traced_only(self, buffer):
        return next(((s.stage, n) for s in reversed(self.stages) if (n := s.analysis.last_reader(buffer))), None)

    monkeypatch.setattr(Program, "last_reader", traced_only)
    # (the rehearsal saw the body's Python read the lengths: dropped as well, or it holds them)
    from readfence.core.internal import Ledger

    monkeypatch.setattr(Ledger, "record", lambda self, run: None)  # every run's reads forgotten
    assert _placements(backend, Policy.EXACT, dev)["seq_lens"].startswith("after node prepare_in_graph:")
    caught = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                    policy=Policy.EXACT).failure()
    assert (caught.kind, caught.buffer, caught.stage, caught.evidence) == (
        "late read", "seq_lens", "body", "observer"), str(caught)


class _Keeper:
    """What an engine-style backend keeps on ``self`` between calls."""

    kept: torch.Tensor | None = None
    reads: int = 0


def _keeps_a_view(keeper: _Keeper, table: torch.Tensor | None = None):
    # the body keeps a view of the lengths (a lazily read reference: of the step's argument, or
    # of the live buffer ``table`` it holds); the next step's out-of-graph stage, which runs as
    # Python too, reads through it
    def out(mode, shared, batch):
        rows = batch["req_pool_indices"]
        assert int(rows.max()) < shared["seq_lens"].shape[0]  # a host read: Python before every replay
        prev = torch.zeros(rows.shape[0], dtype=torch.long)
        if keeper.kept is not None:
            keeper.reads += 1
            prev = keeper.kept.index_select(0, rows).long()
        return {**page_meta(shared, batch), "prev": prev}

    def lens(s, b, m, layer, q):
        keeper.kept = (s["seq_lens"] if table is None else table)[:]
        return torch.maximum(_host_read(s, b, m, layer, q), m["prev"])

    return body_reader("keeps_a_view", lens, prep=None, out=out, declare=_every(POST))


def test_a_view_of_the_live_buffer_kept_on_the_backend_is_read_within_the_next_step_s_fences(dev) -> None:
    # The kept view is read in the next step's out-of-graph stage, after that step's writes and
    # before its PRE_REPLAY fence: it reads that step's values, as the serial run does.
    serial_state, state = make_state(CFG), make_state(CFG)
    serial = _keeps_a_view(_Keeper(), serial_state["shared"]["seq_lens"])
    reference = run_serial(serial, steps=STEPS, batch_size=BATCH, cfg=CFG, state=serial_state)
    keeper = _Keeper()
    backend = _keeps_a_view(keeper, state["shared"]["seq_lens"])
    snapshot = {k: {n: t.clone() for n, t in group.items()} for k, group in state.items()}
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        for group, tensors in snapshot.items():  # the same start for each run
            for n, t in tensors.items():
                state[group][n].copy_(t)
        keeper.reads = 0
        run = run_overlapped(backend, steps=STEPS, policy=policy, device=dev, batch_size=BATCH, cfg=CFG, state=state)
        assert run.matches(reference) and run.violations == (), run.violations[:3]
        assert keeper.reads >= STEPS  # the kept view really is read, step after step
    result = verify(backend, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, state=state,
                    policy=[Policy.PER_BUFFER, Policy.EXACT])
    assert result.map(lambda r: len(r.checks)).value_or(None) == 2, result
    assert audit(backend, M.DECODE, cfg=CFG, state=state).unwrap().sound


def test_a_view_of_an_argument_kept_on_the_backend_is_trace_time_state_no_fence_makes_right(dev) -> None:
    # Kept from the step's argument, the view the trace and the lowering's rehearsal leave on the
    # backend points at an example state: the first step reads it. No static analysis sees Python
    # state; the output comparison does, under every policy alike (no read races a fence).
    reference = run_serial(_keeps_a_view(_Keeper()), steps=STEPS, batch_size=BATCH, cfg=CFG)
    runs = []
    for policy in (Policy.COARSE, Policy.PER_BUFFER, Policy.EXACT):
        run = run_overlapped(_keeps_a_view(_Keeper()), steps=STEPS, policy=policy, device=dev, batch_size=BATCH,
                             cfg=CFG)
        assert run.violations == () and not run.matches(reference)
        runs.append(run)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run.logits, runs[0].logits, strict=True))
    differs = verify(_keeps_a_view(_Keeper()), steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG).failure()
    assert (differs.policy, differs.kind, differs.step, differs.evidence) == (Policy.COARSE, "differs", 0, "output")
    # traced after a step ran, the out-of-graph graph holds the kept view as a constant of an example
    # state: without the live state to match it against, it may be any buffer (UNKNOWN)
    assert audit(_keeps_a_view(_Keeper()), M.DECODE, cfg=CFG).failure().observed is ReadEnd.UNKNOWN


def _cuda() -> CpuDevice:
    # the lowering decides from the device's name and capabilities before it touches the device
    return CpuDevice(name="cuda:0", timeout=10.0)


@pytest.mark.parametrize("name", ["host_read_declared_post", "in_graph_escape_view_declared_post",
                                  "branch_on_content_declared_post"])
@pytest.mark.parametrize("policy", list(Policy), ids=str)
def test_on_cuda_an_in_graph_escape_cannot_be_captured(name, policy) -> None:
    backend = CASES[name].build(None)
    with _cuda() as cuda, pytest.raises(UncapturableStage, match="cannot capture .* a graph would replay only"):
        lower(backend, M.DECODE, batch_size=2, device=cuda, policy=policy, cfg=CFG, state=make_state(CFG))


def test_on_cuda_the_trace_stops_at_an_escape_before_the_replay_too() -> None:
    backend = CASES["host_read_declared_pre"].build(None)
    out_of_graph = body_reader("out_escape", lambda s, b, m, layer, q: m["kv_lens"], prep=None, declare=_every(POST),
                               out=lambda mode, s, b: {**page_meta(s, b), "n": torch.tensor(int(s["seq_lens"][0]))})
    with _cuda() as cuda:
        for b in (backend, out_of_graph):
            with pytest.raises(UncapturableStage, match="escapes under fake tensors"):
                lower(b, M.DECODE, batch_size=2, device=cuda, policy=Policy.COARSE, cfg=CFG, state=make_state(CFG))
        # on the CPU device the same out-of-graph escape counts for what it reaches, until PRE_REPLAY:
        # the lengths it reads and the page table the stage's snapshot reads, no other buffer
        assert audit(out_of_graph, M.DECODE, cfg=CFG).unwrap().observed == ReadEffect.uniform(
            ("req_to_token", "seq_lens"), ReadEnd.PRE_REPLAY)


def _writes_through_data(mode, shared, batch, meta):
    # ``.data =`` points a fresh tensor at the lengths' memory: the trace follows tensors by
    # identity, so the graph adds to the fresh tensor while the Python writes the buffer
    alias = torch.empty(0, dtype=shared["seq_lens"].dtype)
    alias.data = shared["seq_lens"]
    alias.add_(1)
    return page_meta(shared, batch)


def test_a_data_assignment_is_a_reference_escape_not_a_graph_that_misses_the_write(dev) -> None:
    backend = body_reader("writes_through_data", lambda s, b, m, layer, q: m["kv_lens"], prep=_writes_through_data)
    # the trace alone: a reference escape, every buffer UNKNOWN from the stage on
    bad = audit(backend, M.DECODE, cfg=CFG, observe_steps=0).failure()
    assert bad.report.observed["seq_lens"] is ReadEnd.UNKNOWN and "stage prepare_in_graph" in bad.message, bad.message
    assert "escape: .data assignment" in bad.message, bad.message
    # a run of the stage's Python shows the write itself: refused as one, in the audit and in lower
    with pytest.raises(StageWriteError) as e:
        audit(backend, M.DECODE, cfg=CFG)
    assert (e.value.stage, e.value.buffer, e.value.op) == ("prepare_in_graph", "seq_lens", "aten.add_.Tensor"), str(e.value)
    assert "test_escapes.py" in e.value.source and "_writes_through_data" in e.value.source, e.value.source
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        refused = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=policy).failure()
        assert (refused.kind, refused.evidence, refused.buffer) == ("write", "audit", "seq_lens"), str(refused)
