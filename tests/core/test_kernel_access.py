"""What a triton kernel may store to, read from its source: each way a store's target can be spelled.

No kernel runs here (the analysis reads source): these are fast, and skip only where triton is absent.
"""

from __future__ import annotations

import pytest

from readfence.core.tracing._kernel_access import source_access as kernel_access
from tests.conftest import NO_TRITON, TRITON

if not TRITON:
    pytest.skip(NO_TRITON, allow_module_level=True)

import triton
import triton.language as tl


def _tensors(kernel, *names):
    # the analysis lists integers that form an address too: a launch maps only tensors
    return sorted(kernel_access(kernel).writes & set(names))


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


def test_a_store_writes_its_pointers_argument_and_a_load_does_not():
    access = kernel_access(_copy)
    assert _tensors(_copy, "src", "dst") == ["dst"]
    assert access.site("dst").endswith("tl.store") and "test_kernel_access.py" in access.site("dst")
    assert access.unbounded == ""


@triton.jit
def _scatter(values, index, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    where = tl.load(index + i)  # a loaded offset: data, not an address
    tl.store(out + where, tl.load(values + i))


def test_an_offset_loaded_from_memory_is_data_not_an_address():
    assert _tensors(_scatter, "values", "index", "out") == ["out"]


@triton.jit
def _chosen(a, b, src, which, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    if which > 0:
        dst = a
    else:
        dst = b
    tl.store(dst + i, tl.load(src + i))


@triton.jit
def _selected(a, b, src, which, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(tl.where(which > 0, a, b) + i, tl.load(src + i))


@pytest.mark.parametrize("kernel", [_chosen, _selected], ids=["branch", "where"])
def test_a_target_chosen_at_run_time_writes_every_candidate(kernel):
    assert _tensors(kernel, "a", "b", "src") == ["a", "b"]


@triton.jit
def _store_through(ptr, x, BLOCK: tl.constexpr):
    tl.store(ptr + tl.arange(0, BLOCK), x)


@triton.jit
def _calls_helper(src, dst, BLOCK: tl.constexpr):
    x = tl.load(src + tl.arange(0, BLOCK))
    _store_through(dst, x, BLOCK)


@triton.jit
def _calls_helper_by_keyword(src, dst, BLOCK: tl.constexpr):
    x = tl.load(src + tl.arange(0, BLOCK))
    _store_through(x=x, ptr=src, BLOCK=BLOCK)


def test_a_store_in_a_jit_helper_writes_the_argument_given_for_its_pointer():
    assert _tensors(_calls_helper, "src", "dst") == ["dst"]
    assert "_store_through" in kernel_access(_calls_helper).site("dst")
    assert _tensors(_calls_helper_by_keyword, "src", "dst") == ["src"]


@triton.jit
def _counts(counter, src, BLOCK: tl.constexpr):
    tl.atomic_add(counter, tl.sum(tl.load(src + tl.arange(0, BLOCK))))


@triton.jit
def _swaps(lock, flag):
    while tl.atomic_cas(lock, 0, 1) != 0:
        pass
    tl.atomic_xchg(lock, tl.load(flag))


@triton.jit
def _descriptor(src, out, BLOCK: tl.constexpr):
    desc = tl.make_tensor_descriptor(out, shape=[BLOCK], strides=[1], block_shape=[BLOCK])
    desc.store([0], tl.load(src + tl.arange(0, BLOCK)))


def test_a_descriptors_store_method_writes_its_base():
    assert _tensors(_descriptor, "src", "out") == ["out"]


def test_atomics_write_their_pointer():
    assert _tensors(_counts, "counter", "src") == ["counter"]
    assert _tensors(_swaps, "lock", "flag") == ["lock"]


@triton.jit
def _aliased(src, dst, BLOCK: tl.constexpr):
    put = tl.store
    put(dst + tl.arange(0, BLOCK), tl.load(src + tl.arange(0, BLOCK)))


@triton.jit
def _passes_to_param(src, dst, MOD: tl.constexpr):
    if MOD is not None:
        MOD(dst)


def test_a_call_the_analysis_cannot_follow_writes_what_its_arguments_point_to():
    assert _tensors(_aliased, "src", "dst") == ["dst"]  # a local alias of tl.store: unknown, conservative
    assert "cannot follow" in kernel_access(_aliased).site("dst")
    assert _tensors(_passes_to_param, "src", "dst") == ["dst"]
    # given at the launch: None is a branch that does not run; a jit function is followed
    assert kernel_access(_passes_to_param, {"MOD": None}).writes == frozenset()
    assert kernel_access(_passes_to_param, {"MOD": _store_through}).writes >= {"dst"}


@triton.jit
def _from_integer(addresses, x):
    p = tl.load(addresses).to(tl.pointer_type(tl.float32))
    tl.store(p, x)


def test_an_address_made_from_an_integer_is_unbounded():
    access = kernel_access(_from_integer)
    assert "pointer_type" in access.unbounded and "test_kernel_access.py" in access.unbounded


def test_sglangs_page_table_kernel_writes_only_its_output():
    from tests.engine.sglang_standins import import_sglang

    modules, why = import_sglang()
    if not modules:
        pytest.skip(why)
    from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton as k

    tensors = ("req_to_token_ptr", "req_pool_indices_ptr", "page_kernel_lens_ptr", "kv_indptr", "kv_start_idx",
               "kv_indices_ptr", "token_mapping")
    assert _tensors(k, *tensors) == ["kv_indices_ptr"]


_POINTERS = tl.pointer_type(tl.int32)


@triton.jit
def _through_global(addresses, out):
    tl.store(out, tl.load(tl.load(addresses).to(_POINTERS)))


@triton.jit
def _through_parameter(addresses, out, PTR: tl.constexpr):
    tl.store(out, tl.load(tl.load(addresses).to(PTR)))


def test_a_pointer_type_held_by_a_global_or_handed_to_a_parameter_is_unbounded():
    assert "_POINTERS" in kernel_access(_through_global).unbounded
    assert kernel_access(_through_parameter).unbounded == ""  # not known until the launch gives it
    assert "PTR" in kernel_access(_through_parameter, {"PTR": tl.pointer_type(tl.int32)}).unbounded
