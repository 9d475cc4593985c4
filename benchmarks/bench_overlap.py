"""Overlap: steps/s of each fence policy on CpuDevice, as ratios to COARSE and to the limit.

Workload: ``hybrid_linear(trtllm_mha(), linear())`` (page table, lengths and swa map end
before the replay, state slots inside it) on a model big enough that matmuls dominate the
forward, and a scheduler whose page-table write carries a synthetic ``write_cost x write_cost``
matmul calibrated so that the writes cost about as much as the forward. Both sides release
the GIL, so on two cores a policy that releases the page table early overlaps them.

* forward alone: lowered steps back to back, no scheduler;
* writes alone: the scheduler's next step and its writes (matmul included), no forward;
* limit: ``1 / max(forward alone, writes alone)`` steps/s (perfect overlap);
* each policy: the overlapped decode loop (sanitizer off), interleaved with the other policies
  in every repetition; the median steps/s over repetitions.

A second workload, ``hybrid_linear(trtllm_mha(), linear_per_layer)`` (a linear-attention leaf
that looks its state slot up in every layer, so ``state_slots`` ends POST_REPLAY), is where the
join of all buffers is late while the page table ends early: JOINED waits for the replay.

    python benchmarks/bench_overlap.py            # full run (a few minutes on 2 cores)
    python benchmarks/bench_overlap.py --quick    # smoke run (smaller model, fewer steps)
    python benchmarks/bench_overlap.py --json     # the result dict as JSON

``main(quick=False)`` returns the ratios as a dict (``readfence bench`` prints it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from readfence.backends import hybrid_linear, leaf, linear, linear_attention, remap, trtllm_mha
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, Scheduler, decode_loop, lower

MODE = ForwardMode.DECODE
POLICIES = (Policy.COARSE, Policy.JOINED, Policy.PER_BUFFER, Policy.EXACT)


def linear_per_layer():
    """Linear attention that reads ``state_slots`` in every layer (POST_REPLAY)."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        slots = remap(shared["state_slots"], batch["req_pool_indices"])  # read in the body
        pool = pools["state"].select(0, layer)
        out, state = linear_attention(mode, q, k, v, pool.index_select(0, slots), decay=0.9)
        pool.index_copy_(0, slots, state)
        return out

    post = ReadEffect.of({"state_slots": ReadEnd.POST_REPLAY})
    return leaf("linear_per_layer", attend, declare={ForwardMode.DECODE: post}, reads=["state_slots"])


WORKLOADS = {
    "hybrid_linear(trtllm_mha,linear)": lambda: hybrid_linear(trtllm_mha(), linear()),
    "hybrid_linear(trtllm_mha,linear_per_layer)": lambda: hybrid_linear(trtllm_mha(), linear_per_layer()),
}


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"cfg": ModelConfig(hidden=256, mlp=1024, layers=4, heads=4, head_dim=64),
                "batch_size": 8, "steps": 20, "reps": 3, "warmup": 3}
    return {"cfg": ModelConfig(hidden=512, mlp=2048, layers=4, heads=8, head_dim=64),
            "batch_size": 16, "steps": 60, "reps": 5, "warmup": 10}


def _forward_alone(backend: Any, cfg: ModelConfig, batch_size: int, steps: int) -> float:
    """Seconds per step of the lowered forward alone (no scheduler, no fences waited)."""
    with CpuDevice() as dev:
        low = lower(backend, MODE, batch_size=batch_size, device=dev, policy=Policy.COARSE, cfg=cfg)
        nxt = Scheduler(cfg, MODE, batch_size).next_step()
        for b in SHARED_BUFFERS:
            low.shared[b].copy_(nxt.shared[b])
        for _ in range(3):
            low.run(nxt.batch)
        dev.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            low.run(nxt.batch)
        dev.synchronize()
        return (time.perf_counter() - t0) / steps


def _writes_alone(cfg: ModelConfig, batch_size: int, write_cost: int, steps: int) -> float:
    """Seconds per step of the scheduler alone: next step + writes (matmul) on its stream."""
    work = torch.randn(write_cost, write_cost) if write_cost else None
    live = {b: t.clone() for b, t in Scheduler(cfg, MODE, batch_size).next_step().shared.items()}
    sched = Scheduler(cfg, MODE, batch_size)
    with CpuDevice() as dev:
        s = dev.stream("schedule")

        def write(dst, src, w):
            if w is not None:
                torch.mm(w, w)
            dst.copy_(src)

        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = sched.next_step()
            for b in SHARED_BUFFERS:
                s.launch(write, live[b], nxt.shared[b], work if b == "req_to_token" else None)
        dev.synchronize()
        return (time.perf_counter() - t0) / steps


def _mm_seconds(n: int, reps: int = 5) -> float:
    w = torch.randn(n, n)
    torch.mm(w, w)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(w, w)
    return (time.perf_counter() - t0) / reps


def calibrate(target_s: float) -> int:
    """The matmul size whose time is about ``target_s`` (cube-root fit, refined twice)."""
    n = 256
    for _ in range(3):
        t = _mm_seconds(n)
        n = max(16, int(round(n * (target_s / t) ** (1 / 3) / 16)) * 16)
    return n


def measure(workload: str, *, quick: bool = False, progress: bool = False) -> dict[str, Any]:
    """Run one workload; returns steps/s per policy, ratios to COARSE and to the limit."""
    st = _settings(quick)
    cfg, batch_size, steps, reps = st["cfg"], st["batch_size"], st["steps"], st["reps"]
    make = WORKLOADS[workload]
    forward_s = _forward_alone(make(), cfg, batch_size, steps)
    write_cost = calibrate(forward_s)
    writes_s = _writes_alone(cfg, batch_size, write_cost, steps)
    # the scheduler's own work (next step, copies) counts too: refit the matmul once
    other_s = max(0.0, writes_s - _mm_seconds(write_cost))
    write_cost = calibrate(max(forward_s - other_s, 0.2 * forward_s))
    writes_s = _writes_alone(cfg, batch_size, write_cost, steps)
    limit = 1.0 / max(forward_s, writes_s)
    with CpuDevice() as dev:
        loops = {p: decode_loop(make(), MODE, policy=p, device=dev, batch_size=batch_size, cfg=cfg,
                                write_cost=write_cost) for p in POLICIES}
        plans = {p.name: {r["buffer"]: r["end"] for r in loop.lowered.plan.describe()} for p, loop in loops.items()}
        for loop in loops.values():
            loop.run(st["warmup"])
        rates: dict[Policy, list[float]] = {p: [] for p in POLICIES}
        for rep in range(reps):
            order = POLICIES if rep % 2 == 0 else tuple(reversed(POLICIES))
            for p in order:
                _, seconds = loops[p].run(steps)
                rates[p].append(steps / seconds)
            if progress:
                print(f"  rep {rep + 1}/{reps}: " + "  ".join(f"{p.name} {rates[p][-1]:.1f}" for p in POLICIES),
                      file=sys.stderr)
    med = {p: statistics.median(v) for p, v in rates.items()}
    coarse = med[Policy.COARSE]
    return {
        "workload": workload,
        "forward_ms": forward_s * 1e3,
        "writes_ms": writes_s * 1e3,
        "write_cost": write_cost,
        "limit_steps_per_s": limit,
        "steps_per_s": {p.name: med[p] for p in POLICIES},
        "vs_coarse": {p.name: med[p] / coarse for p in POLICIES},
        "vs_limit": {p.name: med[p] / limit for p in POLICIES},
        "plans": plans,
        "settings": {"batch_size": batch_size, "steps": steps, "reps": reps, "hidden": cfg.hidden,
                     "mlp": cfg.mlp, "layers": cfg.layers},
    }


def main(quick: bool = False, workloads: tuple[str, ...] | None = None, progress: bool = False) -> dict[str, Any]:
    """Ratios of every workload (flat ``name: number`` entries, for ``readfence bench``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # streams are the parallelism: one intra-op thread each
    try:
        out: dict[str, Any] = {}
        for i, name in enumerate(workloads or tuple(WORKLOADS)):
            r = measure(name, quick=quick, progress=progress)
            key = "mixed" if i == 0 else "late_join"
            out[key] = {
                "forward_ms": r["forward_ms"], "writes_ms": r["writes_ms"],
                "limit_steps_per_s": r["limit_steps_per_s"],
                **{f"{p.lower()}_steps_per_s": v for p, v in r["steps_per_s"].items()},
                **{f"{p.lower()}_vs_coarse": v for p, v in r["vs_coarse"].items() if p != "COARSE"},
                **{f"{p.lower()}_vs_limit": v for p, v in r["vs_limit"].items()},
            }
            out.setdefault("_details", {})[key] = r
        details = out.pop("_details")
        main.details = details  # type: ignore[attr-defined]
        return out
    finally:
        torch.set_num_threads(threads)


def _print(details: dict[str, Any]) -> None:
    for key, r in details.items():
        s = r["settings"]
        print(f"[{key}] {r['workload']}  (batch {s['batch_size']}, hidden {s['hidden']}, mlp {s['mlp']}, "
              f"{s['layers']} layers; {s['steps']} steps x {s['reps']} reps, median)")
        print(f"  forward alone {r['forward_ms']:.1f} ms/step, writes alone {r['writes_ms']:.1f} ms/step "
              f"(write_cost {r['write_cost']}), limit {r['limit_steps_per_s']:.1f} steps/s")
        for p in POLICIES:
            ends = ", ".join(f"{b}={e}" for b, e in r["plans"][p.name].items())
            print(f"  {p.name:10} {r['steps_per_s'][p.name]:6.1f} steps/s  {r['vs_coarse'][p.name]:5.2f}x COARSE  "
                  f"{r['vs_limit'][p.name]:5.2f}x limit   [{ends}]")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps and repetitions")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--workload", choices=list(WORKLOADS), action="append",
                        help="run only this workload (repeatable)")
    args = parser.parse_args(argv)
    main(quick=args.quick, workloads=tuple(args.workload) if args.workload else None, progress=not args.json)
    details = main.details  # type: ignore[attr-defined]
    if args.json:
        print(json.dumps(details, indent=2))
    else:
        _print(details)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
