"""Triton kernels a user writes, launched in a backend's stages: each launch is one op named after
its kernel, for the tracer, the read observer, the lowering and the lowered step.

The kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``):
a launch costs about a millisecond here, the first of each kernel some tens, so the cases are few
and small (one layer, two requests). Skipped with the reason where triton is not installed.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from readfence.backends import kv_lens, leaf, softmax_attention, store_kv
from readfence.core import ForwardMode, ReadObserver, StageThreadError, StageWriteError, UnboundedKernelError, audit, trace
from readfence.core.internal import launches_unseen
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import LoopOptions, Policy, verify
from tests.conftest import NO_TRITON, TRITON
from tests.conftest import ONE_LAYER as CFG

if not TRITON:
    pytest.skip(NO_TRITON, allow_module_level=True)

import triton
import triton.language as tl

M = ForwardMode
IN, POST = ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY


# -- kernels, as a user writes them ----------------------------------------------------------
@triton.jit
def gather_rows(table, rows, out, W: tl.constexpr):
    """``out[b] = table[rows[b]]``: a request's page-table row."""
    b = tl.program_id(0)
    r = tl.load(rows + b).to(tl.int64)
    i = tl.arange(0, W)
    tl.store(out + b * W + i, tl.load(table + r * W + i))


@triton.jit
def gather_and_mark(table, rows, out, W: tl.constexpr):
    """The same gather, and it marks the row as read: a write of the page table."""
    b = tl.program_id(0)
    r = tl.load(rows + b).to(tl.int64)
    i = tl.arange(0, W)
    row = tl.load(table + r * W + i)
    tl.store(out + b * W + i, row)
    tl.store(table + r * W + i, row)  # writes back what it read: no byte changes, still a write


@triton.jit
def gather_into_chosen(table, rows, out, spare, which, W: tl.constexpr):
    """The gather into a target chosen at run time (``which``: 0 at every launch here)."""
    b = tl.program_id(0)
    r = tl.load(rows + b).to(tl.int64)
    i = tl.arange(0, W)
    if which > 0:
        dst = spare
    else:
        dst = out
    tl.store(dst + b * W + i, tl.load(table + r * W + i))


def _rows(kernel, shared, batch, extra=None):
    """The batch's page-table rows, gathered by ``kernel`` (``extra(out)``: its further arguments)."""
    table, rows = shared["req_to_token"], batch["req_pool_indices"]
    out = torch.empty(rows.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    kernel[(rows.shape[0],)](table, rows, out, *(extra(out) if extra else ()), W=table.shape[1])
    return out.long()


def page_rows(shared, batch):
    return _rows(gather_rows, shared, batch)


def _backend(name, *, late=False, rows=page_rows, declare=IN):
    """A paged leaf whose page-table rows come from a triton kernel: in ``prepare_in_graph``, or
    (``late``) in every layer's ``attend``."""
    effect = ReadEffect.of({"req_to_token": declare, "seq_lens": IN})

    def prep(mode, shared, batch, meta):
        out = {"kv_lens": kv_lens(shared, batch)}
        if not late:
            out["kv_indices"] = rows(shared, batch)
        return out

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        indices = rows(shared, batch) if late else meta["kv_indices"]
        return softmax_attention(mode, q, pools, layer, indices, meta["kv_lens"])

    return leaf(name, attend, prepare_in_graph=prep, declare={M.DECODE: effect, M.TARGET_VERIFY: effect})


def _verify(backend, dev, **options):
    return verify(backend, M.DECODE, steps=2, batch_size=2, device=dev, cfg=CFG,
                  policy=[Policy.PER_BUFFER, Policy.EXACT], options=LoopOptions(**options))


# -- the read ---------------------------------------------------------------------------------
def test_a_launch_is_one_op_named_after_its_kernel_reading_its_arguments():
    report = audit(_backend("early"), M.DECODE, cfg=CFG, batch_sizes=[2]).unwrap()
    (row,) = [b for _, b in report.entries() if b.buffer == "req_to_token"]
    assert (row.observed, row.reader, row.verdict) == (IN, ("prepare_in_graph", "gather_rows"), "exact")
    node = next(n for n in trace(_backend("early"), M.DECODE, cfg=CFG).stages[1].graph.gm.graph.nodes
                if n.name == "gather_rows")
    assert str(node.target) == "triton_kernel.gather_rows.default"


def test_a_kernel_reading_the_page_table_late_is_refused_naming_it_and_caught_by_verify(dev):
    late = _backend("late", late=True)
    found = audit(late, M.DECODE, cfg=CFG, batch_sizes=[2]).failure()
    assert (found.buffer, found.declared, found.observed) == ("req_to_token", IN, POST)
    assert found.reader == ("body", "gather_rows"), found.reader
    # lowered anyway, the late read is seen where it happens, named after the kernel
    bad = _verify(late, dev, UNSAFE_skip_soundness_check=True).failure()
    assert (bad.kind, bad.buffer, bad.stage, bad.evidence) == ("late read", "req_to_token", "body", "observer")
    assert "gather_rows" in bad.op, bad.op
    # poison alone sees it too: the kernel reads the poisoned table, and the output differs
    alone = _verify(late, dev, UNSAFE_skip_soundness_check=True, checks={"poison"}).failure()
    assert (alone.kind, alone.buffer, alone.evidence) == ("late read", "req_to_token", "poison"), str(alone)


def test_the_honest_declarations_run_bit_identical_to_the_serial_run(dev):
    # (verify compares every policy's logits with the serial run's, bit for bit)
    assert _verify(_backend("early"), dev).unwrap()
    assert _verify(_backend("late_declared", late=True, declare=POST), dev).unwrap()


def test_a_plan_for_cuda_traces_the_launch_under_fake_tensors_as_one_node():
    # no GPU, no kernel run: the op's fake kernel stands for the launch
    for late, end in ((False, IN), (True, POST)):
        program = trace(_backend("fake_" + str(late).lower(), late=late), M.DECODE, cfg=CFG, device="cuda")
        assert program.traced()["req_to_token"] is end
        nodes = [n for s in program.stages for n in s.graph.gm.graph.nodes if n.op == "call_function"
                 and str(n.target) == "triton_kernel.gather_rows.default"]
        assert len(nodes) == (CFG.layers if late else 1)


# -- the write --------------------------------------------------------------------------------
def test_a_kernel_writing_a_shared_buffer_is_refused_as_a_write_naming_it():
    marks = _backend("marks", rows=lambda s, b: _rows(gather_and_mark, s, b))
    with pytest.raises(StageWriteError) as caught:
        audit(marks, M.DECODE, cfg=CFG, batch_sizes=[2])
    e = caught.value
    assert (e.buffer, e.stage, e.node, e.op) == ("req_to_token", "prepare_in_graph", "gather_and_mark",
                                                 "triton_kernel.gather_and_mark.default")
    assert "triton kernel 'gather_and_mark' may store through its argument(s) table" in e.why
    assert "test_triton.py" in e.source  # the user's line that launched it


def _chosen(spare_is_table):
    def rows(shared, batch):
        table = shared["req_to_token"]
        return _rows(gather_into_chosen, shared, batch,
                     lambda out: (table if spare_is_table else torch.empty_like(out), 0))
    return rows


def test_a_store_target_chosen_at_run_time_writes_every_candidate(dev):
    # ``which`` is 0 at every launch: the table is never written, but it may be
    with pytest.raises(StageWriteError, match="gather_into_chosen' may store through its argument"):
        audit(_backend("chooses_table", rows=_chosen(True)), M.DECODE, cfg=CFG, batch_sizes=[2])
    # two candidates of the stage's own: accepted, and run as the serial run does
    assert _verify(_backend("chooses_own", rows=_chosen(False)), dev).unwrap()


# -- a launch off the stage's own clock --------------------------------------------------------
def test_a_kernel_launched_on_a_thread_of_its_own_is_refused_naming_it():
    def on_its_own(shared, batch):
        out = []
        worker = threading.Thread(target=lambda: out.append(page_rows(shared, batch)), name="side")
        worker.start()
        worker.join()
        return out[0]

    with pytest.raises(StageThreadError) as caught:
        audit(_backend("side", rows=on_its_own), M.DECODE, cfg=CFG, batch_sizes=[2])
    what = caught.value.what
    assert what.startswith("a thread 'side' running ") and what.endswith(" launching triton kernel 'gather_rows'")


def test_a_launch_on_another_cuda_stream_is_refused(monkeypatch):
    # (no GPU here: the stage's stream and the launch's are told apart by identity, as CUDA's are)
    from readfence.core import LaunchStreamError, _threads

    streams = iter(["the stage's", "a side stream"])
    monkeypatch.setattr(_threads, "_current_stream", lambda: next(streams))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "a side stream")
    table = torch.arange(16, dtype=torch.int32).reshape(1, 16)
    with pytest.raises(LaunchStreamError, match="'gather_rows' is launched on a stream other"):
        with _threads.watch_threads("toy", "body"), ReadObserver({"req_to_token": table}):
            page_rows({"req_to_token": table}, {"req_pool_indices": torch.zeros(1, dtype=torch.int64)})


# -- what the observer sees ---------------------------------------------------------------------
def _observed(unseen=False):
    table = torch.arange(32, dtype=torch.int32).reshape(2, 16)
    obs = ReadObserver({"req_to_token": table})
    with obs, obs.stage("body"), launches_unseen() if unseen else torch.no_grad():
        page_rows({"req_to_token": table}, {"req_pool_indices": torch.tensor([1, 0])})
    return [(a.kind, a.op, a.end) for a in obs.accesses]


def test_the_observer_sees_one_read_and_an_unseen_launch_is_unknown():
    # one read, named after the kernel; no write of the table the interpreter copies back
    assert _observed() == [("read", "triton_kernel.gather_rows.default", POST)]
    # a launch readfence does not make an op, as on a GPU: its pointers taken in Python make the table
    # UNKNOWN, never nothing; the interpreter's host copies and copy-back are no op of the stage's
    unseen = _observed(unseen=True)
    assert unseen == [("escape", "data_ptr()", ReadEnd.UNKNOWN)], unseen


@triton.jit
def _from_address(addresses, out):
    p = tl.load(addresses).to(tl.pointer_type(tl.int32))
    tl.store(out, tl.load(p))


def test_a_kernel_making_addresses_from_integers_is_refused_while_watched():
    table = torch.arange(4, dtype=torch.int32)
    addresses, out = torch.tensor([table.data_ptr()], dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(UnboundedKernelError, match="'_from_address' makes an address from an integer"):
        with ReadObserver({"req_to_token": table}):
            _from_address[(1,)](addresses, out)


def test_an_interpreted_launch_watched_as_an_op_computes_what_it_does_unwatched():
    # the cost of each is printed (pytest -s), not asserted: timings belong to benchmarks; what must
    # hold is that watching changes nothing of the result and sees every launch
    table = torch.arange(128, dtype=torch.int32).reshape(8, 16)
    batch = {"req_pool_indices": torch.tensor([3, 1])}
    expected = table.index_select(0, batch["req_pool_indices"]).clone()
    page_rows({"req_to_token": table}, batch)  # the kernel's first launch rewrites its source

    def per_launch(watched: bool, n: int = 20) -> tuple[float, list[torch.Tensor], int]:
        obs = ReadObserver({"req_to_token": table})
        start = time.perf_counter()
        with obs if watched else torch.no_grad():
            outs = [page_rows({"req_to_token": table}, batch) for _ in range(n)]
        seen = sum(a.op == "triton_kernel.gather_rows.default" for a in obs.accesses)
        return (time.perf_counter() - start) / n, outs, seen

    per_launch(True, 1)  # the first watched launch reads the kernel's source once (cached after)
    (bare, plain, unseen), (watched, outs, seen) = per_launch(False), per_launch(True)
    print(f"\ninterpreted launch (grid 2, 16 lanes): {bare * 1e3:.2f} ms unwatched, {watched * 1e3:.2f} ms as an op "
          f"under the read observer")
    assert all(torch.equal(o, expected) for o in plain + outs)
    assert (unseen, seen) == (0, 20)


@triton.jit
def _program_ids(out, W: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out + pid * W + tl.arange(0, W), tl.zeros([W], dtype=tl.int32) + pid)


def test_launches_from_two_threads_do_not_interleave_in_the_interpreter():
    # a stream's replay and the scheduler's Python stage launch at once: the interpreter keeps the
    # running program in module state (unlocked, one launch breaks the other's)
    from readfence.core.tracing._triton import see_launches

    assert see_launches()
    failures: list[object] = []

    def launches():
        for _ in range(20):
            out = torch.empty(32, 4, dtype=torch.int32)
            try:
                _program_ids[(32,)](out, W=4)
            except Exception as e:  # (a failed launch raises on its own thread)
                failures.append(e)
                return
            if not torch.equal(out[:, 0], torch.arange(32, dtype=torch.int32)):
                failures.append(out[:, 0])

    threads = [threading.Thread(target=launches) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
