"""Tracing: stage graphs, read annotations, calling convention, fake CUDA, writes, escapes."""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest
import torch

from readfence.backends import deepseek_v4, dense, linear, paged, redeclare, reference_compositions, sparse, tbo, trtllm_mha
from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, ForwardMode, Program, StageWriteError, clear_trace_cache, run_step, trace
from readfence.core.internal import example_step, flatten_inputs, trace_cache_size
from readfence.core.tracing._trace import trace_functions
from readfence.effects import ReadEffect, ReadEnd
from tests.conftest import SMALL as CFG

M = ForwardMode
LEAVES = [paged(), trtllm_mha(), deepseek_v4(), deepseek_v4(dspark=True), linear(), sparse(), dense()]


def _inputs() -> dict:
    return {
        "shared": {
            "req_to_token": torch.arange(32, dtype=torch.int32).reshape(4, 8),
            "seq_lens": torch.tensor([3, 4, 5, 6], dtype=torch.int32),
            "swa_map": torch.arange(32, dtype=torch.int32),
        },
        "batch": {"req_pool_indices": torch.tensor([0, 2])},
        "pools": {"k": torch.zeros(40)},
    }


def _nothing(shared, batch):
    return {}


def _toy(out=_nothing, inn=None, body=None, device="cpu") -> Program:
    return trace_functions(
        "toy", M.DECODE, inputs=_inputs(), device=device,
        prepare_out_graph=out,
        prepare_in_graph=inn or (lambda shared, batch, meta: {}),
        body=body or (lambda shared, batch, pools, meta: pools["k"].sum()),
    )


# ------------------------------------------------------------------------------------------
# Reads, views and aliases
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_reads_are_attributed_to_the_stage_of_the_consumer_of_a_view(device) -> None:
    def inn(shared, batch, meta):
        return {"head": shared["req_to_token"][:, :4], "lens": shared["seq_lens"][batch["req_pool_indices"]]}

    def body(shared, batch, pools, meta):
        rows = meta["head"][batch["req_pool_indices"]].long().reshape(-1)
        pools["k"][rows] = 1.0  # a write to a pool through an index: allowed
        return pools["k"].sum() + meta["lens"].sum()

    prog = _toy(inn=inn, body=body, device=device)
    assert prog.traced() == ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    # the view node itself reads nothing; the index in the body does
    in_reads = prog.reads(PREPARE_IN_GRAPH)
    assert list(in_reads.values()) == [frozenset({"seq_lens"})]
    stage, node = prog.last_reader("req_to_token")
    assert stage == BODY
    gm = prog.stage(BODY).graph.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name[node].meta["readfence_reads"] == frozenset({"req_to_token"})
    assert by_name[node].target is torch.ops.aten.index.Tensor
    assert prog.last_reader("swa_map") is None and prog.traced()["swa_map"] is ReadEnd.NONE


def test_a_view_returned_by_the_eager_stage_is_read_by_the_copy_into_the_graph() -> None:
    # what prepare_out_graph returns crosses into the graph as a copy made when it returns
    # (core.cross_into_graph), a node of that stage: the copy is the last read, even of an
    # identity output
    prog = _toy(out=lambda shared, batch: {"pt": shared["req_to_token"].narrow(1, 0, 4), "r": shared["swa_map"]},
                inn=lambda shared, batch, meta: {"x": meta["pt"].sum()},
                body=lambda shared, batch, pools, meta: pools["k"].sum() + meta["x"] + meta["r"].sum())
    assert prog.traced() == ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "swa_map": ReadEnd.PRE_REPLAY})
    stage, node = prog.last_reader("req_to_token")
    nodes = {n.name: n for n in prog.stage(stage).graph.gm.graph.nodes}
    assert stage == PREPARE_OUT_GRAPH and nodes[node].target is torch.ops.aten.clone.default
    assert prog.stage(BODY).analysis.buffers_read() == frozenset()


def test_an_identity_output_of_the_last_stage_is_read_after_the_forward() -> None:
    prog = _toy(body=lambda shared, batch, pools, meta: shared["seq_lens"])
    assert prog.traced() == ReadEffect.of({"seq_lens": ReadEnd.POST_REPLAY})
    assert prog.last_reader("seq_lens") == (BODY, "output")


def test_a_closure_captured_shared_tensor_is_seen_by_storage() -> None:
    inputs = _inputs()
    captured = inputs["shared"]["swa_map"]
    prog = trace_functions(
        "toy", M.DECODE, inputs=inputs, prepare_out_graph=_nothing,
        prepare_in_graph=lambda shared, batch, meta: {"y": captured * 2},
        body=lambda shared, batch, pools, meta: pools["k"].sum())
    assert prog.traced() == ReadEffect.of({"swa_map": ReadEnd.IN_REPLAY})


@torch.library.custom_op("readfence_test::lens_plus", mutates_args=())
def _lens_plus(lens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + lens.sum()


@_lens_plus.register_fake
def _(lens, x):
    return torch.empty_like(x)


@torch.library.custom_op("readfence_test::bump", mutates_args=("t",))
def _bump(t: torch.Tensor) -> None:
    t.add_(1)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_custom_ops_are_visible_and_their_schema_says_reads_and_writes(device) -> None:
    def body(shared, batch, pools, meta):
        _bump(pools["k"])  # mutates a pool: fine
        return _lens_plus(shared["seq_lens"], pools["k"]).sum()

    prog = _toy(body=body, device=device)
    assert prog.traced() == ReadEffect.of({"seq_lens": ReadEnd.POST_REPLAY})
    assert prog.last_reader("seq_lens") == (BODY, "lens_plus")

    with pytest.raises(StageWriteError, match="writes shared buffer 'seq_lens' in stage prepare_out_graph "
                                              r"\(node 'bump', op readfence_test.bump.default, at .*test_trace.py"):
        _toy(out=lambda shared, batch: (_bump(shared["seq_lens"]), {})[1], device=device)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("how", ["add_", "out", "setitem", "index_put_", "view_copy_"])
def test_writes_to_shared_buffers_are_errors(device, how) -> None:
    def inn(shared, batch, meta):
        t = shared["req_to_token"]
        if how == "add_":
            t.add_(1)
        elif how == "out":
            torch.mul(t, 2, out=t)
        elif how == "setitem":
            t[0, 1:3] = 7
        elif how == "index_put_":
            t.index_put_((batch["req_pool_indices"],), torch.zeros((), dtype=t.dtype, device=t.device))
        else:
            t.view(-1).narrow(0, 0, 2).copy_(torch.zeros(2, dtype=t.dtype, device=t.device))
        return {}

    with pytest.raises(StageWriteError) as info:
        _toy(inn=inn, device=device)
    e = info.value
    assert (e.backend, e.stage, e.buffer) == ("toy", "prepare_in_graph", "req_to_token")
    assert f"node {e.node!r}" in str(e) and "writes shared buffer 'req_to_token'" in str(e)


def _escape(escape: str, lens: torch.Tensor) -> int:
    if escape == "numpy":
        return int(lens.numpy().sum())
    if escape == "tolist":
        return sum(lens.tolist())
    if escape == "item":
        return int(lens[1].item()) * 4  # a view of the buffer escapes
    # an opaque "kernel" reading the buffer's memory through its address
    return sum((ctypes.c_int32 * lens.numel()).from_address(lens.data_ptr()))


@pytest.mark.parametrize("escape", ["numpy", "tolist", "item", "data_ptr"])
def test_an_escape_out_of_the_graph_counts_for_the_buffers_it_reaches(escape) -> None:
    # The out-of-graph stage runs eagerly: on any path it reads what it reads before the
    # replay (PRE_REPLAY), and its outputs cross as copies; the escape reads the buffer its
    # tensor is a view of, no other (the paths its Python may take on the value are for the runs
    # on varied states to see); a reference escaping (numpy, data_ptr) may be read through later: UNKNOWN.
    prog = _toy(out=lambda shared, batch: {"total": torch.tensor(_escape(escape, shared["seq_lens"]))},
                body=lambda shared, batch, pools, meta: meta["total"] * 2)
    lens_end = ReadEnd.UNKNOWN if escape in ("numpy", "data_ptr") else ReadEnd.PRE_REPLAY
    assert prog.traced() == ReadEffect.of({"seq_lens": lens_end})
    ((stage, node, why, source),) = prog.unfaithful()
    assert (stage, why) == (PREPARE_OUT_GRAPH, f"escape: {escape}()")
    assert "test_trace.py" in source and "_escape" in source


@pytest.mark.parametrize("escape", ["numpy", "tolist", "item", "data_ptr"])
def test_escapes_in_the_graph_read_every_buffer_until_post_replay_and_the_stage_runs_eagerly(escape) -> None:
    def inn(shared, batch, meta):
        lens = shared["seq_lens"]
        if escape == "numpy":
            total = int(lens.numpy().sum())
        elif escape == "tolist":
            total = sum(lens.tolist())
        elif escape == "item":
            total = int(lens[1].item()) * 4  # a view of the buffer escapes
        else:  # an opaque "kernel" reading the buffer's memory through its address
            cells = (ctypes.c_int32 * lens.numel()).from_address(lens.data_ptr())
            total = sum(cells)
        return {"total": torch.tensor(total)}

    prog = _toy(inn=inn, body=lambda shared, batch, pools, meta: meta["total"] * 2)
    # the stage runs its Python in the step: on a path not traced it could read anything, and hand
    # the body a view of anything (its outputs are not copied), so every buffer is read until the
    # replay's end; a reference escaping (numpy, data_ptr) may be read through later: UNKNOWN
    lens_end = ReadEnd.UNKNOWN if escape in ("numpy", "data_ptr") else ReadEnd.POST_REPLAY
    assert prog.traced() == ReadEffect.of(
        {"req_to_token": ReadEnd.POST_REPLAY, "seq_lens": lens_end, "swa_map": ReadEnd.POST_REPLAY})
    # what the stage hands over may be a view of any buffer: the body's consumer reads them all
    (consumer,) = prog.reads(BODY)
    assert prog.reads(BODY)[consumer] == {"req_to_token", "seq_lens", "swa_map"}
    assert prog.last_reader("swa_map") == (BODY, consumer)
    assert list(prog.opaque()[PREPARE_IN_GRAPH].values()) == [f"escape: {escape}()"]
    stage = prog.stage(PREPARE_IN_GRAPH)
    assert not stage.analysis.faithful
    # the graph misses what the escape computed; run() falls back to the Python stage
    env = flatten_inputs(**_inputs())
    env["shared.seq_lens"] = torch.tensor([1, 1, 1, 1], dtype=torch.int32)
    assert prog.run(env)["logits"].item() == 8
    # under fake tensors the trace cannot continue past the escape: everything UNKNOWN
    fake = _toy(inn=inn, body=lambda shared, batch, pools, meta: meta["total"] * 2, device="cuda")
    assert fake.traced() == ReadEffect.unknown() and fake.aborted


def test_an_escaping_fresh_value_out_of_the_graph_is_a_read_before_the_replay() -> None:
    # the sum is a visible read; only a fresh scalar escapes to the host, there and then: the
    # value it hands over is computed from the lengths, and from no other buffer
    prog = _toy(out=lambda shared, batch: {"n": torch.tensor(int(shared["seq_lens"].sum().item()))})
    assert prog.traced() == ReadEffect.of({"seq_lens": ReadEnd.PRE_REPLAY})
    assert list(prog.opaque()[PREPARE_OUT_GRAPH].values()) == ["escape: item()"]
    assert not prog.stage(PREPARE_OUT_GRAPH).analysis.faithful  # the value is baked: run eagerly


# ------------------------------------------------------------------------------------------
# Reference backends: fake CUDA, calling convention, execution
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", LEAVES, ids=str)
def test_fake_cuda_trace_observes_the_same_effect_as_cpu(backend) -> None:
    for mode in ForwardMode:
        cpu = trace(backend, mode, cfg=CFG)
        cuda = trace(backend, mode, cfg=CFG, device="cuda")
        assert cuda.traced() == cpu.traced(), mode
        for buffer in cpu.buffers:
            assert cuda.last_reader(buffer) == cpu.last_reader(buffer), (mode, buffer)
        body = cuda.stage(BODY).graph.gm
        vals = [n.meta["val"] for n in body.graph.nodes if n.op == "placeholder"]
        assert {v.device.type for v in vals} == {"cuda"}


def test_calling_convention_and_annotations() -> None:
    prog = trace(paged(), M.DECODE, cfg=CFG)
    assert [s.stage for s in prog] == [PREPARE_OUT_GRAPH, PREPARE_IN_GRAPH, BODY]
    assert prog.buffers == ("req_to_token", "seq_lens", "swa_map", "state_slots")
    inn = prog.stage(PREPARE_IN_GRAPH)
    assert inn.graph.inputs[:4] == ("shared.req_to_token", "shared.seq_lens", "shared.swa_map", "shared.state_slots")
    assert inn.graph.outputs == ("meta_in.kv_indices", "meta_in.kv_lens")  # named by the stage that made them
    body = prog.stage(BODY)
    assert "params.['layers.0.wqkv']" in body.graph.inputs and "pools.k_cache" in body.graph.inputs
    assert {"meta_in.kv_indices", "meta_in.kv_lens"} <= set(body.graph.inputs)
    assert body.graph.outputs == ("logits",)
    placeholders = [n for n in body.graph.gm.graph.nodes if n.op == "placeholder"]
    assert [n.meta["readfence_input"] for n in placeholders] == list(body.graph.inputs)
    assert placeholders[0].name == "shared_req_to_token"
    # every node is annotated; the body reads no shared buffer (paged snapshots in graph)
    for stage in prog:
        assert all("readfence_reads" in n.meta for n in stage.graph.gm.graph.nodes)
    assert body.analysis.buffers_read() == frozenset()
    assert prog.last_reader("seq_lens")[0] == PREPARE_IN_GRAPH
    assert prog.traced() == paged().read_effect(M.DECODE)
    # positional call == env call
    step = example_step(CFG, M.DECODE, 2)
    env = flatten_inputs(shared=step.shared, batch=step.batch)
    positional = inn(*[env[name] for name in inn.graph.inputs])
    named = inn.run(env)
    assert all(torch.equal(a, named[n]) for a, n in zip(positional, inn.graph.outputs))


BACKENDS = [*LEAVES, *reference_compositions().values(), tbo(deepseek_v4(dspark=True), paged(), trtllm_mha())]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_running_the_program_equals_the_eager_step_bit_for_bit(backend) -> None:
    for mode in ForwardMode:
        prog = trace(backend, mode, cfg=CFG)
        step = example_step(CFG, mode, 2, seed=1)
        ref = step.clone()
        env = prog.run(flatten_inputs(shared=step.shared, batch=step.batch, pools=step.pools, params=step.params))
        expected = run_step(backend, mode, CFG, ref)
        assert torch.equal(env["logits"], expected), mode
        for name, pool in step.pools.items():  # the graphs wrote the KV caches in place
            assert torch.equal(pool, ref.pools[name]), (mode, name)


def test_a_program_keeps_none_of_the_traced_examples_tensors() -> None:
    # a cached program that held its example's tensors (through the stage it runs eagerly) kept a
    # deep model's caches alive, once for every program in the trace cache and every lowered size
    inputs = _inputs()
    refs = [weakref.ref(t) for t in flatten_inputs(**inputs).values()]

    def inn(shared, batch, meta):  # escapes the tracer: the program runs this stage as written
        return {"total": torch.tensor(sum(shared["seq_lens"].tolist()))}

    prog = trace_functions("toy", M.DECODE, inputs=inputs, prepare_out_graph=_nothing, prepare_in_graph=inn,
                           body=lambda shared, batch, pools, meta: meta["total"] * 2 + pools["k"].sum())
    assert not prog.stage(PREPARE_IN_GRAPH).analysis.faithful
    del inputs
    gc.collect()
    assert [r() for r in refs if r() is not None] == []
    env = flatten_inputs(**_inputs())
    env["shared.seq_lens"] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert prog.run(env)["logits"].item() == 20


def test_traces_are_cached_per_code_not_per_declaration() -> None:
    a = trace(sparse(), M.DECODE, cfg=CFG)
    assert trace(sparse(), M.DECODE, cfg=CFG) is a
    loose = redeclare(sparse(), lambda m: ReadEffect.unknown())
    assert trace(loose, M.DECODE, cfg=CFG) is a
    assert trace(sparse(), M.DECODE, cfg=CFG, batch_size=3) is not a
    assert trace(sparse(top_k=1), M.DECODE, cfg=CFG) is not a


def test_the_trace_cache_is_bounded_by_graph_nodes_too(monkeypatch) -> None:
    from readfence.core.internal import CACHES

    traces = CACHES["traces"]
    clear_trace_cache()
    a = trace(paged(), M.DECODE, cfg=CFG)
    nodes = sum(len(s.graph.gm.graph.nodes) for s in a.stages)
    monkeypatch.setattr(traces, "budget", nodes + nodes // 2)  # room for one such program
    b = trace(paged(), M.DECODE, cfg=CFG, batch_size=3)
    assert trace_cache_size() == 1 and trace(paged(), M.DECODE, cfg=CFG, batch_size=3) is b
    assert trace(paged(), M.DECODE, cfg=CFG) is not a  # forgotten, traced again
    monkeypatch.setattr(traces, "budget", 3 * nodes)
    trace(paged(), M.DECODE, cfg=CFG, batch_size=3)
    assert trace_cache_size() == 2


# -- a torch.compile'd function inside a stage ---------------------------------------------------


@torch.compile(backend="eager")  # dynamo wraps it as for any backend; "eager" keeps the test fast
def _compiled_lengths(lens: torch.Tensor) -> torch.Tensor:
    return (lens * 2 - lens).relu()


def _compiled_reader(s, b, m, layer, q):
    from tests.adversarial import _gather
    return _compiled_lengths(_gather(s["seq_lens"], b))


def test_a_compiled_function_in_a_stage_is_traced_through_and_its_reads_are_seen():
    # dynamo refuses to be traced by FX; the trace runs the Python it compiles instead, so the
    # body's read of the lengths inside it is seen (declared IN_REPLAY: refused) ...
    from readfence.core import audit
    from readfence.graph import CpuDevice, Policy, run_overlapped, run_serial, verify
    from tests.adversarial import _declare, body_reader

    late = body_reader("compiled", _compiled_reader)
    refused = audit(late, M.DECODE, cfg=CFG).failure()
    assert (refused.buffer, refused.observed, refused.reader[0]) == ("seq_lens", ReadEnd.POST_REPLAY, "body")
    program = trace(late, M.DECODE, cfg=CFG)
    assert program.stage(BODY).analysis.faithful  # its ops are in the graph, not an escape
    # ... and declared POST_REPLAY it is lowered, runs bit-identical to serial, and verifies clean
    sound = body_reader("compiled_sound", _compiled_reader, declare=_declare(lens=ReadEnd.POST_REPLAY))
    ref = run_serial(sound, M.DECODE, steps=6, batch_size=2, cfg=CFG)
    with CpuDevice(timeout=30) as dev:
        res = run_overlapped(sound, M.DECODE, steps=6, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG)
        assert res.matches(ref) and res.violations == ()
        report = verify(sound, M.DECODE, steps=4, batch_size=2, device=dev, cfg=CFG, policy=Policy.PER_BUFFER)
        assert "PER_BUFFER clean" in str(report.unwrap())
