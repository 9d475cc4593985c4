"""The tensor-parallel shards: each rank's part of the same seeded model, which together make it up."""

from __future__ import annotations

import pytest
import torch

from readfence.core import ForwardMode, ModelConfig, TensorParallel
from readfence.core.internal import example_step, init_params, make_pools
from tests.conftest import DEFAULT as CFG


def _ranks(cfg: ModelConfig = CFG, size: int = 2) -> list[ModelConfig]:
    return [ModelConfig(tp=TensorParallel(size=size, rank=r, group="tp")) for r in range(size)]


def test_the_weight_shards_make_up_the_whole_model():
    full = init_params(CFG)
    parts = [init_params(c) for c in _ranks()]
    heads, dim, hidden = CFG.heads, CFG.head_dim, CFG.hidden
    for layer in range(CFG.layers):
        pre = f"layers.{layer}."
        qkv = torch.cat([p[pre + "wqkv"].view(hidden, 3, heads // 2, dim) for p in parts], dim=2)
        assert torch.equal(qkv.reshape(hidden, -1), full[pre + "wqkv"])
        assert torch.equal(torch.cat([p[pre + "wo"] for p in parts], 0), full[pre + "wo"])
        assert torch.equal(torch.cat([p[pre + "w_up"] for p in parts], 1), full[pre + "w_up"])
        assert torch.equal(torch.cat([p[pre + "w_down"] for p in parts], 0), full[pre + "w_down"])
    for name in ("embed", "final_norm", "lm_head", "layers.0.attn_norm"):
        assert all(torch.equal(p[name], full[name]) for p in parts)  # replicated


def test_the_cache_shards_hold_each_rank_its_heads_of_the_same_history():
    full = make_pools(CFG, seed=3)
    parts = [make_pools(c, seed=3) for c in _ranks()]
    for name, t in full.items():
        assert torch.equal(torch.cat([p[name] for p in parts], dim=2), t), name
        assert all(p[name].is_contiguous() for p in parts)


def test_the_step_inputs_and_shared_state_are_the_same_on_every_rank():
    whole = example_step(CFG, ForwardMode.DECODE, 2)
    for cfg in _ranks():
        step = example_step(cfg, ForwardMode.DECODE, 2)
        assert all(torch.equal(step.shared[b], whole.shared[b]) for b in whole.shared)
        assert all(torch.equal(step.batch[k], whole.batch[k]) for k in whole.batch)
        assert step.pools["k_cache"].shape[2] == cfg.local_heads == 1 and cfg.local_mlp == 32


def test_one_rank_is_the_unsharded_model_exactly():
    assert ModelConfig().tp == TensorParallel() and ModelConfig().local_heads == CFG.heads
    full, one = init_params(CFG), init_params(ModelConfig(tp=TensorParallel(size=1, rank=0, group="")))
    assert all(torch.equal(full[k], one[k]) for k in full)


def test_a_sharding_the_model_cannot_take_is_named():
    with pytest.raises(ValueError, match="ModelConfig.heads=2 cannot be sharded over 4 tensor-parallel ranks"):
        ModelConfig(tp=TensorParallel(size=4, rank=0, group="tp"))
    with pytest.raises(ValueError, match="ModelConfig.mlp=6 cannot be sharded over 4"):
        ModelConfig(heads=4, mlp=6, tp=TensorParallel(size=4, rank=0, group="tp"))
    with pytest.raises(ValueError, match="TensorParallel.group must name the ranks' process group"):
        TensorParallel(size=2, rank=0, group="")


def test_a_rank_outside_the_group_is_named():
    with pytest.raises(ValueError, match=r"TensorParallel.rank must be an int in 0..1 \(one of 2 ranks\), got -1"):
        TensorParallel(size=2, rank=-1, group="tp")
    with pytest.raises(TypeError, match="tp"):
        ModelConfig(tp=2)
