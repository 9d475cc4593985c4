"""Differential fuzzing of the analysis on generated user backends (``readfence.backends.fuzz``,
``readfence.graph.fuzz``).

P1: accepted by the audit and by ``lower`` (PER_BUFFER, EXACT) implies ``verify`` clean;
P2: the runtime read observer sees no read a faithful stage's trace misses. Both are checked
on as many programs as CI carries (``EXAMPLES``; ``benchmarks/bench_fuzz.py`` runs
thousands). So that they are not vacuous, the generator must produce every pattern, stage,
way of reaching a buffer, combinator and both verdicts, every pattern's read must change the
logits, and a deliberately blinded analysis must make both properties fail. A read handed to
another thread must be refused, and with the thread watch switched off the fuzzer must report it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

import readfence.graph.fuzz as fuzz_check
from readfence.backends.fuzz import (
    COMBINATORS,
    FUZZ_MODES,
    RETURN_SHAPES,
    STAGE_NAMES,
    VIAS,
    VOCABULARY,
    FuzzLeaf,
    FuzzProgram,
    FuzzTree,
    Placement,
    declared,
    programs,
    random_programs,
)
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig, clear_trace_cache, run_step
from readfence.core._state import buffer_ranges
from readfence.core.internal import example_step
from readfence.graph.fuzz import Tally, check_program
from readfence.graph.lowering import POISONS, poison_family
from tests.adversarial import blinded

M = ForwardMode
EXAMPLES = 100  # programs the property tests check, half each: 60 to 90 s on two cores


def _leaf(pattern: str, stage: str, buffer: str = "seq_lens", *, via: str = "argument", carry: bool = False,
          meta: str | None = None, **ends: list[str]) -> FuzzLeaf:
    return FuzzLeaf("f0", (Placement(VOCABULARY[pattern], stage, buffer, via, carry),), declared(**ends), meta)


# -- the generator -----------------------------------------------------------------------------


def test_the_vocabulary_has_at_least_30_patterns_in_every_class() -> None:
    classes = Counter(p.klass for p in VOCABULARY.values())
    assert len(VOCABULARY) >= 30
    assert {"view", "list_view", "copy", "escape", "host", "conditional", "custom_op", "write", "thread",
            "view_claim", "handle", "relation", "metadata"} == set(classes)
    assert classes["view"] >= 10 and classes["list_view"] >= 6 and classes["write"] >= 5
    assert [p.name for p in VOCABULARY.values() if p.invisible] == ["plan_run"]
    assert [p.name for p in VOCABULARY.values() if p.threaded] == ["thread_joined", "thread_left_running", "pool_job"]
    assert all(p.klass == "thread" for p in VOCABULARY.values() if p.threaded)
    assert {p.name for p in VOCABULARY.values() if p.klass == "metadata"} == {
        "zeros_like", "empty_like", "new_zeros", "size", "stride"}


def _sample(n: int, seed: int = 0, max_leaves: int = 3) -> list[FuzzProgram]:
    out: list[FuzzProgram] = []

    @hypothesis_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(programs(max_leaves=max_leaves))
    def collect(program: FuzzProgram) -> None:
        out.append(program)

    collect()
    return out


def _combinators(sample: list[FuzzProgram]) -> Counter:
    seen: Counter = Counter()
    for program in sample:
        stack = [program.root]
        while stack:
            node = stack.pop()
            if isinstance(node, FuzzTree):
                seen[node.combinator] += 1
                stack.extend(node.children)
    return seen


# The generators' draws the coverage tests below read, drawn once per module (hypothesis' 2,000
# took most of their time): hypothesis is not uniform (it favours the first option of each
# choice), so it needs more draws than the uniform decks.
@pytest.fixture(scope="module")
def hypothesis_draws() -> list[FuzzProgram]:
    return _sample(2000)


@pytest.fixture(scope="module")
def uniform_draws() -> list[FuzzProgram]:
    return list(random_programs(1500, seed=0))


@pytest.mark.parametrize("generator", ["hypothesis", "uniform"])
def test_the_generator_produces_every_pattern_stage_via_combinator_and_shape(generator, request) -> None:
    sample = request.getfixturevalue(f"{generator}_draws")
    placements = [p for program in sample for p in program.placements()]
    assert set(VOCABULARY) == {p.pattern.name for p in placements}
    if generator == "uniform":  # hypothesis favours the first option of each choice: not all pairs
        for name, pattern in VOCABULARY.items():
            assert {p.stage for p in placements if p.pattern.name == name} == set(pattern.stages), name
    assert {p.stage for p in placements} == set(STAGE_NAMES)
    assert {p.via for p in placements} == set(VIAS)
    assert {p.buffer for p in placements} == set(SHARED_BUFFERS)
    assert {p.carry for p in placements if p.stage != "attend"} == {True, False}
    assert {leaf.meta_stage for program in sample for leaf in program.leaves()} == {*STAGE_NAMES, None}
    assert {leaf.returns for program in sample for leaf in program.leaves()} == set(RETURN_SHAPES)
    assert {program.mode for program in sample} == set(FUZZ_MODES)
    assert set(_combinators(sample)) == set(COMBINATORS)
    sizes = Counter(len(program.leaves()) for program in sample)
    assert sizes[1] > sizes[2] > sizes[3] > 0  # mostly leaves: each tree node is one more trace
    assert Counter(program.layers for program in sample).keys() == {1, 2, 3}
    ends = Counter(e for program in sample for leaf in program.leaves() for _, e in leaf.declared)
    assert len(ends) == 5  # every end of the lattice is declared


def test_the_same_seed_draws_the_same_programs() -> None:
    assert [str(p) for p in _sample(30, seed=3)] == [str(p) for p in _sample(30, seed=3)]
    assert [str(p) for p in random_programs(30, seed=3)] == [str(p) for p in random_programs(30, seed=3)]
    assert [str(p) for p in random_programs(30, seed=3)] != [str(p) for p in random_programs(30, seed=4)]


@pytest.mark.slow
def test_every_pattern_read_changes_the_logits_in_every_stage_and_stays_in_range() -> None:
    # A race can only be seen in the outputs if what each pattern reads reaches them: overwrite
    # the buffer it reads with each poison verify uses (in range) and the logits must change
    # under at least one (a sum may be the same under a reversed poison: only the constant ones
    # are sure to move it). The leaf's attention takes its metadata from the batch, so the
    # pattern is its only read.
    cfg = ModelConfig(layers=2, max_reqs=8, max_ctx=16)
    taken = {"if_verify": (M.TARGET_VERIFY, 4), "if_batch_1": (M.DECODE, 1)}  # where each branch reads
    k = itertools.count()
    checked = 0
    for name, pattern in sorted(VOCABULARY.items()):
        mode, batch_size = taken.get(name, (M.DECODE, 4))
        for stage in pattern.stages:
            i = next(k)
            vias = ["argument"] if pattern.invisible else [v for v in VIAS if stage != "prepare_out_graph"
                                                           or not v.startswith("stash")]
            buffer, via = SHARED_BUFFERS[i % 4], vias[i % len(vias)]
            program = FuzzProgram(_leaf(name, stage, buffer, via=via, carry=stage != "attend" and i % 2 == 0), mode)
            logits = []
            for which in (None, *range(len(POISONS))):
                step = example_step(cfg, mode, batch_size)
                backend = program.build({"shared": step.shared, "pools": step.pools, "params": step.params})
                if which is not None:
                    values = step.shared[buffer]
                    values.copy_(poison_family(values, *buffer_ranges(cfg)[buffer])[which])
                logits.append(run_step(backend, mode, cfg, step))
            assert torch.isfinite(logits[0]).all(), program
            same = [POISONS[w] for w, poisoned in enumerate(logits[1:]) if torch.equal(logits[0], poisoned)]
            if pattern.klass == "metadata":  # reads no value: no poison may reach the logits
                assert len(same) == len(POISONS), f"{program} reads the values of {buffer}"
            else:
                assert len(same) < len(POISONS), f"what {program} reads does not reach the logits under {same}"
            checked += 1
    assert checked == sum(len(p.stages) for p in VOCABULARY.values())


def test_a_program_that_keeps_references_needs_the_state_to_be_built() -> None:
    with pytest.raises(ValueError, match="keeps references to live buffers"):
        FuzzProgram(_leaf("slice", "attend", via="closure")).build()
    with pytest.raises(ValueError, match="cannot be placed"):
        Placement(VOCABULARY["if_layer0"], "prepare_in_graph", "seq_lens")
    with pytest.raises(ValueError, match="stashed"):
        Placement(VOCABULARY["clone"], "prepare_out_graph", "seq_lens", "stash_clone")


# -- the checks on known programs: each outcome is reachable -----------------------------------


def test_an_exact_declaration_is_accepted_and_verifies(dev) -> None:
    snap = _leaf("clone", "prepare_in_graph", carry=True, meta="prepare_out_graph",
                 PRE_REPLAY=["req_to_token"], IN_REPLAY=["seq_lens"])
    outcome = check_program(FuzzProgram(snap), device=dev)
    assert outcome.verdict == "accepted" and outcome.finding is None, outcome.report()


def test_a_view_carried_into_the_body_declared_in_graph_is_refused_and_caught_unsafely(dev) -> None:
    early = _leaf("chunk", "prepare_in_graph", carry=True, IN_REPLAY=["seq_lens"])
    outcome = check_program(FuzzProgram(early), device=dev)
    assert outcome.verdict == "refused" and outcome.refused_by.startswith("audit: unsound declaration")
    assert outcome.unsafe_ran and not outcome.false_alarm
    assert (outcome.unsafe.buffer, outcome.unsafe.stage) == ("seq_lens", "body")


def test_a_plan_run_read_after_the_declared_end_is_refused_by_the_audit_s_runs_and_caught_unsafely(dev) -> None:
    # no static analysis sees the kernel's read of the live lengths it keeps; the audit's observer,
    # which watches the live state the fuzzer audits on, does
    hidden = _leaf("plan_run", "attend", IN_REPLAY=["seq_lens"])
    outcome = check_program(FuzzProgram(hidden), device=dev)
    assert outcome.verdict == "refused" and outcome.refused_by.startswith("audit: unsound declaration"), outcome.report()
    assert "a read only the observer sees" in outcome.refused_by
    assert outcome.unsafe_ran and not outcome.false_alarm
    assert (outcome.unsafe.buffer, outcome.unsafe.stage) == ("seq_lens", "body") and "plan_run" in outcome.unsafe.op


def test_a_write_is_refused_before_anything_runs(dev) -> None:
    outcome = check_program(FuzzProgram(_leaf("write_chunk", "prepare_in_graph", UNKNOWN=list(SHARED_BUFFERS))),
                            device=dev)
    assert outcome.refused_by.startswith("audit: StageWriteError") and not outcome.unsafe_ran


def test_a_child_below_its_trace_under_a_join_whose_sibling_covers_it_is_accepted_and_clean(dev) -> None:
    # the fence is the join's: a child's own early declaration is a latent finding, not a refusal
    early = _leaf("index_select", "attend", PRE_REPLAY=["req_to_token"])
    late = FuzzLeaf("f1", (), declared(POST_REPLAY=list(SHARED_BUFFERS)))
    outcome = check_program(FuzzProgram(FuzzTree("join", (early, late))), device=dev)
    assert outcome.accepted and outcome.finding is None, outcome.report()
    # the same child under a sibling that does not cover its read: the join's fence is early
    short = FuzzLeaf("f1", (), declared(IN_REPLAY=list(SHARED_BUFFERS)))
    outcome = check_program(FuzzProgram(FuzzTree("join", (early, short))), device=dev)
    assert outcome.refused_by.startswith("audit: unsound declaration: join/children[0]/f0 in mode DECODE")
    assert outcome.refusal_kind == "audit: unsound declaration" and outcome.unsafe is not None


def test_the_properties_fail_on_a_blinded_analysis(dev, monkeypatch) -> None:
    # Break the analysis on purpose, as tests/core/test_adversarial_audit.py does: the schema
    # oracle forgets that split pieces alias their source, the memory probe sees nothing and
    # the audit (and so lower) keeps nothing any run of the step saw. The body's read of the pieces,
    # put back together by cat, is then invisible to the trace: an in-graph declaration is accepted,
    # and verify (P1) and the cross-check of the trace against the observer (P2) catch it.
    import readfence.core.tracing._alias as alias

    real = alias.op_aliasing

    class Blind:
        name, writes, outputs, opaque, is_view, metadata_args = "split", (), ((),), False, True, ()

    monkeypatch.setattr(alias, "op_aliasing", lambda op: Blind() if "split" in str(op) else real(op))
    blinded(monkeypatch)  # the memory probe sees nothing
    # the ledger the audit's verdict is made from, which lower asks too: with the runs' reads (its
    # observer's, the rehearsal's) the audit would refuse
    from readfence.core.internal import Ledger

    monkeypatch.setattr(Ledger, "record", lambda self, run: None)
    clear_trace_cache()
    try:
        early = _leaf("split", "attend", IN_REPLAY=["seq_lens"])
        outcome = check_program(FuzzProgram(early), device=dev)
    finally:
        clear_trace_cache()
    assert outcome.p1_violation and outcome.finding.buffer == "seq_lens", outcome.report()
    assert outcome.p2_violation and (outcome.disagreements[0].buffer, outcome.disagreements[0].op) == (
        "seq_lens", "aten.cat.default")
    assert outcome.verdict == "P1 violation"


# -- reads handed to another thread ---------------------------------------------------------

THREADED = {name: p for name, p in VOCABULARY.items() if p.threaded}

#: Each variant in a stage of its own: the stage the trace names and the work it names.
THREAD_CASES = {
    "thread_joined": ("prepare_in_graph", "prepare_in_graph", "a thread 'fuzz-joined-reader' running _copy_rows"),
    "thread_left_running": ("attend", "body", "a thread 'fuzz-late-reader' running _late_copy"),
    "pool_job": ("prepare_out_graph", "prepare_out_graph", "a thread-pool job running _copy_rows"),
}


def _thread_program(name: str) -> FuzzProgram:
    # declares every buffer until the end of the replay: sound for every read the trace can see,
    # so only the thread can make the analysis refuse it
    stage = THREAD_CASES[name][0]
    return FuzzProgram(_leaf(name, stage, carry=stage != "attend", POST_REPLAY=list(SHARED_BUFFERS)))


@pytest.mark.parametrize("name", sorted(THREAD_CASES))
def test_a_read_on_another_thread_is_refused_by_the_trace_naming_backend_and_stage(dev, name) -> None:
    _, traced_as, what = THREAD_CASES[name]
    outcome = check_program(_thread_program(name), device=dev)
    assert outcome.verdict == "refused" and outcome.thread_refused, outcome.report()
    assert outcome.refused_by.startswith(f"audit: StageThreadError: backend 'f0' stage {traced_as} starts {what} "), (
        outcome.refused_by)
    assert "while the trace watched it" in outcome.refused_by
    assert outcome.refusal_kind == "audit: StageThreadError" and outcome.threads == {"seq_lens"}
    # refused before anything ran, under the unsafe flag too: never counted as a false alarm
    assert not outcome.unsafe_ran and outcome.unsafe.kind == "thread" and not outcome.false_alarm
    assert not (outcome.p1_violation or outcome.p2_violation or outcome.thread_missed)


def test_the_generator_draws_every_read_on_another_thread(hypothesis_draws, uniform_draws) -> None:
    for sample in (hypothesis_draws, uniform_draws):
        placed = Counter(p.pattern.name for program in sample for p in program.placements() if p.pattern.threaded)
        assert set(placed) == set(THREADED), placed
        assert sum(bool(program.thread_reads()) for program in sample) >= 10


def test_a_thread_started_after_a_host_read_is_refused_by_the_trace_too(dev) -> None:
    # the host read makes the stage escape the tracer, which still runs the rest of it
    placed = (Placement(VOCABULARY["item"], "attend", "req_to_token"),
              Placement(VOCABULARY["thread_left_running"], "attend", "seq_lens"))
    outcome = check_program(FuzzProgram(FuzzLeaf("f0", placed, declared(POST_REPLAY=list(SHARED_BUFFERS)))),
                            device=dev, false_alarms=False)
    assert outcome.thread_refused and "stage body starts a thread 'fuzz-late-reader'" in outcome.refused_by


def test_hypothesis_programs_that_read_on_another_thread_are_refused(dev) -> None:
    # every placement a thread, in any stage, via any reference, in trees and both modes:
    # every program with a thread in a leaf that runs is refused for it, and none is a violation
    tally = Tally()

    @settings(max_examples=10, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs(THREADED, max_leaves=2))
    def refused(program: FuzzProgram) -> None:
        outcome = check_program(program, device=dev, false_alarms=False)
        _hold(outcome, tally)
        assert outcome.thread_refused or not outcome.threads, outcome.report()

    refused()
    assert tally.threads >= 6 and tally.thread_refused >= tally.threads, tally.as_dict()
    assert {name for name in THREADED if tally.by_pattern.get(name, {}).get("refused")} == set(THREADED), (
        tally.by_pattern)


def test_with_the_thread_watch_off_the_fuzzer_reports_every_read_on_another_thread(dev, monkeypatch) -> None:
    # Not vacuous: switch the watch off where the tracer and the read observer enter it. The
    # joined reader and the pool job then fill the stage's result on a thread the trace does
    # not follow, so the captured graph replays zeros where the eager serial run read the
    # buffer: the lowering's replay check refuses the joined reader's capture (its graph gives
    # what its Python does not), the pool job's is a P1. The reader left running reads after
    # the stage returned, seen by no check: accepted with verify clean, it is a miss, counted
    # with the violations.
    import readfence.core._ledger as ledger
    import readfence.core._observe as observing
    import readfence.core.tracing._trace as tracing

    def unwatched(*args: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    monkeypatch.setattr(tracing, "watch_threads", unwatched)
    monkeypatch.setattr(observing, "watch_threads", unwatched)
    monkeypatch.setattr(ledger, "watch_threads", unwatched)
    clear_trace_cache()
    tally = Tally()
    outcomes = {}
    try:
        for name in THREAD_CASES:
            outcomes[name] = check_program(_thread_program(name), device=dev)
            tally.add(outcomes[name])
    finally:
        clear_trace_cache()
    verdicts = {o.program.placements()[0].pattern.name: o.verdict for o in tally.violations}
    assert verdicts == {"pool_job": "P1 violation", "thread_left_running": "thread missed"}, [
        o.report() for o in tally.violations]
    assert "not graph-safe" in (outcomes["thread_joined"].refused_by or ""), outcomes["thread_joined"].report()
    assert (tally.threads, tally.p1_violations, tally.thread_missed) == (3, 1, 1)


# -- regressions found by the fuzzer ----------------------------------------------------------


@pytest.mark.parametrize("via", ["closure", "attribute", "global", "dlpack"])
def test_a_view_of_a_captured_buffer_carried_into_the_body_is_read_there(dev, via) -> None:
    # a view of a buffer the leaf keeps by reference, made in prepare_in_graph and read in the
    # body: bound to the live state, the body's placeholder aliases the kept buffer, so an
    # in-graph declaration is refused and the body's read is in the trace
    leaf = _leaf("slice", "prepare_in_graph", via=via, carry=True, IN_REPLAY=["seq_lens"])
    outcome = check_program(FuzzProgram(leaf), device=dev)
    assert not outcome.p1_violation and not outcome.p2_violation, outcome.report()
    assert not outcome.accepted, outcome.report()


# -- the properties ----------------------------------------------------------------------------


def _hold(outcome: fuzz_check.Outcome, tally: Tally) -> None:
    tally.add(outcome)
    assert not outcome.p1_violation, outcome.report()
    assert not outcome.p2_violation, outcome.report()
    assert not outcome.invisible_missed, outcome.report()
    assert not outcome.thread_missed, outcome.report()


def _not_vacuous(tally: Tally) -> None:
    # both verdicts, and trees
    n = tally.programs
    assert tally.accepted >= n // 5 and tally.refused >= n // 5 and tally.combinators, tally.as_dict()


@pytest.mark.slow
def test_hypothesis_programs_accepted_verify_and_traces_cover_what_runs(dev) -> None:
    # hypothesis' draws shrink a failing program to a small one
    tally = Tally()

    @settings(max_examples=EXAMPLES // 2, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs(max_leaves=2))
    def p1_and_p2(program: FuzzProgram) -> None:
        _hold(check_program(program, device=dev, false_alarms=False), tally)

    p1_and_p2()
    _not_vacuous(tally)


@pytest.mark.slow
def test_uniform_programs_accepted_verify_and_traces_cover_what_runs(dev) -> None:
    # hypothesis favours the first option of every choice; uniform draws cover the vocabulary
    tally = Tally()
    # seed 1: a draw whose accepted programs include an invisible read (what the asserts below need)
    for program in random_programs(EXAMPLES // 2, seed=1, max_leaves=2):
        _hold(check_program(program, device=dev, false_alarms=False), tally)
    _not_vacuous(tally)
    # reads no static analysis sees: caught by verify where declared too early, covered where not
    assert tally.invisible_caught + tally.invisible_clean >= 1, tally.as_dict()
    assert tally.thread_refused >= 1, tally.as_dict()  # reads on another thread, refused as such
    assert len(tally.patterns) >= len(VOCABULARY) * 3 // 4, sorted(set(VOCABULARY) - set(tally.patterns))


def test_the_benchmark_runs_and_reports_its_figures() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fuzz.py"
    if not path.is_file():
        pytest.skip("no benchmarks/bench_fuzz.py in this checkout")
    spec = importlib.util.spec_from_file_location("bench_fuzz", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(programs_n=3, seed=0, max_leaves=1)
    assert result["programs"] + result["errors"] == 3 and result["errors"] == 0
    assert {"programs_per_s", "p1_violations", "p2_violations", "false_alarm_rate", "invisible_caught",
            "patterns"} <= set(result)


# -- the oracle models CUDA: a host read inside the captured graph -----------------------------


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # the DLPack round trip
def test_the_patterns_marked_host_read_are_those_torch_cannot_run_without_a_device_value() -> None:
    # torch's own statement, independent of readfence's analysis: on fake tensors (no values) an op
    # that needs a device value on the host raises DataDependentOutputException; on CUDA that value
    # is a device-to-host copy, which stream capture forbids
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    needs_value = set()
    with FakeTensorMode():
        buf = torch.zeros(8, 16, dtype=torch.int32)
        batch = {k: torch.arange(4) for k in ("input_ids", "positions", "req_pool_indices", "out_cache_loc")}
        for name, pattern in VOCABULARY.items():
            if pattern.klass in ("thread", "write") or pattern.invisible:
                continue  # refused or invisible whatever they read; a custom op without a fake impl
            site = fuzz_site(batch)
            try:
                pattern.op(buf, site)
            except DataDependentOutputException:
                needs_value.add(name)
    assert needs_value == {name for name, p in VOCABULARY.items() if p.host_read}
    assert {"item", "tolist", "if_content", "if_value", "equal"} <= needs_value


def fuzz_site(batch):
    from readfence.backends.fuzz import Site

    return Site("seq_lens", "attend", M.DECODE, batch, 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(n for n, p in VOCABULARY.items() if p.host_read))
def test_cuda_cannot_capture_a_host_read_pattern(name) -> None:
    buf = torch.arange(128, dtype=torch.int32, device="cuda").reshape(8, 16)
    batch = {k: torch.arange(4, device="cuda") for k in ("input_ids", "positions", "req_pool_indices", "out_cache_loc")}
    site = fuzz_site(batch)
    VOCABULARY["clone"].op(buf, site)  # a device op captures: the failure below is the host read's
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError):
            with torch.cuda.graph(graph, stream=stream):
                VOCABULARY[name].op(buf, site)


@pytest.mark.parametrize("stage", ["prepare_in_graph", "attend"])
def test_a_host_read_in_the_graph_refused_is_uncapturable_not_a_false_alarm(dev, stage) -> None:
    # declared until the stage that reads it: the escape makes every buffer late, the CPU device
    # runs the stage's Python in the step (clean under the unsafe flag), CUDA cannot capture it
    end = "IN_REPLAY" if stage == "prepare_in_graph" else "POST_REPLAY"
    program = FuzzProgram(_leaf("item", stage, **{end: ["seq_lens"]}))
    assert [p.pattern.name for p in program.uncapturable()] == ["item"]
    outcome = check_program(program, device=dev)
    assert outcome.refused_by.startswith("audit: unsound declaration"), outcome.report()
    assert outcome.unsafe_ran and outcome.unsafe is None and outcome.uncapturable
    assert outcome.clean_on_cpu_only and not outcome.runnable and not outcome.false_alarm
    tally = Tally()
    tally.add(outcome)
    assert (tally.refused_runnable, tally.false_alarms, tally.uncapturable_clean_on_cpu) == (0, 0, 1)
    assert "uncapturable on CUDA" in outcome.report()


def test_a_host_read_before_the_replay_or_in_an_arm_not_run_is_capturable(dev) -> None:
    # (an escape holds every buffer until its stage's end: the trace follows one path of its Python)
    before = FuzzProgram(_leaf("item", "prepare_out_graph", PRE_REPLAY=list(SHARED_BUFFERS)))
    assert before.uncapturable() == ()
    outcome = check_program(before, device=dev)
    assert outcome.accepted and outcome.finding is None and not outcome.uncapturable, outcome.report()
    # the arm select does not run in the mode: its host read is never captured
    idle = _leaf("item", "attend", POST_REPLAY=["seq_lens"])
    running = FuzzLeaf("f1", (), declared(IN_REPLAY=["req_to_token", "seq_lens"]))
    assert FuzzProgram(FuzzTree("select", (idle, running), M.TARGET_VERIFY), M.DECODE).uncapturable() == ()


# -- metadata only: a buffer that lends its shape reads nothing --------------------------------

METADATA = sorted(n for n, p in VOCABULARY.items() if p.klass == "metadata")


@pytest.mark.parametrize("name", METADATA)
def test_a_metadata_only_use_declared_none_is_accepted_and_bit_identical_to_serial(dev, name) -> None:
    # the leaf's attention takes its metadata from the batch: the pattern is its only use of swa_map
    leaf = FuzzLeaf("f0", (Placement(VOCABULARY[name], "attend", "swa_map"),), declared(), None)
    outcome = check_program(FuzzProgram(leaf), device=dev)
    assert outcome.accepted and outcome.finding is None and not outcome.disagreements, outcome.report()


@pytest.mark.parametrize("name", METADATA)
def test_a_metadata_use_beside_a_read_of_the_values_declared_none_is_refused_and_races(dev, name) -> None:
    racing = FuzzLeaf("f0", (Placement(VOCABULARY[name], "attend", "swa_map"),
                             Placement(VOCABULARY["index_select"], "attend", "swa_map")), declared(), None)
    outcome = check_program(FuzzProgram(racing), device=dev)
    assert outcome.refused_by.startswith("audit: unsound declaration"), outcome.report()
    assert "'swa_map'" in outcome.refused_by and outcome.unsafe is not None and not outcome.false_alarm
    assert outcome.unsafe.buffer == "swa_map"
