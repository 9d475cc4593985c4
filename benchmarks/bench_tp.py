"""Tensor parallelism: steps/s of TP=2 per fence policy, against COARSE and against the limit.

Two ranks (``readfence.parallel.launch``, gloo on CPU), each with its own scheduler, shared
buffers and lowered step of its half of the model (half the heads, half the MLP columns,
an all-reduce after attention and after the MLP inside the graph). On each rank, side by side
in every repetition (policies in alternating order, the ranks aligned by a barrier before each
measurement):

* forward alone: that rank's lowered steps back to back, no scheduler (``time_forward``);
* scheduler alone: next step plus writes, no forward (``time_scheduler``);
* limit: ``1 / max(forward alone, scheduler alone)`` steps/s (perfect overlap on that rank);
* each policy: the overlapped decode loop (sanitizer off).

The model, the workload and the scheduler's work are those of ``bench_overlap.py``'s
``mixed_wait`` run: the page-table write is a CPU-free stall of the schedule stream
(``write_wait_s``, a copy engine's stand-in) calibrated to about the forward's time; the ranks
agree on the mean of their calibrations. Each printed ratio is the
median over repetitions of that repetition's ratio.

What two cores can show: each rank's forward gets a core and the writes use none, so whether a
policy lets a rank's writes overlap its forward shows as on a GPU machine, with the all-reduces
in the graph (a rank waits in its all-reduce for the other: a slow rank slows both). What they
cannot show: each rank's host thread (scheduling, launches, the graph replay's per-op Python) and
its forward share that rank's core, so the CPU part of scheduling competes with the forward, and
another job on the machine takes a core from one rank and, through the all-reduces, from both;
the cost of an all-reduce over NVLink or a network (here: loopback TCP, tens of microseconds);
and GPU compute overlapping copies. Read the ratios, not the steps/s.

    python benchmarks/bench_tp.py            # full run (several minutes on 2 cores)
    python benchmarks/bench_tp.py --quick    # smoke run (smaller model, fewer steps)
    python benchmarks/bench_tp.py --json     # the full result as JSON

``main(quick=False)`` returns the ratios as a dict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_overlap import _settings, calibrate  # the overlap benchmark's settings and calibration

from readfence.backends import hybrid_linear, linear, trtllm_mha
from readfence.core import ForwardMode
from readfence.graph import Policy, decode_loop
from readfence.graph.runtime import synthetic_work
from readfence.parallel import launch

POLICIES = (Policy.COARSE, Policy.JOINED, Policy.PER_BUFFER, Policy.EXACT)
WORKLOAD = "hybrid_linear(trtllm_mha, linear)"


def settings(quick: bool) -> dict[str, Any]:
    """The model, batch and step counts of ``bench_overlap.py`` (its ``mixed_wait`` run is this
    workload on one process), so the two compare."""
    return _settings(quick)


def measure_rank(rank: Any, quick: bool) -> dict[str, Any]:
    """One rank's side-by-side measurements (runs on every rank, in lockstep)."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # the streams are the parallelism
    st = settings(quick)
    steps, reps = st["steps"], st["reps"]
    with rank.open_device() as dev:
        loops = {p: decode_loop(hybrid_linear(trtllm_mha(), linear()), ForwardMode.DECODE, policy=p, device=dev,
                                batch_size=st["batch_size"], cfg=rank.cfg) for p in POLICIES}
        coarse = loops[Policy.COARSE]
        for loop in loops.values():  # warm up every loop before timing anything
            loop.run(st["warmup"])
        forward_s = statistics.median(coarse.time_forward(steps) for _ in range(3))  # robust to a load spike
        _, wait_s = calibrate(coarse, forward_s, "wait")
        agreed = torch.tensor([wait_s])
        dist.all_reduce(agreed)  # the same scheduler work on every rank: the ranks' mean
        agreed /= rank.size
        work = synthetic_work(dev, write_wait_s=float(agreed))
        for loop in loops.values():
            loop.write_work = work
        forward, writes = [], []
        rates: dict[Policy, list[float]] = {p: [] for p in POLICIES}
        for rep in range(reps):
            dist.barrier()
            forward.append(coarse.time_forward(steps))
            dist.barrier()
            writes.append(coarse.time_scheduler(steps))
            for p in POLICIES if rep % 2 == 0 else tuple(reversed(POLICIES)):
                dist.barrier()
                _, seconds = loops[p].run(steps)
                rates[p].append(steps / seconds)
    limits = [1.0 / max(f, w) for f, w in zip(forward, writes)]
    med = statistics.median
    return {
        "forward_ms": med(forward) * 1e3,
        "writes_ms": med(writes) * 1e3,
        "write_wait_ms": float(agreed) * 1e3,
        "limit_steps_per_s": med(limits),
        "steps_per_s": {p.name: med(rates[p]) for p in POLICIES},
        "vs_coarse": {p.name: med([r / c for r, c in zip(rates[p], rates[Policy.COARSE])]) for p in POLICIES},
        "vs_limit": {p.name: med([r / lim for r, lim in zip(rates[p], limits)]) for p in POLICIES},
    }


def measure(quick: bool = False) -> dict[int, dict[str, Any]]:
    """Each rank's figures by rank (see :func:`measure_rank`), the two ranks run side by side."""
    st = settings(quick)
    return launch(measure_rank, quick, tp=2, device="cpu", cfg=st["cfg"], collective_timeout_s=120)


def main(quick: bool = False) -> dict[str, Any]:
    """Per rank: steps/s, ratios to COARSE and to the limit, per policy (``readfence bench tp``)."""
    return flat(measure(quick))


def flat(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``measure``'s figures as one mapping of numbers per rank (``rank0.per_buffer_vs_limit``)."""
    out: dict[str, Any] = {}
    for rank, r in sorted(per_rank.items()):
        out[f"rank{rank}"] = {
            "forward_ms": r["forward_ms"], "writes_ms": r["writes_ms"], "limit_steps_per_s": r["limit_steps_per_s"],
            **{f"{p.lower()}_steps_per_s": v for p, v in r["steps_per_s"].items()},
            **{f"{p.lower()}_vs_coarse": v for p, v in r["vs_coarse"].items() if p != "COARSE"},
            **{f"{p.lower()}_vs_limit": v for p, v in r["vs_limit"].items()},
        }
    return out


def report(per_rank: dict[int, dict[str, Any]], quick: bool) -> str:
    """The text report: the setting, then per rank its limit and each policy's ratios."""
    st = settings(quick)
    cfg = st["cfg"]
    lines = [f"TP=2 (gloo on cpu), {WORKLOAD}: hidden {cfg.hidden}, mlp {cfg.mlp}, {cfg.heads} heads, "
             f"{cfg.layers} layers, batch {st['batch_size']}; each rank half the heads and MLP columns; "
             f"{st['steps']} steps x {st['reps']} reps, median; load average {os.getloadavg()[0]:.1f} "
             f"on {os.cpu_count()} cores"]
    for rank, r in sorted(per_rank.items()):
        lines.append(f"[rank {rank}] forward alone {r['forward_ms']:.1f} ms/step, scheduler alone "
                     f"{r['writes_ms']:.1f} ms/step (wait {r['write_wait_ms']:.1f} ms), limit "
                     f"{r['limit_steps_per_s']:.1f} steps/s")
        lines += [f"  {p.name:10} {r['steps_per_s'][p.name]:6.1f} steps/s  {r['vs_coarse'][p.name]:5.2f}x COARSE  "
                  f"{r['vs_limit'][p.name]:5.2f}x limit" for p in POLICIES]
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps and repetitions")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    per_rank = measure(quick=args.quick)
    print(json.dumps(per_rank, indent=2) if args.json else report(per_rank, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
