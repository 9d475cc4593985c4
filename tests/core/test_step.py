"""The step protocol, written once: its stages, its names, what a stage may return."""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

import readfence
from readfence.backends import leaf, page_meta, paged, softmax_attention, store_kv
from readfence.core import (
    BODY,
    PREPARE_IN_GRAPH,
    PREPARE_OUT_GRAPH,
    STAGES,
    ForwardMode,
    StageOutputError,
    audit,
    eval_step,
    run_program,
    run_step,
    step_functions,
    trace,
)
from readfence.core.internal import (
    EAGER,
    OutputGuard,
    StageCall,
    StepFunctions,
    example_step,
    flatten_group,
    flatten_inputs,
    observe_step,
    prepare,
    trace_step,
)
from tests.conftest import SMALL as CFG

PACKAGE = pathlib.Path(readfence.__file__).parent


def _string_literals(nodes: list[ast.AST]) -> list[ast.Constant]:
    docstrings = set()
    for node in nodes:
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


@pytest.fixture(scope="module")
def package_nodes() -> list[tuple[pathlib.Path, list[ast.AST]]]:
    """Every module of the package and the nodes of its syntax tree, parsed and walked once for
    the tests that read the source."""
    return [(f, list(ast.walk(ast.parse(f.read_text())))) for f in sorted(PACKAGE.rglob("*.py"))]


def test_each_stage_name_is_a_string_literal_once_in_the_package(package_nodes) -> None:
    assert len(package_nodes) > 50  # the whole package was read
    literals = [(f"{f.relative_to(PACKAGE)}:{n.lineno}", n.value) for f, nodes in package_nodes
                for n in _string_literals(nodes)]
    for stage in STAGES:
        places = [where for where, value in literals if value == stage.name]
        assert len(places) == 1 and places[0].startswith("core/_stages.py:"), (stage, places)


def test_the_copy_into_the_graph_has_one_caller_in_the_package(package_nodes) -> None:
    calls = [f"{f.relative_to(PACKAGE)}:{n.lineno}" for f, nodes in package_nodes for n in nodes
             if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "cross_into_graph"]
    assert len(calls) == 1 and calls[0].startswith("core/_step.py"), calls


# -- names -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [
    {"a.b": 1, "a": {"b": 2}},  # a dotted key and a nested one
    {1: 1, "1": 2, (1,): 3},  # an int, a str and a tuple key
    {"x": [1, (2, 3)], "x.0": 4, "[1]": 5},
    {ForwardMode.DECODE: 1, "DECODE": 2, None: 3},
])
def test_flattened_names_never_collide(tree: dict) -> None:
    names = [n for n, _ in flatten_group("meta", tree)]
    assert len(set(names)) == len(names) == len(torch.utils._pytree.tree_leaves(tree))


def test_two_keys_whose_reprs_agree_are_refused_by_name() -> None:
    class Key:
        def __init__(self, i: int) -> None:
            self.i = i

        def __repr__(self) -> str:
            return "Key"

    with pytest.raises(StageOutputError, match=r"both flatten to 'meta.\[Key\]'"):
        flatten_group("meta", {Key(1): 1, Key(2): 2})


def test_the_body_reads_each_metadata_key_from_the_stage_that_made_it() -> None:
    call = StageCall(BODY, lambda **kw: None, {"shared": {"s": 1}, "meta": {"a": 1, "b": {"c": 2}}},
                     {"meta": {"a": "meta", "b": "meta_in"}})
    assert call.named_leaves()[0] == ["shared.s", "meta.a", "meta_in.b.c"]


# -- the protocol ----------------------------------------------------------------------------
def _fns(out, inn, body) -> StepFunctions:
    return StepFunctions(out, inn, body, backend="toy")


def test_each_step_sees_its_own_out_of_graph_values_and_the_body_the_refinement() -> None:
    seen = []
    fns = _fns(lambda shared, batch: {"n": shared["x"] * 1},
               lambda shared, batch, meta: seen.append(meta["n"].clone()) or {"n": meta["n"].clamp(min=2)},
               lambda shared, batch, meta: meta["n"] * 10)
    for values in ([1, 3], [0, 5]):
        out = eval_step(EAGER, fns, {"shared": {"x": torch.tensor(values)}, "batch": {}})
        assert out.tolist() == [max(v, 2) * 10 for v in values]
    assert [s.tolist() for s in seen] == [[1, 3], [0, 5]]  # never the previous step's refinement


def test_what_crosses_into_the_graph_is_a_copy_inside_the_out_of_graph_stage() -> None:
    x = torch.arange(4)
    stages = []

    class Recorder:
        def call(self, call: StageCall):
            out = call()
            stages.append((call.stage, out))
            return out

    eval_step(Recorder(), _fns(lambda shared, batch: {"v": shared["x"][:2], "rows": [shared["x"][2:]]},
                               lambda shared, batch, meta: {}, lambda shared, batch, meta: meta["v"]),
              {"shared": {"x": x}, "batch": {}})
    out = stages[0][1]
    assert stages[0][0] is PREPARE_OUT_GRAPH
    assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for t in (out["v"], out["rows"][0]))


def test_prepare_is_the_protocol_stopped_before_the_body() -> None:
    backend = paged()
    step = example_step(CFG, ForwardMode.DECODE, 2)
    meta = prepare(backend, ForwardMode.DECODE, step.shared, step.batch)
    direct = backend.prepare_in_graph(ForwardMode.DECODE, step.shared, step.batch, {})
    assert sorted(meta) == sorted(direct) and all(torch.equal(meta[k], direct[k]) for k in meta)


def test_serial_traced_and_observed_interpretations_compute_the_same_step() -> None:
    backend = paged()
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        step = example_step(CFG, mode, 2, seed=3)
        serial = run_step(backend, mode, CFG, step.clone())
        program = trace_step(step_functions(backend, mode, CFG), mode, step.clone().groups())
        env = flatten_inputs(**step.clone().groups())
        assert torch.equal(run_program(program, env), serial)
        accesses = observe_step(step_functions(backend, mode, CFG), step.clone().groups())
        assert {a.buffer for a in accesses} == {"req_to_token", "seq_lens"}


# -- what a stage may return ----------------------------------------------------------------
def _leaf_returning(inn):
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    return leaf("returns", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch),
                prepare_in_graph=inn)


@pytest.mark.parametrize(("value", "what"), [
    ({1, 2}, "set"),
    (torch.float32, "dtype"),
    (object(), "object"),
])
def test_a_value_a_step_cannot_carry_is_refused_naming_stage_key_and_line(value, what) -> None:
    def inn(mode, shared, batch, meta):
        return {"odd": {"inner": [value]}}  # the line the error names

    with pytest.raises(StageOutputError) as e:
        trace(_leaf_returning(inn), ForwardMode.DECODE, cfg=CFG)
    text = str(e.value)
    assert "stage prepare_in_graph" in text and "['odd']['inner'][0]" in text and what in text, text
    assert f"{__file__}:{inn.__code__.co_firstlineno + 1} in inn" in text, text


class _ListEquality:
    """A hashable key whose ``==`` is a list (as an array type's is elementwise)."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> list[bool]:  # type: ignore[override]
        return [True]


class _RaisingEquality:
    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing me")


@pytest.mark.parametrize(("extra", "key", "where"), [
    (lambda lens: {torch.tensor([1, 2]): lens}, "Tensor", ""),
    (lambda lens: {"rows": [{torch.tensor(0): lens}]}, "Tensor", " at key ['rows'][0]"),
    (lambda lens: {_ListEquality(): 1}, "_ListEquality", ""),
    (lambda lens: {"inner": {_RaisingEquality(): lens}}, "_RaisingEquality", " at key ['inner']"),
])
def test_a_key_that_compares_as_no_python_value_is_refused_naming_stage_key_and_line(extra, key, where) -> None:
    # hashable, but found by ``==`` (a tensor's is elementwise): every run refuses it alike, the
    # serial one too, naming the stage, the key and the line, never a raw error from the tracer
    def snap(mode, shared, batch):
        meta = page_meta(shared, batch)
        return {**meta, **extra(meta["kv_lens"] + 0)}

    from readfence.graph import CpuDevice, Policy, lower

    backend = leaf("keyed", _attend, prepare_out_graph=snap)
    dev = CpuDevice()
    runs = [lambda: trace(backend, ForwardMode.DECODE, cfg=CFG), lambda: audit(backend, ForwardMode.DECODE, cfg=CFG),
            lambda: run_step(backend, ForwardMode.DECODE, CFG, example_step(CFG, ForwardMode.DECODE, 2)),
            lambda: lower(backend, ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG)]
    with dev:
        for run in runs:
            with pytest.raises(StageOutputError) as e:
                run()
            text = str(e.value)
            assert f"stage prepare_out_graph returned a dict keyed by {key}" in text and f"{where} (at " in text, text
            assert f"{__file__}:{extra.__code__.co_firstlineno} in <lambda>" in text, text  # where the key is made


def test_a_stage_must_return_a_dict_and_the_body_a_tensor() -> None:
    with pytest.raises(StageOutputError, match="stage prepare_in_graph returned list .* instead of a dict"):
        eval_step(EAGER, _fns(lambda shared, batch: {}, lambda shared, batch, meta: [1], lambda **kw: 0),
                  {"shared": {}, "batch": {}})
    with pytest.raises(StageOutputError, match="stage body returned int 0 as its output"):
        eval_step(EAGER, _fns(lambda shared, batch: {}, lambda shared, batch, meta: {}, lambda **kw: 0),
                  {"shared": {}, "batch": {}})


def _attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])


def _kv_indices_alone(mode, shared, batch):
    return page_meta(shared, batch)["kv_indices"]  # a tensor, not a dict: the line the error names


@pytest.mark.parametrize("wrap", ["leaf", "hybrid_linear", "tbo"])
def test_a_prepare_stage_returning_a_tensor_is_named_with_its_leaf_and_line_in_every_run(wrap) -> None:
    from readfence.backends import hybrid_linear, linear, tbo
    from readfence.core import audit
    from readfence.graph import run_serial

    mine = leaf("tensor_meta", _attend, prepare_out_graph=_kv_indices_alone)
    target = {"leaf": mine, "hybrid_linear": hybrid_linear(mine, linear()), "tbo": tbo(paged(), mine)}[wrap]
    line = f"{__file__}:{_kv_indices_alone.__code__.co_firstlineno + 1} in _kv_indices_alone"
    for run in (lambda: run_serial(target, steps=1, batch_size=2, cfg=CFG),
                lambda: audit(target, ForwardMode.DECODE, cfg=CFG, batch_sizes=[2])):
        with pytest.raises(StageOutputError) as e:
            run()
        text = str(e.value)
        assert text.startswith("backend 'tensor_meta' stage prepare_out_graph returned Tensor tensor("), text
        assert f"instead of a dict (at {line}): a prepare stage returns a dict" in text, text
        assert "put the tensor under a key" in text and e.value.stage == "prepare_out_graph"


def _attend_none(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)  # and forgets to return


def _attend_one_head(mode, layer, q, k, v, pools, shared, batch, meta):
    return _attend(mode, layer, q, k, v, pools, shared, batch, meta)[:, :1]


def _attend_double(mode, layer, q, k, v, pools, shared, batch, meta):
    return _attend(mode, layer, q, k, v, pools, shared, batch, meta).double()


def _attend_on_meta(mode, layer, q, k, v, pools, shared, batch, meta):
    return torch.empty_like(_attend(mode, layer, q, k, v, pools, shared, batch, meta), device="meta")


@pytest.mark.parametrize("attend,got", [(_attend_none, "NoneType None"), (_attend_one_head, "a tensor of shape [2, 1, "),
                                        (_attend_double, f"a tensor of shape [2, {CFG.heads}, {CFG.head_dim}] (torch.float64 on cpu)"),
                                        (_attend_on_meta, f"a tensor of shape [2, {CFG.heads}, {CFG.head_dim}] (torch.float32 on meta)")])
def test_attend_returning_none_or_a_wrong_shape_dtype_or_device_is_named_with_its_leaf_layer_and_line(attend, got) -> None:
    from readfence.backends import hybrid_linear, linear
    from readfence.graph import run_serial

    mine = leaf("bad_attend", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch))
    for target in (mine, hybrid_linear(mine, linear())):
        with pytest.raises(StageOutputError) as e:
            run_serial(target, steps=1, batch_size=2, cfg=CFG)
        text = str(e.value)
        assert text.startswith(f"backend 'bad_attend' attend returned {got}"), text
        assert " in layer 0 (at " in text and f"{__file__}:" in text and f"in {attend.__name__})" in text, text
        assert text.endswith(f"attend returns a tensor shaped like q, [2, {CFG.heads}, {CFG.head_dim}], of q's dtype "
                             f"and device (torch.float32 on cpu)"), text


def test_attend_may_return_qs_rows_flattened() -> None:
    from readfence.graph import run_serial

    flat = leaf("flat", lambda *args: _attend(*args).flatten(1),
                prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch))
    assert run_serial(flat, steps=1, batch_size=2, cfg=CFG).matches(
        run_serial(leaf("shaped", _attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch)),
                   steps=1, batch_size=2, cfg=CFG))


def test_the_output_guard_refuses_new_keys_values_and_shapes() -> None:
    traced = {"n": 3, "lens": torch.zeros(2), "rows": [torch.zeros(1)]}
    guard = OutputGuard.of(PREPARE_IN_GRAPH, traced, backend="mine")
    guard.check({"n": 3, "lens": torch.ones(2), "rows": [torch.ones(1)]})  # new values of the same shapes: fine
    for changed, expected in (({"n": 4, "lens": torch.ones(2), "rows": [torch.ones(1)]}, r"returned 4 at key \['n'\]"),
                              ({"n": 3, "lens": torch.ones(3), "rows": [torch.ones(1)]}, r"shape \(3,\).*pad it"),
                              ({"n": 3, "lens": torch.ones(2)}, r"returned keys")):
        with pytest.raises(StageOutputError, match=expected):
            guard.check(changed)


def test_the_output_guard_holds_floats_bit_for_bit_with_nan_equal_to_nan() -> None:
    guard = OutputGuard.of(PREPARE_OUT_GRAPH, {"cap": float("nan"), "zero": 0.0}, backend="mine")
    guard.check({"cap": float("nan"), "zero": 0.0})  # a fresh nan is the nan traced
    guard.check({"cap": -math.nan, "zero": 0.0})  # a nan of another sign or payload: no op reads it
    # -0.0 is not 0.0 for a graph that baked one of them (1 / x, copysign)
    for changed, expected in (({"cap": 1.0, "zero": 0.0}, r"returned 1.0 at key \['cap'\] where the traced step returned nan"),
                              ({"cap": float("nan"), "zero": -0.0}, r"returned -0.0 at key \['zero'\]")):
        with pytest.raises(StageOutputError, match=expected):
            guard.check(changed)


def test_the_output_guard_holds_only_the_python_values_a_captured_stage_reads() -> None:
    traced = {"bound": 7, "cap": float("nan"), "lens": torch.zeros(2), "nested": {"flag": True}}
    guard = OutputGuard.of(PREPARE_OUT_GRAPH, traced, backend="mine").consuming({"lens", "nested"})
    guard.check({"bound": 9, "cap": 2.0, "lens": torch.ones(2), "nested": {"flag": True}})  # not read: may change
    for changed, expected in (
            ({"bound": torch.ones(1), "cap": 2.0, "lens": torch.ones(2), "nested": {"flag": True}},
             r"where the traced step returned a Python value"),  # but stays a Python value, not a graph input
            ({"bound": 7, "cap": 2.0, "lens": torch.ones(3), "nested": {"flag": True}}, r"shape \(3,\)"),
            ({"bound": 7, "cap": 2.0, "lens": torch.ones(2), "nested": {"flag": False}},
             r"returned False at key \['nested'\]\['flag'\]")):
        with pytest.raises(StageOutputError, match=expected):
            guard.check(changed)
