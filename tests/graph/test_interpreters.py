"""Every interpreter of the step computes what the serial step computes, on generated programs.

A differential property: programs drawn from the fuzzer's generator (every return shape a stage
may use, reads through views, copies, host reads, custom ops, kept references) run step after
step on the scheduler's changing state under each interpretation of ``core.eval_step``:

* serial (``core.EAGER``), the reference;
* the read observer's (``core.Watched``): the same Python, watched;
* the traced program bound to the live state, run on names (``core.run_program``), and the
  same under the observer, node by node (``core.internal.Ledger.observe_program``: the lowering's rehearsal);
* the lowered step under COARSE on the CPU device, against ``run_serial`` on the same schedule.

Each must be bit-identical, wherever its own preconditions hold: a program the trace refuses (a
write, a thread) has no traced interpretation, one ``lower`` refuses (trace-time state, a Python
value from the data) no lowered one; how many programs reach each interpretation is asserted, so
the property is never vacuous.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends.fuzz import VOCABULARY, FuzzProgram, random_programs
from readfence.core import (
    CapturedStateError,
    ReadObserver,
    StageOutputError,
    StageThreadError,
    StageWriteError,
    bind,
    eval_step,
    run_program,
    step_functions,
    trace,
)
from readfence.core.internal import EAGER, Ledger, RunKind, Watched, flatten_inputs
from readfence.graph import CpuDevice, LoopOptions, Policy, Scheduler, UncapturableStage, make_state, run_overlapped, run_serial
from readfence.graph.fuzz import FUZZ_CONFIG
from readfence.graph.lowering.internal import restore, snapshot

#: Patterns that the trace refuses whatever else the program does (writes, threads) would hide
#: the rest of the program from every interpretation but the serial one.
VOCAB = {k: p for k, p in VOCABULARY.items() if p.klass not in ("write", "thread")}
STEPS, BATCH = 3, 3
REFUSED = (CapturedStateError, StageOutputError, StageThreadError, StageWriteError, UncapturableStage)




def _steps(program: FuzzProgram, cfg, state):
    """Each scheduler step's inputs, written into the live shared buffers (the references a
    generated leaf keeps point there); pools are fresh copies per interpretation."""
    scheduler = Scheduler(cfg, program.mode, BATCH, seed=5)
    for _ in range(STEPS):
        step = scheduler.next_step()
        for k, v in step.shared.items():
            state["shared"][k].copy_(v)
        yield step


def _interpretations(program: FuzzProgram) -> dict[str, bool]:
    cfg = program.config(FUZZ_CONFIG)
    state = make_state(cfg)
    saved = snapshot(state)
    backend = program.build(state)
    fns = step_functions(backend, program.mode, cfg)
    try:
        bound = bind(trace(backend, program.mode, cfg=cfg, batch_size=BATCH), state)
    except (StageWriteError, StageThreadError):
        bound = None
    runnable = bound is not None and all(c.usable for c in bound.captured())
    for step in _steps(program, cfg, state):
        inputs = {"shared": state["shared"], "batch": step.batch, "params": state["params"]}
        serial = eval_step(EAGER, fns, {**inputs, "pools": snapshot(state)["pools"]})
        observer = ReadObserver(state["shared"])
        with observer:
            watched = eval_step(Watched(observer), fns, {**inputs, "pools": snapshot(state)["pools"]})
        assert torch.equal(watched, serial), f"observer\n{program}"
        if runnable:
            env = flatten_inputs(**inputs, pools=snapshot(state)["pools"])
            assert torch.equal(run_program(bound, env), serial), f"traced program\n{program}"
            env = flatten_inputs(**inputs, pools=snapshot(state)["pools"])
            Ledger(bound, cfg, BATCH, state).observe_program(RunKind.REHEARSAL, "observed", env, state["shared"])
            assert torch.equal(env["logits"], serial), f"traced program, observed\n{program}"
    restore(state, saved)
    lowered = False
    reference = run_serial(backend, program.mode, steps=STEPS, batch_size=BATCH, cfg=cfg, state=state,
                           options=LoopOptions(seed=2))
    restore(state, saved)
    try:
        with CpuDevice(timeout=30.0) as dev:
            run = run_overlapped(backend, program.mode, steps=STEPS, policy=Policy.COARSE, device=dev, batch_size=BATCH,
                                 cfg=cfg, state=state, options=LoopOptions(seed=2, sanitize=False))
        lowered = True
        assert run.matches(reference), f"lowered under COARSE\n{program}"
    except REFUSED:
        pass
    return {"traced": runnable, "lowered": lowered}


def _check(programs: list[FuzzProgram]) -> None:
    reached = [_interpretations(p) for p in programs]
    # not vacuous: most programs reach the traced and the lowered interpretations
    assert sum(r["traced"] for r in reached) >= len(programs) // 2
    assert sum(r["lowered"] for r in reached) >= len(programs) // 2


def test_every_interpreter_computes_the_serial_step_on_generated_programs() -> None:
    _check(list(random_programs(8, seed=11, vocabulary=VOCAB)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_every_interpreter_computes_the_serial_step_on_more_generated_programs(seed: int) -> None:
    _check(list(random_programs(14, seed=100 + seed, vocabulary=VOCAB)))


def test_the_generated_programs_use_every_return_shape() -> None:
    from readfence.backends.fuzz import RETURN_SHAPES

    seen = {leaf.returns for seed in range(2) for p in random_programs(14, seed=100 + seed, vocabulary=VOCAB)
            for leaf in p.leaves()}
    assert seen == set(RETURN_SHAPES)
