"""The layers of a body that compute alike compiled as one function, called once per layer: the
same values as the eager step, every integer that differs between layers an argument, a
function that writes known to write, and node by node wherever the layers differ or an op's
schema is not taken at its word."""

from __future__ import annotations

import pytest
import torch

import readfence.graph.lowering._fx_compile as fx_compile
import readfence.graph.lowering._fx_memory as fx_memory
from readfence.backends import REFERENCE_LEAVES, hybrid_linear, leaf, linear, page_meta, softmax_attention, store_kv, trtllm_mha
from readfence.core import BODY, ForwardMode, ModelConfig, trace
from readfence.core.tracing import Segment
from readfence.graph import Policy
from readfence.graph.lowering._fx_compile import compile_graph
from tests.graph.test_fx_memory import _workspace_bumper
from tests.graph.test_lower_what_runs import lowered_against_eager, no_validation

M = ForwardMode
LAYERS = ModelConfig(layers=4, max_reqs=8, max_ctx=16)


def _body_runs(low: object) -> int:
    return low._slots[0].stages[BODY].runner.graph.stats["layer_runs"]


@pytest.mark.parametrize("name", sorted(REFERENCE_LEAVES))
def test_every_reference_leaf_s_layers_are_one_function_and_compute_the_eager_step(name) -> None:
    equal, low = lowered_against_eager(REFERENCE_LEAVES[name](), cfg=LAYERS)
    assert equal and low.optimized and _body_runs(low) >= LAYERS.layers


def test_a_body_of_two_classes_of_layers_calls_two_functions() -> None:
    body = trace(hybrid_linear(trtllm_mha(), linear()), M.DECODE, cfg=LAYERS, batch_size=2).stage(BODY).graph
    compiled = compile_graph(body.gm)
    assert compiled.stats["layer_runs"] == LAYERS.layers
    assert compiled.hoisted  # (the causal mask every attention layer computes alike: once)
    functions = {line.split(" = ")[1] for line in compiled.computation.splitlines() if " = <piece_" in line}
    assert len(functions) == 2, compiled.computation  # (the model's own pieces are called inside them)


def _edges_read_what_the_middle_writes() -> object:
    """The first and last layers read the whole state pool with the same op (and differ from each
    other: neither is a class of two); the layers between write their slice of it. A pass that
    took the middle layers' function for one that writes nothing would compute the last layer's
    read once, before the writes."""
    last = LAYERS.layers - 1

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        if layer == 0:
            return out + pools["state"].sum() * 1e-3
        if layer == last:
            return out - pools["state"].sum() * 1e-3
        pools["state"].select(0, layer).add_(1.0)
        return out

    return leaf("edges_read_what_the_middle_writes", attend, prepare_in_graph=prep,
                reads=["req_to_token", "seq_lens"])


def test_what_a_class_of_layers_writes_is_known_to_be_written(monkeypatch) -> None:
    # the deliberately broken analysis (a layer function's writes unseen) computes it wrong; the
    # validation, which compares with the stages' Python and shares nothing with the analysis,
    # catches that and runs the plain code
    with monkeypatch.context() as m:
        m.setattr(fx_memory, "PIECE_WRITES_KEY", "writes nobody looks up")
        with no_validation(m):
            equal, low = lowered_against_eager(_edges_read_what_the_middle_writes(), cfg=LAYERS)
        assert not equal and _body_runs(low) == LAYERS.layers - 2, "the case attacks nothing"
        equal, low = lowered_against_eager(_edges_read_what_the_middle_writes(), cfg=LAYERS)
        assert equal and not low.optimized
    equal, low = lowered_against_eager(_edges_read_what_the_middle_writes(), cfg=LAYERS)
    assert equal and low.optimized and _body_runs(low) == LAYERS.layers - 2


def _each_layer_reads_what_the_last_wrote() -> object:
    """Every layer reads the whole state pool with the same op on the same input (an invariant of
    the class by its arguments), then writes its slice: computed once, the read would miss the
    writes of the layers before."""

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        seen = pools["state"].sum()
        pools["state"].select(0, layer).add_(1.0)
        return out + seen * 1e-3

    return leaf("each_layer_reads_what_the_last_wrote", attend, prepare_in_graph=prep,
                reads=["req_to_token", "seq_lens"])


def test_a_value_computed_once_for_a_class_of_layers_is_one_no_layer_writes(monkeypatch) -> None:
    # taken for a value every layer computes alike (the check after the fact made blind), the read
    # runs once and the output is wrong; the validation catches that; the check itself keeps it in
    # every layer, and the layers are still one function
    with monkeypatch.context() as m:
        m.setattr(fx_compile, "hoists_hold", lambda gm, memory, hoisted: True)
        with no_validation(m):
            equal, low = lowered_against_eager(_each_layer_reads_what_the_last_wrote(), cfg=LAYERS)
        assert not equal and _body_runs(low) == LAYERS.layers, "the case attacks nothing"
        equal, low = lowered_against_eager(_each_layer_reads_what_the_last_wrote(), cfg=LAYERS)
        assert equal and not low.optimized
    equal, low = lowered_against_eager(_each_layer_reads_what_the_last_wrote(), cfg=LAYERS)
    assert equal and low.optimized and _body_runs(low) == LAYERS.layers
    assert not low._slots[0].stages[BODY].runner.graph.hoisted


def _a_piece_every_layer_writes() -> object:
    """Layers 1..3 call a one-op model piece (a ``Segment``) on the same lengths and each writes
    the fresh tensor it returned (layer 0 only makes the piece's record): a value the class
    computes alike by its arguments, which every run then writes. Computed once it would carry each
    layer's write into the next; the piece's outlining must not hide it from the check."""
    piece = Segment("lengths_twice", lambda x: x * 2.0)

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        y = piece(meta["kv_lens"].float())
        if layer == 0:
            return out
        y.add_(1.0)
        return out + y.sum() * 1e-3

    return leaf("a_piece_every_layer_writes", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])


def test_a_value_computed_once_is_checked_after_the_model_pieces_are_outlined(monkeypatch) -> None:
    with monkeypatch.context() as m, no_validation(m):  # the check alone, the validation's backstop off
        equal, low = lowered_against_eager(_a_piece_every_layer_writes(), cfg=LAYERS)
    assert equal and low.optimized and _body_runs(low) == LAYERS.layers - 1
    assert not low._slots[0].stages[BODY].runner.graph.hoisted


def _layer_scaled(by: str) -> object:
    """Every layer computes alike but for a constant of its own: an integer (an argument of the
    one function), a tensor it captured (an input, as any tensor) or a float (each layer its own
    code)."""
    scales = [torch.full((1,), 1.0 + i) for i in range(LAYERS.layers)]

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        if by == "int":
            return out.roll(layer, 0)
        if by == "float":
            return out * (1.0 + layer / 8)
        return out * scales[layer]

    return leaf(f"scaled_by_{by}", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])


@pytest.mark.parametrize("by", ["int", "float", "tensor"])
def test_a_constant_of_each_layer_is_computed_as_that_layer_s(by) -> None:
    equal, low = lowered_against_eager(_layer_scaled(by), cfg=LAYERS)
    assert equal and low.optimized
    assert (_body_runs(low) >= LAYERS.layers) == (by != "float")


def _a_kernel_that_writes_what_it_closes_over() -> object:
    """Every layer calls a custom op whose schema says it writes nothing while its kernel bumps a
    workspace it closes over: the memory analysis does not take its schema at its word, so no
    layer's call of it is inside a class's function, and the step computes as its Python."""
    bump = _workspace_bumper("rf_layers_test", torch.zeros(1))

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return bump(out)

    return leaf("a_kernel_that_writes_what_it_closes_over", attend, prepare_in_graph=prep,
                reads=["req_to_token", "seq_lens"])


def test_a_layer_calling_a_kernel_not_taken_at_its_word_stays_node_by_node() -> None:
    # (the rest of each layer, after the op's alias check, may still be a class's function)
    equal, low = lowered_against_eager(_a_kernel_that_writes_what_it_closes_over(), cfg=LAYERS)
    outlined = low._slots[0].stages[BODY].runner.graph.outlined
    calls = [n for n in outlined.graph.nodes if n.target is torch.ops.rf_layers_test.rf_bump_workspace.default]
    assert equal and low.optimized and len(calls) == LAYERS.layers


def test_the_plain_code_verify_reruns_calls_no_layer_function() -> None:
    from readfence.graph import LowerOptions, lower
    from readfence.graph.devices import CpuDevice

    with CpuDevice(timeout=30.0) as dev:
        low = lower(REFERENCE_LEAVES["paged"](), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=LAYERS,
                    lowering=LowerOptions(optimize=False))
    assert not low.optimized and _body_runs(low) == 0


@pytest.mark.parametrize("signs", [("nan", "-nan"), ("inf", "-inf")])
def test_layers_whose_constants_differ_only_in_sign_are_two_classes(signs, monkeypatch) -> None:
    # a NaN's (or an infinity's) sign is part of its value: torch.signbit reads it, so the layers
    # differ and the pass computes each its own (checked against the eager step with the
    # validation off, which would otherwise fall back to the plain code and hide a wrong merge)
    even, odd = (float(s) for s in signs)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out + 1e-2 * torch.signbit(torch.full_like(out, even if layer % 2 == 0 else odd)).float()

    backend = leaf(f"sign_{signs[0]}", attend, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch))
    with no_validation(monkeypatch):
        equal, low = lowered_against_eager(backend, cfg=LAYERS)
    assert equal and low.optimized
