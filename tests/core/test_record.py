"""A stage recorded as it runs must be the stage traced with make_fx, node for node.

Each test traces the same step twice: as the tracer does (every stage recorded, see
``readfence.core.tracing._record``) and with the record turned off (``recorded=False``: every stage
through make_fx). The graphs, their node names, their reads, what their nodes touch in memory
and the traced effects must agree. Backends that make the record's job hard (a read at one
layer only, a per-layer literal or scale, a tensor passed from layer to layer behind the
model's back, a list-returning op, a captured constant, a composite op under inference mode, a
compiled function) must be recorded faithfully; what a record cannot hold (a host read, an
escape, a higher-order op) must be traced with make_fx, with the same findings.
"""

from __future__ import annotations

from typing import Any

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
from readfence.core import BODY, ForwardMode, ModelConfig, audit, step_functions
from readfence.core._state import example_step
from readfence.core.tracing._trace import trace_step
from readfence.effects import ReadEffect, ReadEnd

M = ForwardMode


def _programs(make: Any, mode: ForwardMode, layers: int, device: str = "cpu") -> tuple[Any, Any]:
    """The step recorded and traced with make_fx; ``make()`` builds the backend anew for each
    (a backend that keeps state between calls starts both from scratch)."""
    cfg = ModelConfig(layers=layers)
    out = []
    for recorded in (True, False):
        fns = step_functions(make(), mode, cfg)
        out.append(trace_step(fns, mode, example_step(cfg, mode, 2).groups(), device=device, recorded=recorded))
    return out[0], out[1]


def _signature(gm: torch.fx.GraphModule) -> list[tuple[str, str, str, str]]:
    index: dict[torch.fx.Node, int] = {}
    out = []
    for n in gm.graph.nodes:
        index[n] = len(index)
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda m: ("%", index[m]))  # type: ignore[arg-type,return-value]
        target = "" if n.op in ("placeholder", "get_attr") else str(n.target)
        out.append((n.op, n.name, target, "" if n.op == "get_attr" else str(args)))
    return out


def _vals(gm: torch.fx.GraphModule) -> list[Any]:
    def shape(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), tuple(v.stride()), v.dtype)
        if isinstance(v, (list, tuple)):
            return [shape(x) for x in v]
        return v

    return [shape(n.meta.get("val")) for n in gm.graph.nodes if n.op != "output"]


def _same(recorded: Any, traced: Any) -> None:
    assert recorded.traced() == traced.traced()
    assert recorded.unfaithful() == traced.unfaithful()
    for a, b in zip(recorded.stages, traced.stages, strict=True):
        assert _signature(a.graph.gm) == _signature(b.graph.gm), a.stage
        assert _vals(a.graph.gm) == _vals(b.graph.gm), a.stage
        assert [a.graph.source(n) for n in a.analysis.reads] == [b.graph.source(n) for n in b.analysis.reads], a.stage
        assert dict(a.analysis.reads) == dict(b.analysis.reads), a.stage
        assert (dict(a.analysis.memory), a.analysis.copies) == (dict(b.analysis.memory), b.analysis.copies), a.stage
        assert a.analysis.faithful == b.analysis.faithful
        assert not b.graph.recorded
    for buffer in traced.buffers:
        assert recorded.last_reader(buffer) == traced.last_reader(buffer)


def _targets() -> list[tuple[str, Any]]:
    leaves = [(name, make) for name, make in REFERENCE_LEAVES.items()]
    return leaves + [(name, lambda name=name: reference_compositions()[name]) for name in reference_compositions()]


@pytest.mark.parametrize(("name", "make"), _targets(), ids=[n for n, _ in _targets()])
def test_a_recorded_step_is_the_traced_step(name: str, make: Any) -> None:
    recorded, traced = _programs(make, M.DECODE, layers=4)
    _same(recorded, traced)
    assert all(s.graph.recorded for s in recorded.stages), name  # the point: no make_fx


@pytest.mark.parametrize("mode", [M.TARGET_VERIFY, M.EXTEND, M.DRAFT_EXTEND])
def test_a_recorded_step_in_other_modes(mode: ForwardMode) -> None:
    _same(*_programs(lambda: hybrid_linear(trtllm_mha(), linear()), mode, layers=4))


def test_a_recorded_step_under_fake_tensors() -> None:
    recorded, traced = _programs(lambda: hybrid_linear(trtllm_mha(), linear()), M.DECODE, layers=4, device="cuda")
    _same(recorded, traced)
    assert all(s.graph.recorded for s in recorded.stages)


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


def test_a_read_at_one_layer_is_recorded_there() -> None:
    late = _reader("at_four", lambda layer, s, b, q: _lens_scale(s, b, q) if layer == 4 else q)
    recorded, traced = _programs(lambda: late, M.DECODE, layers=6)
    _same(recorded, traced)
    assert recorded.traced()["seq_lens"] is ReadEnd.POST_REPLAY
    assert audit(late, M.DECODE, cfg=ModelConfig(layers=6), batch_sizes=[2]).failure().buffer == "seq_lens"


def test_every_fourth_layer_and_a_layer_pattern() -> None:
    late = _reader("fourth", lambda layer, s, b, q: _lens_scale(s, b, q) if layer % 4 == 3 else q)
    _same(*_programs(lambda: late, M.DECODE, layers=8))
    _same(*_programs(lambda: hybrid_linear(paged(), linear(), pattern="0001"), M.DECODE, layers=5))


def test_per_layer_values_and_a_neighbours_cache() -> None:
    scale = _reader("scaled", lambda layer, s, b, q: q * (1.0 / (layer + 1)))
    _same(*_programs(lambda: scale, M.DECODE, layers=3))

    def neighbour(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, (layer + 1) % 3, meta["kv_indices"], meta["kv_lens"])

    _same(*_programs(lambda: leaf("neighbour", neighbour, prepare_in_graph=_prep), M.DECODE, layers=3))


def test_literals_become_constants_copied_where_used() -> None:
    late = _reader("literal", lambda layer, s, b, q: q + torch.tensor(float(layer)) * torch.tensor([0.5, 2.0]).sum())
    recorded, traced = _programs(lambda: late, M.DECODE, layers=3)
    _same(recorded, traced)
    body = recorded.stages[-1].graph.gm
    assert sum(n.target is torch.ops.aten.lift_fresh_copy.default for n in body.graph.nodes) == 6


class _Stash:
    def __init__(self) -> None:
        self.kept: torch.Tensor | None = None


def _handing(stash: _Stash) -> Any:
    def late(layer, s, b, q):
        out = q if stash.kept is None or stash.kept.shape != q.shape else q + stash.kept
        stash.kept = _lens_scale(s, b, q)
        return out

    return _reader("handed", late)


def test_a_tensor_handed_between_layers_is_dataflow() -> None:
    # layer i reads what layer i-1 computed and kept on the object: within one step that is
    # dataflow the graph holds (the reads of seq_lens go on to the last layer)
    recorded, traced = _programs(lambda: _handing(_Stash()), M.DECODE, layers=3)
    _same(recorded, traced)
    assert recorded.traced()["seq_lens"] is ReadEnd.POST_REPLAY
    # what a layer kept from an earlier step is trace-time state: every buffer UNKNOWN
    stash = _Stash()
    cfg = ModelConfig(layers=3)
    fns = step_functions(_handing(stash), M.DECODE, cfg)
    trace_step(fns, M.DECODE, example_step(cfg, M.DECODE, 2).groups())
    again = trace_step(fns, M.DECODE, example_step(cfg, M.DECODE, 2).groups())
    assert again.traced()["seq_lens"] is ReadEnd.UNKNOWN and again.stages[-1].graph.recorded


def test_a_list_returning_op_and_a_captured_constant() -> None:
    table = torch.arange(4.0)

    def late(layer, s, b, q):
        first, second = q.chunk(2, dim=-1)  # getitem per piece
        weights = table.unbind(0)  # a constant, a get_attr node per use
        return torch.cat([first * weights[layer % 4], second], dim=-1)

    _same(*_programs(lambda: _reader("pieces", late), M.DECODE, layers=3))


def test_a_generator_and_a_captured_parameter_are_held_as_make_fx_holds_them() -> None:
    generator = torch.Generator().manual_seed(0)
    scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)

    def late(layer, s, b, q):
        noise = torch.randint(0, 2, q.shape, generator=generator).to(q.dtype)
        return q * scale + noise * 0

    _same(*_programs(lambda: _reader("drawn", late), M.DECODE, layers=2))


def test_a_composite_op_under_inference_mode_is_decomposed_as_make_fx_does() -> None:
    def late(layer, s, b, q):
        with torch.inference_mode(False):
            return torch.nn.functional.layer_norm(q, q.shape[-1:]) * 0 + q

    _same(*_programs(lambda: _reader("composite", late), M.DECODE, layers=2))


def test_a_compiled_function_is_recorded_as_its_python() -> None:
    @torch.compile(backend="eager", fullgraph=True)
    def scaled(q, lens):
        return q * lens.float().view(-1, 1, 1).clamp(max=2)

    late = _reader("compiled", lambda layer, s, b, q: scaled(q, s["seq_lens"].index_select(0, b["req_pool_indices"])))
    recorded, traced = _programs(lambda: late, M.DECODE, layers=2)
    _same(recorded, traced)
    assert recorded.stages[-1].graph.recorded and recorded.traced()["seq_lens"] is ReadEnd.POST_REPLAY


# -- escapes: recorded as make_fx records them ----------------------------------------------------
def test_a_host_read_is_recorded_as_an_escape() -> None:
    def late(layer, s, b, q):
        if layer == 3 and int(s["seq_lens"].max()) > 10 ** 6:
            return q * 2
        return q

    recorded, traced = _programs(lambda: _reader("host", late), M.DECODE, layers=4)
    _same(recorded, traced)
    body = recorded.stages[-1]
    assert body.graph.recorded and not body.analysis.faithful
    assert any(why.startswith("escape: ") for _, why, _ in body.escapes())


@pytest.mark.parametrize("escape", ["data_ptr", "tolist", "contains", "bool", "equal"])
def test_every_way_to_escape_is_recorded_as_make_fx_traces_it(escape: str) -> None:
    def late(layer, s, b, q):
        lens = s["seq_lens"]
        hidden = {"data_ptr": lambda: lens.data_ptr(), "tolist": lambda: lens.tolist(),
                  "contains": lambda: 3 in lens, "bool": lambda: bool(lens.sum() > 0),
                  "equal": lambda: torch.equal(lens, lens)}[escape]()
        return q if hidden is not None else q * 2

    recorded, traced = _programs(lambda: _reader(escape, late), M.DECODE, layers=2)
    _same(recorded, traced)
    assert recorded.stages[-1].graph.recorded and not recorded.stages[-1].analysis.faithful


def test_a_stage_that_escapes_runs_once_while_traced() -> None:
    # a recorded escape does not send the stage through make_fx after it: an engine's stage
    # that counts its calls (or keeps state) sees the trace call it once, as make_fx did
    calls = []

    def late(layer, s, b, q):
        calls.append(layer)
        s["seq_lens"].data_ptr()
        return q

    cfg = ModelConfig(layers=2)
    fns = step_functions(_reader("counted", late), M.DECODE, cfg)
    trace_step(fns, M.DECODE, example_step(cfg, M.DECODE, 2).groups())
    assert calls == [0, 1]


# -- what a record cannot hold ---------------------------------------------------------------------
def test_a_higher_order_op_is_traced_with_make_fx() -> None:
    def late(layer, s, b, q):
        return torch.cond(q.sum() > 0, lambda x: x * 2, lambda x: x * 3, (q,))

    recorded, traced = _programs(lambda: _reader("cond", late), M.DECODE, layers=2)
    _same(recorded, traced)
    assert not recorded.stages[-1].graph.recorded


def test_a_stages_error_is_make_fx_s_error() -> None:
    def late(layer, s, b, q):
        raise RuntimeError(f"broken at layer {layer}")

    for recorded in (True, False):
        cfg = ModelConfig(layers=2)
        fns = step_functions(_reader("broken", late), M.DECODE, cfg)
        with pytest.raises(RuntimeError, match="broken at layer 0"):
            trace_step(fns, M.DECODE, example_step(cfg, M.DECODE, 2).groups(), recorded=recorded)


@pytest.mark.slow
def test_verdicts_and_last_readers_do_not_change_with_depth() -> None:
    backend = hybrid_linear(trtllm_mha(), linear())
    rows = []
    for layers in (4, 64):
        report = audit(backend, M.DECODE, cfg=ModelConfig(layers=layers), batch_sizes=[2]).unwrap()
        rows.append([(r["buffer"], r["declared"], r["observed"], r["verdict"]) for r in report.rows()])
    assert rows[0] == rows[1]
    # at 64 layers EXACT's last reader of a buffer read in every fourth layer's attend is in the
    # last layer (make_fx's trace is the recorded one at any depth: the tests above, at 4 to 8)
    late = _reader("fourth", lambda layer, s, b, q: _lens_scale(s, b, q) if layer % 4 == 3 else q)
    cfg = ModelConfig(layers=64)
    recorded = trace_step(step_functions(late, M.DECODE, cfg), M.DECODE, example_step(cfg, M.DECODE, 2).groups())
    body = recorded.stages[-1]
    stage, node = recorded.last_reader("seq_lens") or (None, "")
    nodes = [n.name for n in body.graph.gm.graph.nodes]
    assert stage == BODY and nodes.index(node) > len(nodes) * 63 // 64
