"""What the analysis makes of a collective: its inputs are read until the wait of its output.

Attacks: a collective's input is a shared buffer read asynchronously until ``wait_tensor``; an
un-waited collective handed to the next stage; an in-place collective and ``irecv`` writing a
shared buffer; an ``Any`` argument holding an object (it may carry a tensor) against one holding
a name. And the false alarm to avoid: the model's own all-reduces read no shared buffer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives
from torch import fx

from readfence.backends import leaf, page_meta, paged, softmax_attention, store_kv
from readfence.core import BODY, ForwardMode, ModelConfig, StageWriteError, TensorParallel, trace
from readfence.core.tracing import _alias, _collectives
from readfence.core.tracing._trace import trace_functions
from readfence.effects import ReadEffect, ReadEnd

OPS = torch.ops._c10d_functional
DECODE = ForwardMode.DECODE


def _graph(op, *args):
    """``x`` (aliasing seq_lens) passed to ``op(x, *args)``, its output waited for and returned."""
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(op, (x, *args))
    g.output(g.call_function(OPS.wait_tensor.default, (node,)))
    return g, node


def test_an_any_argument_bound_to_a_name_hides_nothing():
    g, node = _graph(OPS.all_reduce.default, "sum", "0")
    result = _alias.analyse(g, {"x": frozenset({"seq_lens"})})
    assert result.reads == {node.name: frozenset({"seq_lens"}), "wait_tensor_default": frozenset({"seq_lens"})}
    assert not result.unknown and not result.opaque


def test_an_any_argument_bound_to_an_object_stays_opaque():
    # an object could carry a tensor into the op: what it touches is unknown
    g, node = _graph(OPS.all_reduce.default, "sum", object())
    result = _alias.analyse(g, {"x": frozenset({"seq_lens"})})
    assert result.unknown == {"seq_lens"} and node.name in result.opaque


def test_irecv_writes_its_tensor_though_its_schema_does_not_say_so():
    g, node = _graph(OPS.irecv.default, 0, 0, "0")
    result = _alias.analyse(g, {"x": frozenset({"seq_lens"})})
    assert [(w.node, w.buffers) for w in result.writes] == [(node.name, frozenset({"seq_lens"}))]


def _gathers(group):
    """A leaf whose body all-gathers the lengths (a shared buffer) with a functional collective."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = OPS.all_gather_into_tensor.default(shared["seq_lens"], 1, group)
        lens = OPS.wait_tensor.default(lens)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + lens.sum() * 0

    return leaf("gathers", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch),
                declare={DECODE: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.POST_REPLAY})})


def test_a_collective_reads_its_input_until_its_wait(solo_group):
    program = trace(_gathers(solo_group), DECODE, batch_size=2)
    stage, node = program.last_reader("seq_lens")
    target = {n.name: n.target for n in program.stage(stage).graph.gm.graph.nodes}[node]
    assert stage == BODY and _collectives.is_wait(target), (stage, node, target)
    assert program.traced()["seq_lens"] is ReadEnd.POST_REPLAY


def test_without_the_rule_the_last_read_would_be_the_starting_node(solo_group, monkeypatch):
    # the test above can fail: the same trace, analysed without the rule, ends the read too early
    monkeypatch.setattr(_alias, "starts_collective", lambda op: False)
    program = trace_functions(
        "gathers", DECODE, inputs={"shared": {"seq_lens": torch.ones(4, dtype=torch.int32)}},
        prepare_out_graph=lambda shared, batch: {},
        prepare_in_graph=lambda shared, batch, meta: {},
        body=lambda shared, meta: OPS.wait_tensor.default(
            OPS.all_gather_into_tensor.default(shared["seq_lens"], 1, solo_group)).sum())
    stage, node = program.last_reader("seq_lens")
    target = {n.name: n.target for n in program.stage(stage).graph.gm.graph.nodes}[node]
    assert target is OPS.all_gather_into_tensor.default


def test_a_collective_not_waited_in_its_stage_reads_for_as_long_as_anyone_knows(solo_group):
    # (the gather the tracer runs once more to watch memory is never waited for: torch warns of
    # one unwaited collective when the test process exits)
    # prepare_in_graph starts a gather of the lengths and hands the pending output to the body
    program = trace_functions(
        "leaks", DECODE, inputs={"shared": {"seq_lens": torch.ones(4, dtype=torch.int32)}},
        prepare_out_graph=lambda shared, batch: {},
        prepare_in_graph=lambda shared, batch, meta: {
            "lens": OPS.all_gather_into_tensor.default(shared["seq_lens"], 1, solo_group)},
        body=lambda shared, meta: OPS.wait_tensor.default(meta["lens"]).sum())
    assert program.traced()["seq_lens"] is ReadEnd.UNKNOWN


def test_an_in_place_collective_on_a_shared_buffer_is_a_write(solo_group):
    with pytest.raises(StageWriteError, match="seq_lens"):
        trace_functions(
            "sums", DECODE, inputs={"shared": {"seq_lens": torch.ones(4, dtype=torch.int32)}},
            prepare_out_graph=lambda shared, batch: {},
            prepare_in_graph=lambda shared, batch, meta: {},
            body=lambda shared, meta: OPS.wait_tensor.default(
                OPS.all_reduce_.default(shared["seq_lens"], "sum", solo_group)).sum())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_model_all_reduces_read_no_shared_buffer(solo_group, device):
    # cpu: real collectives over a one-rank group; cuda: fake tensors (no collective runs)
    cfg = ModelConfig(tp=TensorParallel(size=2, rank=1, group=solo_group))
    sharded, whole = trace(paged(), DECODE, cfg=cfg, device=device), trace(paged(), DECODE, device=device)
    body = sharded.stage(BODY).graph.gm.graph.nodes
    collectives = [n for n in body if _collectives.starts_collective(n.target) or _collectives.is_wait(n.target)]
    assert len(collectives) == 2 * 2 * cfg.layers  # an all-reduce and its wait, after attention and after the MLP
    assert not any(n.name in sharded.reads(BODY) for n in collectives)
    assert sharded.traced() == whole.traced() and not sharded.opaque()
    assert sharded.last_reader("req_to_token") == whole.last_reader("req_to_token")
