"""Each reference leaf's attention equals an independent dense reference (see backend_refs).

Tolerance: float32 kernel vs float64 python-loop reference, atol 2e-5, rtol 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import (
    deepseek_v4,
    dense,
    leaf,
    linear,
    paged,
    softmax_attention,
    sparse,
    trtllm_mha,
)
from readfence.core import ForwardMode
from readfence.core.internal import example_step, prepare
from tests.conftest import DEFAULT as CFG

from .backend_refs import ATOL, RTOL, linear_reference, softmax_reference

WORK_MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.EXTEND]


def _qkv(step, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (step.num_tokens, CFG.heads, CFG.head_dim)
    return tuple(torch.randn(shape, generator=g) for _ in range(3))


def _run(backend, mode, layer, batch_size=8, seed=0):
    step = example_step(CFG, mode, batch_size, seed=seed)
    before = step.clone()
    q, k, v = _qkv(step, seed + 100)
    meta = prepare(backend, mode, step.shared, step.batch)
    out = backend.attend(mode, layer, q, k, v, step.pools, step.shared, step.batch, meta)
    for name, t in before.shared.items():
        assert torch.equal(step.shared[name], t), f"{backend} wrote shared buffer {name}"
    return before, step, (q, k, v), out


SOFTMAX_CASES = [
    ("paged", paged(), {}),
    ("deepseek_v4", deepseek_v4(), {}),
    ("deepseek_v4_dspark", deepseek_v4(dspark=True), {}),
    ("dense", dense(), {}),
    ("sparse", sparse(top_k=2, page_size=8), {"top_k": 2, "page_size": 8}),
    ("sparse_k1", sparse(top_k=1, page_size=4), {"top_k": 1, "page_size": 4}),
]


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
@pytest.mark.parametrize("name,backend,kw", SOFTMAX_CASES, ids=[c[0] for c in SOFTMAX_CASES])
def test_softmax_leaf_matches_dense_reference(name, backend, kw, mode):
    before, after, (q, k, v), out = _run(backend, mode, layer=1, seed=3)
    ref = softmax_reference(before, mode, 1, q, k, v, **kw)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    loc = before.batch["out_cache_loc"]
    assert torch.equal(after.pools["k_cache"][1, loc], k), "new keys not stored at out_cache_loc"
    assert torch.equal(after.pools["v_cache"][1, loc], v)


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
@pytest.mark.parametrize("layer", [0, 1])
def test_trtllm_full_and_sliding_layers_match_reference(mode, layer):
    window = 4
    before, after, (q, k, v), out = _run(trtllm_mha(window=window), mode, layer, seed=1)
    sliding = layer % 2 == 1
    ref = softmax_reference(before, mode, layer, q, k, v, window=window if sliding else None, swa=sliding)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    loc = before.batch["out_cache_loc"]
    if sliding:
        swa_loc = before.shared["swa_map"][loc].long()
        assert torch.equal(after.pools["swa_k_cache"][layer, swa_loc], k)
    else:
        assert torch.equal(after.pools["k_cache"][layer, loc], k)


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
def test_linear_matches_closed_form_and_updates_state(mode):
    decay = 0.8
    before, after, (q, k, v), out = _run(linear(decay=decay), mode, layer=2, seed=2)
    ref, finals = linear_reference(before, mode, 2, q, k, v, decay=decay)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    for slot, state in finals.items():
        torch.testing.assert_close(after.pools["state"][2, slot].double(), state, atol=ATOL, rtol=RTOL)


def test_window_and_sparsity_actually_bite():
    """The options change outputs (else the tests above could not tell them apart)."""
    mode = ForwardMode.DECODE
    _, _, _, full = _run(trtllm_mha(window=64), mode, 1, seed=1)
    _, _, _, narrow = _run(trtllm_mha(window=4), mode, 1, seed=1)
    assert not torch.allclose(full, narrow)
    _, _, _, dense_out = _run(paged(), mode, 1, seed=3)
    _, _, _, sparse_out = _run(sparse(top_k=1, page_size=4), mode, 1, seed=3)
    assert not torch.allclose(dense_out, sparse_out)


def test_reference_catches_a_kernel_that_forgets_the_new_tokens():
    """A kernel attending to the stale cache (no store) disagrees with the reference."""
    mode = ForwardMode.TARGET_VERIFY

    def prep(mode, shared, batch, meta):
        from readfence.backends import page_meta
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    forgetful = leaf("forgetful", attend, prepare_in_graph=prep)
    before, _, (q, k, v), out = _run(forgetful, mode, 0)
    ref = softmax_reference(before, mode, 0, q, k, v)
    assert not torch.allclose(out.double(), ref, atol=1e-3)


@pytest.mark.parametrize("backend", [paged(), trtllm_mha(), deepseek_v4(), linear(), sparse(), dense()], ids=str)
def test_idle_step_is_empty_and_reads_nothing(backend):
    step = example_step(CFG, ForwardMode.IDLE, 4)
    assert step.num_tokens == 0
    assert backend.prepare_out_graph(ForwardMode.IDLE, step.shared, step.batch) == {}
    assert backend.prepare_in_graph(ForwardMode.IDLE, step.shared, step.batch, {}) == {}
    q = torch.zeros(0, CFG.heads, CFG.head_dim)
    out = backend.attend(ForwardMode.IDLE, 0, q, q, q, step.pools, step.shared, step.batch, {})
    assert out.shape == q.shape
