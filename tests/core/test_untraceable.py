"""Where tracing cannot follow, a clear answer: higher-order ops are traced, tensor subclasses
are refused naming backend, stage, key and line, never a crash from inside readfence."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import BODY, CapturedStateError, ForwardMode, StageOutputError, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, lower, run_overlapped, run_serial
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode.DECODE
POST = ReadEffect.uniform(("req_to_token", "seq_lens"), ReadEnd.POST_REPLAY)


class Wrapped(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass, as a user library writes one."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Wrapped(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def _scaled(scale, **stages):
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        m = page_meta(shared, batch)
        return softmax_attention(mode, q, pools, layer, m["kv_indices"], m["kv_lens"]) * scale(shared, meta)

    return leaf("scaled", attend, declare={M: POST}, **stages)


def _cond(shared, meta):
    lens = shared["seq_lens"].float()
    return torch.cond(lens[1] > 3, lambda x: x.mean() * 0 + 2, lambda x: x.mean() * 0 + 1, (lens,))


def test_a_higher_order_op_is_traced_and_runs_bit_identical_to_serial() -> None:
    backend = _scaled(_cond)
    program = trace(backend, M, cfg=CFG)
    assert program.traced()["seq_lens"] is ReadEnd.POST_REPLAY and not program.unfaithful()
    serial = run_serial(backend, M, steps=4, batch_size=2, cfg=CFG)
    for policy in (Policy.COARSE, Policy.EXACT):
        with CpuDevice(timeout=30.0) as dev:
            assert run_overlapped(backend, M, steps=4, policy=policy, device=dev, batch_size=2, cfg=CFG).matches(serial)


def test_a_higher_order_op_over_a_shared_buffer_makes_it_unknown_naming_the_op() -> None:
    def branchy(shared, meta):  # the branches close over the live lengths: operands of the op
        lens = shared["seq_lens"]
        return torch.cond(lens.float().sum() > 0, lambda: lens.float().mean() * 0 + 1, lambda: lens.float().mean() * 0 + 2, ())

    program = trace(_scaled(branchy), M, cfg=CFG)
    assert program.traced()["seq_lens"] is ReadEnd.UNKNOWN
    assert any("cond" in why for why in program.opaque().get(BODY, {}).values()), program.opaque()


def test_a_tensor_subclass_returned_by_a_stage_is_refused_naming_stage_key_and_line() -> None:
    def inn(mode, shared, batch, meta):
        return {"wrapped": Wrapped(shared["seq_lens"].float())}  # the line named

    with pytest.raises(StageOutputError) as e:
        trace(_scaled(lambda shared, meta: 1.0, prepare_in_graph=inn), M, cfg=CFG)
    text = str(e.value)
    assert "stage prepare_in_graph" in text and "['wrapped']" in text and "Wrapped" in text, text
    assert f"{__file__}:{inn.__code__.co_firstlineno + 1}" in text and "unwrap a tensor subclass" in text, text


def test_a_tensor_subclass_made_inside_a_stage_is_refused_not_a_crash() -> None:
    with pytest.raises(StageOutputError, match="Wrapped"):
        trace(_scaled(lambda shared, meta: Wrapped(shared["seq_lens"].float()).mean() * 0 + 1), M, cfg=CFG)


def test_a_subclass_view_made_while_tracing_is_trace_time_state_refused_by_lower() -> None:
    backend = _scaled(lambda shared, meta: shared["seq_lens"].float().as_subclass(torch.nn.Parameter).mean() * 0 + 1)
    assert trace(backend, M, cfg=CFG).traced()["seq_lens"] is ReadEnd.UNKNOWN
    with CpuDevice() as dev, pytest.raises(CapturedStateError, match=r"test_untraceable.py:\d+"):
        lower(backend, M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG)
