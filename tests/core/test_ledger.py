"""The ledger: every run of a step's code records what it read, and the verdict is the ledger's.

The backends that attack it (``tests/traffic.py``) read a buffer, or compute a value, only on a
kind of batch that traffic has and the trace's example has not. Each is refused here; the checks
that trust no analysis catch each one at run time (``tests/graph/test_traffic_runs.py``), and the
same code with an honest declaration is accepted.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import paged
from readfence.core import (
    BODY,
    PREPARE_IN_GRAPH,
    PREPARE_OUT_GRAPH,
    ForwardMode,
    ModelConfig,
    audit,
    clear_trace_cache,
    step_functions,
    trace,
    varied_step,
)
from readfence.core.internal import (
    PYTHON,
    REPLAY_SEEDS,
    Ledger,
    RunKind,
    evidence_epoch,
    example_step,
    flatten_inputs,
    ledger_of,
    tokens_per_request,
)
from readfence.effects import ReadEnd
from readfence.graph import Scheduler, make_state
from tests import traffic
from tests.conftest import SMALL as CFG

M = ForwardMode


# -- the ledger itself -------------------------------------------------------------------------
def test_a_read_seen_in_a_stage_s_python_is_placed_at_its_traced_reader_or_the_stage_s_end() -> None:
    program = trace(paged(), M.DECODE, cfg=CFG)
    ledger = Ledger(program, CFG, 2)
    ledger.observe_examples(step_functions(paged(), M.DECODE, CFG))
    reads = ledger.node_reads(RunKind.OBSERVER)
    # the stages' Python: prepare_in_graph runs its graph, which reads each buffer at its traced node
    assert reads[PREPARE_IN_GRAPH] == {"index_select": frozenset({"req_to_token"}),
                                       "index_select_1": frozenset({"seq_lens"})}
    # a step that is not replayed runs every stage's Python: no node of a graph to follow
    extend = Ledger(trace(paged(), M.EXTEND, cfg=CFG), CFG, 2)
    extend.observe_varied()
    assert set(extend.node_reads()[PREPARE_IN_GRAPH]) == {PYTHON}
    assert [r.label for r in extend.runs()] == ["first_tokens", "longest_context", "mixed_batch"]


def test_every_run_goes_through_one_entry_that_records_even_when_the_code_raises() -> None:
    program = trace(paged(), M.DECODE, cfg=CFG)
    ledger = Ledger(program, CFG, 2)
    step = example_step(CFG, M.DECODE, 2)
    with pytest.raises(RuntimeError, match="stage failed"), ledger.watch(RunKind.CHECK, "raising", step.shared) as seen:
        with seen, seen.stage(BODY.name):
            step.shared["seq_lens"].sum()
            raise RuntimeError("stage failed")
    assert ledger.effect(RunKind.CHECK, traced=False)["seq_lens"] is ReadEnd.POST_REPLAY
    assert ledger.last_reader("seq_lens").run.label == "raising"  # later than the trace's read


def test_a_read_any_run_saw_counts_and_the_evidence_epoch_moves_only_when_the_reads_do() -> None:
    program = trace(paged(), M.DECODE, cfg=CFG)
    ledger = Ledger(program, CFG, 2)
    step = example_step(CFG, M.DECODE, 2)
    before = evidence_epoch()
    ledger.observe_program(RunKind.REHEARSAL, "rehearsal", flatten_inputs(**step.groups()), step.shared)
    assert ledger.effect() == program.traced() and ledger.version > 0  # node by node: the very reads of the trace
    moved, version = evidence_epoch(), ledger.version
    again = step.clone()
    ledger.observe_program(RunKind.REHEARSAL, "rehearsal", flatten_inputs(**again.groups()), again.shared)
    assert (evidence_epoch(), ledger.version) == (moved, version)  # again: nothing new, no verdict goes stale
    with ledger.watch(RunKind.CHECK, "late", step.shared) as seen, seen, seen.stage(BODY.name):
        step.shared["swa_map"].max()
    assert ledger.effect()["swa_map"] is ReadEnd.POST_REPLAY and evidence_epoch() > moved >= before


def test_one_ledger_per_bound_program_and_state() -> None:
    program = trace(paged(), M.DECODE, cfg=CFG)
    state = make_state(CFG)
    assert ledger_of(program, CFG, 2, state) is ledger_of(program, CFG, 2, state)
    assert ledger_of(program, CFG, 2, make_state(CFG)) is not ledger_of(program, CFG, 2, state)
    assert ledger_of(program, CFG, 2) is not ledger_of(program, CFG, 2, state)
    first = ledger_of(program, CFG, 2)
    clear_trace_cache()  # forgotten with the traces
    assert ledger_of(program, CFG, 2) is not first


# -- the generated states cover what traffic has -------------------------------------------------
def _statistics(shared: dict, batch: dict, cfg: ModelConfig, mode: ForwardMode) -> dict[str, object]:
    """Data-dependent values a step's code may branch on or bake."""
    n = tokens_per_request(mode)
    rows, pos = batch["req_pool_indices"], batch["positions"].view(-1, n)[:, 0]
    lens = shared["seq_lens"].index_select(0, rows)
    new, deep = int((pos == 0).sum()), int((pos > 0).sum())
    return {
        "new": new, "deep": deep, "mixed": bool(new and deep), "all new": new == len(rows),
        "at the longest": bool((lens == cfg.max_ctx).any()), "longest a power of two": _power_of_two(int(lens.max())),
        "longest a power of two strictly between": 1 < int(lens.max()) < cfg.max_ctx and _power_of_two(int(lens.max())),
        "stale rows": int((shared["seq_lens"] > 0).sum()) - int(
            rows.unique().numel()), "repeated rows": int(rows.numel() - rows.unique().numel()),
    }


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY, M.EXTEND])
def test_every_value_real_traffic_varies_differs_from_the_example_on_a_generated_state(mode) -> None:
    # real traffic: the scheduler a decode loop runs (requests finish, rows are reused) and the
    # serving loop's padded batches; every statistic that takes another value there than on the
    # trace's example takes another on one of the generated states, at every batch size lowered
    cfg = CFG
    for size in (1, 2, 4):
        example = _statistics(example_step(cfg, mode, size).shared, example_step(cfg, mode, size).batch, cfg, mode)
        scheduler = Scheduler(cfg, mode, size, seed=3, finish_prob=0.3)
        seen: dict[str, set] = {k: set() for k in example}
        for _ in range(3 * cfg.max_ctx):
            step = scheduler.next_step()
            for k, v in _statistics(step.shared, step.batch, cfg, mode).items():
                seen[k].add(v)
        if size >= 3:  # a graph captured for it running fewer requests, padded with copies of one (serve_loop)
            seen["repeated rows"].add(1)
        generated = [_statistics(s.shared, s.batch, cfg, mode)
                     for s in (varied_step(cfg, mode, size, seed=seed) for seed in REPLAY_SEEDS)]
        for k, values in seen.items():
            if values - {example[k]}:
                assert any(g[k] != example[k] for g in generated), (mode, size, k, example[k], values)


def test_the_generated_states_are_consistent_steps() -> None:
    # each is a step a scheduler could write: every new token's slot is its row's page entry, and
    # a length counts the tokens of its request up to this step's last
    for mode in (M.DECODE, M.EXTEND):
        n = tokens_per_request(mode)
        for seed in (*REPLAY_SEEDS, 7):
            step = varied_step(CFG, mode, 4, seed=seed)
            rows = step.batch["req_pool_indices"].repeat_interleave(n)
            pos = step.batch["positions"]
            table = step.shared["req_to_token"][rows, pos].long()
            assert torch.equal(table, step.batch["out_cache_loc"]), (mode, seed)
            assert torch.equal(step.shared["seq_lens"][rows].long(), pos.view(-1, n)[:, -1].repeat_interleave(n) + 1)


# -- reads the ledger's runs see, that a trace's example does not take ---------------------------
def _slow_but_first(names):
    return [pytest.param(n, marks=[] if i == 0 else [pytest.mark.slow]) for i, n in enumerate(names)]


#: (a batch-size-1 example is at a middle length: its trace takes that path, no varied state is needed)
_VARIED_ONLY = [n for n in traffic.out_of_graph_cases(CFG.max_ctx) if n != "middle_length"]


@pytest.mark.parametrize("name", _slow_but_first(_VARIED_ONLY))
def test_a_read_the_out_of_graph_stage_makes_only_on_some_traffic_is_refused(name) -> None:
    make = traffic.out_of_graph_cases(CFG.max_ctx)[name]
    bad = audit(make(False), M.DECODE, cfg=CFG).failure()
    hidden = "state_slots" if name in ("reused_slot", "pad_token") else "seq_lens"
    assert (bad.buffer, bad.declared, bad.observed, bad.reader[0]) == (hidden, ReadEnd.NONE, ReadEnd.PRE_REPLAY,
                                                                        PREPARE_OUT_GRAPH.name), bad.message
    assert "stage prepare_out_graph's Python read it on a varied state" in bad.message, bad.message
    assert audit(make(True), M.DECODE, cfg=CFG).map(lambda r: r.sound).value_or(False)
    # the trace and the example's run alone take the other path (at batch size 8 the example has a
    # request at the longest context)
    clear_trace_cache()
    assert audit(make(False), M.DECODE, cfg=CFG, batch_sizes=[2], observe_steps=0).map(lambda r: r.sound).value_or(False)


@pytest.mark.parametrize("name", _slow_but_first(traffic.KEPT))
def test_a_custom_op_reading_the_live_lengths_it_keeps_is_refused_by_the_audit_given_the_state(name) -> None:
    state = make_state(CFG)
    bad = audit(traffic.kept(name, state), M.DECODE, cfg=CFG, state=state, batch_sizes=[2]).failure()
    stage = PREPARE_IN_GRAPH if name == "in_graph" else BODY
    assert (bad.buffer, bad.reader[0]) == ("seq_lens", stage.name), bad.message
    assert "a read only the observer sees" in bad.message and "aten.index_select" in bad.reader[1]
    assert audit(traffic.kept(name, state, honest=True), M.DECODE, cfg=CFG, state=state,
                 batch_sizes=[2]).map(lambda r: r.sound).value_or(False)


@pytest.mark.parametrize("name", _slow_but_first(traffic.EXTEND_BRANCHES))
def test_a_branch_on_a_mixed_batch_in_extend_is_refused(name) -> None:
    bad = audit(traffic.extend_branch(name, CFG.max_ctx), M.EXTEND, cfg=CFG).failure()
    stage = PREPARE_IN_GRAPH if name == "in_graph" else BODY
    assert (bad.buffer, bad.reader[0], bad.batch_size) == ("req_to_token", stage.name, 2), bad.message
    assert "read it on a varied state" in bad.message
    assert audit(traffic.extend_branch(name, CFG.max_ctx, honest=True), M.EXTEND,
                 cfg=CFG).map(lambda r: r.sound).value_or(False)
