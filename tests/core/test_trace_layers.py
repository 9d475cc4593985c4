"""A body traced once per class of layers must be the body traced whole, node for node.

Each test traces the same step twice: as the tracer does (the model's body is a scan, so
layers that repeat are copied from one trace) and with the scan hidden (``layers=None``: every
layer through make_fx). The graphs, their reads and the traced effects must agree; backends
that try to make layers look alike when they are not (a read at one layer only, a per-layer
literal or scale, a tensor passed from layer to layer behind the scan's back, a host read at
one layer) must either be traced per behaviour or traced whole.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from readfence.backends import (
    REFERENCE_LEAVES,
    hybrid_linear,
    leaf,
    linear,
    page_meta,
    paged,
    reference_compositions,
    softmax_attention,
    store_kv,
    trtllm_mha,
)
from readfence.core import ForwardMode, ModelConfig, audit, step_functions
from readfence.core._state import example_step
from readfence.core._trace import trace_step
from readfence.core._trace_layers import LayerRecord, classes, substitutions
from readfence.effects import ReadEffect, ReadEnd

M = ForwardMode


def _programs(backend: Any, mode: ForwardMode, layers: int, device: str = "cpu") -> tuple[Any, Any]:
    cfg = ModelConfig(layers=layers)
    fns = step_functions(backend, mode, cfg)
    out = []
    for f in (fns, attrs.evolve(fns, layers=None)):
        step = example_step(cfg, mode, 2)
        out.append(trace_step(f, mode, step.groups(), device=device))
    return out[0], out[1]


def _signature(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    index: dict[torch.fx.Node, int] = {}
    out = []
    for n in gm.graph.nodes:
        index[n] = len(index)
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda m: ("%", index[m]))  # type: ignore[arg-type,return-value]
        out.append((n.op, "" if n.op in ("placeholder", "get_attr") else str(n.target), "" if n.op == "get_attr" else str(args)))
    return out


def _reads_by_position(stage: Any) -> dict[int, frozenset[str]]:
    names = [n.name for n in stage.gm.graph.nodes]
    return {names.index(k): v for k, v in stage.reads.items()}


def _same(layered: Any, whole: Any) -> None:
    assert layered.traced() == whole.traced()
    for a, b in zip(layered.stages, whole.stages, strict=True):
        assert _signature(a.gm) == _signature(b.gm), a.name
        assert _reads_by_position(a) == _reads_by_position(b), a.name
        assert a.faithful == b.faithful
    for buffer in whole.buffers:
        assert layered.last_reader(buffer) == whole.last_reader(buffer)


def _targets() -> list[tuple[str, Any]]:
    leaves = [(name, make()) for name, make in REFERENCE_LEAVES.items()]
    return leaves + list(reference_compositions().items())


@pytest.mark.parametrize(("name", "backend"), _targets(), ids=[n for n, _ in _targets()])
def test_layered_trace_is_the_whole_trace(name: str, backend: Any) -> None:
    layered, whole = _programs(backend, M.DECODE, layers=4)
    _same(layered, whole)
    body = layered.stages[-1]
    assert whole.stages[-1].layer_traces is None
    assert body.layer_traces is not None and body.layer_traces < 4, name  # the point: layers were reused


@pytest.mark.parametrize("mode", [M.TARGET_VERIFY, M.EXTEND])
def test_layered_trace_in_other_modes(mode: ForwardMode) -> None:
    _same(*_programs(hybrid_linear(trtllm_mha(), linear()), mode, layers=4))


def test_layered_trace_under_fake_tensors() -> None:
    layered, whole = _programs(hybrid_linear(trtllm_mha(), linear()), M.DECODE, layers=4, device="cuda")
    _same(layered, whole)
    assert layered.stages[-1].layer_traces == 2


# -- layers that differ -------------------------------------------------------------------------
def _prep(mode, shared, batch, meta):
    return page_meta(shared, batch)


def _reader(name: str, late: Any, declare: ReadEnd = ReadEnd.IN_REPLAY) -> Any:
    """A paged leaf whose ``attend`` also calls ``late(layer, shared, batch, q) -> q``."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        q = late(layer, shared, batch, q)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    effect = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": declare})
    return leaf(name, attend, prepare_in_graph=_prep, declare={M.DECODE: effect})


def _lens_scale(shared, batch, q):
    return q * shared["seq_lens"].index_select(0, batch["req_pool_indices"]).float().view(-1, 1, 1).clamp(max=2)


def test_a_read_at_one_layer_is_traced_there() -> None:
    late = _reader("at_four", lambda layer, s, b, q: _lens_scale(s, b, q) if layer == 4 else q)
    layered, whole = _programs(late, M.DECODE, layers=6)
    _same(layered, whole)
    assert layered.stages[-1].layer_traces == 2  # layer 4, and every other layer
    assert layered.traced()["seq_lens"] is ReadEnd.POST_REPLAY
    assert audit(late, M.DECODE, cfg=ModelConfig(layers=6), batch_sizes=[2]).failure().buffer == "seq_lens"


def test_every_fourth_layer_is_its_own_class() -> None:
    late = _reader("fourth", lambda layer, s, b, q: _lens_scale(s, b, q) if layer % 4 == 3 else q)
    layered, whole = _programs(late, M.DECODE, layers=8)
    _same(layered, whole)
    assert layered.stages[-1].layer_traces == 2
    pattern = hybrid_linear(paged(), linear(), pattern="0001")
    layered, whole = _programs(pattern, M.DECODE, layers=5)
    _same(layered, whole)
    assert layered.stages[-1].layer_traces == 2


def test_per_layer_values_are_not_merged() -> None:
    # a scale computed from the index, and an index one off: no two layers' records agree
    scale = _reader("scaled", lambda layer, s, b, q: q * (1.0 / (layer + 1)))
    layered, whole = _programs(scale, M.DECODE, layers=3)
    _same(layered, whole)
    assert layered.stages[-1].layer_traces is None  # nothing repeats: traced whole

    def neighbour(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, (layer + 1) % 3, meta["kv_indices"], meta["kv_lens"])

    other = leaf("neighbour", neighbour, prepare_in_graph=_prep)
    layered, whole = _programs(other, M.DECODE, layers=3)
    _same(layered, whole)


def test_literals_are_compared_by_value() -> None:
    # a literal of the index differs in every layer; one of a constant is the same literal
    late = _reader("literal", lambda layer, s, b, q: q + torch.tensor(float(layer)))
    layered, whole = _programs(late, M.DECODE, layers=3)
    _same(layered, whole)
    assert layered.stages[-1].layer_traces is None
    same = _reader("constant", lambda layer, s, b, q: q * torch.tensor([0.5, 2.0]).sum())
    layered, whole = _programs(same, M.DECODE, layers=3)
    _same(layered, whole)
    assert layered.stages[-1].layer_traces == 1


class _Stash:
    def __init__(self) -> None:
        self.kept: torch.Tensor | None = None


def test_a_tensor_handed_between_layers_is_traced_whole() -> None:
    # layer i reads what layer i-1 computed and kept on the object: dataflow the scan's carry
    # does not hold; copies of one layer's graph would read a constant instead
    stash = _Stash()

    def late(layer, s, b, q):
        out = q if stash.kept is None or stash.kept.shape != q.shape else q + stash.kept
        stash.kept = _lens_scale(s, b, q)
        return out

    layered, whole = _programs(_reader("handed", late), M.DECODE, layers=3)
    assert layered.stages[-1].layer_traces is None
    _same(layered, whole)
    # what a layer kept from an earlier run is trace-time state: every buffer UNKNOWN
    assert layered.traced()["seq_lens"] is ReadEnd.UNKNOWN


def test_a_host_read_at_one_layer_is_traced_whole() -> None:
    def late(layer, s, b, q):
        if layer == 3 and int(s["seq_lens"].max()) > 10 ** 6:
            return q * 2
        return q

    layered, whole = _programs(_reader("host", late), M.DECODE, layers=4)
    assert layered.stages[-1].layer_traces is None
    _same(layered, whole)
    assert not layered.stages[-1].faithful


# -- the records ----------------------------------------------------------------------------------
def _record(index: int, *leaves: Any) -> LayerRecord:
    return LayerRecord(index, ((torch.ops.aten.select.int, None, tuple(leaves)),), ("op", 0, 0))


def test_substitutions_only_where_each_holds_its_own_index() -> None:
    i = int
    assert substitutions(_record(4, (i, 0), (i, 4)), _record(9, (i, 0), (i, 9))) == ((0, 1),)
    assert substitutions(_record(4, (i, 4), (i, 4)), _record(9, (i, 4), (i, 9))) == ((0, 1),)  # a constant 4 stays
    assert substitutions(_record(4, (i, 5)), _record(9, (i, 10))) is None  # index + 1: not the index
    assert substitutions(_record(4, (i, 4)), _record(9, (bool, True))) is None
    assert substitutions(_record(0, (i, 0)), _record(1, (i, 0))) == ()  # a constant 0 both times
    grouped = classes([_record(0, (i, 0)), _record(1, (i, 1)), _record(2, (i, 7)), _record(3, (i, 3))])
    assert [sorted(c.members) for c in grouped] == [[0, 1, 3], [2]]


@pytest.mark.slow
def test_verdicts_do_not_change_with_depth() -> None:
    for backend in (hybrid_linear(trtllm_mha(), linear()),):
        rows = []
        for layers in (4, 64):
            report = audit(backend, M.DECODE, cfg=ModelConfig(layers=layers), batch_sizes=[2]).unwrap()
            rows.append([(r["buffer"], r["declared"], r["observed"], r["verdict"]) for r in report.rows()])
        assert rows[0] == rows[1]
