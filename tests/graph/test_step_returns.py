"""What a stage may return, lowered: bit-identical to the serial step under every policy, or refused.

Each backend below is written as a user would, with one of the return shapes the step
carries (a same-key refinement, nested dicts, lists and tuples, keys of other types, Python
scalars and ``None``, a copy passed through under another key). Every policy must compute
exactly what the serial run computes, step after step, with the forward stream's ops delayed
at random; what a traced graph cannot reproduce (a Python value or a shape computed from the
step's data) is refused by ``lower``, naming stage, key and line.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, StageOutputError, audit
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import (
    CpuDevice,
    FaultInjector,
    LoopResult,
    Policy,
    UnsoundLowering,
    lower,
    run_overlapped,
    run_serial,
    verify,
)
from tests.conftest import SMALL as CFG

from ._live_state import LiveState

M = ForwardMode.DECODE
PRE = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})


def _backend(name, out, inn, indices_lens, declare=None):
    """A leaf whose stages return ``out(shared, batch)`` and ``inn(meta)``, its attention
    reading ``indices_lens(meta)``."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        indices, lens = indices_lens(meta)
        return softmax_attention(mode, q, pools, layer, indices, lens)

    return leaf(name, attend, prepare_out_graph=lambda mode, shared, batch: out(shared, batch),
                prepare_in_graph=lambda mode, shared, batch, meta: inn(meta), declare=declare or {M: PRE})


def _page(shared, batch):
    return page_meta(shared, batch)


SHAPES = {
    # the refinement of an out-of-graph tensor under its own key
    "same_key": _backend("same_key", _page, lambda meta: {"kv_lens": meta["kv_lens"].clamp(min=1)},
                         lambda meta: (meta["kv_indices"], meta["kv_lens"])),
    # a nested dict: the in-graph output replaces the whole top-level key
    "nested": _backend(
        "nested", lambda s, b: {"pages": {"idx": page_meta(s, b)["kv_indices"], "lens": page_meta(s, b)["kv_lens"]}},
        lambda meta: {"pages": {"idx": meta["pages"]["idx"], "lens": meta["pages"]["lens"].clamp(min=1)}},
        lambda meta: (meta["pages"]["idx"], meta["pages"]["lens"])),
    # lists and tuples
    "sequences": _backend(
        "sequences", lambda s, b: {"pair": [page_meta(s, b)["kv_indices"], (page_meta(s, b)["kv_lens"],)]},
        lambda meta: {"again": (meta["pair"][1][0] * 1, [meta["pair"][0]])},
        lambda meta: (meta["again"][1][0], meta["again"][0])),
    # keys of other types, and keys that a dotted name would confuse
    "odd_keys": _backend(
        "odd_keys", lambda s, b: {0: page_meta(s, b)["kv_indices"], ("lens", 1): page_meta(s, b)["kv_lens"],
                                  "a.b": page_meta(s, b)["kv_lens"] * 0, "a": {"b": page_meta(s, b)["kv_lens"] * 0}},
        lambda meta: {M: meta[("lens", 1)] + meta["a.b"] + meta["a"]["b"], "a.b": meta["a.b"] + 1},
        lambda meta: (meta[0], meta[M] + meta["a.b"] - 1)),
    # Python scalars and None, constants of the code
    "python_values": _backend(
        "python_values", lambda s, b: {**page_meta(s, b), "scale": 2, "none": None, "name": "p", "flag": True},
        lambda meta: {"shift": -1.0 if meta["flag"] else 0.0, "empty": None},
        lambda meta: (meta["kv_indices"], (meta["kv_lens"] * meta["scale"] + int(meta["shift"]) * meta["kv_lens"]))),
    # a copy handed on under another key
    "passthrough": _backend("passthrough", _page, lambda meta: {"lens2": meta["kv_lens"]},
                            lambda meta: (meta["kv_indices"], meta["lens2"])),
}


def _faults(seed: int) -> FaultInjector:
    return FaultInjector(seed, max_delay_s=0.002, streams=["forward"], probability=0.3)


@functools.cache
def _serial(shape: str, steps: int, batch_size: int) -> LoopResult:
    # the serial reference of a shape, run once for all its policies
    return run_serial(SHAPES[shape], M, steps=steps, batch_size=batch_size, cfg=CFG)


@functools.cache
def _live(shape: str) -> LiveState:
    # one live state per shape, shared by its policies' runs (see ``_live_state``)
    return LiveState(CFG)


@pytest.mark.parametrize("policy", list(Policy))
def test_a_same_key_refinement_matches_serial_under_every_policy(policy: Policy) -> None:
    with CpuDevice(timeout=20.0, faults=_faults(1)) as dev:
        run = run_overlapped(SHAPES["same_key"], M, steps=5, policy=policy, device=dev, batch_size=2, cfg=CFG,
                             state=_live("same_key").fresh())
    assert run.matches(_serial("same_key", 5, 2)) and run.violations == ()


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "policy"), list(itertools.product(sorted(SHAPES), list(Policy))))
def test_every_return_shape_matches_serial_under_every_policy(shape: str, policy: Policy) -> None:
    with CpuDevice(timeout=20.0, faults=_faults(len(shape))) as dev:
        run = run_overlapped(SHAPES[shape], M, steps=4, policy=policy, device=dev, batch_size=3, cfg=CFG,
                             state=_live(shape).fresh())
    assert run.matches(_serial(shape, 4, 3)) and run.violations == ()


def test_every_step_of_the_return_shapes_computes_something_new() -> None:
    # not vacuous: the metadata changes from step to step, so a lowered step that read any
    # earlier step's metadata (the refinement kept where the next copy should go) would differ
    for name, backend in SHAPES.items():
        logits = run_serial(backend, M, steps=3, batch_size=3, cfg=CFG).logits
        assert not torch.equal(logits[1], logits[2]), name


@pytest.mark.parametrize("shape", ["same_key", "odd_keys"])
def test_verify_is_clean_on_the_return_shapes(shape: str) -> None:
    with CpuDevice(timeout=20.0) as dev:
        report = verify(SHAPES[shape], M, steps=3, batch_size=2, cfg=CFG, device=dev)
    assert report.unwrap().checks and len(report.unwrap().checks) == len(Policy)


def test_a_python_value_computed_from_the_data_out_of_graph_is_refused_by_lower() -> None:
    def out(shared, batch):
        meta = page_meta(shared, batch)
        return {**meta, "longest": int(meta["kv_lens"].max())}  # a host read: the stage runs as Python

    backend = _backend("longest", out, lambda meta: {"kv_lens": meta["kv_lens"].clamp(max=meta["longest"] - 1)},
                       lambda meta: (meta["kv_indices"], meta["kv_lens"]))
    with CpuDevice(timeout=20.0) as dev, pytest.raises(StageOutputError) as e:
        lower(backend, M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG)
    text = str(e.value)
    assert "stage prepare_out_graph" in text and "['longest']" in text and "return it as a tensor" in text, text
    assert f"{__file__}:" in text and "in out" in text, text


def test_metadata_whose_shape_follows_the_data_is_refused_by_lower_naming_stage_and_key() -> None:
    def out(shared, batch):
        lens = page_meta(shared, batch)["kv_lens"]
        return {"long": lens[lens > 4], **page_meta(shared, batch)}  # a shape that follows the values

    backend = _backend("masked", out, lambda meta: {"n": meta["long"].sum()},
                       lambda meta: (meta["kv_indices"], meta["kv_lens"] + meta["n"] * 0))
    for policy in (Policy.COARSE, Policy.EXACT):
        with CpuDevice(timeout=20.0) as dev, pytest.raises(StageOutputError) as e:
            lower(backend, M, batch_size=2, device=dev, policy=policy, cfg=CFG)
        text = str(e.value)
        assert "stage prepare_out_graph" in text and "['long']" in text and "pad it" in text, text
        assert f"{__file__}:" in text and "in out" in text, text


def test_python_state_a_capture_bakes_is_refused_by_verify_as_not_graph_safe() -> None:
    calls = itertools.count()

    def inn(meta):  # Python state the traced graph bakes in: every replay would use the trace's value
        return {"kv_lens": (meta["kv_lens"] - next(calls) % 2).clamp(min=1)}

    backend = _backend("counter", _page, inn, lambda meta: (meta["kv_indices"], meta["kv_lens"]))
    with CpuDevice(timeout=20.0) as dev:
        finding = verify(backend, M, steps=4, batch_size=2, cfg=CFG, device=dev, policy=Policy.COARSE).failure()
    assert (finding.kind, finding.evidence, finding.stage, finding.op) == (
        "refused", "replay", "prepare_in_graph", "meta_in.kv_lens"), finding
    assert "not graph-safe" in finding.detail and "CUDA graph" in finding.detail


def test_a_lowered_step_that_computes_something_else_is_named_so_by_verify() -> None:
    def inn(meta):  # a value read by printing (unseen), equal on every example state, not in the run:
        lens = meta["kv_lens"]  # no generated state's longest request is 3 tokens long, the loop's third step's is
        fresh = str(lens.max()) == "tensor(3)"
        return {"kv_lens": (lens - int(fresh)).clamp(min=1)}

    backend = _backend("late_counter", _page, inn, lambda meta: (meta["kv_indices"], meta["kv_lens"]))
    with CpuDevice(timeout=20.0) as dev:
        finding = verify(backend, M, steps=4, batch_size=2, cfg=CFG, device=dev, policy=Policy.COARSE).failure()
    assert (finding.kind, finding.evidence) == ("differs", "output"), finding
    assert "lowered step differs from the serial step" in finding.detail and "not a race" in finding.detail


# -- a step that is not replayed (EXTEND) runs every stage's Python, as engines run it ---------------
E = ForwardMode.EXTEND


def _masked(shared, batch):
    lens = page_meta(shared, batch)["kv_lens"]
    return {"long": lens[lens > 4], **page_meta(shared, batch)}  # a shape that follows the values


def _longest(shared, batch):
    meta = page_meta(shared, batch)
    return {**meta, "longest": int(meta["kv_lens"].max())}  # a Python value computed from the data


def _printed(meta):  # a value read by printing: the tracer does not see it, a capture bakes the trace's
    lens = meta["kv_lens"]
    longest = int(str(lens.max()).removeprefix("tensor(").removesuffix(")"))
    return {"kv_lens": lens.clamp(max=longest)}  # unchanged with this step's value, shorter with a baked one


def _eager_shapes() -> dict[str, object]:
    early = {M: PRE, E: ReadEffect.of({}, default=ReadEnd.PRE_REPLAY)}  # a host read: every buffer until PRE
    return {
        "masked": _backend("masked", _masked, lambda meta: {"n": meta["long"].sum()},
                           lambda meta: (meta["kv_indices"], meta["kv_lens"] + meta["n"] * 0), early),
        "longest": _backend("longest", _longest,
                            # unchanged when it is this step's value; a baked one would shift the lengths
                            lambda meta: {"kv_lens": meta["kv_lens"] + (meta["longest"] - meta["kv_lens"].max())},
                            lambda meta: (meta["kv_indices"], meta["kv_lens"]), early),
        # a value a capture would bake (verify finds it in DECODE): every step runs the Python, so it is this step's
        "printed": _backend("printed", _page, _printed, lambda meta: (meta["kv_indices"], meta["kv_lens"]), early),
    }


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["masked", "longest", "printed"])
def test_in_extend_what_a_graph_cannot_hold_runs_as_python_and_matches_serial(shape: str) -> None:
    # each is refused in DECODE (the tests above): a replayed graph bakes a shape, a value, a state
    for policy in (Policy.JOINED, Policy.EXACT):
        backend = _eager_shapes()[shape]
        serial = run_serial(backend, E, steps=4, batch_size=3, cfg=CFG)
        with CpuDevice(timeout=20.0, faults=_faults(len(shape))) as dev:
            run = run_overlapped(backend, E, steps=4, policy=policy, device=dev, batch_size=3, cfg=CFG)
        assert run.matches(serial) and run.violations == (), (shape, policy)
    logits = run_serial(_eager_shapes()[shape], E, steps=3, batch_size=3, cfg=CFG).logits
    assert not torch.equal(logits[1], logits[2]), shape  # the metadata changes from step to step


def test_in_extend_reads_of_the_stages_python_are_still_analysed_and_a_late_one_refused() -> None:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"] + meta["rows"].sum() * 0, meta["kv_lens"])

    def backend(rows):
        return leaf("rows", attend, prepare_out_graph=lambda mode, shared, batch: _page(shared, batch),
                    prepare_in_graph=lambda mode, shared, batch, meta: {"rows": rows(shared)},
                    declare={M: PRE, E: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})})

    with CpuDevice(timeout=20.0) as dev:  # a snapshot: read by prepare_in_graph, its own Python in EXTEND
        lower(backend(lambda shared: shared["req_to_token"][:, :1].clone()), E, batch_size=2, device=dev,
              policy=Policy.EXACT, cfg=CFG)
    with CpuDevice(timeout=20.0) as dev, pytest.raises(UnsoundLowering) as e:  # a view: read where attend uses it
        lower(backend(lambda shared: shared["req_to_token"][:, :1]), E, batch_size=2, device=dev,
              policy=Policy.EXACT, cfg=CFG)
    assert "req_to_token" in str(e.value) and "POST_REPLAY" in str(e.value), str(e.value)


def test_in_extend_a_read_on_a_path_the_example_did_not_take_is_seen_on_a_varied_state_and_refused() -> None:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        if meta["longest"] >= CFG.max_ctx:  # a Python value: only a batch at the longest context goes here
            out = out + shared["req_to_token"].index_select(0, batch["req_pool_indices"]).sum() * 0
        return out

    def backend(declared: ReadEffect):
        return leaf("long_path", attend, prepare_out_graph=lambda mode, shared, batch: _longest(shared, batch),
                    declare={M: PRE, E: declared})

    early = backend(ReadEffect.of({}, default=ReadEnd.PRE_REPLAY))
    # one verdict: at the batch size lowered the trace's example takes the short path, and the audit
    # refuses the read its Python makes on a varied state, naming buffer and stage, as lower does
    failure = audit(early, E, cfg=CFG, batch_sizes=[2]).failure()
    assert (failure.path, failure.buffer, failure.observed, str(failure.reader[0])) == (
        "long_path", "req_to_token", ReadEnd.POST_REPLAY, "body"), failure.message
    assert [b.varied for b in failure.report.buffers if b.buffer == "req_to_token"] == [True]
    assert "stage body's Python read it on a varied state" in failure.message, failure.message
    with CpuDevice(timeout=20.0) as dev:
        lower(early, E, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG)
    with CpuDevice(timeout=20.0) as dev, pytest.raises(UnsoundLowering) as e:
        lower(early, E, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)
    assert e.value.failure is not None and e.value.failure.message == failure.message, str(e.value)
    # the honest declaration passes both
    honest = backend(ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY}, default=ReadEnd.PRE_REPLAY))
    assert audit(honest, E, cfg=CFG, batch_sizes=[2]).map(lambda r: r.sound).value_or(False)
    with CpuDevice(timeout=20.0) as dev:
        lower(honest, E, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)
