"""Each spliced call of a model piece compiled as one call of the piece, compiled once: the same
values as the GraphModule, bit for bit, and node by node wherever one call is not the same
computation (a value used outside it, a node kept in place, a piece that writes)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from readfence.backends import hybrid_linear, linear, trtllm_mha
from readfence.core import BODY, ForwardMode, StepInputs, run_step
from readfence.core.tracing import _record, _segment
from readfence.graph import Policy, Scheduler, lower
from readfence.graph.lowering import _fx_pieces
from readfence.graph.lowering._fx_compile import compile_graph
from tests.conftest import SMALL as CFG
from tests.graph.test_fx_compile import _clones, _same
from tests.graph.test_fx_memory import _workspace_bumper

M = ForwardMode


def _recorded(fn, *inputs):
    """``fn`` recorded twice, its pieces' templates made the first time: every call spliced."""
    def once():
        return _record.record(fn, list(inputs), [f"x{i}" for i in range(len(inputs))], outputs=lambda out: list(out),
                              context=lambda r: contextlib.nullcontext(), escape_op=None)[0]

    _segment.clear_templates()
    once()
    return once()


def _compiled_alike(gm, *inputs, **compile_kw):
    compiled = compile_graph(gm, **compile_kw)
    a, b = _clones(inputs), _clones(inputs)
    assert _same(compiled(*b), gm(*a)), compiled.source
    assert _same(b, a), "the compiled graph left its inputs in a different state"
    return compiled


def _spliced_calls(gm):
    calls = {}
    for n in gm.graph.nodes:
        mark = n.meta.get(_segment.SPLICED_KEY)
        if mark is not None:
            calls.setdefault(mark.call, []).append(n)
    return list(calls.values())


MLP = _segment.Segment("mlp", lambda x, w: (x @ w).relu() * 2.0)


def _three_layers(x, w1, w2, w3):
    return (MLP(MLP(MLP(x, w1), w2), w3),)


def _weights():
    return [torch.randn(4, 8)] + [torch.randn(8, 8) for _ in range(3)]


def test_each_spliced_call_is_one_call_of_its_piece_compiled_once():
    gm = _recorded(_three_layers, *_weights())
    assert len(_spliced_calls(gm)) == 3
    compiled = _compiled_alike(gm, *_weights())
    assert compiled.stats["pieces"] == 3
    assert compiled.source.count("\n") < compile_graph(gm, simplify=False).source.count("\n")
    (piece,) = {line.split(" = ")[1] for line in compiled.computation.splitlines() if "<piece_" in line}
    assert compiled.computation.count(piece.strip()) == 1  # one function, called three times


def test_a_value_used_outside_its_call_leaves_that_call_node_by_node():
    gm = _recorded(_three_layers, *_weights())
    inner = next(n for n in _spliced_calls(gm)[1] if n.target is torch.ops.aten.relu.default)  # not returned
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        extra = gm.graph.call_function(torch.ops.aten.mul.Tensor, (inner, 3.0))
    out.args = ((*out.args[0], extra),)
    gm.recompile()
    assert _compiled_alike(gm, *_weights()).stats["pieces"] == 2


def test_a_node_kept_in_place_leaves_its_call_node_by_node():
    gm = _recorded(_three_layers, *_weights())
    kept = _spliced_calls(gm)[0][0].name
    compiled = _compiled_alike(gm, *_weights(), keep={kept})
    assert compiled.stats["pieces"] == 2


def test_a_piece_that_writes_is_compiled_node_by_node():
    writes = _segment.Segment("writes", lambda x: (x * 2.0).add_(1.0).exp())

    def two(x):
        return (writes(writes(x)),)

    gm = _recorded(two, torch.randn(5))
    assert len(_spliced_calls(gm)) == 2  # spliced: the recorder took it; the compile does not
    assert _compiled_alike(gm, torch.randn(5)).stats["pieces"] == 0


VIEW = _segment.Segment("flat", lambda x: x.view(-1))


def _writes_through_the_piece(x):
    before = x.sum()
    VIEW(x).add_(1.0)  # the piece returns its input's memory: this writes x
    return (before * 10.0 + x.sum(),)  # the same call as ``before``, on memory written since


def test_what_a_piece_returns_is_the_memory_of_its_input_where_its_own_analysis_says_so():
    gm = _recorded(_writes_through_the_piece, torch.randn(2, 3))
    assert len(_spliced_calls(gm)) == 1
    compiled = _compiled_alike(gm, torch.randn(2, 3))
    assert compiled.stats["pieces"] == 1 and compiled.stats["shared"] == 0


def test_without_the_piece_s_memory_facts_the_comparison_with_the_graph_fails(monkeypatch):
    # the deliberately broken rule: a piece's values taken for memory of its own. The two sums are
    # then shared across the write, and the independent check (the GraphModule's values) differs
    made = _fx_pieces.Piece.__init__

    def forgetting(self, compiled, returned, shares):
        made(self, compiled, returned, tuple(() for _ in shares))

    monkeypatch.setattr(_fx_pieces.Piece, "__init__", forgetting)
    gm = _recorded(_writes_through_the_piece, torch.randn(2, 3))
    x = torch.randn(2, 3)
    compiled = compile_graph(gm)
    assert compiled.stats["shared"] == 1
    assert not _same(compiled(x.clone()), gm(x.clone()))


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY], ids=str)
def test_a_lowered_step_runs_its_pieces_and_equals_the_eager_step(dev, mode):
    backend = hybrid_linear(trtllm_mha(), linear())
    low = lower(backend, mode, batch_size=2, cfg=CFG, device=dev, policy=Policy.EXACT)
    assert low.optimized and low._slots[0].stages[BODY].runner.graph.stats["pieces"] > 0
    nxt = Scheduler(low.cfg, mode, 2, seed=3).next_step()
    for name, t in nxt.shared.items():
        low.shared[name].copy_(t)
    pools = {k: v.clone() for k, v in low.pools.items()}
    out = low.run(nxt.batch, step=0).result(10.0)
    expected = run_step(backend, mode, low.cfg, StepInputs(shared={k: v.clone() for k, v in low.shared.items()},
                                                           batch=nxt.batch, pools=pools, params=low.params))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("namespace", ["rf_pieces_test", "aten"])
def test_a_piece_calling_an_op_of_someone_else_s_kernel_is_compiled_node_by_node(namespace):
    # its schema says it writes nothing; its kernel writes a workspace it closes over. Whatever the
    # namespace it was registered in, the memory analysis does not take it at its word: no piece
    op = _workspace_bumper(namespace, torch.zeros(3), name="rf_piece_bump")
    piece = _segment.Segment(f"bumps_{namespace}", lambda x: op(x) * 2.0)

    def two(x):
        return (piece(piece(x)),)

    gm = _recorded(two, torch.randn(4))
    assert len(_spliced_calls(gm)) == 2
    assert _compiled_alike(gm, torch.randn(4)).stats["pieces"] == 0
