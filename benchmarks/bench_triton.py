"""How many times one audit of SGLang's Triton backend runs each kernel in triton's interpreter, and why.

An audit of ``TritonAttnBackend`` (SGLang 0.5.23, its kernels in triton's interpreter:
``TRITON_INTERPRET=1``) spends nearly all its time in interpreted kernel runs. Every run is counted
by kernel and by purpose, read off the call stack: the trace's recorded run (``trace``), its second
eager run that tells a constant the backend keeps from one made for a call (``persistence``), the
engine's capture-time calls (``capture``), the stage run again on the live state when a program is
bound to it (``bind``), the read observer's scheduler steps (``observe``), a step's Python on the
varied states (``varied``), and verify's validation, rehearsal and loop runs.

Side by side in each repetition, in alternating order: the audit as it was (``before``: every
bound stage run again on the live state) and as it is (``after``: a stage is run again only where
something it can reach overlaps the live shared buffers, decided from memory ranges). Both must give
the same report. Prints the runs per kernel and purpose and the median wall time of each.

    python benchmarks/bench_triton.py [--runs 3] [--mode decode] [--steps 2] [--json]
    python benchmarks/bench_triton.py --quick     # one repetition, one scheduler step

``main(quick=False, *, runs=3, mode="decode", steps=2)`` returns the counts and times (``readfence
bench triton`` prints them). Needs SGLang and triton (``tests/engine/sglang-requirements.txt``):
without them it returns ``{"skipped": why}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: before SGLang is imported

import torch

#: (a function on the stack, the purpose of the run), the innermost match wins.
PURPOSES = (
    ("mark_persistent", "persistence"), ("_capture", "capture"), ("_record", "trace"), ("_live_memory", "bind"),
    ("observe_engine", "observe"), ("varied_reads", "varied"), ("observe_varied", "varied"),
    ("validate_replay", "validation"), ("rehearse", "rehearsal"), ("run_serial", "serial run"),
)


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter[tuple[str, str]]]:
    """Count every interpreted kernel run in the block, by (kernel, purpose)."""
    from triton.runtime.interpreter import GridExecutor

    runs: collections.Counter[tuple[str, str]] = collections.Counter()
    original = GridExecutor.__call__

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = [f.name for f in traceback.extract_stack()]
        purpose = next((p for name in reversed(names) for key, p in PURPOSES if name == key), "other")
        runs[(self.fn.__name__, purpose)] += 1
        return original(self, *args, **kwargs)

    GridExecutor.__call__ = run
    try:
        yield runs
    finally:
        GridExecutor.__call__ = original


@contextlib.contextmanager
def before() -> Iterator[None]:
    """The audit as it was: every bound stage run again on the live state."""
    from readfence.core.tracing import _bind

    decide = _bind._may_touch
    _bind._may_touch = lambda *args: True
    try:
        yield
    finally:
        _bind._may_touch = decide


def _audit(mode: Any, steps: int) -> tuple[float, collections.Counter[tuple[str, str]], str]:
    from readfence.core import clear_trace_cache
    from readfence.engine import audit_engine
    from tests.engine import sglang_engines as sg

    clear_trace_cache()
    engine = sg.triton_attn()
    with counted() as runs:
        start = time.perf_counter()
        report = audit_engine(engine, mode, batch_sizes=[2], steps=steps)
        spent = time.perf_counter() - start
    table = report.map(lambda r: r.table()).value_or(None) or report.failure().report.table()
    return spent, runs, table


def main(quick: bool = False, *, runs: int = 3, mode: str = "decode", steps: int = 2) -> dict[str, Any]:
    """The interpreted runs and times of one audit, before and after (see the module docstring)."""
    from readfence.core import ForwardMode

    root = str(pathlib.Path(__file__).resolve().parents[1])  # tests.engine: SGLang's backend as the tests build it
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.engine import sglang_engines as sg

    if sg.TRITON_REASON:
        return {"skipped": sg.TRITON_REASON}
    torch.set_num_threads(1)
    forward = ForwardMode[mode.upper()]
    runs, steps = (1, 1) if quick else (runs, steps)
    _audit(forward, 1)  # imports, each kernel's first rewrite by the interpreter, its IR: not measured
    times: dict[str, list[float]] = {"before": [], "after": []}
    counts: dict[str, collections.Counter[tuple[str, str]]] = {}
    tables = {}
    for i in range(runs):
        for label in (("before", "after") if i % 2 == 0 else ("after", "before")):
            with before() if label == "before" else contextlib.nullcontext():
                spent, counts[label], tables[label] = _audit(forward, steps)
            times[label].append(spent)
    if tables["before"] != tables["after"]:
        raise AssertionError(f"the reports differ:\n{tables['before']}\n---\n{tables['after']}")
    kernels = sorted({k for c in counts.values() for k, _ in c})
    purposes = list(dict.fromkeys([*(p for _, p in PURPOSES), "other"]))
    seen = [(k, p) for k in kernels for p in purposes if counts["before"][(k, p)] or counts["after"][(k, p)]]
    return {"mode": forward.name, "steps": steps, "runs": runs,
            "runs_before": {f"{k}.{p}": counts["before"][(k, p)] for k, p in seen},
            "runs_after": {f"{k}.{p}": counts["after"][(k, p)] for k, p in seen},
            "total_before": sum(counts["before"].values()), "total_after": sum(counts["after"].values()),
            "median_s_before": statistics.median(times["before"]), "median_s_after": statistics.median(times["after"]),
            "after_vs_before": statistics.median(times["after"]) / statistics.median(times["before"])}


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of one scheduler step: a smoke run")
    parser.add_argument("--runs", type=int, default=3, help="repetitions (median; default 3)")
    parser.add_argument("--mode", default="decode", help="decode, target_verify or extend")
    parser.add_argument("--steps", type=int, default=2, help="the observer's scheduler steps (the CLI's default: 2)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    r = main(args.quick, runs=args.runs, mode=args.mode, steps=args.steps)
    if args.json or "skipped" in r:
        print(json.dumps(r, indent=2))
        return
    print(f"TritonAttnBackend in {r['mode']}, batch size 2, {r['steps']} scheduler step(s); interpreted kernel runs "
          f"per audit, before -> after:")
    for key, n in r["runs_before"].items():
        kernel, purpose = key.rsplit(".", 1)
        print(f"  {kernel:40} {purpose:12} {n:3} -> {r['runs_after'][key]:3}")
    print(f"  {'total':53} {r['total_before']:3} -> {r['total_after']:3}")
    print(f"median of {r['runs']}: {r['median_s_before']:.1f} s -> {r['median_s_after']:.1f} s "
          f"({r['median_s_after'] / r['median_s_before']:.2f}x)")


if __name__ == "__main__":
    _cli()
