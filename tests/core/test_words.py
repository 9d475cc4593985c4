"""Stage outputs of the dtypes torch has no kernels for (bits, sub-byte integers, fp4, complex32):
copied across the graph's boundary and compared by the validation as their words, bit for bit."""

from __future__ import annotations

import pytest
import torch

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, NotGraphSafe
from readfence.core.tracing import same_values
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, lower, make_state, run_overlapped, run_serial
from tests.conftest import SMALL as CFG

M = ForwardMode.DECODE
#: dtypes torch neither compares nor fills, and one it fills but does not compare
ODD = ["bits8", "float4_e2m1fn_x2", "bits16", "uint4", "complex32"]


def _encode(lens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.complex32:
        return lens.float().to(torch.complex32)
    words = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    return lens.to(words).view(dtype)


def _decode(x: torch.Tensor) -> torch.Tensor:
    if x.dtype is torch.complex32:
        return x.to(torch.complex64).real
    return x.view({1: torch.uint8, 2: torch.int16}[x.dtype.itemsize]).float()


def _odd(name: str, where: str, *, baked: bool = False):
    """A paged leaf whose ``where`` stage hands the body the lengths as ``name``'s dtype (``baked``:
    scaled by a Python int taken from the data, which a captured graph freezes)."""
    dtype = getattr(torch, name)

    def encoded(shared, batch):
        lens = shared["seq_lens"].index_select(0, batch["req_pool_indices"])
        return _encode(lens * (lens[lens > 3].numel() + 1 if baked else 1), dtype)  # a count the capture bakes

    def out(mode, shared, batch):
        return {**page_meta(shared, batch), **({"odd": encoded(shared, batch)} if where == "out" else {})}

    def prep(mode, shared, batch, meta):
        return {"odd": encoded(shared, batch)} if where == "in" else {}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        o = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return o * (1 + 1e-3 * _decode(meta["odd"]).sum())

    effect = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                            "seq_lens": ReadEnd.IN_REPLAY if where == "in" else ReadEnd.PRE_REPLAY})
    return leaf(f"odd_{name}_{where}{'_baked' if baked else ''}", attend, prepare_out_graph=out,
                prepare_in_graph=prep, declare={M: effect})


@pytest.mark.parametrize("where", ["in", "out"])
@pytest.mark.parametrize("name", ODD)
def test_a_stage_may_return_a_dtype_torch_has_no_kernels_for(name, where) -> None:
    serial = run_serial(_odd(name, where), M, steps=4, batch_size=2, cfg=CFG, state=make_state(CFG))
    with CpuDevice(timeout=60) as dev:
        for policy in (Policy.COARSE, Policy.EXACT):
            run = run_overlapped(_odd(name, where), M, steps=4, policy=policy, device=dev, batch_size=2, cfg=CFG,
                                 state=make_state(CFG))
            assert run.matches(serial) and run.violations == (), (name, where, policy)


@pytest.mark.parametrize("name", ["bits8", "float4_e2m1fn_x2", "complex32"])
def test_a_value_baked_into_such_an_output_is_still_refused(name, monkeypatch) -> None:
    with CpuDevice(timeout=60) as dev:
        with pytest.raises(NotGraphSafe, match="prepare_in_graph"):
            lower(_odd(name, "in", baked=True), M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG)
        # the check sharing nothing with the validation: without it, the loop differs from serial
        import readfence.graph.lowering._lower as lowering

        monkeypatch.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)
        run = run_overlapped(_odd(name, "in", baked=True), M, steps=4, policy=Policy.COARSE, device=dev,
                             batch_size=2, cfg=CFG, state=make_state(CFG))
    assert not run.matches(run_serial(_odd(name, "in", baked=True), M, steps=4, batch_size=2, cfg=CFG,
                                      state=make_state(CFG)))


@pytest.mark.parametrize("name", ODD)
def test_such_tensors_compare_bit_for_bit(name) -> None:
    dtype = getattr(torch, name)
    a = _encode(torch.arange(4), dtype)
    b = _encode(torch.tensor([0, 1, 2, 5]), dtype)
    assert same_values(a, _encode(torch.arange(4), dtype)) and not same_values(a, b)


@pytest.mark.parametrize("name", ["bits8", "float4_e2m1fn_x2"])
def test_an_empty_tensor_of_such_a_dtype_crosses_into_the_graph(name) -> None:
    dtype = getattr(torch, name)

    def out(mode, shared, batch):
        return {**page_meta(shared, batch), "none": torch.zeros(0, dtype=torch.uint8).view(dtype)}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + meta["none"].numel()

    backend = leaf(f"empty_{name}", attend, prepare_out_graph=out,
                   declare={M: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})})
    serial = run_serial(backend, M, steps=3, batch_size=2, cfg=CFG, state=make_state(CFG))
    with CpuDevice(timeout=60) as dev:
        run = run_overlapped(backend, M, steps=3, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                             state=make_state(CFG))
    assert run.matches(serial)


@pytest.mark.parametrize("name", ["bits8", "float4_e2m1fn_x2"])
def test_a_stage_that_allocates_such_a_dtype_itself_is_validated_without_the_fill(name, monkeypatch) -> None:
    # the stage's own .contiguous() of a transposed tensor allocates the dtype, which torch cannot
    # fill: the state is compared without the fixed fill, and a baked count is still refused there
    dtype = getattr(torch, name)

    def backend(baked: bool):
        def prep(mode, shared, batch, meta):
            lens = shared["seq_lens"].index_select(0, batch["req_pool_indices"])
            lens = lens * (lens[lens > 3].numel() + 1 if baked else 1)
            pair = torch.stack([lens, lens + 1]).to(torch.uint8).view(dtype)
            return {"odd": pair.t().contiguous()}

        def attend(mode, layer, q, k, v, pools, shared, batch, meta):
            store_kv(pools, layer, batch["out_cache_loc"], k, v)
            o = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
            return o * (1 + 1e-3 * meta["odd"].view(torch.uint8).float().sum())

        return leaf(f"own_{name}_{int(baked)}", attend, prepare_out_graph=lambda mode, s, b: page_meta(s, b),
                    prepare_in_graph=prep, declare={M: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                                      "seq_lens": ReadEnd.IN_REPLAY})})

    serial = run_serial(backend(False), M, steps=4, batch_size=2, cfg=CFG, state=make_state(CFG))
    with CpuDevice(timeout=60) as dev:
        run = run_overlapped(backend(False), M, steps=4, policy=Policy.COARSE, device=dev, batch_size=2, cfg=CFG,
                             state=make_state(CFG))
        assert run.matches(serial)
        with pytest.raises(NotGraphSafe, match="prepare_in_graph"):
            lower(backend(True), M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG)
