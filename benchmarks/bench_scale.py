"""What tracing, auditing and lowering cost as the model deepens and the capture list grows.

The tracer records each stage as it runs (``readfence.core.tracing._record``: the node make_fx would
make for each op, at tens of microseconds an op rather than a millisecond). Measured side by
side in one run, on ``hybrid_linear(trtllm_mha, linear)`` in DECODE, trace cache cleared before
each measurement, median of ``--runs``:

* ``trace``: one step's trace at batch size 2, per depth (4, 16, 64 layers), and the same
  step traced with make_fx beside it: ``trace_make_fx_s``;
* ``audit``: ``audit`` at its default batch sizes (1, 2, max), with the observer;
* ``lower``: ``lower`` at batch size 2 under EXACT on the CPU device (its audit included);
* ``replay_check``: per depth, ``lower`` with and without its translation validation of the
  captured stages (``core.validate_replay``: the step's Python on three varied states, each
  captured stage replayed beside it), timed alternately: the check's seconds, ``lower`` over
  ``lower`` without it, and the check over the audit;
* ratios 64 / 4 layers of each, and recorded / make_fx at 64 layers;
* ``capture``: ``lower_capture_list`` over batch sizes 1..16 (4 layers): the first size, the
  median extra size and their ratio;
* ``memory``: in a fresh process, what lowering sizes 1..4 at 64 layers one at a time, keeping
  every graph, adds to its resident memory: for the first size, and per further size (Linux);
* ``floor``: what any audit or lowering that watches every op of every layer pays at least:
  each step the audit traces and observes (every node of the tree at each audited batch size;
  ``lower``'s at its one size), run once under a dispatch mode and a function mode that only
  run each op, the least a per-op watcher in Python costs; per depth, beside the eager step,
  and the 64 / 4 layer ratios those runs alone set for the audit and ``lower``, everything
  else free;
* ``ratio`` (``--ratio LAYERS`` alone): ``lower`` at that depth over its floor (``lower``'s part
  of ``floor``: the root's step, all its verdict runs when no node below places a fence), and over
  the floor of every node of the tree (what ``lower`` watched when it audited the whole tree),
  measured in the same rounds, and the validation's seconds and share of ``lower`` (as
  ``replay_check``);
* ``audit_all``: every reference backend in every mode (4 layers);
* ``fuzz``: programs per second of the differential fuzzer (one process);
* ``dispatch``: microseconds an op (``x + 1``) takes with no mode, under a mode that only runs
  it as torch wraps every mode's handler, and as readfence's ``DispatchMode`` does; and the
  seconds a fresh process's first audit and first lowering take (``paged`` in DECODE: torch's
  wrapper imported dynamo at the first op under any mode, and torch's Python meta kernels at
  the first probe of an op's binding).

    python benchmarks/bench_scale.py [--runs 3] [--json]
    python benchmarks/bench_scale.py --quick      # smoke run of seconds: its figures measure nothing
    python benchmarks/bench_scale.py --ratio 64 --runs 5 --cpu   # lower over its floor, the whole audit

``--cpu`` times every figure measured in this process with its CPU seconds (``time.process_time``,
the device's stream threads included), not wall seconds: on a machine shared with other jobs a
figure then counts this process's work only. A fresh process's first audit and lowering stay wall.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from readfence.backends import REFERENCE_LEAVES, hybrid_linear, linear, reference_compositions, trtllm_mha
from readfence.backends.fuzz import random_programs
from readfence.core import ForwardMode, ModelConfig, audit, clear_trace_cache, default_batch_sizes, run_program, run_step, step_functions, trace
from readfence.core.internal import REPLAY_SEEDS, DispatchMode, example_step, flatten_inputs, runs_as, trace_step, verdict_nodes
from readfence.graph import CpuDevice, Policy, Scheduler, lower, lower_capture_list
from readfence.graph.fuzz import check_program

M = ForwardMode


def target() -> Any:
    return hybrid_linear(trtllm_mha(), linear())


def _median(fn: Callable[[], float], runs: int) -> float:
    return statistics.median(fn() for _ in range(runs))


#: What every figure is timed with: wall seconds, or the process's CPU seconds (``--cpu``, on a
#: machine shared with other jobs: a figure then counts only this process's work).
_CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _now() -> float:
    return _CLOCK[0]()


def _timed(fn: Callable[[], object]) -> float:
    clear_trace_cache()
    start = _now()
    fn()
    return _now() - start


def _with_make_fx(cfg: ModelConfig) -> object:
    fns = step_functions(target(), M.DECODE, cfg)
    return trace_step(fns, M.DECODE, example_step(cfg, M.DECODE, 2).groups(), recorded=False)


def at_depth(cfg: ModelConfig, runs: int, dev: CpuDevice, sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Seconds to trace (layered and whole), audit (at ``sizes``: default 1, 2, max) and lower at
    ``cfg``'s depth; classes traced."""
    def traced() -> object:
        return trace(target(), M.DECODE, cfg=cfg, batch_size=2)

    def audited() -> object:
        return audit(target(), M.DECODE, cfg=cfg, batch_sizes=sizes)

    def lowered() -> object:
        return lower(target(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg)

    figures: dict[str, Any] = {"recorded": all(s.graph.recorded for s in trace(target(), M.DECODE, cfg=cfg, batch_size=2))}
    for name, fn in (("trace_s", traced), ("trace_make_fx_s", lambda: _with_make_fx(cfg)), ("audit_s", audited),
                     ("lower_s", lowered)):
        figures[name] = _median(lambda: _timed(fn), runs)  # noqa: B023 (called in the loop)
    return figures


@contextlib.contextmanager
def _replay_unchecked() -> Any:
    # ``lower`` without its translation validation of the captured stages (what it cost before)
    import readfence.graph.lowering._lower as lowering

    checked = lowering.validate_replay
    lowering.validate_replay = lambda *args, **kwargs: None
    try:
        yield
    finally:
        lowering.validate_replay = checked


def replay_check(layers: Sequence[int], runs: int, dev: CpuDevice, by_depth: dict[int, Any]) -> dict[str, Any]:
    """Per depth, ``lower`` with and without its replay check, timed alternately (median of
    ``runs`` each), the check's own seconds and its share of ``lower`` and of the audit."""
    out: dict[str, Any] = {}
    for n in layers:
        cfg = ModelConfig(layers=n)

        def lowered() -> object:
            return lower(target(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg)  # noqa: B023

        checked, unchecked = [], []
        for _ in range(runs):
            checked.append(_timed(lowered))
            with _replay_unchecked():
                unchecked.append(_timed(lowered))
        with_s, without_s = statistics.median(checked), statistics.median(unchecked)
        out[n] = {"lower_s": with_s, "lower_unchecked_s": without_s, "check_s": with_s - without_s,
                  "lower_over_unchecked": with_s / without_s, "check_over_audit": (with_s - without_s) /
                  by_depth[n]["audit_s"]}
    return out


def depth(layers: Sequence[int], runs: int, dev: CpuDevice, sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """:func:`at_depth` per number of layers."""
    return {n: at_depth(ModelConfig(layers=n), runs, dev, sizes) for n in layers}


class _RunsOps(DispatchMode):
    """Runs each op and nothing else: the per-op cost of any dispatch-level watcher."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _RunsCalls(TorchFunctionMode):
    """Runs each torch call and nothing else (the tracer and the observer watch above the
    dispatcher too: escapes, host reads, source lines)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _run_as(nodes: Sequence[Any]) -> list[Any]:
    """The backends ``nodes``' steps run as (a wrapper that hands its whole step to a child as that
    child), each once."""
    found: dict[str, Any] = {}
    for node in nodes:
        runner = runs_as(node, M.DECODE)
        found.setdefault(repr(runner), runner)
    return list(found.values())


def _runners(backend: Any) -> list[Any]:
    """The backends the audit's steps run as: every node of the tree (traced and observed once)."""
    nodes, stack = [], [backend]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack += [child for _, child in node.children()]
    return _run_as(nodes)


def _lower_runners(backend: Any) -> list[Any]:
    """The backends ``lower``'s verdict runs (``core.internal.verdict_nodes``: the root alone where
    no node below it places a fence of its own, else every node of the tree)."""
    return _run_as(verdict_nodes(backend, M.DECODE, batch_sizes=[2]))


def _watched(runner: Any, cfg: ModelConfig, size: int, runs: int) -> tuple[float, float]:
    """Seconds of ``runner``'s example step at batch size ``size``: eager, and watched (under
    :class:`_RunsCalls` and :class:`_RunsOps`), medians of ``runs`` after a warm-up run of each."""
    step = example_step(cfg, M.DECODE, size)

    def plain() -> float:
        start = _now()
        run_step(runner, M.DECODE, cfg, step)
        return _now() - start

    def under_modes() -> float:
        with _RunsCalls(), _RunsOps():
            return plain()

    plain(), under_modes()  # warm: the first call of a shape pays its allocations
    return _median(plain, runs), _median(under_modes, runs)


def lower_floor(cfg: ModelConfig, runs: int, runners: Sequence[Any] | None = None) -> float:
    """Seconds of the steps ``lower`` (batch size 2) runs watched (``runners``, default
    :func:`_lower_runners`: the root's), times two (a trace and an observation each): the least a
    lowering that watches every op of them pays."""
    chosen = _lower_runners(target()) if runners is None else runners
    return 2 * sum(_watched(runner, cfg, 2, runs)[1] for runner in chosen)


def floor(layers: Sequence[int], runs: int, audit_sizes: Sequence[int] | None,
          measured: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Seconds of the steps the audit (at ``audit_sizes``, default 1, 2, max) and ``lower`` (at
    batch size 2) run watched, each run once eagerly and once under :class:`_RunsOps` and
    :class:`_RunsCalls`, per depth; times two (the trace and the observer each run every step),
    over the 4-layer audit and lower ``measured``: the least 64 / 4 ratio those runs allow."""
    out: dict[str, Any] = {}
    for n in layers:
        cfg = ModelConfig(layers=n)
        sizes = tuple(audit_sizes) if audit_sizes is not None else default_batch_sizes(cfg)
        eager = watched = lower_watched = 0.0
        lowered = [repr(r) for r in _lower_runners(target())]
        for runner in _runners(target()):
            for size in sorted({*sizes, 2}):
                plain_s, watched_s = _watched(runner, cfg, size, runs)
                if size in sizes:
                    eager += plain_s
                    watched += watched_s
                if size == 2 and repr(runner) in lowered:
                    lower_watched += watched_s
        out[n] = {"eager_steps_s": eager, "watched_steps_s": watched, "audit_floor_s": 2 * watched,
                  "lower_floor_s": 2 * lower_watched}
    deep, shallow = layers[-1], layers[0]
    out[f"audit_{deep}_over_{shallow}_at_least"] = out[deep]["audit_floor_s"] / measured[shallow]["audit_s"]
    out[f"lower_{deep}_over_{shallow}_at_least"] = out[deep]["lower_floor_s"] / measured[shallow]["lower_s"]
    return out


def checks_floor(cfg: ModelConfig, runs: int, dev: CpuDevice, watched_floor: float) -> dict[str, float]:
    """The least the runs ``lower``'s checks make cost (batch size 2): its watched floor (the
    trace and the observer, ``watched_floor``), per generated state (``REPLAY_SEEDS``) an eager
    step beside a replay of the lowered step, and the rehearsal: the lowered program run once on
    another example with each op through a mode that only runs it (the rehearsal watches every
    node it runs: this is its least price), nothing of readfence's own around them. ``lower``
    cannot be cheaper than this sum."""
    runner = _lower_runners(target())[0]
    step = example_step(cfg, M.DECODE, 2)
    low = lower(target(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg)
    batch = Scheduler(cfg, M.DECODE, 2).next_step().batch

    def eager() -> float:
        start = _now()
        run_step(runner, M.DECODE, cfg, step)
        return _now() - start

    def replayed() -> float:
        start = _now()
        low.run(batch).result(timeout=60)
        return _now() - start

    def rehearsed() -> float:
        env = flatten_inputs(**example_step(cfg, M.DECODE, 2, seed=1).groups())
        start = _now()
        with torch.no_grad(), _RunsCalls(), _RunsOps():
            run_program(low.program, env)
        return _now() - start

    eager(), replayed(), rehearsed()  # warm
    eager_s, replay_s, rehearsal_s = _median(eager, runs), _median(replayed, runs), _median(rehearsed, runs)
    states = len(REPLAY_SEEDS)
    return {"eager_step_s": eager_s, "lowered_step_s": replay_s, "rehearsal_floor_s": rehearsal_s,
            "checks_floor_s": watched_floor + states * (eager_s + replay_s) + rehearsal_s}


def ratio(layers: int, runs: int, dev: CpuDevice) -> dict[str, Any]:
    """``lower`` at ``layers`` layers (batch size 2, EXACT) over its floor (:func:`lower_floor`),
    over the floor of its checks' runs (:func:`checks_floor`), where its time goes
    (``Lowered.pass_seconds``, wall seconds, medians) and the validation's share of it (``lower``
    with ``validate_replay`` a no-op): each round measures the floor, ``lower`` and ``lower``
    unvalidated one after the other, so that a slow spell of a shared machine hits all three;
    medians of ``runs`` rounds, every ``lower`` with the caches cleared (a first lowering)."""
    cfg = ModelConfig(layers=layers)
    made: list[Any] = []

    def lowered() -> object:
        made.append(lower(target(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg))
        return made[-1]

    lowered()  # warm: torch's first calls of each op, the example weights and caches drawn
    floors, trees, checked, unchecked, passes = [], [], [], [], []
    for _ in range(runs):
        floors.append(lower_floor(cfg, 3))  # (one watched run a node swings by a third on a busy machine)
        trees.append(lower_floor(cfg, 3, _runners(target())))
        checked.append(_timed(lowered))
        passes.append(made[-1].pass_seconds)
        with _replay_unchecked():
            unchecked.append(_timed(lowered))
        made.clear()
    lower_s, floor_s, tree_s = statistics.median(checked), statistics.median(floors), statistics.median(trees)
    validation_s = lower_s - statistics.median(unchecked)
    checks = checks_floor(cfg, max(runs, 3), dev, floor_s)
    return {"layers": layers, "lower_s": lower_s, "floor_s": floor_s, "lower_over_floor": lower_s / floor_s,
            "tree_floor_s": tree_s, "lower_over_tree_floor": lower_s / tree_s,
            **checks, "lower_over_checks_floor": lower_s / checks["checks_floor_s"],
            "checks_floor_over_floor": checks["checks_floor_s"] / floor_s,
            "passes_wall_s": {name: statistics.median(p[name] for p in passes) for name in passes[0]},
            "validation_s": validation_s, "validation_share": validation_s / lower_s,
            "rounds": [f"{c:.2f}/{f:.2f}" for c, f in zip(checked, floors)]}


def capture(sizes: Sequence[int], runs: int, dev: CpuDevice) -> dict[str, Any]:
    """Seconds to lower a capture list: the first size and the median of the others."""
    firsts, extras = [], []
    for _ in range(runs):
        clear_trace_cache()
        graphs = lower_capture_list(target(), M.DECODE, sizes, device=dev, policy=Policy.EXACT)
        seconds = [graphs.seconds[s] for s in graphs.sizes]
        firsts.append(seconds[0])
        extras.append(statistics.median(seconds[1:]))
    first, extra = statistics.median(firsts), statistics.median(extras)
    return {"sizes": f"{sizes[0]}..{sizes[-1]}", "first_s": first, "per_extra_size_s": extra,
            "extra_over_first": extra / first}


def fresh_processes(snippets: Sequence[tuple[str, str]], together: bool = False) -> dict[str, list[str]]:
    """What each ``(name, code)`` snippet prints, by name (a name given twice: each run's), each
    run in a fresh Python process: what it measures is a process's first import, call or
    allocation. ``together`` (a smoke run, whose figures measure nothing): all of them in one
    process, one after another, each in a namespace of its own: the same code runs and prints,
    at one interpreter's and torch's import instead of one per snippet.

    >>> fresh_processes([("a", "print(1)"), ("b", "print(2)")]) == fresh_processes(
    ...     [("a", "print(1)"), ("b", "print(2)")], together=True) == {"a": ["1\\n"], "b": ["2\\n"]}
    True
    """
    def run(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=600).stdout

    if together:
        driver = ("import contextlib, io, json, sys\n"
                  "printed = []\n"
                  "for code in json.loads(sys.argv[1]):\n"
                  "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
                  "        exec(compile(code, '<snippet>', 'exec'), {'__name__': '__main__'})\n"
                  "    printed.append(out.getvalue())\n"
                  "print(json.dumps(printed))\n")
        done = subprocess.run([sys.executable, "-c", driver, json.dumps([code for _, code in snippets])],
                              capture_output=True, text=True, check=True, timeout=600)
        outputs = json.loads(done.stdout)
    else:
        outputs = [run(code) for _, code in snippets]
    got: dict[str, list[str]] = {}
    for (name, _), out in zip(snippets, outputs, strict=True):
        got.setdefault(name, []).append(out)
    return got


def memory_code(layers: int, sizes: int) -> str:
    """A fresh process's code that prints the megabytes its resident memory grows by as it lowers
    a capture list of ``sizes`` sizes at ``layers`` layers, one size at a time, keeping every
    graph: for the first size, and per further size (what each lowered size, and the trace cache,
    keep). Read from ``/proc/self/statm`` after a collection (a peak from ``getrusage`` is no use
    here: Linux carries it over ``exec`` from the forking benchmark's own)."""
    return ("import gc, os, torch\n"
            "from readfence.backends import hybrid_linear, linear, trtllm_mha\n"
            "from readfence.core import ForwardMode, ModelConfig\n"
            "from readfence.graph import CpuDevice, Policy, lower_capture_list, make_state\n"
            "def rss():\n"
            "    gc.collect()\n"
            "    with open('/proc/self/statm') as f: return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 1e6\n"
            "torch.set_num_threads(1)\n"
            f"cfg = ModelConfig(layers={layers}); kept = []\n"
            "with CpuDevice(timeout=300.0) as dev:\n"
            "    state = make_state(cfg, dev); seen = [rss()]\n"
            f"    for size in range(1, {sizes} + 1):\n"
            "        kept.append(lower_capture_list(hybrid_linear(trtllm_mha(), linear()), ForwardMode.DECODE, [size],\n"
            "                                       device=dev, policy=Policy.EXACT, cfg=cfg, state=state))\n"
            "        seen.append(rss())\n"
            "print(seen[1] - seen[0], (seen[-1] - seen[1]) / (len(seen) - 2))\n")


def memory(layers: int, sizes: int, printed: Sequence[str] | None) -> dict[str, Any]:
    """``memory_code``'s figures from what it printed (``None``: not run, no ``/proc/self/statm``)."""
    if printed is None:
        return {"layers": layers, "sizes": f"1..{sizes}", "skipped": "no /proc/self/statm (Linux only)"}
    (out,) = printed
    first, extra = map(float, out.split())
    return {"layers": layers, "sizes": f"1..{sizes}", "first_size_mb": first, "per_extra_size_mb": extra}


def audit_all(runs: int, quick: bool = False) -> float:
    """Seconds to audit every reference backend in every mode (cache cleared first; ``quick``:
    one backend in one mode)."""
    targets = [make() for make in REFERENCE_LEAVES.values()] + list(reference_compositions().values())
    modes = (M.DECODE,) if quick else tuple(M)

    def once() -> None:
        for backend in targets[:1] if quick else targets:
            for mode in modes:
                audit(backend, mode)

    return _median(lambda: _timed(once), runs)


def fuzz(programs: int, dev: CpuDevice) -> float:
    """Programs per second of the differential fuzzer, one process."""
    drawn = list(random_programs(programs, 2026))
    start = _now()
    for p in drawn:
        check_program(p, device=dev)
    return programs / (_now() - start)


#: A fresh process's first audit and first lowering, each a snippet that prints its seconds.
FIRST_CALLS = {name: ("import time, torch\n"
                      "from readfence.backends import paged\n"
                      "from readfence.core import ForwardMode, audit\n"
                      "from readfence.graph import CpuDevice, Policy, lower\n"
                      f"start = time.perf_counter(); {call}\n"
                      "print(time.perf_counter() - start)\n")
               for name, call in {"first_audit_fresh_process_s": "audit(paged(), ForwardMode.DECODE)",
                                  "first_lower_fresh_process_s": "lower(paged(), ForwardMode.DECODE, batch_size=2, "
                                                                 "device=CpuDevice(), policy=Policy.EXACT)"}.items()}


def dispatch(ops: int, runs: int, printed: dict[str, list[str]]) -> dict[str, float]:
    """Microseconds an op under no mode, under a mode with torch's handler wrapper, under one
    with readfence's; seconds of a fresh process's first audit and first lowering (``FIRST_CALLS``
    as ``printed``, median of its runs)."""
    def passing(base: type) -> type:
        class Passing(base):  # type: ignore[misc, valid-type]
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                return func(*args, **(kwargs or {}))
        return Passing

    x = torch.ones(4)

    def per_op(mode: Any) -> float:
        with mode:
            start = _now()
            for _ in range(ops):
                x + 1
            return (_now() - start) / ops * 1e6

    modes = {"op_us": contextlib.nullcontext, "torch_mode_op_us": passing(TorchDispatchMode),
             "readfence_mode_op_us": passing(DispatchMode)}
    seen: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(max(runs, 7)):  # interleaved: a slow spell of the machine hits each alike
        for name, make in modes.items():
            seen[name].append(per_op(make()))
    out = {name: statistics.median(times) for name, times in seen.items()}
    for name in FIRST_CALLS:
        out[name] = statistics.median(float(x) for x in printed[name])
    return out


def main(quick: bool = False, *, runs: int | None = None, only_ratio: int | None = None) -> dict[str, Any]:
    """The figures above (``quick``, a smoke run: 1 and 2 layers audited at batch size 2,
    capture sizes 1..2, one backend audited in one mode, one program, 1,000 ops; one run; the
    fresh processes' snippets run in one process). ``only_ratio``: only :func:`ratio` at that
    many layers (and every reference audit in one process, unless ``quick``)."""
    torch.set_num_threads(1)  # the device's streams are the parallelism (benchmarks/README.md)
    runs = runs or (1 if quick else 3)
    if only_ratio is not None:
        with CpuDevice(timeout=120.0) as dev:
            figures = {"ratio": ratio(only_ratio, runs, dev)}
        if not quick:
            figures["audit_all_s"] = audit_all(1)
        return figures
    layers = (1, 2) if quick else (4, 16, 64)
    kept = (2, 3) if quick else (64, 4)
    linux = os.path.exists("/proc/self/statm")
    snippets = [("memory", memory_code(*kept))] * linux + [(n, code) for n, code in FIRST_CALLS.items()
                                                          for _ in range(runs)]
    printed = fresh_processes(snippets, together=quick)
    with CpuDevice(timeout=120.0) as dev:
        trace(target(), M.DECODE, cfg=ModelConfig(layers=2))  # warm the tracer up
        by_depth = depth(layers, runs, dev, [2] if quick else None)
        deep, shallow = by_depth[layers[-1]], by_depth[layers[0]]
        ratios = {f"{k.removesuffix('_s')}_{layers[-1]}_over_{layers[0]}": deep[k] / shallow[k]
                  for k in ("trace_s", "audit_s", "lower_s")}
        ratios[f"trace_recorded_over_make_fx_at_{layers[-1]}"] = deep["trace_s"] / deep["trace_make_fx_s"]
        out: dict[str, Any] = {"layers": by_depth, "ratios": ratios,
                               "replay_check": replay_check(layers, runs, dev, by_depth),
                               "floor": floor(layers, runs, [2] if quick else None, by_depth),
                               "capture": capture(range(1, 3) if quick else range(1, 17), runs, dev),
                               "memory": memory(*kept, printed.get("memory")),
                               "audit_all_s": audit_all(1, quick),
                               "fuzz_programs_per_s": fuzz(1 if quick else 20, dev),
                               "dispatch": dispatch(1_000 if quick else 20_000, runs, printed)}
    return out


def _print(figures: dict[str, Any], prefix: str = "") -> None:
    for k, v in figures.items():
        if isinstance(v, dict):
            _print(v, f"{prefix}{k}.")
        else:
            print(f"{prefix}{k}: {v:.3f}" if isinstance(v, float) else f"{prefix}{k}: {v}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ratio", type=int, metavar="LAYERS", default=None,
                    help="only lower at LAYERS layers over its floor, the validation's share, every reference audit")
    ap.add_argument("--cpu", action="store_true", help="time with the process's CPU seconds, not wall seconds")
    a = ap.parse_args()
    if a.cpu:
        _CLOCK[0] = time.process_time
    result = main(a.quick, runs=a.runs, only_ratio=a.ratio)
    print(json.dumps(result, indent=2, default=str) if a.json else "", end="")
    if not a.json:
        _print(result)
