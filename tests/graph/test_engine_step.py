"""The lowered step is the engine's step: what it runs as Python, and what it replays, proven.

An engine runs its out-of-graph hooks as Python every step and replays a capture of the rest.
Each case below is an ordinary backend whose trace, taken on one example, is not its code: a
Python value computed from the step's data where the tracer did not notice (printing a tensor,
``tolist()`` inside TorchScript, a count from a data-dependent shape), a Python value an
out-of-graph stage keeps on ``self`` for the body, a host side effect a kernel depends on. Each
must be either run bit-identical to the serial run under every policy (COARSE included: these are
not fence questions) or refused by ``lower`` with an error naming the stage; never accepted and
different. Before the lowered step ran ``prepare_out_graph`` as Python and validated its replays,
every case here that is refused, and every case of the out-of-graph class, ran accepted and
different from serial.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest
import torch
from torch import Tensor

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.backends.fuzz import keep, planned_gather
from readfence.core import BODY, PREPARE_IN_GRAPH, ForwardMode, NotGraphSafe, audit, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, lower, make_state, run_overlapped, run_serial, verify
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode.DECODE
BUFFERS = ("req_to_token", "seq_lens", "swa_map", "state_slots")
STEPS, BATCH = 4, 3


def _declared(end: ReadEnd) -> dict[ForwardMode, ReadEffect]:
    return {M: ReadEffect.uniform(BUFFERS, end)}


def _attend(lens_of):
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens_of(meta))

    return attend


def _printed(t: Tensor) -> int:
    return int(str(t)[7:-1])  # "tensor(7)": the printer runs with every mode off


@torch.jit.script
def _scripted_max(t: Tensor) -> int:
    values: list[int] = t.tolist()
    return max(values)


# -- Python values computed from the data inside a captured stage ---------------------------
#: in the body (each layer's attention): the lengths clamped by a host value of the data
IN_BODY = {
    "str": lambda lens: _printed(lens.max()),
    "repr": lambda lens: int(repr(lens.max())[7:-1]),
    "format": lambda lens: int(f"{lens.max()}"),
    "jit_tolist": lambda lens: _scripted_max(lens),
    "masked_numel": lambda lens: lens[lens > 5].numel() + 5,
    "nonzero_rows": lambda lens: (lens > 5).nonzero().shape[0] + 5,
    "unique_count": lambda lens: torch.unique(lens).numel() + 5,
}


def _body_case(name: str) -> Any:
    host = IN_BODY[name]

    def lens_of(meta):
        return meta["kv_lens"].clamp(max=host(meta["kv_lens"]) - 1).clamp(min=1)

    return leaf(f"body_{name}", _attend(lens_of), prepare_in_graph=lambda mode, shared, batch, meta:
                page_meta(shared, batch), declare=_declared(ReadEnd.POST_REPLAY))


def _in_graph_case(name: str) -> Any:
    host = IN_BODY[name]

    def prep(mode, shared, batch, meta):
        m = page_meta(shared, batch)
        return {**m, "kv_lens": m["kv_lens"].clamp(max=host(m["kv_lens"]) - 1).clamp(min=1)}

    return leaf(f"in_graph_{name}", _attend(lambda meta: meta["kv_lens"]), prepare_in_graph=prep,
                declare=_declared(ReadEnd.POST_REPLAY))


# -- Python values an out-of-graph stage keeps on self for the body --------------------------
class _Kept:
    """What an engine backend keeps on ``self`` in its out-of-graph hook (SGLang's FlashAttention
    backend keeps ``max_seq_len_k = int(seq_lens_cpu.max())``)."""

    value: Any = None


KEPT_LINE = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
KEPT = {
    "int": (lambda lens: _printed(lens.max()), lambda lens, v: lens.clamp(max=v - 1)),
    "int_item": (lambda lens: int(lens.max()), lambda lens, v: lens.clamp(max=v - 1)),
    "bool": (lambda lens: bool(lens.max() > 8), lambda lens, v: lens + (0 if v else 1)),
    "float": (lambda lens: float(lens.float().mean()), lambda lens, v: lens.clamp(max=int(v))),
    "list": (lambda lens: lens.tolist(), lambda lens, v: torch.tensor(v, dtype=lens.dtype) - 1),
}


def _kept_case(name: str) -> Any:
    compute, use = KEPT[name]
    kept = _Kept()

    def out(mode, shared, batch):
        m = page_meta(shared, batch)
        kept.value = compute(m["kv_lens"])  # on self, not returned: the body reads it from there
        return m

    def lens_of(meta):
        return use(meta["kv_lens"], kept.value).clamp(min=1)

    return leaf(f"kept_{name}", _attend(lens_of), prepare_out_graph=out, declare=_declared(ReadEnd.PRE_REPLAY))


# -- host side effects a kernel in the body depends on ---------------------------------------
_PLAN = keep(torch.zeros(1, dtype=torch.int32))  # one plan handle the wrapper keeps for its lifetime


def _plan_case(name: str) -> Any:
    """A FlashInfer-style wrapper: ``plan`` in the out-of-graph stage points its handle at the
    lengths (the live buffer itself, or a copy it made), ``run`` in the body reads them by
    reference. Declared honestly: POST_REPLAY for the live buffer, PRE_REPLAY for a copy."""
    from readfence.backends import fuzz

    live = name == "plan_live"

    def out(mode, shared, batch):
        fuzz._KEPT[_PLAN] = shared["seq_lens"] if live else shared["seq_lens"].clone()
        return page_meta(shared, batch)

    def lens_of_batch(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = planned_gather(batch["req_pool_indices"], _PLAN)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    return leaf(name, lens_of_batch, prepare_out_graph=out,
                declare=_declared(ReadEnd.POST_REPLAY if live else ReadEnd.PRE_REPLAY))


class _Counter:
    calls = 0


def _side_effect_case(name: str) -> tuple[Any, _Counter]:
    """A host side effect with no tensor in it: the out-of-graph stage counts its steps in Python
    and hands the count over as a tensor it builds (an engine's step counter, a sampling seed)."""
    count = _Counter()

    def out(mode, shared, batch):
        count.calls += 1
        return {**page_meta(shared, batch), "step": torch.full((1,), count.calls % 2, dtype=torch.int64)}

    backend = leaf(name, _attend(lambda meta: (meta["kv_lens"] - meta["step"]).clamp(min=1)), prepare_out_graph=out,
                   declare=_declared(ReadEnd.PRE_REPLAY))
    return backend, count


CASES: dict[str, Any] = {
    **{f"body_{n}": (lambda n=n: _body_case(n)) for n in IN_BODY},
    **{f"in_graph_{n}": (lambda n=n: _in_graph_case(n)) for n in ("str", "jit_tolist", "masked_numel")},
    **{f"kept_{n}": (lambda n=n: _kept_case(n)) for n in KEPT},
    "plan_live": lambda: _plan_case("plan_live"),
    "plan_copy": lambda: _plan_case("plan_copy"),
}


def _lowered_or_refused(backend: Any, policy: Policy) -> tuple[str, Any]:
    """("refused", error) when ``lower`` refuses it, else ("ran", whether it matched serial)."""
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    try:
        with CpuDevice(timeout=30.0) as dev:
            run = run_overlapped(backend, M, steps=STEPS, policy=policy, device=dev, batch_size=BATCH, cfg=CFG)
    except NotGraphSafe as e:
        return "refused", e
    return "ran", run.matches(serial) and run.violations == ()


@pytest.mark.parametrize("name", sorted(CASES))
def test_never_accepted_and_different_from_serial(name: str) -> None:
    backend = CASES[name]()
    assert audit(backend, M, cfg=CFG).map(lambda r: r.sound).value_or(None), name  # honest declarations
    for policy in (Policy.COARSE, Policy.EXACT):
        outcome, detail = _lowered_or_refused(backend, policy)
        if outcome == "refused":
            assert detail.backend == backend.name and detail.stage in ("prepare_in_graph", "body"), detail
            assert "not graph-safe" in str(detail) and "CUDA graph" in str(detail)
        else:
            assert detail, f"{name} under {policy.name}: lowered, accepted, and different from the serial run"


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n.startswith(("body_", "in_graph_"))])
def test_a_value_the_tracer_did_not_notice_is_refused_naming_stage_and_line(name: str) -> None:
    backend = CASES[name]()
    program = trace(backend, M, cfg=CFG)
    stage = BODY if name.startswith("body_") else PREPARE_IN_GRAPH
    if program.stage(stage).runs_python:  # the tracer noticed it after all: its Python runs, nothing baked
        assert program.unfaithful(), name
        return
    with CpuDevice(timeout=30.0) as dev, pytest.raises(NotGraphSafe) as e:
        lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)
    assert e.value.stage == stage.name and e.value.line.startswith(f"{__file__}:"), str(e.value)


def test_the_unnoticed_spellings_are_really_unnoticed() -> None:
    # not vacuous: these reach Python with no escape the tracer records, so only the replay
    # check stands between them and a wrong run
    for name in ("body_str", "body_repr", "body_jit_tolist", "body_masked_numel", "in_graph_str"):
        program = trace(CASES[name](), M, cfg=CFG)
        assert program.unfaithful() == [] and all(not s.runs_python for s in program.stages[1:]), name


@pytest.mark.parametrize("name", [f"kept_{n}" for n in KEPT])
def test_a_python_value_kept_on_self_by_the_out_of_graph_stage_is_refused_in_the_body(name: str) -> None:
    # the out-of-graph stage runs as Python every step and keeps a new value; the body's capture
    # holds the traced one: refused, naming the body's line that used it
    with CpuDevice(timeout=30.0) as dev, pytest.raises(NotGraphSafe) as e:
        lower(CASES[name](), M, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)
    uses = {f"{__file__}:{KEPT_LINE + i}" for i in range(len(KEPT))}  # the line of the use of the kept value
    assert e.value.stage == "body" and e.value.line.rsplit(" in ", 1)[0] in uses, str(e.value)


@pytest.mark.parametrize("name", ["plan_live", "plan_copy"])
def test_a_plan_the_out_of_graph_stage_makes_in_python_is_made_every_step(name: str) -> None:
    # the plan points the kernel's handle at this step's lengths: it must happen in every step,
    # as the engine does it, under every policy; EXACT waits for the live buffer's read by the
    # kernel, which only the rehearsal's observer sees
    state = make_state(CFG)
    backend = CASES[name]()
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG, state=state)
    for policy in Policy:
        with CpuDevice(timeout=30.0) as dev:
            run = run_overlapped(backend, M, steps=STEPS, policy=policy, device=dev, batch_size=BATCH, cfg=CFG,
                                 state=state)
        assert run.matches(serial) and run.violations == (), (name, policy, run.violations[:2])
    with CpuDevice(timeout=30.0) as dev:
        low = lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.EXACT, cfg=CFG, state=state)
    placement = {r["buffer"]: r["placement"] for r in low.describe()}["seq_lens"]
    if name == "plan_live":
        assert placement.startswith("after node body:plan_run"), placement
    else:
        assert placement == "after prepare_out_graph, before replay", placement


def test_a_host_side_effect_without_tensors_happens_every_step() -> None:
    from readfence.graph import Scheduler

    backend, counter = _side_effect_case("step_counter")
    with CpuDevice(timeout=30.0) as dev:
        low = lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.EXACT, cfg=CFG)
        sched = Scheduler(low.cfg, M, BATCH)
        start, logits = counter.calls, []
        for _ in range(3):
            logits.append(low.run(sched.next_step().batch).result(timeout=30).clone())
    assert counter.calls == start + 3  # its Python ran once in each lowered step
    assert not torch.equal(logits[0], logits[1])  # and what it handed over changed with it


def test_verify_names_a_capture_that_is_not_graph_safe_as_refused_by_the_replay_check() -> None:
    with CpuDevice(timeout=30.0) as dev:
        finding = verify(CASES["body_str"](), M, steps=3, batch_size=BATCH, device=dev, cfg=CFG).failure()
    assert (finding.kind, finding.evidence, finding.stage, finding.op) == ("refused", "replay", "body", "logits")


def test_a_broken_replay_check_lets_the_run_differ_and_the_serial_comparison_catches_it(monkeypatch) -> None:
    # the deliberately broken case: with the check off, the very same backend is lowered, and
    # the independent ground truth (bit-identical to the serial run) catches it
    import readfence.graph.lowering._lower as lowering

    monkeypatch.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)
    outcome, matched = _lowered_or_refused(CASES["body_str"](), Policy.COARSE)
    assert (outcome, matched) == ("ran", False)


def test_validation_compares_what_the_stage_writes_as_well_as_what_it_returns() -> None:
    # a body that writes the cache at a slot baked from the data: the logits agree on the step
    # that writes, the pool does not
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        loc = batch["out_cache_loc"] + (_printed(page_meta(shared, batch)["kv_lens"].max()) % 2)
        store_kv(pools, layer, loc, k, v)
        return q * 0

    backend = leaf("writes_baked", attend, reads=())
    with CpuDevice(timeout=30.0) as dev, pytest.raises(NotGraphSafe) as e:
        lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)
    assert e.value.output.startswith("pools."), str(e.value)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_deterministic_backend_is_validated_on_every_seed_without_a_false_alarm(seed: int) -> None:
    from readfence.backends import REFERENCE_LEAVES

    for make in itertools.islice(REFERENCE_LEAVES.values(), seed, None, 2):
        backend = make()
        with CpuDevice(timeout=30.0) as dev:
            lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.EXACT, cfg=CFG)


# -- what used to crash: clear errors, or it works ---------------------------------------------
def _sparse_case(over_lengths: bool) -> Any:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        m = page_meta(shared, batch)
        if over_lengths:  # a sparse tensor whose values are the live lengths themselves (no copy)
            lens = shared["seq_lens"]
            sparse = torch.sparse_coo_tensor(torch.arange(lens.shape[0]).unsqueeze(0), lens, (lens.shape[0],))
            m["kv_lens"] = sparse.to_dense().index_select(0, batch["req_pool_indices"]).long()
        weight = torch.sparse.mm(torch.eye(q.shape[-1]).to_sparse(), torch.ones(q.shape[-1], 1)).sum() / q.shape[-1]
        return softmax_attention(mode, q, pools, layer, m["kv_indices"], m["kv_lens"]) * weight

    return leaf(f"sparse_{'lens' if over_lengths else 'own'}", attend, declare=_declared(ReadEnd.POST_REPLAY))


def test_a_sparse_tensor_that_touches_no_shared_buffer_is_simply_not_one() -> None:
    backend = _sparse_case(False)
    report = audit(backend, M, cfg=CFG).unwrap()
    assert report.observed["state_slots"] is ReadEnd.NONE
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        run = run_overlapped(backend, M, steps=STEPS, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG)
    assert run.matches(serial) and run.violations == ()


def test_a_sparse_tensor_over_a_shared_buffer_reads_it() -> None:
    # its values are the live lengths: reading it is reading them, until the body's end
    early = leaf("sparse_early", _sparse_case(True).kernel.attend,
                 declare={M: ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})})
    failure = audit(early, M, cfg=CFG).failure()
    assert (failure.buffer, failure.observed) == ("seq_lens", ReadEnd.POST_REPLAY), failure


def test_a_callable_dataclass_instance_is_an_attend_like_any_function() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Attend:
        scale: float = 0.5

        def __call__(self, mode, layer, q, k, v, pools, shared, batch, meta):
            store_kv(pools, layer, batch["out_cache_loc"], k, v)
            return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) * self.scale

    backend = leaf("scaled", Attend(), prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                   reads=["req_to_token", "seq_lens"])
    assert backend == backend and hash(backend) == hash(backend)
    assert audit(backend, M, cfg=CFG).map(lambda r: r.sound).value_or(None)
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        run = run_overlapped(backend, M, steps=STEPS, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG)
    assert run.matches(serial) and run.violations == ()


def _changes_its_python_value() -> Any:
    def out(mode, shared, batch):
        return {**page_meta(shared, batch), "long": int(shared["seq_lens"].max() > 5)}  # a host read: Python

    return leaf("changes_value", _attend(lambda meta: meta["kv_lens"] + meta["long"]), prepare_out_graph=out,
                declare=_declared(ReadEnd.PRE_REPLAY))


def test_verify_returns_the_finding_of_a_python_value_a_later_step_changes(monkeypatch) -> None:
    # the lowering's check meets it on its varied states: refused before any step runs
    with CpuDevice(timeout=30.0) as dev:
        refused = verify(_changes_its_python_value(), M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                         policy=Policy.EXACT).failure()
    assert (refused.kind, refused.evidence, refused.stage) == ("refused", "audit", "prepare_out_graph"), refused
    # with those checks off (the validation, and the out-of-graph stage's Python on the generated
    # states), a step meets it in the run: its finding, not the stream's error
    import readfence.graph.lowering._lower as lowering
    from readfence.core.internal import Ledger

    monkeypatch.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)
    monkeypatch.setattr(Ledger, "observe_varied", lambda self, **kwargs: None)
    with CpuDevice(timeout=30.0) as dev:
        found = verify(_changes_its_python_value(), M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                       policy=Policy.EXACT).failure()
    assert (found.kind, found.evidence, found.stage) == ("refused", "run", "prepare_out_graph"), found
    assert "['long']" in found.detail and "return it as a tensor" in found.detail
