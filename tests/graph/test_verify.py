"""``verify``: poison on release, the write guard and the runtime read observer, which do not
trust the analysis that placed the fences.

* every reference backend, combinator and step shape verifies clean under every policy;
* every buffer declared one step earlier than its traced end (lowered with the unsafe flag)
  is caught, naming that buffer, the step and the reading stage and op, and the finding is
  the same on every repetition (no fault injection, no timing);
* every adversarial backend that hides a read or a write is caught, including the ones no
  static analysis can see (a custom op reading or writing a buffer it keeps by reference);
* poison alone, without the observer, still catches and names the buffer;
* each check (poison, guard, observer) catches its own case with the other two off, and
  ``checks`` names what it runs and refuses what it cannot;
* a late read no check but poison sees is blamed on its own buffer, in every run and seed,
  while every other buffer is held; outputs that differ with nothing poisoned are not blamed
  on any buffer.
"""

from __future__ import annotations

import functools

import pytest
import torch

from readfence.backends import (
    REFERENCE_LEAVES,
    deepseek_v4,
    hybrid_linear,
    leaf,
    linear,
    page_meta,
    paged,
    redeclare,
    reference_compositions,
    softmax_attention,
    sparse,
    store_kv,
    trtllm_mha,
)
from readfence.backends.fuzz import keep, planned_gather
from readfence.core import ForwardMode, ModelConfig, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import LoopOptions, Policy, eagle, make_state, multi_eagle, ngram, verify
from tests.adversarial import CASES, _every, body_reader
from tests.conftest import ONE_LAYER as CFG
from tests.conftest import first_of_each

CFG2 = ModelConfig(layers=2, max_reqs=8, max_ctx=16)  # the adversarial layer branch needs two layers
M = ForwardMode
STEPS, BATCH = 4, 4

TARGETS = {
    **{f"{name}-{mode.name}": (make, mode) for name, make in REFERENCE_LEAVES.items()
       for mode in (M.DECODE, M.TARGET_VERIFY)},
    **{name: (lambda b=b: b, M.DECODE) for name, b in reference_compositions().items()},
    "eagle": (lambda: eagle(hybrid_linear(trtllm_mha(), linear()), paged(), draft_steps=2), M.DECODE),
    "multi_eagle": (lambda: multi_eagle(trtllm_mha(), paged(), paged()), M.DECODE),
    "ngram": (lambda: ngram(deepseek_v4()), M.DECODE),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_reference_target_verifies_clean_under_every_policy(name, dev) -> None:
    make, mode = TARGETS[name]
    report = verify(make(), mode, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG)
    assert report.map(lambda r: [c.policy for c in r.checks]).value_or(None) == list(Policy), report
    checks = {c.policy: c for c in report.unwrap().checks}
    assert checks[Policy.COARSE].poisoned == ()  # COARSE releases after the whole forward
    assert report.unwrap().observer


#: The buffers each reference leaf's trace reads (an end other than NONE or UNKNOWN), in both graphed
#: modes: the early declarations' cases, named without tracing at collection (checked against the
#: trace by the test below).
EARLY_READS = {"paged": ("req_to_token", "seq_lens"), "trtllm_mha": ("req_to_token", "seq_lens", "swa_map"),
               "deepseek_v4": ("req_to_token", "seq_lens"), "linear": ("state_slots",),
               "sparse": ("req_to_token", "seq_lens"), "dense": ("req_to_token", "seq_lens")}
EARLY = [(f"{name}-{mode.name}-{buffer}", name, mode, buffer)
         for name in EARLY_READS for mode in (M.DECODE, M.TARGET_VERIFY) for buffer in EARLY_READS[name]]


@functools.cache
def _early(name: str, mode: M) -> dict[str, object]:
    """Each buffer the leaf reads, redeclared one lattice step before its traced end (traced on
    first use: a test traces only the leaf it runs)."""
    backend = REFERENCE_LEAVES[name]()
    observed = trace(backend, mode, cfg=CFG, batch_size=BATCH).traced()
    out = {}
    for buffer in ("req_to_token", "seq_lens", "swa_map", "state_slots"):
        end = observed[buffer]
        if end in (ReadEnd.NONE, ReadEnd.UNKNOWN):
            continue
        earlier = ReadEnd(end.value - 1)
        declared = backend.read_effect(mode)

        def table(m, declared=declared, buffer=buffer, earlier=earlier, mode=mode):
            if m is not mode:
                return backend.read_effect(m)
            return ReadEffect.of({**{b: declared[b] for b in declared.buffers}, buffer: earlier})

        out[buffer] = redeclare(backend, table)
    return out


def test_the_early_declarations_cover_every_leaf_and_both_graphed_modes() -> None:
    traced = {f"{name}-{mode.name}-{buffer}" for name in REFERENCE_LEAVES for mode in (M.DECODE, M.TARGET_VERIFY)
              for buffer in _early(name, mode)}
    assert traced == {case[0] for case in EARLY}  # the cases named at collection are the trace's
    assert {case[1] for case in EARLY} == set(REFERENCE_LEAVES)
    assert len(EARLY) >= 20


@pytest.mark.parametrize(("case", "name", "mode", "buffer"), EARLY, ids=[c[0] for c in EARLY])
def test_a_buffer_declared_one_step_early_is_caught_with_buffer_step_and_reader(case, name, mode, buffer,
                                                                                 dev) -> None:
    leaf = _early(name, mode)[buffer]
    found = verify(leaf, mode, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER,
                   options=LoopOptions(UNSAFE_skip_soundness_check=True))
    bad = found.failure()
    assert (bad.kind, bad.buffer, bad.step, bad.policy) == ("late read", buffer, 0, Policy.PER_BUFFER), str(bad)
    assert bad.evidence == "observer" and bad.stage in ("prepare_out_graph", "prepare_in_graph", "body") and bad.op
    # without the unsafe flag the lowering refuses it, and verify says so
    refused = verify(leaf, mode, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER)
    assert (refused.failure().kind, refused.failure().buffer) == ("unsound declaration", buffer)


@pytest.mark.parametrize("observer", [True, False], ids=["observer", "poison-only"])
def test_the_same_finding_on_every_one_of_20_runs(observer, dev) -> None:
    # (with one layer trtllm_mha computes its sliding-window indices but never uses them: a
    # value-blind read only the observer sees; the page table influences every output)
    mode, buffer = M.TARGET_VERIFY, "req_to_token"
    leaf = _early("trtllm_mha", mode)[buffer]
    findings = {str(verify(leaf, mode, steps=2, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER,
                           options=LoopOptions(checks=None if observer else {"poison", "guard"},
                                               UNSAFE_skip_soundness_check=True)).failure())
                for _ in range(20)}
    assert len(findings) == 1, findings
    (text,) = findings
    assert f"late read of {buffer!r} at step 0" in text
    assert ("(observer)" if observer else "(poison)") in text


def test_poison_alone_names_the_buffer_by_poisoning_one_at_a_time(dev) -> None:
    early = redeclare(sparse(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY,
                                                         "seq_lens": ReadEnd.IN_REPLAY}))
    bad = verify(early, M.TARGET_VERIFY, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                 policy=Policy.PER_BUFFER,
                 options=LoopOptions(checks={"poison", "guard"}, UNSAFE_skip_soundness_check=True)).failure()
    assert (bad.kind, bad.evidence, bad.buffer, bad.step) == ("late read", "poison", "req_to_token", 0)
    # who read it: where the step's ledger last saw it read, past its release (the body's traced node)
    assert bad.stage == "body" and "the step's ledger saw" in bad.detail, str(bad)


HIDDEN = [n for n, c in CASES.items() if c.verdict in ("refused", "invisible")]


@pytest.mark.parametrize("name", first_of_each(HIDDEN, lambda n: CASES[n].klass))
def test_every_adversarial_backend_is_caught_by_verify_under_the_unsafe_flag(name, dev) -> None:
    case = CASES[name]
    state = make_state(CFG2)
    bad = verify(case.build(state), case.mode, steps=STEPS, batch_size=case.batch_size or BATCH, device=dev, cfg=CFG2,
                 state=state, policy=[Policy.PER_BUFFER, Policy.EXACT],
                 options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    if case.klass == "baked":  # trace-time state: no fence makes it right, lowering refuses it
        assert bad.kind == "refused" and "trace-time state" in bad.detail
    elif case.klass == "owned":  # another state's buffer: no fence of this state covers it
        assert bad.kind == "refused" and "of another state" in bad.detail, str(bad)
    elif case.klass in ("writes", "kept_write"):
        assert bad.kind == "write" and bad.buffer in ("seq_lens", "req_to_token"), str(bad)
    elif case.verdict == "invisible":  # no observer sees it: poison does
        assert (bad.kind, bad.buffer, bad.evidence) == ("late read", case.buffer, "poison"), str(bad)
    else:
        assert (bad.kind, bad.buffer, bad.evidence) == ("late read", case.buffer, "observer"), str(bad)
        assert bad.stage == "body" and bad.op


@pytest.mark.parametrize("policy", [Policy.COARSE, Policy.PER_BUFFER, Policy.EXACT])
def test_a_write_to_a_buffer_released_only_after_the_forward_is_caught_by_the_guard(policy, dev) -> None:
    # the write goes through a ``.data`` alias in prepare_in_graph, which runs as Python in the
    # step; declared UNKNOWN (sound: a reference escape) or under COARSE, seq_lens has no
    # release point inside the step: only the guard at the step's end can see the write
    from tests.graph.test_escapes import _writes_through_data

    backend = body_reader("writes_late", lambda s, b, m, layer, q: m["kv_lens"], prep=_writes_through_data,
                          declare=_every(ReadEnd.UNKNOWN))
    # (lowering refuses it first: the audit's observer saw the write; the flag lowers it anyway)
    refused = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=policy).failure()
    assert (refused.kind, refused.evidence, refused.buffer) == ("write", "audit", "seq_lens"), str(refused)
    bad = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=policy,
                 options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    assert (bad.kind, bad.evidence, bad.buffer, bad.step) == ("write", "guard", "seq_lens", 0), str(bad)


def test_verify_names_bad_input(dev) -> None:
    with pytest.raises(ValueError, match="steps must be a positive int"):
        verify(paged(), steps=0, device=dev)
    with pytest.raises(TypeError, match="policy must be"):
        verify(paged(), policy="exact", device=dev)


def test_the_check_mode_benchmark_runs_and_reports_its_ratios() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_check.py"
    spec = importlib.util.spec_from_file_location("bench_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(steps=2, reps=1)
    assert (result["steps"], result["repetitions"]) == (2, 1)
    assert result["poison_vs_plain"] > 0 and result["observer_vs_plain"] > 0 and result["plain_steps_per_s"] > 0


# -- each check on its own -------------------------------------------------------------------
EARLY_PAGED = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                          "seq_lens": ReadEnd.IN_REPLAY}))


def _writes_late():
    from tests.graph.test_escapes import _writes_through_data

    return body_reader("writes_late", lambda s, b, m, layer, q: m["kv_lens"], prep=_writes_through_data,
                       declare=_every(ReadEnd.UNKNOWN))


@pytest.mark.parametrize("alone", ["poison", "observer"])
def test_a_late_read_is_caught_by_poison_alone_and_by_the_observer_alone(alone, dev) -> None:
    bad = verify(EARLY_PAGED, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER,
                 options=LoopOptions(checks={alone}, UNSAFE_skip_soundness_check=True)).failure()
    assert (bad.kind, bad.evidence, bad.buffer, bad.step) == ("late read", alone, "req_to_token", 0), str(bad)
    # the observer saw the op; poison names what the step's ledger saw read it past its release
    assert bad.stage == "prepare_in_graph" and "index_select" in bad.op, str(bad)


def test_a_write_is_caught_by_the_guard_alone_and_by_no_other_check(dev) -> None:
    # (lowered anyway: a run of the step's code saw the write, so lowering refuses it first)
    common = dict(steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER)
    bad = verify(_writes_late(), M.DECODE, **common,
                 options=LoopOptions(checks={"guard"}, UNSAFE_skip_soundness_check=True)).failure()
    assert (bad.kind, bad.evidence, bad.buffer, bad.step) == ("write", "guard", "seq_lens", 0), str(bad)
    # every buffer is released only after the whole forward (declared UNKNOWN): nothing is
    # poisoned or read late, and the scheduler rewrites the buffer before the next step: the
    # other two checks verify it clean, only the guard sees the write
    clean = verify(_writes_late(), M.DECODE, **common,
                   options=LoopOptions(checks={"poison", "observer"}, UNSAFE_skip_soundness_check=True)).unwrap()
    assert clean.checks[0].poisoned == () and clean.checks[0].observed_ops > 0


def test_checks_says_what_ran_and_refuses_what_it_cannot(dev) -> None:
    common = dict(steps=2, batch_size=2, device=dev, cfg=CFG, policy=Policy.PER_BUFFER)
    report = verify(paged(), **common, options=LoopOptions(checks=["guard", "poison"])).unwrap()
    assert report.checks_run == ("poison", "guard") and not report.observer
    assert "checks: poison and guard\n" in str(report) + "\n" and report.rows()[0]["checks"] == ["poison", "guard"]
    guard_only = verify(paged(), **common, options=LoopOptions(checks={"guard"})).unwrap()
    assert "checks: guard\n" in str(guard_only) + "\n" and guard_only.checks[0].poisoned == ()
    assert verify(paged(), **common).unwrap().checks_run == ("poison", "guard", "observer")
    with pytest.raises(ValueError, match="at least one of"):
        verify(paged(), **common, options=LoopOptions(checks={"poisson"}))
    with pytest.raises(ValueError, match="at least one of"):
        verify(paged(), **common, options=LoopOptions(checks=()))
    with pytest.raises(TypeError, match="collection of names"):
        verify(paged(), **common, options=LoopOptions(checks="poison"))
    with pytest.raises(TypeError, match=r"^verify\(\) runs the loop in its own check mode: leave check out of its "
                                        r"LoopOptions \(its checks= picks the checks it runs\)$"):
        verify(paged(), **common, options=LoopOptions(check=True, checks={"poison"}))


# -- which buffer: poison one at a time, every other buffer held -----------------------------
def _plan_run_reader(state, late: tuple[str, ...]):
    """A paged leaf whose body runs a plan/run kernel over each buffer of ``late``: the kernel
    reads the live buffer the leaf planned (kept by reference), after its fence (the leaf
    declares only its metadata reads, IN_REPLAY), and the rows it reads reach the output."""
    handles = {b: keep(state["shared"][b]) for b in late}

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        indices, lens = meta["kv_indices"], meta["kv_lens"]
        mark = torch.zeros_like(lens, dtype=q.dtype)
        for b, handle in handles.items():
            rows = batch["out_cache_loc"] if b == "swa_map" else batch["req_pool_indices"]
            got = planned_gather(rows, handle)
            if b == "req_to_token":
                indices = got
            elif b == "seq_lens":
                lens = got
            else:
                mark = mark + got.to(q.dtype)
        out = softmax_attention(mode, q, pools, layer, indices, lens)
        return out + 1e-3 * mark.view(-1, 1, 1)

    effect = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf("plan_run_" + "_".join(late), attend, prepare_in_graph=prep,
                declare={M.DECODE: effect, M.TARGET_VERIFY: effect})


def _poison_only(backend_of, *, seed: int, policy: Policy, dev):
    state = make_state(CFG)
    # (a plan/run read is seen by the audit's observer on the live state: lowered with the unsafe flag)
    return verify(backend_of(state), M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, state=state,
                  policy=policy, options=LoopOptions(seed=seed, checks={"poison"}, UNSAFE_skip_soundness_check=True))


@pytest.mark.parametrize("buffer", ["req_to_token", "seq_lens", "state_slots", "swa_map"])
def test_a_late_read_is_blamed_on_its_own_buffer_in_every_run(buffer, dev) -> None:
    findings = set()
    for seed, policy in [(0, Policy.PER_BUFFER), (1, Policy.PER_BUFFER), (2, Policy.JOINED), (0, Policy.JOINED)]:
        bad = _poison_only(lambda state: _plan_run_reader(state, (buffer,)), seed=seed, policy=policy, dev=dev).failure()
        assert (bad.kind, bad.evidence, bad.buffer) == ("late read", "poison", buffer), str(bad)
        assert "also" not in bad.detail, bad.detail
        findings.add((seed, policy, str(bad)))
    # EXACT places from what the lowering's rehearsal saw the kernel read, too: no late read
    exact = _poison_only(lambda state: _plan_run_reader(state, (buffer,)), seed=0, policy=Policy.EXACT, dev=dev)
    assert exact.map(lambda r: len(r.checks)).value_or(None) == 1, exact
    again = _poison_only(lambda state: _plan_run_reader(state, (buffer,)), seed=0, policy=Policy.PER_BUFFER, dev=dev)
    assert str(again.failure()) in {text for seed, policy, text in findings if (seed, policy) == (0, Policy.PER_BUFFER)}


def test_two_buffers_read_late_are_both_named(dev) -> None:
    bad = _poison_only(lambda state: _plan_run_reader(state, ("seq_lens", "state_slots")), seed=0,
                       policy=Policy.PER_BUFFER, dev=dev).failure()
    assert (bad.kind, bad.evidence) == ("late read", "poison") and bad.buffer in ("seq_lens", "state_slots")
    other = ({"seq_lens", "state_slots"} - {bad.buffer}).pop()
    assert f"poisoned alone, {other} also change the outputs" in bad.detail, bad.detail


_PLANS: dict[int, torch.Tensor] = {}


@torch.library.custom_op("readfence_test_verify::previous_plan", mutates_args=())
def previous_plan(lens: torch.Tensor, handle: int) -> torch.Tensor:
    """A plan/run kernel that runs on the plan of its previous call (the wrapper keeps one plan
    and plans after running): its result depends on what ran before, not on any buffer."""
    previous = _PLANS.get(handle, lens)
    _PLANS[handle] = lens.clone()
    return previous.clone()


@previous_plan.register_fake
def _(lens: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(lens)


def test_outputs_that_differ_with_every_buffer_held_are_not_blamed_on_a_buffer(dev) -> None:
    # The lowering rehearses the step before running it, so the first lowered step runs on the
    # rehearsal's plan: its outputs differ from the serial run's whatever is poisoned. Poisoning
    # one buffer at a time would blame the first buffer tried (req_to_token); a run with every
    # buffer held and nothing poisoned differs too, so no buffer is blamed.
    handle = keep(torch.zeros(1))

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], previous_plan(meta["kv_lens"], handle))

    effect = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    stale = leaf("stale_plan", attend, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                 declare={M.DECODE: effect, M.TARGET_VERIFY: effect})
    # the lowering's replay check already sees the capture compute other than the code
    refused = _poison_only(lambda state: stale, seed=0, policy=Policy.PER_BUFFER, dev=dev).failure()
    assert (refused.kind, refused.evidence, refused.stage) == ("refused", "replay", "body"), str(refused)

    def lens(meta):  # a value read by printing (unseen), equal on every example state, not in the run
        fresh = str(meta["kv_lens"].max()) == "tensor(3)"  # a threshold no generated state's longest request hits
        return (meta["kv_lens"] - int(fresh)).clamp(min=1)

    def missed(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens(meta))

    unseen = leaf("unseen", missed, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                  declare={M.DECODE: effect, M.TARGET_VERIFY: effect})
    for seed in (0, 1):
        bad = _poison_only(lambda state: unseen, seed=seed, policy=Policy.PER_BUFFER, dev=dev).failure()
        assert (bad.kind, bad.evidence, bad.buffer) == ("differs", "output", None), str(bad)
        assert "every buffer held" in bad.detail


def _miscompiling_passes(monkeypatch) -> None:
    """readfence's compile passes broken on purpose, past its validation: in every graph the last
    add is taken for an earlier one of its shape (a node dropped as a common subexpression)."""
    import readfence.graph.lowering._fx_compile as fx_compile
    import readfence.graph.lowering._lower as lowering
    import readfence.graph.lowering._slot as slot
    from readfence.core.tracing import Table

    real = fx_compile._simplify

    def dropping(gm, keep, inputs):
        folded, same, memory = real(gm, keep, inputs)
        adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and n not in same
                and n not in folded and n.name not in keep and isinstance(n.meta.get("val"), torch.Tensor)]
        for late in reversed(adds):
            early = next((n for n in adds if n is not late and n.meta["val"].shape == late.meta["val"].shape), None)
            if early is not None and adds.index(early) < adds.index(late):
                return folded, {**same, late: early}, memory
        return folded, same, memory

    monkeypatch.setattr(fx_compile, "_simplify", dropping)
    monkeypatch.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)  # what slipped past it
    # code is kept under what it is compiled from, not under the passes' own code: the broken
    # passes compile into a table of their own, forgotten with them
    monkeypatch.setattr(slot, "_COMPILED", Table("compiled_stages", slot.CompileKey, "broken passes", limit=8))


@pytest.mark.parametrize("policy", [Policy.COARSE, Policy.PER_BUFFER], ids=str)
def test_a_miscompile_by_readfences_own_passes_is_named_as_readfences_bug(policy, dev, monkeypatch) -> None:
    # a correct backend, a lowered step that differs with nothing poisoned (COARSE poisons
    # nothing; PER_BUFFER's held run differs too): the same step without the passes matches the
    # serial run, so the passes are wrong, not the backend
    _miscompiling_passes(monkeypatch)
    bad = verify(paged(), M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=policy).failure()
    assert (bad.kind, bad.evidence, bad.buffer) == ("miscompiled", "rerun", None), str(bad)
    assert "bug in readfence, not in the backend" in bad.detail and "optimize=False" in bad.detail


@pytest.mark.parametrize("policy", [Policy.COARSE, Policy.PER_BUFFER], ids=str)
def test_a_backend_that_differs_without_the_passes_too_is_still_blamed(policy, dev) -> None:
    # a value read by printing, equal on every state the validation tries (the longest request
    # exactly three tokens ahead of the shortest: no generated state has it, the loop's traffic
    # does): the lowered step bakes it, with the compile passes or without them; the backend is
    # blamed, never readfence
    def lens(meta):
        spread = str(meta["kv_lens"].max() - meta["kv_lens"].min()) == "tensor(3)"
        return (meta["kv_lens"] - int(spread)).clamp(min=1)

    def missed(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens(meta))

    unseen = leaf("unseen", missed, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                  reads=["req_to_token", "seq_lens"])
    bad = verify(unseen, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=policy).failure()
    assert (bad.kind, bad.evidence, bad.buffer) == ("differs", "output", None), str(bad)
    assert "not deterministic, or keeps Python state" in bad.detail and "readfence" not in bad.detail


# -- steps that sample, and outputs that hold NaN: the same program, not a different one ---------
def _sampling(declared: ReadEnd, where: str):
    """A correct backend that samples (dropout in every layer's output, or noise its out-of-graph
    stage draws), declared ``declared`` for both buffers."""
    def snapshot(mode, shared, batch):
        meta = page_meta(shared, batch)
        return {**meta, "noise": torch.rand(()) * 1e-3} if where == "prepare_out_graph" else meta

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        if where == "body":
            return torch.nn.functional.dropout(out, 0.1, training=True)
        return out + meta["noise"]

    effect = ReadEffect.of({"req_to_token": declared, "seq_lens": declared})
    return leaf(f"sampling_in_{where}", attend, prepare_out_graph=snapshot, declare={M.DECODE: effect})


@pytest.mark.parametrize("where", ["body", "prepare_out_graph"])
def test_a_step_that_samples_verifies_clean_and_verify_draws_nothing(where, dev) -> None:
    # every run verify makes (the serial reference, each policy's, each rerun) starts from the same
    # random numbers, as two runs of the engine from one seed do; and verify leaves the generator
    # as it found it
    torch.manual_seed(5)
    before = torch.get_rng_state()
    report = verify(_sampling(ReadEnd.PRE_REPLAY, where), M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG)
    assert {c.policy for c in report.unwrap().checks} == set(Policy), report
    assert torch.equal(torch.get_rng_state(), before)


def test_a_step_that_samples_and_reads_late_is_still_caught_and_blamed_on_its_buffer(dev) -> None:
    # the rewind must not hide a race: declared before the replay, read in it (unsafe flag)
    sampler = _sampling(ReadEnd.NONE, "body")
    for checks in ({"poison"}, None):
        bad = verify(sampler, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER,
                     options=LoopOptions(checks=checks, UNSAFE_skip_soundness_check=True)).failure()
        assert bad.kind == "late read" and bad.buffer in ("req_to_token", "seq_lens"), str(bad)
        assert bad.evidence == ("poison" if checks else "observer"), str(bad)


def _nan_on_first_token(declared: ReadEnd):
    # a mean over a request's earlier tokens: 0 / 0 at its first, in every output of that step
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = meta["kv_lens"]
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)
        earlier = (lens - 1).float()
        mean = (earlier * 0.5) / earlier
        return out + mean.repeat_interleave(out.shape[0] // lens.shape[0]).view(-1, *([1] * (out.dim() - 1)))

    effect = ReadEffect.of({"req_to_token": declared, "seq_lens": declared})
    return leaf("nan_on_first_token", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch),
                declare={M.DECODE: effect})


def test_outputs_that_hold_nan_where_the_serial_run_does_verify_clean(dev) -> None:
    # bit-identical outputs, NaN in the same places: the same program (a NaN is not unequal to
    # itself here); a late read that changes them is still caught
    from readfence.graph import run_serial

    backend = _nan_on_first_token(ReadEnd.PRE_REPLAY)
    assert run_serial(backend, M.DECODE, steps=STEPS, batch_size=BATCH, cfg=CFG).logits[0].isnan().any()
    clean = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG)
    assert {c.policy for c in clean.unwrap().checks} == set(Policy), clean
    bad = verify(_nan_on_first_token(ReadEnd.NONE), M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                 policy=Policy.PER_BUFFER, options=LoopOptions(checks={"poison"}, UNSAFE_skip_soundness_check=True))
    assert bad.failure().kind == "late read" and bad.failure().buffer in ("req_to_token", "seq_lens"), str(bad)


def test_a_refusal_names_the_mode_refused_not_the_loops(dev) -> None:
    # the serving loop lowers its prefill steps in EXTEND: a declaration unsound there alone is
    # reported in EXTEND, though the loop's decode mode is DECODE
    from readfence.graph import Traffic, verify_serve

    pre = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        rows = page_meta(shared, batch) if mode is M.EXTEND else meta  # EXTEND reads the page table in the body
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, rows["kv_indices"], rows["kv_lens"])

    prefill_late = leaf("prefill_late", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch),
                        declare={m: pre for m in (M.DECODE, M.EXTEND, M.TARGET_VERIFY, M.DRAFT_EXTEND)})
    bad = verify_serve(prefill_late, steps=8, policy=Policy.EXACT, device=dev, capture_sizes=[1, 2, 4], cfg=CFG,
                       traffic=Traffic(rate=1.0, prompt=(2, 6), output=(2, 5))).failure()
    assert (bad.kind, bad.mode, bad.buffer) == ("unsound declaration", M.EXTEND, "req_to_token"), str(bad)
    assert "prefill_late in EXTEND under EXACT" in str(bad)
