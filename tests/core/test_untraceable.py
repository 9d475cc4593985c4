"""Where tracing cannot follow, a clear answer: higher-order ops are traced (``torch.cond`` runs in
any stage, its branches as serial), tensors a graph cannot hold (subclasses, nested, quantized,
sparse) are refused naming backend, stage, key and line, never a crash from inside readfence;
plain tensors however unusual (complex, empty, strided, meta) run as serial."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import BODY, CapturedStateError, ForwardMode, StageOutputError, UntraceableStage, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, lower, run_overlapped, run_serial
from tests.conftest import ONE_LAYER as CFG
from tests.conftest import first_of_each

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


# -- tensors a stage may not return, made anywhere: a clear refusal, never torch's crash --------
def _two_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass of torch's own, as DTensor

    return TwoTensor(t, t.clone())


#: What a stage returns at key "x", from the live lengths, and how the error names it.
UNFIT = {
    "nested (jagged)": (lambda lens: torch.nested.nested_tensor([lens[:2].float(), lens[:3].float()], layout=torch.jagged),
                        "a nested tensor"),
    "nested (strided)": (lambda lens: torch.nested.nested_tensor([lens[:2].float(), lens[:3].float()]), "a nested tensor"),
    "quantized": (lambda lens: torch.quantize_per_tensor(lens.float() + 0, 0.5, 0, torch.quint8), "a quantized tensor"),
    "sparse COO": (lambda lens: (lens.float() + 0).to_sparse(), "a torch.sparse_coo tensor"),
    "sparse CSR": (lambda lens: (lens[:3].float().diag() + 0).to_sparse_csr(), "a torch.sparse_csr tensor"),
    "a wrapper subclass": (lambda lens: _two_tensor(lens.float() + 0), "a TwoTensor (a tensor subclass)"),
}


def _returning(make, where: str):
    def out_stage(mode, shared, batch):
        return {**page_meta(shared, batch), "x": make(shared["seq_lens"])}  # the line named

    def in_stage(mode, shared, batch, meta):
        return {**page_meta(shared, batch), "x": make(shared["seq_lens"])}  # the line named

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    stage = {"prepare_out_graph": out_stage} if where == "prepare_out_graph" else {"prepare_in_graph": in_stage}
    line = (out_stage if where == "prepare_out_graph" else in_stage).__code__.co_firstlineno + 1
    return leaf("unfit", attend, declare={M: POST}, **stage), line


@pytest.mark.parametrize("where", ["prepare_out_graph", "prepare_in_graph"])
@pytest.mark.parametrize("kind", first_of_each(list(UNFIT), lambda k: "quick" if k in ("nested (jagged)", "quantized") else k))
def test_a_tensor_a_graph_cannot_hold_returned_by_a_stage_is_refused_naming_backend_stage_key_and_line(kind, where) -> None:
    make, named = UNFIT[kind]
    backend, line = _returning(make, where)
    for attempt in (lambda: lower(backend, M, batch_size=2, device=CpuDevice(timeout=30.0), policy=Policy.PER_BUFFER, cfg=CFG),
                    lambda: run_serial(backend, M, steps=1, batch_size=2, cfg=CFG)):
        with pytest.raises(StageOutputError) as e:
            attempt()
        text = str(e.value)
        assert e.value.stage == where and f"backend 'unfit' stage {where} returned {named}" in text, text
        assert "at key ['x']" in text and f"{__file__}:{line}" in text, text


#: Tensors a stage may return however unusual: each consumed by the body, the lowered run as serial.
FIT = {
    "complex": (lambda lens: lens.to(torch.complex64) * (1 + 1j), lambda x: x.real.sum() + x.imag.sum()),
    "empty": (lambda lens: torch.empty(0, lens.shape[0]), lambda x: x.sum()),
    "non-contiguous": (lambda lens: (lens.float() + 0).expand(3, lens.shape[0]).t(), lambda x: x.sum()),
    "meta (a shape, no data)": (lambda lens: torch.empty(lens.shape, device="meta"), lambda x: x.shape[0]),
}


@pytest.mark.parametrize("where", ["prepare_out_graph", "prepare_in_graph"])
@pytest.mark.parametrize("kind", first_of_each(list(FIT), lambda k: "quick" if k == "non-contiguous" else k))
def test_an_unusual_but_plain_tensor_crosses_into_the_graph_and_runs_bit_identical(kind, where) -> None:
    make, use = FIT[kind]

    def out_stage(mode, shared, batch):
        return {**page_meta(shared, batch), "x": make(shared["seq_lens"])}

    def in_stage(mode, shared, batch, meta):
        return {**page_meta(shared, batch), "x": make(shared["seq_lens"])}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        scale = 1 + use(meta["x"]) * 1e-3
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) * scale

    stage = {"prepare_out_graph": out_stage} if where == "prepare_out_graph" else {"prepare_in_graph": in_stage}
    backend = leaf("plain_" + "".join(c if c.isalnum() else "_" for c in kind), attend, declare={M: POST}, **stage)
    serial = run_serial(backend, M, steps=4, batch_size=2, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        assert run_overlapped(backend, M, steps=4, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG).matches(serial)


@pytest.mark.parametrize("kind", ["quantized", "sparse CSR"])
def test_a_tensor_the_tracer_cannot_hold_made_inside_a_stage_is_a_clear_refusal(kind) -> None:
    inside = {"quantized": lambda lens: torch.quantize_per_tensor(lens.float() + 0, 0.5, 0, torch.quint8).dequantize(),
              "sparse CSR": lambda lens: (lens[:3].float().diag() + 0).to_sparse_csr().to_dense()}[kind]
    backend, _ = _returning(inside, "prepare_out_graph")
    with pytest.raises(UntraceableStage) as e:
        lower(backend, M, batch_size=2, device=CpuDevice(timeout=30.0), policy=Policy.PER_BUFFER, cfg=CFG)
    assert (e.value.backend, e.value.stage) == ("unfit", "prepare_out_graph") and "cannot follow" in str(e.value)


# -- torch.cond in any stage: lowered, it runs as serial where the branch taken changes ---------
def _branching(how: str):
    def scale(shared):
        lens = shared["seq_lens"]
        if how != "cond":
            return torch.tensor(2.0 if how == "true" else 1.0)
        # the first request's length changes parity every decode step: so does the branch (its
        # operands are copies: a cond over a shared buffer itself is opaque, UNKNOWN)
        first = lens[:1].float() + 0
        return torch.cond(first[0] % 2 == 0, lambda x: x.mean() * 0 + 2, lambda x: x.mean() * 0 + 1, (first,))

    return scale


@pytest.mark.parametrize("where", first_of_each(["body", "prepare_out_graph", "prepare_in_graph"], lambda w: "cond"))
def test_torch_cond_in_any_stage_runs_as_serial_on_steps_that_take_either_branch(where) -> None:
    def backend(how: str):
        scale = _branching(how)

        def out_stage(mode, shared, batch):
            return {**page_meta(shared, batch), "s": scale(shared)}

        def in_stage(mode, shared, batch, meta):
            return {**page_meta(shared, batch), "s": scale(shared)}

        def attend(mode, layer, q, k, v, pools, shared, batch, meta):
            store_kv(pools, layer, batch["out_cache_loc"], k, v)
            s = scale(shared) if where == "body" else meta["s"]
            return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) * s

        stage = {"prepare_out_graph": out_stage} if where == "prepare_out_graph" else {"prepare_in_graph": in_stage}
        return leaf(f"cond_{how}", attend, declare={M: POST}, **stage)

    serial = {how: run_serial(backend(how), M, steps=4, batch_size=2, cfg=CFG).logits for how in ("cond", "true", "false")}
    took = [next(how for how in ("true", "false") if torch.equal(serial["cond"][i], serial[how][i])) for i in range(4)]
    assert set(took) == {"true", "false"}, took  # not vacuous: the steps take both branches
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        with CpuDevice(timeout=30.0) as dev:
            run = run_overlapped(backend("cond"), M, steps=4, policy=policy, device=dev, batch_size=2, cfg=CFG)
        assert run.matches(serial["cond"]), (where, policy)
