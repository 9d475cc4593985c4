"""Differential fuzzing of the analysis: generated user backends through audit, lower, verify.

Draws ``--programs`` programs with ``readfence.backends.fuzz.random_programs`` (uniform over
the vocabulary, the same programs for the same ``--seed``) and checks each with
``readfence.graph.fuzz.check_program``: P1 (accepted by the audit and by ``lower`` under
PER_BUFFER and EXACT implies ``verify`` clean under both) and P2 (the runtime read observer
sees nothing a faithful stage's trace misses) must never fail;
reads no static analysis can see (plan/run) are counted apart, and ``verify`` must catch
them; so are reads handed to a thread a stage starts, which must be refused
(``StageThreadError``) or caught by ``verify``, never accepted. P3, the false-alarm rate, is
measured: refused programs that run clean under
``verify(..., UNSAFE_skip_soundness_check=True)``, over the refused programs that could run.
The oracle models a CUDA engine: a program that reads a device value on the host inside the
captured graph cannot be captured on CUDA, so it is counted as uncapturable (and how many of those
ran clean on the CPU device), neither a runnable refusal nor a false alarm.
Prints programs per second, the violations, the false-alarm rate and the per-pattern counts.

    python benchmarks/bench_fuzz.py --programs 200 [--seed 0] [--json] [--log fuzz.log]
    python benchmarks/bench_fuzz.py --quick            # 2 programs: a smoke run
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from typing import Any, TextIO

import torch

from readfence.backends.fuzz import random_programs
from readfence.graph import CpuDevice
from readfence.graph.fuzz import Outcome, Tally, check_program

#: Fewest refused-but-runnable programs a false-alarm rate is reported from (``None`` below it).
MIN_FOR_RATE = 20


def main(programs_n: int = 200, seed: int = 0, *, quick: bool = False, max_leaves: int = 3,
         log: TextIO | None = None, progress: TextIO | None = None) -> dict[str, Any]:
    """Check ``programs_n`` generated programs (2 with ``quick``: a smoke run); returns the tally as a dict
    plus ``programs_per_s``, ``errors`` (programs whose check raised) and ``interrupted``
    (stopped early by Ctrl-C or SIGTERM: the figures cover the programs that ran).
    ``false_alarm_rate`` is ``None`` when fewer than :data:`MIN_FOR_RATE` programs could give one."""
    torch.set_num_threads(1)  # the device's streams are the parallelism (benchmarks/README.md)
    n = 2 if quick else programs_n
    drawn = list(random_programs(n, seed, max_leaves=max_leaves))
    tally = Tally()
    errors = 0
    start = time.perf_counter()
    interrupted = False
    with CpuDevice(timeout=60.0) as dev:
        for i, program in enumerate(drawn, 1):
            try:
                outcome = check_program(program, device=dev)
            except KeyboardInterrupt:  # stopped early (Ctrl-C, SIGTERM): report what ran
                interrupted = True
                break
            except Exception:  # a crash is a finding too: log it and go on
                errors += 1
                if log is not None:
                    print(f"ERROR on program {i}:\n{program}\n{traceback.format_exc()}", file=log, flush=True)
                continue
            tally.add(outcome)
            if log is not None and _notable(outcome):
                print(f"program {i}: {outcome.report()}\n", file=log, flush=True)
            if progress is not None and i % 100 == 0:
                rate = i / (time.perf_counter() - start)
                print(f"{i}/{len(drawn)} programs, {rate:.2f}/s, P1 {tally.p1_violations}, P2 {tally.p2_violations}, "
                      f"invisible caught {tally.invisible_caught}, threads missed {tally.thread_missed}, "
                      f"false alarms {tally.false_alarms}/{tally.refused_runnable}, errors {errors}", file=progress,
                      flush=True)
    seconds = time.perf_counter() - start
    result = tally.as_dict()
    if result["refused_runnable"] < MIN_FOR_RATE:  # a rate of 1 of 1 is not a rate
        result["false_alarm_rate"] = None
    ran = tally.programs + errors
    result.update(programs_per_s=round(ran / seconds, 3), wall_s=round(seconds, 1), errors=errors,
                  seed=seed, max_leaves=max_leaves, interrupted=interrupted)
    return result


def _notable(outcome: Outcome) -> bool:
    return outcome.verdict not in ("accepted", "refused") or outcome.false_alarm


def _print(r: dict[str, Any]) -> None:
    stopped = " (interrupted)" if r["interrupted"] else ""
    print(f"{r['programs']} programs{stopped} (seed {r['seed']}, up to {r['max_leaves']} leaves) in {r['wall_s']} s: "
          f"{r['programs_per_s']} programs/s")
    print(f"accepted {r['accepted']}, refused {r['refused']} ({r['refused_runnable']} could run under the unsafe flag "
          f"and be captured on CUDA)")
    print(f"uncapturable on CUDA (a captured stage reads a device value on the host): {r['uncapturable']} programs, "
          f"{r['uncapturable_refused']} refused, {r['uncapturable_clean_on_cpu']} of those clean on the CPU device "
          f"under the unsafe flag (no false alarm: no CUDA engine runs them)")
    print(f"P1 violations: {r['p1_violations']}")
    print(f"P2 violations: {r['p2_violations']}")
    print(f"invisible to static analysis, caught by verify: {r['invisible_caught']}; covered by the fences (verify "
          f"clean): {r['invisible_clean']}; missed by verify: {r['invisible_missed']}")
    print(f"read on another thread: {r['threads']} programs; refused as such {r['thread_refused']}, caught by "
          f"verify {r['thread_caught']}, missed {r['thread_missed']}")
    rate = "no rate from so few" if r["false_alarm_rate"] is None else f"{r['false_alarm_rate']:.3f}"
    print(f"false alarms (P3): {r['false_alarms']} / {r['refused_runnable']} = {rate}")
    print("false alarms by refusal: " + ", ".join(f"{k} {v}" for k, v in sorted(r["false_alarm_kinds"].items())))
    print(f"errors: {r['errors']}")
    print("refusals: " + ", ".join(f"{k} {v}" for k, v in sorted(r["refusals"].items())))
    print("combinators: " + ", ".join(f"{k} {v}" for k, v in sorted(r["combinators"].items())))
    print("stages: " + ", ".join(f"{k} {v}" for k, v in r["stages"].items()))
    print("vias: " + ", ".join(f"{k} {v}" for k, v in sorted(r["vias"].items())))
    print(f"{'pattern':22} {'placed':>7} {'accepted':>9} {'refused':>8} {'false alarm':>12} {'other':>6}")
    for name, count in r["patterns"].items():
        v = r["by_pattern"].get(name, {})
        other = sum(c for k, c in v.items() if k not in ("accepted", "refused", "false alarm"))
        print(f"{name:22} {count:7} {v.get('accepted', 0):9} {v.get('refused', 0):8} {v.get('false alarm', 0):12} "
              f"{other:6}")


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # main() reports the programs that ran


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=200, help="programs to generate and check")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed: the same programs for the same seed")
    parser.add_argument("--max-leaves", type=int, default=3, help="leaves per tree at most")
    parser.add_argument("--quick", action="store_true", help="2 programs: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--log", help="append every violation, false alarm and crash, in full, to this file")
    args = parser.parse_args()
    if args.programs < 1:
        parser.error(f"--programs must be at least 1, got {args.programs}")
    signal.signal(signal.SIGTERM, _stop)
    log = open(args.log, "a") if args.log else None
    try:
        r = main(args.programs, args.seed, quick=args.quick, max_leaves=args.max_leaves, log=log,
                 progress=sys.stderr)
    finally:
        if log is not None:
            log.close()
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print(r)


if __name__ == "__main__":
    _cli()
