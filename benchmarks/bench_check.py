"""Cost of the check modes: the decode loop with poison on release, and with the runtime read
observer as well, against the plain loop, side by side in one run.

Each repetition runs the three loops one after another on fresh lowered steps (same backend,
policy, batch size and scheduler seed) and times ``DecodeLoop.run``; a ratio is the median over
repetitions of ``check seconds / plain seconds``. The check modes are for verification, not
for serving: the scheduler waits for the whole step before writing (so nothing overlaps), and
the observer runs Python for every op.

    python benchmarks/bench_check.py [--quick] [--json]

``main(quick=False, *, steps=None, reps=None)`` returns ``{"poison_vs_plain": r, "observer_vs_plain": r, ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from readfence.backends import hybrid_linear, linear, trtllm_mha
from readfence.core import ModelConfig
from readfence.graph import CheckState, CpuDevice, LoopOptions, Policy, decode_loop, make_state
from readfence.graph.verification import LateReadWatch


def _seconds(kind: str, steps: int, cfg: ModelConfig) -> float:
    backend = hybrid_linear(trtllm_mha(), linear())
    state = make_state(cfg)
    check: bool | CheckState = False
    if kind == "poison":
        check = CheckState(state["shared"], cfg)
    elif kind == "observer":
        check = CheckState(state["shared"], cfg, watcher=LateReadWatch(state["shared"]))
    with CpuDevice(timeout=60.0) as dev:
        loop = decode_loop(backend, policy=Policy.PER_BUFFER, device=dev, batch_size=4, cfg=cfg, state=state,
                           options=LoopOptions(check=check))
        loop.run(2)  # warm up
        t0 = time.perf_counter()
        loop.run(steps)
        return time.perf_counter() - t0


def main(quick: bool = False, *, steps: int | None = None, reps: int | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = ModelConfig()
    default_steps, default_reps = (4, 1) if quick else (40, 5)  # quick: a smoke run of seconds
    steps, reps = steps or default_steps, reps or default_reps
    ratios: dict[str, list[float]] = {"poison": [], "observer": []}
    plain_steps: list[float] = []
    for _ in range(reps):
        plain = _seconds("plain", steps, cfg)
        plain_steps.append(steps / plain)
        for kind in ratios:
            ratios[kind].append(_seconds(kind, steps, cfg) / plain)
    return {
        "poison_vs_plain": round(statistics.median(ratios["poison"]), 3),
        "observer_vs_plain": round(statistics.median(ratios["observer"]), 3),
        "plain_steps_per_s": round(statistics.median(plain_steps), 1),
        "steps": steps,
        "repetitions": reps,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and repetitions (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = main(quick=args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        print("check modes against the plain decode loop (PER_BUFFER, hybrid_linear(trtllm_mha, linear), batch 4)")
        print(f"plain loop:                      {result['plain_steps_per_s']} steps/s")
        print(f"poison on release:               {result['poison_vs_plain']}x the plain loop's time")
        print(f"poison + runtime read observer:  {result['observer_vs_plain']}x the plain loop's time")
        print(f"(median of {result['repetitions']} repetitions of {result['steps']} steps, side by side)")
