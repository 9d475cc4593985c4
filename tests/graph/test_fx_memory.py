"""What a stage graph's values may share, decided from real storages, schemas and tags."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from readfence.core.internal import SHARES_KEY
from readfence.graph.lowering._fx_compile import compile_graph
from readfence.graph.lowering._fx_memory import UNKNOWN, GraphMemory, storage_token


def _names(gm: fx.GraphModule, op: str) -> list[str]:
    return [n.name for n in gm.graph.nodes if op in str(n.target)]


def test_tensors_over_one_storage_are_one_memory_whatever_their_offsets() -> None:
    buf = torch.zeros(12)
    kept = {"p": buf[0:4], "q": buf[8:12], "r": torch.zeros(4)}

    def f(x):
        kept["p"].add_(x)
        return kept["q"].sum() + kept["r"].sum()

    gm = make_fx(f)(torch.ones(4))
    memory = GraphMemory(gm, (torch.ones(4),))
    q, r = (n for n in gm.graph.nodes if n.op == "get_attr" and n.name != "_tensor_constant0")
    assert memory.classes(q) & memory.written  # elements apart, one storage
    assert not memory.classes(r) & memory.written


def test_two_storage_objects_over_one_memory_are_one_memory() -> None:
    ws = torch.zeros(8)
    assert storage_token(torch.from_dlpack(torch.to_dlpack(ws))) == storage_token(ws)
    gm = make_fx(lambda a, b: (a.add_(1), b.sum()))(torch.zeros(8), torch.zeros(4))
    assert GraphMemory(gm, (ws, torch.from_dlpack(torch.to_dlpack(ws))[2:6])).written_by_any(["b_1"])
    assert not GraphMemory(gm, (ws, torch.zeros(4))).written_by_any(["b_1"])
    assert not GraphMemory(gm).written_by_any(["b_1"])  # undescribed inputs: each its own


def test_set_makes_a_tensor_any_memory_it_was_given_from_its_tag() -> None:
    def f(x, src):
        h = torch.empty(0)
        h.set_(src)
        h.add_(x)
        return src.sum()

    gm = make_fx(f)(torch.ones(4), torch.zeros(4))
    assert torch.Tag.inplace_view in torch.ops.aten.set_.source_Tensor.tags
    assert GraphMemory(gm, (torch.ones(4), torch.zeros(4))).written_by_any(["src_1"])


def test_an_input_of_unknown_memory_may_be_any_real_memory() -> None:
    gm = make_fx(lambda a, b: (a.add_(1), b.sum()))(torch.zeros(4), torch.zeros(4))
    assert GraphMemory(gm, (torch.zeros(4), None)).written_by_any(["b_1"])
    assert GraphMemory(gm, (torch.zeros(4), frozenset({UNKNOWN}))).written_by_any(["b_1"])
    fake = torch.empty(4, device="meta")
    assert storage_token(fake) == UNKNOWN


def test_a_graphs_outputs_say_what_the_next_graph_is_given() -> None:
    ws = torch.zeros(8)
    first = make_fx(lambda w, x: (w[2:6], x * 2))(ws, torch.ones(4))
    view, fresh = GraphMemory(first, (ws, torch.ones(4))).outputs()
    assert view == frozenset({storage_token(ws)})
    assert storage_token(ws) not in fresh
    second = make_fx(lambda w, v, m: (w.add_(1), v.sum(), m.sum()))(torch.zeros(8), torch.zeros(4), torch.zeros(4))
    memory = GraphMemory(second, (ws, view, fresh))
    assert memory.written_by_any(["v_1"]) and not memory.written_by_any(["m_1"])


def _workspace_bumper(namespace: str, ws: torch.Tensor, name: str = "rf_bump_workspace") -> object:
    """An op ``namespace::name`` whose schema says it writes nothing, whose kernel adds one to ``ws``
    (a tensor it closes over)."""
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(f"{name}(Tensor x) -> Tensor")

    def bump(x: torch.Tensor) -> torch.Tensor:
        ws.add_(1)
        return x.clone()

    lib.impl(name, bump, "CPU")
    _LIBRARIES.append(lib)
    return getattr(getattr(torch.ops, namespace), name).default


_LIBRARIES: list[torch.library.Library] = []


def _sum_around(op: object, ws: torch.Tensor) -> fx.GraphModule:
    # ws.sum() before and after the op, added: equal sums are one computation only if the op wrote nothing
    root = torch.nn.Module()
    root.ws = ws
    g = fx.Graph()
    x, w = g.placeholder("x"), g.get_attr("ws")
    before = g.call_function(torch.ops.aten.sum.default, (w,))
    out = g.call_function(op, (x,))
    after = g.call_function(torch.ops.aten.sum.default, (w,))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (before, after)), out))
    for node in g.nodes:  # as the trace's recorder leaves them: each output seen to share no argument's memory
        if node.op == "call_function":
            node.meta[SHARES_KEY] = ()
    return fx.GraphModule(root, g)


@pytest.mark.parametrize("namespace", ["aten", "prims", "readfence", "rf_fx_memory_user"])
def test_an_op_whose_kernel_someone_else_wrote_may_write_what_it_reaches_in_any_namespace(namespace: str) -> None:
    # its schema claims no write; its kernel writes a captured workspace: sharing the two sums
    # across it would compute 2 * before instead of before + after
    ws = torch.zeros(4)
    gm = _sum_around(_workspace_bumper(namespace, ws), ws)
    memory = GraphMemory(gm, (torch.ones(4),))
    assert memory.opaque
    run = compile_graph(gm)
    ws.zero_()
    got = run(torch.ones(4))
    ws.zero_()
    want = gm(torch.ones(4))
    assert torch.equal(got[0], want[0]) and want[0].item() == 4.0
    assert run.stats["shared"] == 0


def test_an_op_of_torch_that_writes_nothing_lets_the_sums_be_shared() -> None:
    # the same graph around torch's own clone: the pass still shares what it may (no false alarm)
    ws = torch.zeros(4)
    gm = _sum_around(torch.ops.aten.clone.default, ws)
    assert not GraphMemory(gm, (torch.ones(4),)).opaque
    run = compile_graph(gm)
    assert run.stats["shared"] == 1
    got, want = run(torch.ones(4)), gm(torch.ones(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- an output a schema calls fresh that is its input's memory -------------------------------------
#: Ways to make a value twice where the first is written between: each makes a copy and returns a
#: view of it through ``aten._unsafe_view``, whose schema declares a fresh output.
RESHAPED_TWICE = {
    "reshape_of_transpose": lambda x: x.t().reshape(-1),
    "flatten_of_transpose": lambda x: x.t().flatten(),
    "mT_reshape": lambda x: x.mT.reshape(x.shape[1], -1),
    "unsafe_view": lambda x: torch.ops.aten._unsafe_view(x * 2, [-1]),
}


@pytest.mark.parametrize("tracer", ["recorder", "make_fx"])
@pytest.mark.parametrize("name", list(RESHAPED_TWICE))
def test_a_value_made_twice_is_not_shared_when_the_first_was_written_through_a_view_no_schema_declares(name,
                                                                                                      tracer) -> None:
    make = RESHAPED_TWICE[name]

    def f(x):
        first = make(x)
        first.add_(100.0)  # writes the copy the first one made
        return make(x).sum() + first.sum() * 0  # the second is a new copy of the unwritten x

    import contextlib

    from readfence.core.tracing._record import record

    # the trace's recorder notes what each op's output was; a stage it cannot record is traced by
    # make_fx, whose graph says nothing of it: an output called fresh may then be any memory given
    gm = (record(f, [torch.ones(2, 3)], ["x"], outputs=lambda out: (out,), context=lambda r: contextlib.nullcontext(),
                 escape_op=None)[0] if tracer == "recorder" else make_fx(lambda x: (f(x),))(torch.ones(2, 3)))
    x = torch.arange(6.0).view(2, 3)
    # the independent reference: the graph itself, op by op
    assert torch.equal(compile_graph(gm)(x.clone())[0], gm(x.clone())[0])


@pytest.mark.parametrize("complex_scalar", [False, True], ids=["recorded", "make_fx"])
@pytest.mark.parametrize("name", ["reshape_of_transpose", "unsafe_view"])
def test_a_stage_that_writes_a_reshaped_copy_and_makes_it_again_runs_as_its_eager_step(name, complex_scalar,
                                                                                      monkeypatch) -> None:
    # the step lowered with its passes and without the validation (which would fall back to the
    # plain step where the passes differ from it) computes its eager step, step after step
    from readfence.backends import leaf, page_meta, softmax_attention, store_kv
    from tests.graph.test_lower_what_runs import lowered_against_eager, no_validation

    make = RESHAPED_TWICE[name]

    def prep(mode, shared, batch, meta):
        out = page_meta(shared, batch)
        x = torch.stack([out["kv_lens"].float(), out["kv_lens"].float() * 3])
        if complex_scalar:  # an argument the recorder cannot hold: the stage is traced by make_fx
            x = (x * (1 + 0j)).real.contiguous()
        first = make(x)
        first.add_(100.0)
        return {**out, "bias": make(x).sum() + first.sum() * 0}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + 1e-3 * meta["bias"]

    with no_validation(monkeypatch):
        equal, low = lowered_against_eager(leaf(f"twice_{name}_{int(complex_scalar)}", attend, prepare_in_graph=prep),
                                           steps=2)
    assert equal and low.optimized


def test_a_plan_traced_on_fake_tensors_notes_each_ops_output_memory_too() -> None:
    # a plan for a CUDA device is traced on fake tensors: their storages say what each output is
    # (without the note every output a schema calls fresh would be taken for any memory given)
    from readfence.backends import paged
    from readfence.core import ForwardMode, trace

    def marks(device: str) -> list[tuple[str, tuple[int, ...]]]:
        program = trace(paged(), ForwardMode.DECODE, batch_size=2, device=device)
        return [(n.name, n.meta[SHARES_KEY]) for s in program.stages for n in s.graph.gm.graph.nodes
                if SHARES_KEY in n.meta]

    real, fake = marks("cpu"), marks("cuda")
    assert real and fake == real
