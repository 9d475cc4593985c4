"""What a triton kernel reads and writes, decided from triton's own IR of the launch.

Each spelling the source walk (``_kernel_access``) misses is a case here that the IR decides, the
IR's own traps (a pointer swapped in a loop, an early return, an IR that cannot be built) are
cases, and the pointer cast of SGLang's ``cache_move`` kernels is accepted while its twin that
loads an address is refused. Building an IR takes milliseconds; the few kernels that run do in
triton's interpreter. Skipped with the reason where triton is not installed.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from readfence.backends import kv_lens, leaf, softmax_attention
from readfence.core import ForwardMode, ReadObserver, StageWriteError, UnboundedKernelError, audit, kernel_access, trace
from readfence.effects import ReadEffect, ReadEnd
from tests.conftest import NO_TRITON, TRITON
from tests.conftest import ONE_LAYER as CFG

if not TRITON:
    pytest.skip(NO_TRITON, allow_module_level=True)

import triton
import triton.language as tl

from readfence.core.tracing import _kernel_ir
from readfence.core.tracing._kernel_access import FROM_IR, FROM_SOURCE, source_access
from readfence.core.tracing._triton import see_launches
from tests.core import kernel_helpers
from tests.core.test_triton import _backend, _rows, _verify, gather_and_mark, gather_rows

M = ForwardMode
IN = ReadEnd.IN_REPLAY


def _access(kernel, *args, **kwargs):
    """The IR's answer for a launch of ``kernel`` with these arguments."""
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    access = kernel_access(kernel, bound.arguments)
    assert access.basis == FROM_IR, access.basis
    return access


def _tensors(access, *names):
    return sorted(access.writes & set(names))


X = torch.arange(16, dtype=torch.float32)


# -- the spellings the source walk misses ------------------------------------------------------
@triton.jit
def _functional_descriptor(src, out, BLOCK: tl.constexpr):
    desc = tl.make_tensor_descriptor(out, shape=[BLOCK], strides=[1], block_shape=[BLOCK])
    tl.store_tensor_descriptor(desc, [0], tl.load(src + tl.arange(0, BLOCK)))


@triton.jit
def _method_descriptor(src, out, BLOCK: tl.constexpr):
    desc = tl.make_tensor_descriptor(out, shape=[BLOCK], strides=[1], block_shape=[BLOCK])
    desc.store([0], tl.load(src + tl.arange(0, BLOCK)))


@triton.jit
def _store_second(x, ptr, BLOCK: tl.constexpr):
    tl.store(ptr + tl.arange(0, BLOCK), x)


@triton.jit
def _starred(src, dst, BLOCK: tl.constexpr):
    x = tl.load(src + tl.arange(0, BLOCK))
    _store_second(*(x, dst), BLOCK)


@triton.jit
def _row(base, r, W: tl.constexpr):
    return base + r * W + tl.arange(0, W)


@triton.jit
def _row_of(base, r, W: tl.constexpr):
    return _row(base, r, W)


@triton.jit
def _nested(src, dst, W: tl.constexpr):
    tl.store(_row_of(dst, 0, W), tl.load(_row_of(src, 0, W)))


def test_the_functional_descriptor_store_writes_its_base_which_the_source_walk_misses():
    assert _tensors(_access(_functional_descriptor, X, X.clone(), 16), "src", "out") == ["out"]
    assert _tensors(_access(_method_descriptor, X, X.clone(), 16), "src", "out") == ["out"]
    assert "descriptor_store" in _access(_functional_descriptor, X, X.clone(), 16).site("out")
    # (why the IR is primary: matched by name, the function spelling writes nothing)
    assert source_access(_functional_descriptor).writes == frozenset()


def test_a_helper_called_with_a_starred_argument_writes_the_argument_it_expands_to():
    assert _tensors(_access(_starred, X, X.clone(), 16), "src", "dst") == ["dst"]
    assert "dst" not in source_access(_starred).writes  # the walk pairs parameters with the starred tuple


def test_a_store_through_a_pointer_a_nested_helper_computes_writes_its_base():
    access = _access(_nested, X, X.clone(), 16)
    assert _tensors(access, "src", "dst") == ["dst"]
    assert access.reads >= {"src"}


@triton.jit
def _atomics(counter, lock, flag, peak, src, BLOCK: tl.constexpr):
    tl.atomic_add(counter, tl.sum(tl.load(src + tl.arange(0, BLOCK))))
    while tl.atomic_cas(lock, 0, 1) != 0:
        pass
    tl.atomic_xchg(lock, tl.load(flag))
    tl.atomic_max(peak, tl.load(src))


def test_atomics_read_and_write_their_pointer():
    i = torch.zeros(1, dtype=torch.int32)
    access = _access(_atomics, X[:1].clone(), i, i.clone(), X[:1].clone(), X, 16)
    assert _tensors(access, "counter", "lock", "flag", "peak", "src") == ["counter", "lock", "peak"]
    assert access.reads >= {"counter", "lock", "flag", "peak", "src"}


@triton.jit
def _block_pointer(src, out, BLOCK: tl.constexpr):
    p = tl.make_block_ptr(out, shape=[BLOCK], strides=[1], offsets=[0], block_shape=[BLOCK], order=[0])
    tl.store(p, tl.load(src + tl.arange(0, BLOCK)))


def test_a_kernel_whose_ir_cannot_be_built_reads_and_writes_every_argument():
    # triton 3.9 removed block pointers: no IR (nor an interpreted run) - never "writes nothing"
    bound = dict(src=X, out=X.clone(), BLOCK=16)
    access = kernel_access(_block_pointer, bound)
    assert access.writes == access.reads == {"src", "out", "BLOCK"}
    assert access.basis.startswith("its IR cannot be built (CompilationError: ") and "every argument" in access.basis
    assert access.site("src") == access.basis


# -- what the IR's structure hides ---------------------------------------------------------------
@triton.jit
def _swapped(a, b, n):
    for i in range(n):
        tl.store(a + i, 1.0)
        a, b = b, a


@triton.jit
def _swapped_while(a, b, n):
    i = 0
    while i < n:
        tl.store(a + i, 1.0)
        a, b = b, a
        i += 1


@triton.jit
def _early_return(src, dst, out, n):
    if tl.load(src) > n:
        return
    tl.store(dst, tl.load(src))


def test_a_pointer_swapped_in_a_loop_writes_both_and_an_early_return_is_followed():
    # the second iteration stores through ``b``: a loop's value is its initial one or any iteration's
    for kernel in (_swapped, _swapped_while):
        assert _tensors(_access(kernel, X.clone(), X.clone(), 4), "a", "b") == ["a", "b"], kernel
    # an early return is unstructured control flow in the IR (cf.cond_br)
    assert _tensors(_access(_early_return, X, X.clone(), X.clone(), 3), "src", "dst", "out") == ["dst"]


def test_the_rows_of_a_table_picked_by_loaded_indices_are_kept_for_the_message():
    access = _access(gather_rows, X.view(2, 8), torch.tensor([1, 0]), X.clone(), 8)
    assert (access.reads, _tensors(access, "table", "rows", "out")) == ({"table", "rows"}, ["out"])
    assert access.index_of("table") == ("rows",) and access.index_of("out") == ()
    marks = _backend("marks_rows", rows=lambda s, b: _rows(gather_and_mark, s, b))
    with pytest.raises(StageWriteError) as caught:
        audit(marks, M.DECODE, cfg=CFG, batch_sizes=[2])
    assert "its argument(s) table (" in caught.value.why and "tt.store, at addresses computed from rows)" in caught.value.why


# -- a pointer cast of the kernel's own argument (SGLang's cache_move) ----------------------------
@triton.jit
def store_rows(src_ptr, dst_ptr, loc_ptr, ROW_BYTES: tl.constexpr):
    """``dst[loc[r]] = src[r]``, row by row as bytes: SGLang's ``cache_move`` kernels cast their
    own pointer arguments to ``uint8`` pointers."""
    r = tl.program_id(0)
    loc = tl.load(loc_ptr + r).to(tl.int64)
    i = tl.arange(0, ROW_BYTES)
    src = tl.cast(src_ptr, tl.pointer_type(tl.uint8))
    dst = dst_ptr.to(tl.pointer_type(tl.uint8))
    tl.store(dst + loc * ROW_BYTES + i, tl.load(src + r * ROW_BYTES + i))


@triton.jit
def store_rows_at_address(src_ptr, addresses, loc_ptr, ROW_BYTES: tl.constexpr):
    """The same copy into a buffer whose address is loaded from memory (SGLang's
    ``copy_all_layer_kv_cache_tiled``): any memory at all."""
    r = tl.program_id(0)
    loc = tl.load(loc_ptr + r).to(tl.int64)
    i = tl.arange(0, ROW_BYTES)
    dst = tl.load(addresses).to(tl.pointer_type(tl.uint8))
    src = tl.cast(src_ptr, tl.pointer_type(tl.uint8))
    tl.store(dst + loc * ROW_BYTES + i, tl.load(src + r * ROW_BYTES + i))


def _store_kv(kernel):
    def store(pools, layer, loc, k, v):
        for name, new in (("k_cache", k), ("v_cache", v)):
            cache = pools[name].select(0, layer)
            row = cache[0].numel() * cache.element_size()
            target = torch.tensor([cache.data_ptr()]) if kernel is store_rows_at_address else cache
            kernel[(new.shape[0],)](new.contiguous(), target, loc, ROW_BYTES=row)
    return store


def _moving(name, kernel):
    effect = ReadEffect.of({"req_to_token": IN, "seq_lens": IN})

    def prep(mode, shared, batch, meta):
        return {"kv_lens": kv_lens(shared, batch), "kv_indices": _rows(gather_rows, shared, batch)}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        _store_kv(kernel)(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    return leaf(name, attend, prepare_in_graph=prep, declare={M.DECODE: effect})


def test_a_pointer_cast_of_an_argument_stays_within_it_and_a_loaded_address_is_unbounded():
    src, dst, loc = torch.arange(8, dtype=torch.int32).view(2, 4), torch.zeros(4, 4, dtype=torch.int32), torch.tensor([3, 1])
    access = _access(store_rows, src, dst, loc, 16)
    assert (access.unbounded, _tensors(access, "src_ptr", "dst_ptr", "loc_ptr")) == ("", ["dst_ptr"])
    assert "pointer_type" in source_access(store_rows).unbounded  # the source walk cannot tell a pointer from an int
    loaded = _access(store_rows_at_address, src, torch.tensor([dst.data_ptr()]), loc, 16)
    assert "tt.int_to_ptr" in loaded.unbounded and "test_kernel_ir.py" in loaded.unbounded
    # watched, it runs as the kernel does: the rows land where they do unwatched
    with ReadObserver({"req_to_token": torch.zeros(1)}):
        store_rows[(2,)](src, dst, loc, ROW_BYTES=16)
    assert torch.equal(dst[3], src[0]) and torch.equal(dst[1], src[1]) and dst[0].eq(0).all()


def test_a_backend_moving_kv_rows_with_a_cast_pointer_is_accepted_and_runs_as_the_serial_run(dev):
    assert _verify(_moving("casts", store_rows), dev).unwrap()  # logits bit-identical to the serial run


def test_the_same_backend_through_an_address_loaded_from_memory_is_refused():
    with pytest.raises(UnboundedKernelError, match="'store_rows_at_address' makes an address from an integer"):
        audit(_moving("loads_address", store_rows_at_address), M.DECODE, cfg=CFG, batch_sizes=[2])


@pytest.mark.slow  # imports SGLang's modules: most of a minute on a loaded machine
def test_sglangs_cache_move_kernel_is_bounded_by_its_arguments():
    from tests.engine.sglang_standins import import_sglang

    modules, why = import_sglang()
    if not modules:
        pytest.skip(why)
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled, set_kv_buffer_prefix_valid_tiled

    k = torch.zeros(8, 64, dtype=torch.bfloat16)
    i = torch.zeros(4, dtype=torch.int64)
    access = _access(set_kv_buffer_prefix_valid_tiled, k, k, k.clone(), k.clone(), i, i, 128, 128, 128, 128, 4,
                     ROW_BYTES=128, BYTES_PER_TILE=128)
    assert access.unbounded == ""
    assert _tensors(access, "src_k_ptr", "src_v_ptr", "dst_k_ptr", "dst_v_ptr", "loc_2d_ptr", "commit_len_ptr") == [
        "dst_k_ptr", "dst_v_ptr"]
    every_layer = _access(copy_all_layer_kv_cache_tiled, i, i, i, i, 4, 4, BYTES_PER_TILE=128)
    assert "tt.int_to_ptr" in every_layer.unbounded  # its buffers' addresses are data: still refused


# -- failing closed, in an audit ------------------------------------------------------------------
SCALE = 1  # a plain global: triton's interpreter reads it, its compiler refuses it


@triton.jit
def _gather_scaled(table, rows, out, W: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(rows + b).to(tl.int64)
    i = tl.arange(0, W)
    tl.store(out + b * W + i, tl.load(table + r * W + i) * SCALE)


def test_a_kernel_whose_ir_cannot_be_built_is_refused_as_a_write_of_what_it_reads():
    table = torch.arange(32, dtype=torch.int32).view(2, 16)
    out = torch.zeros(2, 16, dtype=torch.int32)
    _gather_scaled[(2,)](table, torch.tensor([1, 0]), out, W=16)  # unwatched it runs: only the analysis fails
    assert torch.equal(out, table.flip(0))
    scaled = _backend("scaled", rows=lambda s, b: _rows(_gather_scaled, s, b))
    with pytest.raises(StageWriteError) as caught:
        audit(scaled, M.DECODE, cfg=CFG, batch_sizes=[2])
    assert caught.value.buffer == "req_to_token" and caught.value.node == "_gather_scaled"
    assert "its IR cannot be built" in caught.value.why and "SCALE" in caught.value.why


def test_without_triton_s_front_end_the_source_walk_decides(monkeypatch):
    monkeypatch.setattr(_kernel_ir, "frontend_missing", lambda: "triton's front end cannot be imported (a test)")
    access = kernel_access(gather_rows, dict(table=X, rows=X, out=X, W=8))
    assert access.basis == FROM_SOURCE and "out" in access.writes


# -- triton's interpreter leaves the language patched ----------------------------------------------
@triton.jit
def _calls_helper_of_another_module(src, dst, W: tl.constexpr):
    kernel_helpers.store_row(dst, tl.load(src + tl.arange(0, W)), W)


def test_a_launch_whose_helper_patches_the_language_leaves_the_ir_buildable():
    assert see_launches()
    dst = torch.zeros(16)
    _calls_helper_of_another_module[(1,)](X, dst, W=16)
    assert torch.equal(dst, X)
    # a kernel not analysed before: its IR is built after the launch
    assert _tensors(_access(_gather_scaled_twin, X.view(2, 8), torch.tensor([0, 1]), X.clone(), 8), "out") == ["out"]


@triton.jit
def _gather_scaled_twin(table, rows, out, W: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(rows + b).to(tl.int64)
    tl.store(out + b * W + tl.arange(0, W), tl.load(table + r * W + tl.arange(0, W)))


# -- the source walk against the IR, on every kernel of SGLang's tree and of these tests ------------
#: Where the source walk finds less than the IR, kernel by kernel (what a name list cannot see).
SOURCE_MISSES = [["tests.core.test_kernel_ir", "_functional_descriptor", ["out"]],
                 ["tests.core.test_kernel_ir", "_starred", ["dst"]]]
#: Unbounded by the IR only: SGLang's symmetric-memory kernels run inline assembly not marked pure.
IR_ONLY_UNBOUNDED = [["sglang.srt.distributed.device_communicators.triton_symm_mem_ag", name] for name in
                     ("_multimem_st_128", "_send_signal", "_send_signal_release", "_sync_threads", "_wait_signal",
                      "_wait_signal_acquire")]
#: Unbounded by the source walk only: a pointer argument cast to another pointer type.
SOURCE_ONLY_UNBOUNDED = [["sglang.kernels.ops.attention.flash_mla_sm120", "_page_split_kernel"],
                         ["tests.core.test_kernel_ir", "store_rows"]]


#: The census runs in this many processes, each over one run of the modules. One: each process pays
#: torch's, triton's and SGLang's imports and the read of SGLang's tree again, which is most of what
#: a second shard saved a test runner on two cores.
CENSUS_SHARDS = 1


@pytest.mark.slow  # imports SGLang's ~400 kernel modules and builds ~650 IRs, a shard of them per process
@pytest.mark.parametrize("shard", range(CENSUS_SHARDS))
def test_the_source_walk_finds_what_the_ir_finds_on_every_kernel_but_those_recorded(shard):
    import json
    import os
    import pathlib
    import subprocess
    import sys

    from tests.engine.sglang_standins import import_sglang

    modules, why = import_sglang()
    if not modules:
        pytest.skip(why)
    root = pathlib.Path(__file__).resolve().parents[2]  # this checkout's readfence and tests, in a process of its own
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "tests.core.kernel_census", "--json", "--shard", f"{shard}/{CENSUS_SHARDS}"],
                         capture_output=True, text=True, timeout=2400, check=False, cwd=root, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    # 618 of SGLang's 970 kernels build with arguments made up (tests/core/kernel_census.py): each
    # shard builds its share of the 550 the whole census must
    assert found["sglang_built"] >= 550 // CENSUS_SHARDS, found
    recorded = [*SOURCE_MISSES, *IR_ONLY_UNBOUNDED, *SOURCE_ONLY_UNBOUNDED]
    assert {row[0] for row in recorded} <= set(found["every"])  # every recorded kernel's module is in a shard

    def mine(rows):
        return [row for row in rows if row[0] in found["modules"]]

    assert found["source_misses"] == mine(SOURCE_MISSES)
    assert found["ir_only_unbounded"] == mine(IR_ONLY_UNBOUNDED)
    assert found["source_only_unbounded"] == mine(SOURCE_ONLY_UNBOUNDED)


# -- the IR's table is keyed by what the kernel's Python can read --------------------------------
@triton.jit
def _store_to_first(a, b, x, W: tl.constexpr):
    tl.store(a + tl.arange(0, W), x)


@triton.jit
def _store_to_second(a, b, x, W: tl.constexpr):
    tl.store(b + tl.arange(0, W), x)


_STORE = _store_to_first


@triton.jit
def _through_global_helper(src, dst, W: tl.constexpr):
    _STORE(dst, src, tl.load(src + tl.arange(0, W)), W)


@triton.jit
def _one_helper_down(a, b, x, W: tl.constexpr):
    _STORE(a, b, x, W)


@triton.jit
def _through_two_helpers(src, dst, W: tl.constexpr):
    _one_helper_down(dst, src, tl.load(src + tl.arange(0, W)), W)


_WRITE_BACK = tl.constexpr(0)


@triton.jit
def _writes_back_when_set(src, dst, W: tl.constexpr):
    x = tl.load(src + tl.arange(0, W))
    tl.store(dst + tl.arange(0, W), x)
    if _WRITE_BACK:
        tl.store(src + tl.arange(0, W), x)


@pytest.mark.parametrize("kernel", [_through_global_helper, _through_two_helpers], ids=["helper", "helper's helper"])
def test_a_helper_rebound_in_a_kernel_s_globals_is_built_anew(monkeypatch, kernel):
    # the same kernel object, the same specialization: triton would compile it again (its globals
    # changed), and the table's answer must change with it, both ways
    out = torch.zeros(16)
    assert _tensors(_access(kernel, X, out, W=16), "src", "dst") == ["dst"]
    monkeypatch.setitem(globals(), "_STORE", _store_to_second)
    assert _tensors(_access(kernel, X, out, W=16), "src", "dst") == ["src"]
    monkeypatch.setitem(globals(), "_STORE", _store_to_first)
    assert _tensors(_access(kernel, X, out, W=16), "src", "dst") == ["dst"]


def test_a_constant_global_a_kernel_is_compiled_with_changes_its_ir_s_answer(monkeypatch):
    out = torch.zeros(16)
    assert _tensors(_access(_writes_back_when_set, X, out, W=16), "src", "dst") == ["dst"]
    monkeypatch.setitem(globals(), "_WRITE_BACK", tl.constexpr(1))
    assert _tensors(_access(_writes_back_when_set, X, out, W=16), "src", "dst") == ["dst", "src"]


@triton.jit
def _gather_then_store(table, rows, out, W: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(rows + b).to(tl.int64)
    i = tl.arange(0, W)
    _STORE(out + b * W + i, table + r * W + i, tl.load(table + r * W + i), 1)


@triton.jit
def _store_both(a, b, x, W: tl.constexpr):
    tl.store(a, x)
    tl.store(b, x)  # writes back what it read: no byte changes, still a write of the table


_GATHER = _gather_then_store


def _gather_rows_by_global(shared, batch):
    return _rows(_GATHER, shared, batch)


#: One backend object throughout: its traces are cached (a new closure would be new code).
_REBOUND = _backend("rebound", rows=_gather_rows_by_global)


def _audit_rebound():
    return audit(_REBOUND, M.DECODE, cfg=CFG, batch_sizes=[2])


def test_a_helper_rebound_in_a_launched_kernel_s_globals_changes_the_trace_and_the_audit(monkeypatch):
    # the backend's code and the kernel object are unchanged: only the kernel's helper is rebound,
    # to one that writes the page table; the trace must be made again (its launch writes the
    # table), the audit refuse it, and the harmless helper be accepted again once it is back
    program = trace(_REBOUND, M.DECODE, cfg=CFG, batch_size=2)
    assert trace(_REBOUND, M.DECODE, cfg=CFG, batch_size=2) is program  # cached while nothing changed
    assert _audit_rebound().unwrap()
    monkeypatch.setitem(globals(), "_STORE", _store_both)
    with pytest.raises(StageWriteError, match="'_gather_then_store' may store through its argument"):
        trace(_REBOUND, M.DECODE, cfg=CFG, batch_size=2)
    with pytest.raises(StageWriteError, match="may store through its argument"):
        _audit_rebound()
    monkeypatch.setitem(globals(), "_STORE", _store_to_first)
    assert _audit_rebound().unwrap()


def test_a_kernel_compiled_again_from_other_source_under_the_same_name_changes_the_audit(monkeypatch, tmp_path):
    # as a module reloaded: a new kernel object of the same name where the backend's code reads it
    assert _audit_rebound().unwrap()
    source = inspect.getsource(_gather_then_store.fn).replace("_STORE(", "_store_both(")
    path = tmp_path / "reloaded_kernels.py"
    path.write_text("import triton\nimport triton.language as tl\n"
                    "from tests.core.test_kernel_ir import _store_both\n\n\n" + source)
    spec = importlib.util.spec_from_file_location("reloaded_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(globals(), "_GATHER", module._gather_then_store)
    with pytest.raises(StageWriteError, match="may store through its argument"):
        _audit_rebound()
