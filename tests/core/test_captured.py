"""Tensors a stage captured, worked out against the live state the program is bound to.

A backend that keeps the live page table (the README's "pass the live state" case) may make a
handle on it, ``torch.empty(0).set_(table)``: no schema says the handle aliases the table, and
the example the trace ran on does not hold the live memory. ``bind`` runs such a stage once
more with its captured tensors live, so the handle's reads and writes are seen statically.
And a tensor the backend keeps, made by itself (a constant, a buffer it fills), is its own whatever
its shape; it is another state's buffer only when its memory is one.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import kv_indices, kv_lens, leaf, softmax_attention, store_kv
from readfence.core import BODY, CapturedStateError, ForwardMode, StageWriteError, audit, bind, trace
from readfence.core._program import Constant
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, FaultInjector, Policy, UnsoundLowering, lower, make_state, run_overlapped, run_serial
from tests.conftest import SMALL as CFG

M = ForwardMode.DECODE


def _handle(table: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=table.dtype).set_(table)


def _handle_in_graph(state, end: ReadEnd, *, write: bool = False):
    table = state["shared"]["req_to_token"]

    def inn(mode, shared, batch, meta):
        handle = _handle(table)
        if write:
            handle.mul_(1)  # a write through the handle (the same bytes: only aliasing can tell)
        return {"kv_lens": kv_lens(shared, batch), "table": handle}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        rows = meta["table"].index_select(0, batch["req_pool_indices"]).long()
        return softmax_attention(mode, q, pools, layer, rows, meta["kv_lens"])

    effect = ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY, "req_to_token": end})
    return leaf("handle_in_graph", attend, prepare_in_graph=inn, declare={M: effect})


def _handle_in_body(state, end: ReadEnd):
    table = state["shared"]["req_to_token"]

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        rows = _handle(table).index_select(0, batch["req_pool_indices"]).long()
        return softmax_attention(mode, q, pools, layer, rows, meta["kv_lens"])

    effect = ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY, "req_to_token": end})
    return leaf("handle_in_body", attend, prepare_in_graph=lambda mode, s, b, meta: {"kv_lens": kv_lens(s, b)},
                declare={M: effect})


@pytest.mark.parametrize("make", [_handle_in_graph, _handle_in_body])
def test_reads_through_a_handle_on_a_captured_live_buffer_are_seen(make) -> None:
    state = make_state(CFG)
    early = make(state, ReadEnd.IN_REPLAY)
    program = bind(trace(early, M, cfg=CFG), state)
    assert program.traced()["req_to_token"] is ReadEnd.POST_REPLAY
    assert program.last_reader("req_to_token")[0] == BODY
    assert audit(early, M, cfg=CFG, state=state).failure().buffer == "req_to_token"
    with CpuDevice() as dev, pytest.raises(UnsoundLowering, match="req_to_token"):
        lower(early, M, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=state)


def test_a_write_through_a_handle_on_a_captured_live_buffer_is_refused() -> None:
    state = make_state(CFG)
    before = state["shared"]["req_to_token"].clone()
    writer = _handle_in_graph(state, ReadEnd.POST_REPLAY, write=True)
    with pytest.raises(StageWriteError) as e:
        bind(trace(writer, M, cfg=CFG), state)
    assert (e.value.stage, e.value.buffer) == ("prepare_in_graph", "req_to_token")
    assert torch.equal(state["shared"]["req_to_token"], before)  # binding left the live state as it was


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT])
def test_declared_right_the_handle_runs_bit_identical_to_serial(policy: Policy) -> None:
    state = make_state(CFG)
    backend = _handle_in_graph(state, ReadEnd.POST_REPLAY)
    serial = run_serial(backend, M, steps=5, batch_size=3, cfg=CFG, state=state)
    with CpuDevice(timeout=30.0, faults=FaultInjector(5, 0.002, streams=["forward"], probability=0.3)) as dev:
        run = run_overlapped(backend, M, steps=5, policy=policy, device=dev, batch_size=3, cfg=CFG, state=state)
    assert run.matches(serial) and run.violations == ()


def test_a_snapshot_buffer_the_backend_keeps_and_fills_is_its_own() -> None:
    # shaped like seq_lens, it is no other state's seq_lens: the step writes it itself
    state = make_state(CFG)
    snap = torch.zeros_like(state["shared"]["seq_lens"])

    def out(mode, shared, batch):
        snap.copy_(shared["seq_lens"])
        return {"kv_indices": kv_indices(shared, batch)}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = snap.index_select(0, batch["req_pool_indices"]).long()
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    pre = ReadEffect.of({"seq_lens": ReadEnd.PRE_REPLAY, "req_to_token": ReadEnd.PRE_REPLAY})
    snapper = leaf("snapper", attend, prepare_out_graph=out, declare={M: pre})
    assert audit(snapper, M, cfg=CFG, state=state).map(lambda r: r.sound).value_or(False)
    serial = run_serial(snapper, M, steps=5, batch_size=3, cfg=CFG, state=state)
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        with CpuDevice(timeout=30.0) as dev:
            run = run_overlapped(snapper, M, steps=5, policy=policy, device=dev, batch_size=3, cfg=CFG, state=state)
        assert run.matches(serial) and run.violations == ()


def test_a_persistent_tensor_the_backend_made_is_its_own_whatever_its_shape() -> None:
    # FlashInfer's kv_last_page_len: torch.ones(max_bs, int32), the shape and dtype of seq_lens
    last_page_len = torch.ones(CFG.max_reqs, dtype=torch.int32)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = meta["kv_lens"] + last_page_len.index_select(0, batch["req_pool_indices"]).long() - 1
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    def inn(mode, shared, batch, meta):
        return {"kv_indices": kv_indices(shared, batch), "kv_lens": kv_lens(shared, batch)}

    flashinfer_like = leaf("flashinfer_like", attend, prepare_in_graph=inn)
    state = make_state(CFG)
    for given in (None, state):  # without the state and bound to it
        report = audit(flashinfer_like, M, cfg=CFG, state=given).unwrap()
        assert report.observed["seq_lens"] is ReadEnd.IN_REPLAY and not report.opaque
    kept = bind(trace(flashinfer_like, M, cfg=CFG), state).captured()  # one per layer
    assert kept and all(c.matches == Constant() and c.usable for c in kept), kept
    serial = run_serial(flashinfer_like, M, steps=4, batch_size=3, cfg=CFG, state=state)
    for policy in (Policy.COARSE, Policy.PER_BUFFER, Policy.EXACT):
        with CpuDevice(timeout=30.0) as dev:
            run = run_overlapped(flashinfer_like, M, steps=4, policy=policy, device=dev, batch_size=3, cfg=CFG,
                                 state=state)
        assert run.matches(serial) and run.violations == (), policy


def test_a_buffer_of_another_state_is_still_refused() -> None:
    # its memory is another state's lengths: refused, naming the buffer
    other, state = make_state(CFG), make_state(CFG)
    foreign = other["shared"]["seq_lens"]

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = foreign.index_select(0, batch["req_pool_indices"]).long()
        return softmax_attention(mode, q, pools, layer, kv_indices(shared, batch), lens)

    stranger = leaf("stranger", attend)
    with CpuDevice() as dev, pytest.raises(CapturedStateError, match="shared buffer 'seq_lens' of another state; "
                                                                      "pass the state the backend keeps references to: state="):
        lower(stranger, M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG, state=state)


def test_a_refusal_says_each_cause_once_counting_its_tensors() -> None:
    # four tensors kept from the trace, made by one line: one clause, counted, with one example
    stash: dict[int, torch.Tensor] = {}

    def out(mode, shared, batch):
        for i in range(4):
            stash[i] = shared["seq_lens"].clone() + i  # kept in a closure, not returned
        return {}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = sum(stash[i] for i in range(4)).index_select(0, batch["req_pool_indices"]).long() % 8 + 1
        return softmax_attention(mode, q, pools, layer, kv_indices(shared, batch), lens)

    hoarder = leaf("hoarder", attend, prepare_out_graph=out)
    state = make_state(CFG)
    with CpuDevice() as dev, pytest.raises(CapturedStateError) as caught:
        lower(hoarder, M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG, state=state)
    message = str(caught.value)
    assert message.count("trace-time state baked into the graph") == 1, message
    assert "stage body: 4 captured tensors made in test_captured.py (_tensor_constant" in message, message


# -- when binding need not run a stage again ------------------------------------------------------
def _own_table(name: str):
    """A backend whose body gathers from a table it keeps (its own memory, no state's)."""
    mine = torch.arange(CFG.max_reqs * CFG.max_ctx, dtype=torch.int32).view(CFG.max_reqs, CFG.max_ctx)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        rows = mine.index_select(0, batch["req_pool_indices"]).long() % CFG.num_slots
        return softmax_attention(mode, q, pools, layer, rows, meta["kv_lens"])

    return leaf(name, attend, prepare_in_graph=lambda mode, s, b, meta: {"kv_lens": kv_lens(s, b)})


@torch.library.custom_op("readfence_test_bind::rows_of", mutates_args=())
def _rows_of(index: torch.Tensor) -> torch.Tensor:
    return index.clone()


def test_a_stage_that_can_reach_no_live_buffer_is_bound_without_running_it_again(monkeypatch) -> None:
    from readfence.core.tracing import _bind
    from readfence.core.tracing._probe import MemoryProbe

    runs: list[str] = []
    real_run = MemoryProbe.run
    monkeypatch.setattr(MemoryProbe, "run", lambda self, *args: runs.append(self.module.__class__.__name__)
                        or real_run(self, *args))
    state = make_state(CFG)
    program = trace(_own_table("own_table"), M, cfg=CFG)
    skipped = bind(program, state)
    assert runs == []  # its kept table is no live memory: the run would have shown nothing
    monkeypatch.setattr(_bind, "_may_touch", lambda *args: True)
    _bind._BOUND.clear()
    ran = bind(program, state)
    assert len(runs) == 1
    assert [s.analysis for s in skipped] == [s.analysis for s in ran]  # nothing the run shows was missed


def test_a_stage_that_holds_live_memory_or_calls_an_opaque_op_is_run_again() -> None:
    from torch import fx

    from readfence.core.tracing._bind import _may_touch
    from readfence.core.tracing._memory import BufferMap

    state = make_state(CFG)
    live = BufferMap.of(state["shared"])
    table = state["shared"]["req_to_token"]
    plain = fx.symbolic_trace(lambda x: x + 1)
    assert not _may_touch(plain, (torch.zeros(3),), live)
    assert _may_touch(plain, (table[:0],), live)  # an empty view of a live buffer: its storage is live
    holder = fx.symbolic_trace(lambda x: x + 1)
    holder.kept = table.narrow(0, 0, 1)  # a tensor the graph module holds
    assert _may_touch(holder, (torch.zeros(3),), live)
    opaque = fx.symbolic_trace(lambda x: torch.ops.readfence_test_bind.rows_of(x))
    assert _may_touch(opaque, (torch.zeros(3),), live)  # a custom op may close over live memory


# -- a view of the state an earlier stage keeps, read by a later one -----------------------------
#: How an out-of-graph stage keeps a view of the lengths it was handed (a new tensor every step, so
#: the trace meets it as a tensor the body did not receive).
KEPT_VIEWS = {
    "slice": lambda lens: lens[:],
    "view": lambda lens: lens.view(-1),
    "detach": lambda lens: lens.detach(),
    "offset": lambda lens: lens[1:],  # another start: the body reads rows shifted by one
    "strided": lambda lens: lens.as_strided((lens.numel() // 2,), (2,)),  # every other row
    "dlpack_piece": lambda lens: torch.from_dlpack(lens[1:]),  # a storage of its own, over the buffer's memory
}


def _kept_view(how: str, end: ReadEnd, *, stale: bool = False):
    """A paged leaf whose ``prepare_out_graph`` keeps ``KEPT_VIEWS[how]`` of the lengths on an
    object every step (``stale``: only on its first call, so later steps read that first state's
    memory), and whose body reads the lengths only through it (declared to end at ``end``)."""
    from readfence.backends import page_meta

    class Holder:
        lens: torch.Tensor | None = None

    held = Holder()

    def out(mode, shared, batch):
        if not stale or held.lens is None:
            held.lens = KEPT_VIEWS[how](shared["seq_lens"])
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = held.lens.index_select(0, batch["req_pool_indices"] % held.lens.numel()).long().clamp(1, CFG.max_ctx)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    effect = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": end})
    return leaf(f"kept_view_{how}{'_stale' if stale else ''}", attend, prepare_out_graph=out, declare={M: effect})


@pytest.mark.parametrize("how", list(KEPT_VIEWS))
def test_a_view_of_its_state_an_earlier_stage_keeps_is_a_read_of_the_live_buffer(how) -> None:
    # the graph reads that view of the state it runs on: audited as a read in the body, lowered,
    # and the loop computes what the serial run does (checked without readfence's verdict)
    # (a DLPack hand-over is an escape of the buffer: UNKNOWN, wherever the view is then read)
    end = ReadEnd.UNKNOWN if how.startswith("dlpack") else ReadEnd.POST_REPLAY
    honest, early = _kept_view(how, end), _kept_view(how, ReadEnd.PRE_REPLAY)
    assert audit(honest, M, cfg=CFG).unwrap().observed["seq_lens"] is end
    refused = audit(early, M, cfg=CFG).failure()
    assert (refused.buffer, refused.observed) == ("seq_lens", end), str(refused)
    with CpuDevice(timeout=60) as dev:
        for policy in (Policy.PER_BUFFER, Policy.EXACT):
            ran = run_overlapped(honest, M, steps=6, policy=policy, device=dev, batch_size=2, cfg=CFG,
                                 state=make_state(CFG))
            assert ran.matches(run_serial(honest, M, steps=6, batch_size=2, cfg=CFG, state=make_state(CFG)))
        with pytest.raises(UnsoundLowering, match="seq_lens"):
            lower(early, M, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=make_state(CFG))


@pytest.mark.parametrize("how", ["slice", "strided"])
def test_a_view_kept_from_another_steps_state_is_refused_and_really_differs(how) -> None:
    # kept on the first call only: the Python reads that state's memory at every later step, which
    # the graph (reading the view of the state it runs on) does not; refused under every policy
    from readfence.core import NotGraphSafe

    with CpuDevice(timeout=60) as dev:
        for policy in Policy:
            with pytest.raises((NotGraphSafe, CapturedStateError)):
                lower(_kept_view(how, ReadEnd.POST_REPLAY, stale=True), M, batch_size=2, device=dev, policy=policy,
                      cfg=CFG, state=make_state(CFG))
        # the independent check: without the validation, the loop (its graph reads the view of the
        # live state) and the same backend's serial run (its Python reads the view it kept from the
        # first state it met, the trace's) differ
        import readfence.graph.lowering._lower as lowering

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)
            stale = _kept_view(how, ReadEnd.POST_REPLAY, stale=True)
            ran = run_overlapped(stale, M, steps=6, policy=Policy.COARSE, device=dev, batch_size=2, cfg=CFG,
                                 state=make_state(CFG))
            reference = run_serial(stale, M, steps=6, batch_size=2, cfg=CFG, state=make_state(CFG))
        assert not ran.matches(reference)


def test_a_view_of_another_dtype_is_still_trace_time_state() -> None:
    # reinterpreted bytes are no view of the buffer the graph can take from its input: refused as before
    from readfence.backends import page_meta

    class Holder:
        lens: torch.Tensor | None = None

    held = Holder()

    def out(mode, shared, batch):
        held.lens = shared["seq_lens"].view(torch.float32)
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + held.lens.sum() * 0

    backend = leaf("kept_view_float", attend, prepare_out_graph=out,
                   declare={M: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.POST_REPLAY})})
    with CpuDevice(timeout=60) as dev, pytest.raises(CapturedStateError, match="_tensor_constant"):
        lower(backend, M, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=make_state(CFG))


@pytest.mark.parametrize("buffer", ["req_to_token", "seq_lens"])
def test_a_kept_view_reads_the_live_buffer_laid_out_otherwise_than_the_example(buffer) -> None:
    # the live page table's rows padded (stride 24 for 16 columns), the lengths at an offset into
    # an arena: the graph takes the kept view's elements in their logical order from the live buffer
    from readfence.backends import page_meta
    from tests.graph.test_lower_what_runs import _padded_state

    class Holder:
        view: torch.Tensor | None = None

    held = Holder()

    def out(mode, shared, batch):
        held.view = shared[buffer][1:]  # rows (or lengths) from the second on, kept for the body
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        rows = (batch["req_pool_indices"] - 1).clamp(min=0)
        extra = held.view.index_select(0, rows).float().sum() * 1e-4
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + extra

    effect = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY,
                            buffer: ReadEnd.POST_REPLAY})
    backend = leaf(f"kept_view_padded_{buffer}", attend, prepare_out_graph=out, declare={M: effect})
    serial = run_serial(backend, M, steps=4, batch_size=2, cfg=CFG, state=_padded_state())
    with CpuDevice(timeout=60) as dev:
        run = run_overlapped(backend, M, steps=4, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG,
                             state=_padded_state())
    assert run.matches(serial) and run.violations == ()
