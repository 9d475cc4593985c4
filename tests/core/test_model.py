"""The step program: a consistent example step, the tiny decoder, the serial eager reference."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from readfence.backends import REFERENCE_LEAVES, deepseek_v4, hybrid_linear, linear, paged, tbo, trtllm_mha
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig, run_step
from readfence.core.internal import example_step, forward, prepare, tokens_per_request
from tests.conftest import DEFAULT as CFG
from tests.conftest import TWO_LAYERS

M = ForwardMode


@pytest.mark.parametrize("mode", [m for m in M if m is not M.IDLE], ids=str)
def test_example_step_is_consistent(mode):
    step = example_step(CFG, mode, 6, seed=3)
    n = tokens_per_request(mode)
    shared, batch = step.shared, step.batch
    assert set(shared) == set(SHARED_BUFFERS)
    assert batch["input_ids"].shape == batch["positions"].shape == batch["out_cache_loc"].shape == (6 * n,)
    assert batch["req_pool_indices"].unique().numel() == 6
    assert shared["req_to_token"].unique().numel() == shared["req_to_token"].numel()  # distinct slots
    assert shared["swa_map"].unique().numel() == shared["swa_map"].numel()
    for t in range(6 * n):
        req = int(batch["req_pool_indices"][t // n])
        pos = int(batch["positions"][t])
        assert pos == int(shared["seq_lens"][req]) - n + t % n
        assert int(batch["out_cache_loc"][t]) == int(shared["req_to_token"][req, pos])
    assert int(shared["seq_lens"].max()) <= CFG.max_ctx
    assert batch["input_ids"].dtype == torch.int64 and shared["req_to_token"].dtype == torch.int32


def test_idle_is_the_empty_step():
    step = example_step(CFG, M.IDLE, 5)
    assert step.num_tokens == 0 and step.batch_size == 0
    for backend in (paged(), tbo(deepseek_v4(), paged(), linear())):
        logits = run_step(backend, M.IDLE, CFG, step.clone())
        assert logits.shape == (0, CFG.vocab)


@pytest.mark.parametrize("mode", list(M), ids=str)
@pytest.mark.parametrize("name", sorted(REFERENCE_LEAVES))
def test_run_step_never_writes_shared_and_is_deterministic(name, mode):
    backend = REFERENCE_LEAVES[name]()
    step = example_step(CFG, mode, 3)
    before = step.clone()
    logits = run_step(backend, mode, CFG, step)
    assert logits.shape == (step.num_tokens, CFG.vocab)
    assert torch.isfinite(logits).all()
    for buf in SHARED_BUFFERS:
        assert torch.equal(step.shared[buf], before.shared[buf]), f"{name} wrote {buf}"
    assert torch.equal(run_step(backend, mode, CFG, before.clone()), logits)


def test_run_step_writes_the_pools_and_the_next_step_sees_them():
    """Decode twice: the second step attends to the first step's keys through the cache."""
    step = example_step(CFG, M.DECODE, 2)
    fresh = step.clone()
    run_step(paged(), M.DECODE, CFG, step)
    loc = step.batch["out_cache_loc"]
    assert not torch.equal(step.pools["k_cache"][:, loc], fresh.pools["k_cache"][:, loc])
    # Poison the history of request 0's position 0 and the output changes: the cache is read.
    poisoned = fresh.clone()
    req = int(poisoned.batch["req_pool_indices"][0])
    slot = int(poisoned.shared["req_to_token"][req, 0])
    poisoned.pools["v_cache"][:, slot] += 10.0
    a = run_step(paged(), M.DECODE, CFG, fresh.clone())
    b = run_step(paged(), M.DECODE, CFG, poisoned)
    assert not torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_backends_change_the_output():
    step = example_step(CFG, M.TARGET_VERIFY, 3)
    outs = [run_step(b, M.TARGET_VERIFY, CFG, step.clone()) for b in (paged(), trtllm_mha(window=4), linear())]
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])


def test_read_effect_rejects_a_string_mode():
    with pytest.raises(TypeError, match="'decode'"):
        run_step(paged(), "decode", CFG, example_step(CFG, M.DECODE, 1))  # type: ignore[arg-type]


def test_config_validation():
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(heads=0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig(head_dim=3)
    with pytest.raises(ValueError, match="batch_size"):
        example_step(CFG, M.DECODE, CFG.max_reqs + 1)
    # the seed is drawn from, not validated by torch: named where it is given
    for seed in ("abc", 1.5, None, True, -1, 2**70):
        with pytest.raises(ValueError, match=r"^ModelConfig.seed must be an int in 0..2\*\*63-2, got "):
            ModelConfig(seed=seed)
    assert ModelConfig(seed=2**63 - 2).seed == 2**63 - 2


def _traced(backend, mode, step, cfg=CFG):
    def f(shared, batch, pools, params):
        meta = prepare(backend, mode, shared, batch)
        return forward(cfg, params, pools, shared, batch, meta, backend, mode)

    return make_fx(torch.func.functionalize(f, remove="mutations_and_views"))(
        step.shared, step.batch, step.pools, step.params)


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY, M.IDLE], ids=str)
def test_forward_traces_with_make_fx_and_functionalize(mode):
    # two layers: each child of the hybrid attends in one, and make_fx traces half the ops
    backend = hybrid_linear(trtllm_mha(), linear())
    step = example_step(TWO_LAYERS, mode, 2)
    graph = _traced(backend, mode, step.clone(), TWO_LAYERS)
    want = run_step(backend, mode, TWO_LAYERS, step.clone())
    work = step.clone()
    got = graph(work.shared, work.batch, work.pools, work.params)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_example_step_and_trace_under_fake_cuda():
    """The tracer builds CUDA plans on a CPU-only build inside FakeTensorMode."""
    with FakeTensorMode():
        step = example_step(CFG, M.TARGET_VERIFY, 2, device="cuda")
        assert step.shared["req_to_token"].device.type == "cuda"
        graph = _traced(tbo(deepseek_v4(), paged()), M.TARGET_VERIFY, step)
    assert any(n.op == "call_function" for n in graph.graph.nodes)


class _GeneratorDeviceRule(torch.overrides.TorchFunctionMode):
    """CUDA's rule, on any build: a factory given a generator must create on its device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen, device = kwargs.get("generator"), kwargs.get("device")
        if gen is not None and device is not None and torch.device(device).type != gen.device.type:
            raise RuntimeError(f"Expected a {torch.device(device).type!r} device type for generator "
                               f"but found {gen.device.type!r}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY], ids=str)
def test_state_for_another_device_is_drawn_on_the_cpu_generator_then_moved(mode):
    # The path that creates a CUDA step's weights, caches and token ids, on the meta device
    # (not CPU, present on every build): a CPU generator must never meet a foreign device.
    with _GeneratorDeviceRule():
        step = example_step(CFG, mode, 2, device="meta")
    assert {t.device.type for d in (step.shared, step.batch, step.pools, step.params) for t in d.values()} == {"meta"}


def test_example_steps_are_fresh_copies_of_the_seeded_draws():
    from readfence.core import _state

    cfg = ModelConfig(layers=2)
    first = example_step(cfg, M.DECODE, 2, seed=5)
    for group in (first.pools, first.params):
        for t in group.values():
            t.fill_(7.0)  # a step writes its pools; a careless caller its params
    again = example_step(cfg, M.DECODE, 2, seed=5)
    drawn = {**_state._make_pools(cfg, "cpu", 5), **_state._init_params(cfg, "cpu")}  # not kept: drawn anew
    assert set(drawn) == {*again.pools, *again.params}
    assert all(torch.equal(drawn[k], v) for k, v in {**again.pools, **again.params}.items())
    assert not any(v.eq(7.0).all() for v in again.pools.values())
    # another seed, another draw; under a fake mode nothing is kept (fake tensors come back)
    assert not torch.equal(example_step(cfg, M.DECODE, 2, seed=6).pools["k_cache"], again.pools["k_cache"])
    with FakeTensorMode():
        fake = example_step(cfg, M.DECODE, 2, seed=5)
    assert all(type(t) is not torch.Tensor for t in fake.pools.values())
