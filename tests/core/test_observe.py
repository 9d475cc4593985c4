"""The runtime read observer: user backends that hide their reads, and the cross-check."""

from __future__ import annotations

from typing import NamedTuple

import attrs
import pytest
import torch

from readfence.backends import REFERENCE_LEAVES, Leaf, leaf, page_meta, paged, softmax_attention, store_kv
from readfence.core import (
    BODY,
    PREPARE_IN_GRAPH,
    Disagreement,
    ForwardMode,
    Observation,
    ReadObserver,
    Stage,
    clear_trace_cache,
    cross_check,
    observe,
    trace,
)
from readfence.core._observe import observe_functions
from readfence.core.internal import example_step
from readfence.core.tracing._trace import trace_functions
from readfence.effects import ReadEffect, ReadEnd
from tests.conftest import ONE_LAYER
from tests.conftest import SMALL as CFG

M = ForwardMode
NONE, PRE, IN, POST, UNKNOWN = (ReadEnd.NONE, ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY,
                                ReadEnd.UNKNOWN)
SUM, CLONE = "aten.sum.default", "aten.clone.default"


# ------------------------------------------------------------------------------------------
# User backends that hide a read of one buffer from a name-based analysis
# ------------------------------------------------------------------------------------------


def _user(name, extra, *, prepare_out_graph=None, prepare_in_graph=None):
    """Paged attention (metadata planned in graph) plus ``extra(...)``, a read of some other
    shared buffer folded into the output with weight 0, so only the read is in question."""

    def prep_in(mode, shared, batch, meta):
        out = page_meta(shared, batch)
        if prepare_in_graph is not None:
            out.update(prepare_in_graph(shared=shared, batch=batch, meta=meta))
        return out

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out + 0 * extra(layer=layer, shared=shared, batch=batch, meta=meta)

    prep_out = None
    if prepare_out_graph is not None:
        def prep_out(mode, shared, batch):
            return prepare_out_graph(shared=shared, batch=batch)

    return leaf(name, attend, prepare_out_graph=prep_out, prepare_in_graph=prep_in)


def _cat_of_pieces(shared, **_):
    return torch.cat(shared["swa_map"].split(32)).sum()


def _chunks(shared, **_):
    return torch.stack(shared["swa_map"].chunk(4)).amax()


def _unbound(shared, **_):
    rows = shared["req_to_token"].unbind(0)
    return torch.maximum(rows[1], rows[2]).sum()


def _iterated(shared, **_):
    total = torch.zeros((), dtype=torch.int64)
    for row in shared["req_to_token"]:  # iteration: unbind pieces
        total = total + row[0]
    return total


# closure: the attend function reads a free variable that an earlier stage bound
def _closure_backend():
    captured = None

    def plan(shared, batch):
        nonlocal captured
        captured = shared["state_slots"]
        return {}

    return _user("closure", lambda **_: captured.float().mean(), prepare_out_graph=plan)


class _Holder:
    """An engine-style backend object keeping a reference to a shared tensor."""

    ref: torch.Tensor | None = None


_HOLDER = _Holder()


def _attr_plan(shared, batch):
    _HOLDER.ref = shared["swa_map"][: 8]
    return {}


_GLOBAL_REF: torch.Tensor | None = None


def _global_plan(shared, batch, meta):
    global _GLOBAL_REF
    _GLOBAL_REF = shared["state_slots"]
    return {}


def _dlpack(shared, **_):
    return torch.from_dlpack(torch.to_dlpack(shared["swa_map"])).sum()


def _odd_layers(layer, shared, **_):
    return shared["swa_map"].sum() if layer == 1 else 0


def _some_batches(shared, batch, **_):
    # a host read of the batch (not shared): the example step of seed 0 starts at row 0
    return shared["state_slots"].sum() if int(batch["req_pool_indices"][0]) == 1 else 0


# plan/run: the plan keeps a reference to the page table in a Python object; the run kernel,
# a custom op whose own arguments touch no shared buffer, reads it inside its implementation
class _FlashPlan:
    pages: torch.Tensor | None = None
    rows: torch.Tensor | None = None


_PLAN = _FlashPlan()


@torch.library.custom_op("readfence_test_observe::run", mutates_args=())
def _run(q: torch.Tensor) -> torch.Tensor:
    rows = _PLAN.pages.index_select(0, _PLAN.rows)
    return q + rows.float().mean()


@_run.register_fake
def _(q):
    return torch.empty_like(q)


def _plan(shared, batch):
    _PLAN.pages, _PLAN.rows = shared["req_to_token"], batch["req_pool_indices"].clone()
    return {}


RUN = "readfence_test_observe.run.default"


class Case(NamedTuple):
    """A user backend hiding a read of ``buffer``: its observed end and last reader."""

    backend: Leaf
    buffer: str
    end: ReadEnd
    last: tuple[str, str]  # (stage, op)


CASES: dict[str, Case] = {}


def _case(name: str, read, buffer: str, end: ReadEnd, last: tuple[str, str], **stages) -> None:
    CASES[name] = Case(_user(name, read, **stages), buffer, end, last)


def _body(op: str) -> tuple[str, str]:
    return ("body", op)


_case("plain", lambda shared, **_: shared["swa_map"].sum(), "swa_map", POST, _body(SUM))
_case("slice", lambda shared, **_: shared["req_to_token"][1:3, 2:].amax(), "req_to_token", POST,
      _body("aten.amax.default"))
_case("narrow", lambda shared, **_: shared["swa_map"].narrow(0, 4, 8).prod(), "swa_map", POST,
      _body("aten.prod.default"))
_case("view", lambda shared, **_: shared["swa_map"].view(16, 8).max(), "swa_map", POST,
      _body("aten.max.default"))
_case("t", lambda shared, **_: shared["req_to_token"].t().cumsum(0).sum(), "req_to_token", POST,
      _body("aten.cumsum.default"))
_case("expand", lambda shared, **_: shared["state_slots"].expand(3, 8).sum(), "state_slots", POST, _body(SUM))
_case("detach", lambda shared, **_: shared["swa_map"].detach().min(), "swa_map", POST,
      _body("aten.min.default"))
_case("split", _cat_of_pieces, "swa_map", POST, _body("aten.cat.default"))
_case("chunk", _chunks, "swa_map", POST, _body("aten.stack.default"))
_case("unbind", _unbound, "req_to_token", POST, _body("aten.maximum.default"))
_case("iteration", _iterated, "req_to_token", POST, _body("aten.add.Tensor"))
# pieces made in graph and read in the body: the piece's consumer reads, not the split
_case("split_in_graph", lambda meta, **_: meta["piece"].sum(), "swa_map", POST, _body(SUM),
      prepare_in_graph=lambda shared, **_: {"piece": shared["swa_map"].split(32)[1]})
_case("chunk_in_graph", lambda meta, **_: meta["piece"].sum(), "swa_map", POST, _body(SUM),
      prepare_in_graph=lambda shared, **_: {"piece": shared["swa_map"].chunk(4)[3]})
_case("unbind_in_graph", lambda meta, **_: meta["row"].sum(), "req_to_token", POST, _body(SUM),
      prepare_in_graph=lambda shared, **_: {"row": shared["req_to_token"].unbind(0)[2]})
_case("iteration_in_graph", lambda meta, **_: meta["row"].sum(), "req_to_token", POST, _body(SUM),
      prepare_in_graph=lambda shared, **_: {"row": next(iter(shared["req_to_token"]))})
CASES["closure"] = Case(_closure_backend(), "state_slots", POST, _body("aten._to_copy.default"))
_case("attribute", lambda **_: _HOLDER.ref.sum(), "swa_map", POST, _body(SUM), prepare_out_graph=_attr_plan)
_case("global", lambda **_: _GLOBAL_REF.sum(), "state_slots", POST, _body(SUM), prepare_in_graph=_global_plan)
_case("dlpack", _dlpack, "swa_map", POST, _body(SUM))
_case("item", lambda shared, **_: shared["state_slots"][1].item(), "state_slots", POST,
      _body("aten._local_scalar_dense.default"))
_case("tolist", lambda shared, **_: sum(shared["state_slots"].tolist()), "state_slots", POST, _body("tolist()"))
_case("some_layer", _odd_layers, "swa_map", POST, _body(SUM))
_case("some_batch", _some_batches, "state_slots", POST, _body(SUM))
# crosses into the graph as a copy: read by the copy, never in the body
_case("out_graph_view", lambda meta, **_: meta["pt"].sum(), "swa_map", PRE, ("prepare_out_graph", CLONE),
      prepare_out_graph=lambda shared, batch: {"pt": shared["swa_map"][:16]})
# stays a view inside the graph: read where the body consumes it
_case("in_graph_view", lambda meta, **_: meta["pt"].sum(), "swa_map", POST, _body(SUM),
      prepare_in_graph=lambda shared, **_: {"pt": shared["swa_map"][:16]})
_case("in_graph_clone", lambda meta, **_: meta["pt"].sum(), "swa_map", IN, ("prepare_in_graph", CLONE),
      prepare_in_graph=lambda shared, **_: {"pt": shared["swa_map"].clone()})
_case("in_graph_index_select", lambda meta, **_: meta["slots"].sum(), "state_slots", IN,
      ("prepare_in_graph", "aten.index_select.default"),
      prepare_in_graph=lambda shared, batch, **_: {
          "slots": shared["state_slots"].index_select(0, batch["req_pool_indices"])})
_case("plan_run", lambda meta, **_: _run(meta["kv_lens"].float()).sum(), "req_to_token", POST,
      _body(f"{RUN}/aten.index_select.default"), prepare_out_graph=_plan)


@pytest.mark.parametrize("case", CASES)
def test_the_observer_sees_the_hidden_read_at_its_stage(case) -> None:
    backend, buffer, end, last = CASES[case]
    cfg, steps = {"some_layer": (CFG, 1), "some_batch": (ONE_LAYER, 2)}.get(case, (ONE_LAYER, 1))
    obs = observe(backend, M.DECODE, cfg=cfg, steps=steps)
    # the page table and lengths are read by the paged metadata in graph, unless read later
    base = {"req_to_token": IN, "seq_lens": IN}
    assert obs.observed() == ReadEffect.of({**base, buffer: end | base.get(buffer, NONE)})
    assert obs.last_reader(buffer) == last
    assert obs.writes == ()


def test_a_copy_across_the_graph_boundary_leaves_no_read_in_the_body() -> None:
    for case in ("out_graph_view", "in_graph_clone", "in_graph_index_select"):
        backend, buffer = CASES[case].backend, CASES[case].buffer
        obs = observe(backend, M.DECODE, cfg=ONE_LAYER, steps=1)
        stages = {stage for b, stage, _ in obs.reads if b == buffer}
        assert "body" not in stages and stages, case


def test_the_plan_stores_a_reference_without_reading_and_the_run_kernel_reads_it() -> None:
    obs = observe(CASES["plan_run"].backend, M.TARGET_VERIFY, cfg=ONE_LAYER, steps=1)
    # the run op's own arguments touch nothing: the reads are its implementation's
    body = [op for b, stage, op in obs.reads if b == "req_to_token" and stage == "body"]
    assert body == [f"{RUN}/aten.index_select.default"]
    assert [op for b, stage, op in obs.reads if stage == "prepare_out_graph"] == []


def test_a_conditional_read_is_observed_only_on_the_paths_that_ran() -> None:
    some_layer, some_batch = CASES["some_layer"].backend, CASES["some_batch"].backend
    assert observe(some_layer, M.DECODE, cfg=ONE_LAYER, steps=1).observed()["swa_map"] is NONE
    # successive seeds are different batches: seed 1 starts at request row 1
    rows = [example_step(CFG, M.DECODE, 2, seed=s).batch["req_pool_indices"].tolist() for s in range(3)]
    assert len({tuple(r) for r in rows}) == 3 and rows[0][0] != 1 and rows[1][0] == 1
    assert observe(some_batch, M.DECODE, cfg=ONE_LAYER, steps=1).observed()["state_slots"] is NONE
    obs = observe(some_batch, M.DECODE, cfg=ONE_LAYER, steps=3)
    assert obs.observed()["state_slots"] is POST
    assert {a.step for a in obs.accesses if a.buffer == "state_slots"} == {1}


# ------------------------------------------------------------------------------------------
# The observer on its own
# ------------------------------------------------------------------------------------------


def _shared() -> dict[str, torch.Tensor]:
    return {"seq_lens": torch.arange(8, dtype=torch.int32),
            "swa_map": torch.arange(16, dtype=torch.int32)}


def _accesses(fn, shared) -> list[tuple[str, str, str]]:
    obs = ReadObserver(shared)
    with obs, obs.stage("s"):
        fn(shared)
    return [(a.buffer, a.op, a.kind) for a in obs.accesses]


@pytest.mark.parametrize("read", [
    lambda s: s["seq_lens"][2].item(),
    lambda s: int(s["seq_lens"][2]),
    lambda s: bool(s["seq_lens"][2]),
    lambda s: float(s["seq_lens"][2]),
], ids=["item", "int", "bool", "float"])
def test_host_reads_go_through_an_op(read) -> None:
    assert _accesses(read, _shared()) == [("seq_lens", "aten._local_scalar_dense.default", "read")]


def test_host_reads_without_an_op_and_escapes_are_recorded() -> None:
    shared = _shared()
    assert _accesses(lambda s: s["seq_lens"].tolist(), shared) == [("seq_lens", "tolist()", "read")]
    assert _accesses(lambda s: repr(s["swa_map"][:2]), shared) == [("swa_map", "__repr__()", "read")]
    assert _accesses(lambda s: s["swa_map"].data_ptr(), shared) == [("swa_map", "data_ptr()", "escape")]
    assert _accesses(lambda s: s["seq_lens"].numpy().sum(), shared) == [("seq_lens", "numpy()", "escape")]
    # an escape makes the buffer UNKNOWN: what the pointer or the array is used for is unseen
    def pointer(shared, batch, meta):
        return {"p": torch.tensor(shared["seq_lens"].data_ptr())}

    obs = observe_functions("toy", M.DECODE, inputs={"shared": shared, "batch": {}},
                            prepare_out_graph=lambda shared, batch: {}, prepare_in_graph=pointer,
                            body=lambda shared, batch, meta: meta["p"] * 2)
    assert obs.observed() == ReadEffect.of({"seq_lens": UNKNOWN})


def test_views_read_nothing_their_consumers_do_and_writes_are_writes() -> None:
    shared = _shared()
    views = lambda s: s["seq_lens"].view(2, 4).t().expand(3, 4, 2).detach()  # noqa: E731
    assert _accesses(views, shared) == []
    assert _accesses(lambda s: views(s) + 1, shared) == [("seq_lens", "aten.add.Tensor", "read")]
    assert _accesses(lambda s: s["seq_lens"][:2].add_(1), shared) == [
        ("seq_lens", "aten.add_.Tensor", "read"), ("seq_lens", "aten.add_.Tensor", "write")]
    assert _accesses(lambda s: torch.mul(s["swa_map"], 2, out=s["swa_map"]), shared) == [
        ("swa_map", "aten.mul.out", "read"), ("swa_map", "aten.mul.out", "write")]


def test_an_observer_is_entered_once_at_a_time() -> None:
    obs = ReadObserver(_shared())
    with obs, pytest.raises(RuntimeError, match="already entered"):
        with obs:
            pass
    with obs:  # and again after it left
        pass


def test_an_op_without_a_schema_counts_as_a_read_and_says_so() -> None:
    shared = _shared()
    obs = ReadObserver(shared)
    with obs.stage("s"):
        obs.__torch_dispatch__(lambda t: t + 1, (), (shared["swa_map"],))
    assert [(a.buffer, a.kind, a.note) for a in obs.accesses] == [
        ("swa_map", "read", "no schema: counted as a read")]


def test_composite_ops_below_autograd_are_decomposed_so_copies_are_seen() -> None:
    # under inference_mode composite ops reach the mode; their schema says "may alias"
    def copies(s):
        with torch.inference_mode():
            s["swa_map"].view(4, 4).t().reshape(16)  # not viewable: reshape copies
            s["seq_lens"].to(torch.float32)

    assert _accesses(copies, _shared()) == [("swa_map", CLONE, "read"),
                                            ("seq_lens", "aten._to_copy.default", "read")]


@torch.library.custom_op("readfence_test_observe::stored", mutates_args=())
def _stored(x: torch.Tensor) -> torch.Tensor:
    rows = _HOLDER.ref.reshape(2, -1).t().reshape(-1)  # a copy made by a composite op
    return x + rows.float().sum() + sum(_HOLDER.ref.tolist())


def test_ops_inside_a_python_custom_op_are_observed() -> None:
    shared = _shared()
    _HOLDER.ref = shared["swa_map"][:4]
    got = _accesses(lambda s: _stored(torch.ones(2)), shared)
    op = "readfence_test_observe.stored.default"
    assert got == [("swa_map", f"{op}/{CLONE}", "read"), ("swa_map", f"{op}/tolist()", "read")]
    # and the kernel computed what it computes without the observer
    assert torch.equal(_stored(torch.ones(2)), torch.full((2,), 1.0 + 6 + 6))


# ------------------------------------------------------------------------------------------
# observe(): steps, batch sizes, coverage, validation
# ------------------------------------------------------------------------------------------


def test_an_observation_covers_every_step_and_batch_size_and_says_only_those() -> None:
    obs = observe(paged(), M.TARGET_VERIFY, cfg=ONE_LAYER, batch_size=[1, 3], steps=2)
    assert (obs.steps, obs.batch_sizes) == (2, (1, 3))
    assert {a.step for a in obs.accesses} == {0, 1, 2, 3}
    assert "only the paths that ran" in obs.coverage
    text = str(obs)
    assert "only the paths that ran" in text and "writes of shared buffers: none" in text
    assert "req_to_token  IN_REPLAY  prepare_in_graph: aten.index_select.default" in text
    assert observe(paged(), M.IDLE, cfg=ONE_LAYER, steps=1).observed() == ReadEffect.none()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"mode": "decode"}, TypeError, r"mode must be a ForwardMode, got 'decode' \(str\); did you mean"),
    ({"batch_size": 0}, ValueError, r"batch_size must be an int in 1\.\.8, got 0"),
    ({"batch_size": 9}, ValueError, r"batch_size must be an int in 1\.\.8, got 9"),
    ({"batch_size": True}, ValueError, r"batch_size must be an int in 1\.\.8, got True"),
    ({"batch_size": "2"}, ValueError, r"batch_size must be an int in 1\.\.8 or a non-empty sequence"),
    ({"batch_size": []}, ValueError, r"or a non-empty sequence of them, got \[\]"),
    ({"batch_size": (2, 0)}, ValueError, r"batch_size must be an int in 1\.\.8, got 0"),
    ({"steps": 0}, ValueError, r"steps must be a positive int, got 0"),
    ({"steps": 1.5}, ValueError, r"steps must be a positive int, got 1\.5"),
    ({"cfg": {"layers": 2}}, TypeError, r"cfg must be a ModelConfig, got \{'layers': 2\} \(dict\)"),
    ({"backend": "paged"}, TypeError, r"backend must be a backend .* got 'paged' \(str\)"),
])
def test_observe_validates_its_arguments(kwargs, error, match) -> None:
    args = {"backend": paged(), "mode": M.DECODE, "cfg": CFG, **kwargs}
    with pytest.raises(error, match=match):
        observe(args.pop("backend"), args.pop("mode"), **args)


# ------------------------------------------------------------------------------------------
# cross_check: observed reads must lie within the traced reads of faithful stages
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY], ids=str)
@pytest.mark.parametrize("name", REFERENCE_LEAVES)
def test_reference_leaves_agree_with_their_trace(name, mode) -> None:
    backend = REFERENCE_LEAVES[name]()
    program, obs = trace(backend, mode, cfg=CFG), observe(backend, mode, cfg=CFG, steps=1)
    assert cross_check(program, obs) == ()
    assert obs.observed() == program.traced()  # not vacuous: the same reads, seen twice
    for buffer in program.buffers:
        assert (obs.last_reader(buffer) or ("",))[0] == str((program.last_reader(buffer) or ("",))[0]), buffer


def _toy_inputs() -> dict:
    return {"shared": {"seq_lens": torch.tensor([3, 4, 5, 6], dtype=torch.int32),
                       "swa_map": torch.arange(32, dtype=torch.int32)},
            "batch": {"rows": torch.tensor([0, 2])}}


def _toy(name="toy", *, inn, body):
    stages = {"prepare_out_graph": lambda shared, batch: {},
              "prepare_in_graph": inn, "body": body}
    inputs = _toy_inputs()
    return trace_functions(name, M.DECODE, inputs=inputs, **stages), observe_functions(
        name, M.DECODE, inputs=inputs, **stages)


def _lens(shared, batch, meta):
    return {"lens": shared["seq_lens"].index_select(0, batch["rows"])}


def _broken(program, stage: Stage):
    """``program`` with the traced reads of ``stage`` forgotten: an analysis bug, on purpose."""
    stages = tuple(attrs.evolve(s, analysis=attrs.evolve(s.analysis, reads={})) if s.stage == stage else s
                   for s in program.stages)
    return attrs.evolve(program, stages=stages)


def test_cross_check_names_a_read_the_trace_missed() -> None:
    program, obs = _toy(inn=_lens, body=lambda shared, batch, meta: meta["lens"] * 2)
    assert cross_check(program, obs) == ()
    (d,) = cross_check(_broken(program, PREPARE_IN_GRAPH), obs)
    assert (d.buffer, d.stage, d.op, d.kind, d.observed, d.traced) == (
        "seq_lens", "prepare_in_graph", "aten.index_select.default", "read", IN, NONE)
    assert str(d) == (
        "readfence's static analysis missed a read (a bug in the analysis): backend 'toy' in mode DECODE "
        "reads shared buffer 'seq_lens' in stage prepare_in_graph (op aten.index_select.default, observed "
        "at run time: IN_REPLAY), but the traced program never reads it; a fence placed from the trace "
        "would release it while it is still read")


def test_cross_check_accepts_a_later_traced_read_and_skips_unfaithful_stages() -> None:
    def body(shared, batch, meta):
        return meta["lens"] + shared["seq_lens"].sum()

    program, obs = _toy(inn=_lens, body=body)
    assert cross_check(program, obs) == ()
    # the in-graph read is covered by the body's traced read: a later end is sound
    assert cross_check(_broken(program, PREPARE_IN_GRAPH), obs) == ()
    (d,) = cross_check(_broken(program, BODY), obs)
    assert (d.stage, d.observed, d.traced) == ("body", POST, IN)
    assert d.traced_reader == (PREPARE_IN_GRAPH, "index_select")
    assert "reads it only until IN_REPLAY (last traced read: prepare_in_graph:index_select)" in str(d)
    broken = _broken(program, BODY)
    unfaithful = attrs.evolve(broken, stages=tuple(
        attrs.evolve(s, analysis=attrs.evolve(s.analysis, faithful=False)) if s.stage == BODY else s
        for s in broken.stages))
    assert cross_check(unfaithful, obs) == ()
    assert cross_check(attrs.evolve(broken, aborted="escape"), obs) == ()


def test_cross_check_reports_a_write_tracing_did_not_refuse() -> None:
    program, _ = _toy(inn=_lens, body=lambda shared, batch, meta: meta["lens"] * 2)

    def writing(shared, batch, meta):
        return {**_lens(shared, batch, meta), "w": shared["swa_map"].add_(0)}

    writes = observe_functions(  # tracing refuses this stage (StageWriteError): observe it alone
        "toy", M.DECODE, inputs=_toy_inputs(), prepare_out_graph=lambda shared, batch: {},
        prepare_in_graph=writing, body=lambda shared, batch, meta: meta["lens"] * 2)
    found = cross_check(program, writes)
    assert [(d.kind, d.buffer, d.stage) for d in found] == [("read", "swa_map", "prepare_in_graph"),
                                                            ("write", "swa_map", "prepare_in_graph")]
    assert "missed a write (a bug in the analysis)" in str(found[1]) and "'swa_map'" in str(found[1])


def test_cross_check_refuses_to_compare_different_steps() -> None:
    program, obs = _toy(inn=_lens, body=lambda shared, batch, meta: meta["lens"] * 2)
    with pytest.raises(ValueError, match="cannot cross-check a trace of 'toy' in DECODE with an observation "
                                         "of 'toy' in TARGET_VERIFY"):
        cross_check(program, attrs.evolve(obs, mode=M.TARGET_VERIFY))
    with pytest.raises(TypeError, match="observation must be an Observation"):
        cross_check(program, program)  # type: ignore[arg-type]


def test_the_run_kernel_of_a_plan_is_invisible_to_the_static_analysis() -> None:
    # only the dynamic checks can see a read through a reference an earlier stage
    # stored; cross_check reports it unless the trace gives up on the buffer (UNKNOWN)
    backend = CASES["plan_run"].backend
    program = trace(backend, M.DECODE, cfg=ONE_LAYER)
    found = cross_check(program, observe(backend, M.DECODE, cfg=ONE_LAYER, steps=1))
    # the trace sees the page table read in the prelude only: not UNKNOWN, so the run kernel's
    # read in the body is a disagreement
    assert program.traced()["req_to_token"] is ReadEnd.IN_REPLAY
    assert [(d.buffer, d.stage, d.op) for d in found] == [("req_to_token", "body", f"{RUN}/aten.index_select.default")]
    assert isinstance(found[0], Disagreement)


#: The adversarial backends whose reads the static analysis must follow through list views
#: (``Tensor(a)[]`` pieces), captured tensors and DLPack aliases: an analysis that misses one
#: is what cross_check exists to report.
LIST_VIEWS_AND_CAPTURES = ["split", "chunk", "unbind", "iteration", "split_in_graph", "chunk_in_graph",
                           "unbind_in_graph", "iteration_in_graph", "in_graph_view", "closure", "attribute",
                           "global", "dlpack"]


@pytest.mark.parametrize("case", LIST_VIEWS_AND_CAPTURES)
def test_the_static_analysis_covers_what_the_observer_sees(case) -> None:
    backend = CASES[case].backend
    program, obs = trace(backend, M.DECODE, cfg=ONE_LAYER), observe(backend, M.DECODE, cfg=ONE_LAYER, steps=1)
    found = cross_check(program, obs)
    assert found == (), "\n".join(map(str, found))


def test_observation_is_exported_with_its_fields() -> None:
    fields = {f.name for f in attrs.fields(Observation)}
    assert fields >= {"backend", "mode", "buffers", "accesses", "steps", "batch_sizes", "coverage"}


def test_a_step_already_observed_is_not_run_again_and_its_accesses_are_relabelled(monkeypatch) -> None:
    # An audit observes one step, the fuzzer three from the same seed: the first is shared. The
    # composed observation must be the one observing every step afresh gives.
    import readfence.core._observe as observing

    real, ran = observing.observe_step, []

    def counted(fns, inputs, *, step=0):
        ran.append(step)
        return real(fns, inputs, step=step)

    clear_trace_cache()
    monkeypatch.setattr(observing, "observe_step", counted)
    one = observe(paged(), M.DECODE, cfg=ONE_LAYER, batch_size=2, steps=1)
    three = observe(paged(), M.DECODE, cfg=ONE_LAYER, batch_size=2, steps=3)
    assert len(ran) == 3  # one step, then the two not seen yet
    clear_trace_cache()
    fresh = observe(paged(), M.DECODE, cfg=ONE_LAYER, batch_size=2, steps=3)
    assert len(ran) == 6
    assert three.accesses == fresh.accesses and {a.step for a in three.accesses} == {0, 1, 2}
    assert one.accesses == tuple(a for a in fresh.accesses if a.step == 0)
