"""Overlap: steps/s of each fence policy on CpuDevice, as ratios to COARSE and to the limit.

A model big enough that matmuls dominate the forward, and a scheduler whose page-table write
carries extra work calibrated so that the scheduler alone costs about as much as the forward:

* ``matmul``: a ``write_cost x write_cost`` matmul (GIL-free CPU work). On CpuDevice it
  competes with the forward for the same cores and memory bandwidth, so even perfect fences
  cannot reach the limit; the measured slowdown of each side is part of the result;
* ``wait``: a CPU-free wait of the same duration (host work that does not share the device's
  compute, as on a GPU machine). This isolates what the fences themselves allow;
* ``none``: no extra work, on the demo's own model and batch (``default_nowait``): the loop
  against the serial eager run (``run_serial``: scheduler, writes and forward on one thread),
  the baseline a user compares with. Overlap has only the scheduler's own work to hide here.

Measured side by side in every repetition (policies in alternating order):

* forward alone: lowered steps back to back, no scheduler;
* writes alone: the scheduler's next step and its writes (extra work included), no forward;
* limit: ``1 / max(forward alone, writes alone)`` steps/s (perfect overlap);
* each policy: the overlapped decode loop (sanitizer off);
* for ``none``: the serial eager run, as one more contender.

Each printed ratio is the median over repetitions of that repetition's ratio.

Workloads (see ``RUNS``): ``hybrid_linear(trtllm_mha(), linear())`` (page table, lengths and
swa map end before the replay, state slots inside it: the join is early);
``hybrid_linear(trtllm_mha(), linear_per_layer)`` (state slots read in every layer: the join is
POST_REPLAY and JOINED waits for the replay); ``hybrid_linear(trtllm_mha(), linear_indexed)``
(state slots read first in a long in-graph prepare: the join falls mid-forward and JOINED lands
between COARSE and PER_BUFFER).

    python benchmarks/bench_overlap.py            # full run (about 11 minutes on 2 cores)
    python benchmarks/bench_overlap.py --quick    # smoke run of seconds (tiny model, few steps)
    python benchmarks/bench_overlap.py --json     # the full result as JSON
    python benchmarks/bench_overlap.py --only mixed_wait

``main(quick=False)`` returns the ratios as a dict (``readfence bench`` prints it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import attrs
import torch

from readfence.backends import hybrid_linear, leaf, linear, linear_attention, remap, trtllm_mha
from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import DEVICE_KINDS, DecodeLoop, Policy, decode_loop, open_device, run_serial
from readfence.graph.runtime import synthetic_work

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


def linear_indexed(width: int = 1024, depth: int = 32):
    """Linear attention whose in-graph prepare looks up ``state_slots`` first, then runs an
    indexer network (IN_REPLAY, with the IN_REPLAY point well inside the forward).

    The indexer stands for in-graph work such as DeepSeek's lightning indexer; its cost here
    is synthetic (``depth`` ``width x width`` matmuls) and its scores are not used by the model.
    """
    weight = torch.randn(width, width) / width**0.5

    def prepare_in_graph(mode, shared, batch, meta):
        slots = remap(shared["state_slots"], batch["req_pool_indices"])  # the last read
        h = weight.index_select(0, batch["input_ids"].reshape(-1) % width)
        for _ in range(depth):
            h = torch.tanh(h @ weight)
        return {"state_slots": slots, "indexer_scores": h}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        slots = meta["state_slots"]
        pool = pools["state"].select(0, layer)
        out, state = linear_attention(mode, q, k, v, pool.index_select(0, slots), decay=0.9)
        pool.index_copy_(0, slots, state)
        return out

    return leaf("linear_indexed", attend, prepare_in_graph=prepare_in_graph, reads=["state_slots"])


WORKLOADS = {
    "hybrid_linear(trtllm_mha,linear)": lambda cfg: hybrid_linear(trtllm_mha(), linear()),
    "hybrid_linear(trtllm_mha,linear_per_layer)": lambda cfg: hybrid_linear(trtllm_mha(), linear_per_layer()),
    # an indexer about a third of the forward: the model's width, 32 deep
    "hybrid_linear(trtllm_mha,linear_indexed)": lambda cfg: hybrid_linear(trtllm_mha(),
                                                                          linear_indexed(width=cfg.hidden)),
}


def _settings(quick: bool, kind: str = "wait") -> dict[str, Any]:
    if kind == "none":  # the demo's model and batch, and enough steps that a step is ~1 ms of ~0.2 s
        return {"cfg": ModelConfig(), "batch_size": 4, "steps": 20 if quick else 200, "reps": 1 if quick else 7,
                "warmup": 2 if quick else 10}
    if quick:  # a smoke run of seconds: every workload and policy runs, the ratios are noise
        return {"cfg": ModelConfig(hidden=128, mlp=512, layers=2, heads=2, head_dim=64),
                "batch_size": 4, "steps": 5, "reps": 1, "warmup": 1, "calibration": (5, 4, 2), "capacity": 3}
    # Big enough that compute dominates the per-op Python of CpuDevice's graph replay, which
    # holds the GIL the host scheduler needs too (at hidden 512 that costs 5-15% of the limit).
    return {"cfg": ModelConfig(hidden=1024, mlp=4096, layers=4, heads=8, head_dim=64),
            "batch_size": 16, "steps": 40, "reps": 5, "warmup": 5, "calibration": (20, 8, 4), "capacity": 20}


def calibrate(loop: DecodeLoop, forward_s: float, kind: str, steps: tuple[int, int, int] = (20, 8, 4)) -> tuple[int, float]:
    """``(write_cost, write_wait_s)`` so that ``loop``'s scheduler alone takes about ``forward_s``.

    ``steps``: scheduler steps timed for the baseline and per matmul fit, and how many fits.
    """
    base_steps, fit_steps, fits = steps
    base = attrs.evolve(loop, write_work=None).time_scheduler(base_steps)  # next step and copies only
    if kind == "wait":
        return 0, max(forward_s - base, 0.0)
    n = 512
    for _ in range(fits):  # matmul time ~ n^3: refit on the measured writes
        work = synthetic_work(loop.device, write_cost=n)
        writes = attrs.evolve(loop, write_work=work).time_scheduler(fit_steps)
        n = max(32, int(round(n * (max(forward_s - base, 1e-4) / max(writes - base, 1e-4)) ** (1 / 3) / 16)) * 16)
    return n, 0.0


def parallel_speedup(dev: Any, work: Any, n: int = 20) -> float:
    """How much faster two streams run ``work`` than one (2.0: two free cores, or a device
    with room for both). Bounds what overlapping a forward with compute writes can gain."""
    one, two = dev.stream("capacity a"), dev.stream("capacity b")
    t0 = time.perf_counter()
    for _ in range(n):
        one.launch(work, label="capacity")
    dev.synchronize()
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        one.launch(work, label="capacity")
        two.launch(work, label="capacity")
    dev.synchronize()
    return 2 * alone / (time.perf_counter() - t0)


def measure(workload: str, *, kind: str = "matmul", quick: bool = False, progress: bool = False,
            device: str = "cpu") -> dict[str, Any]:
    """Run one workload; returns steps/s per policy, ratios to COARSE and to the limit.

    ``kind``: the scheduler's extra page-table work is a matmul (``"matmul"``: compute that,
    on CpuDevice, competes with the forward for the cores) or a stall of the schedule stream
    that uses no compute (``"wait"``). Every repetition measures the forward alone and the
    scheduler alone (``DecodeLoop.time_forward`` / ``time_scheduler`` of the COARSE loop, hence
    that repetition's limit) and each policy, side by side; each ratio is the median over
    repetitions of that repetition's ratio, so a machine that slows down halfway does not skew it.
    """
    st = _settings(quick, kind)
    cfg, batch_size, steps, reps = st["cfg"], st["batch_size"], st["steps"], st["reps"]
    backend = WORKLOADS[workload](cfg)  # one value for every policy: traced once, the same weights
    with open_device(device) as dev:
        loops = {p: decode_loop(backend, MODE, policy=p, device=dev, batch_size=batch_size, cfg=cfg)
                 for p in POLICIES}
        coarse = loops[Policy.COARSE]
        coarse.time_forward(st["warmup"])
        write_cost, wait_s = ((0, 0.0) if kind == "none" else
                              calibrate(coarse, coarse.time_forward(steps), kind, st["calibration"]))
        work = synthetic_work(dev, write_cost=write_cost, write_wait_s=wait_s)
        speedup = parallel_speedup(dev, work, st["capacity"]) if kind == "matmul" else None
        for loop in loops.values():
            loop.write_work = work
        plans = {p.name: {r["buffer"]: r["end"] for r in loop.lowered.plan.describe()} for p, loop in loops.items()}
        for loop in loops.values():
            loop.run(st["warmup"])
        forward, writes = [], []
        contenders: tuple[Any, ...] = POLICIES + ((SERIAL,) if kind == "none" else ())
        rates: dict[Any, list[float]] = {p: [] for p in contenders}
        for rep in range(reps):
            forward.append(coarse.time_forward(steps))
            writes.append(coarse.time_scheduler(steps))
            for p in contenders if rep % 2 == 0 else tuple(reversed(contenders)):
                # each timed run starts from a clean heap: otherwise about one run in five holds a
                # full collection of torch's ~300,000 objects (130-145 ms, GIL held), whichever
                # contender it falls on (see benchmarks/README.md)
                gc.collect()
                gc.freeze()  # the survivors (torch's own objects) are left out of later collections
                if p is SERIAL:
                    seconds = run_serial(backend, MODE, steps=steps, batch_size=batch_size, cfg=cfg,
                                         device=dev).seconds
                else:
                    _, seconds = loops[p].run(steps)
                rates[p].append(steps / seconds)
            if progress:
                print(f"  rep {rep + 1}/{reps}: forward {forward[-1] * 1e3:.1f} ms, writes {writes[-1] * 1e3:.1f} ms; "
                      + "  ".join(f"{_name(p)} {rates[p][-1]:.1f}" for p in contenders), file=sys.stderr)
        device_name = dev.name
    limits = [1.0 / max(f, w) for f, w in zip(forward, writes)]
    med = statistics.median
    serial = rates.get(SERIAL)
    return {
        "workload": workload,
        "device": device_name,
        "write_kind": kind,
        "forward_ms": med(forward) * 1e3,
        "writes_ms": med(writes) * 1e3,
        "write_cost": write_cost,
        "write_wait_ms": wait_s * 1e3,
        "limit_steps_per_s": med(limits),
        "parallel_speedup": speedup,
        "steps_per_s": {p.name: med(rates[p]) for p in POLICIES},
        "vs_coarse": {p.name: med([r / c for r, c in zip(rates[p], rates[Policy.COARSE])]) for p in POLICIES},
        "vs_limit": {p.name: med([r / lim for r, lim in zip(rates[p], limits)]) for p in POLICIES},
        "serial_steps_per_s": None if serial is None else med(serial),
        "serial_vs_limit": None if serial is None else med([r / lim for r, lim in zip(serial, limits)]),
        "vs_serial": None if serial is None else {p.name: med([r / e for r, e in zip(rates[p], serial)])
                                                  for p in POLICIES},
        "plans": plans,
        "settings": {"batch_size": batch_size, "steps": steps, "reps": reps, "hidden": cfg.hidden,
                     "mlp": cfg.mlp, "layers": cfg.layers},
    }


#: The serial eager run, a contender of the ``none`` runs.
SERIAL = "SERIAL"


def _name(contender: Any) -> str:
    return contender if isinstance(contender, str) else contender.name


#: (key, workload, write kind) measured by ``main``, in order.
RUNS = (
    ("default_nowait", "hybrid_linear(trtllm_mha,linear)", "none"),
    ("mixed_matmul", "hybrid_linear(trtllm_mha,linear)", "matmul"),
    ("mixed_wait", "hybrid_linear(trtllm_mha,linear)", "wait"),
    ("late_join_wait", "hybrid_linear(trtllm_mha,linear_per_layer)", "wait"),
    ("mid_join_wait", "hybrid_linear(trtllm_mha,linear_indexed)", "wait"),
)


def main(quick: bool = False, runs: tuple[tuple[str, str, str], ...] = RUNS,
         progress: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Ratios of every run (nested ``name: number`` entries, for ``readfence bench``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # streams are the parallelism: one intra-op thread each
    try:
        out: dict[str, Any] = {}
        details: dict[str, Any] = {}
        for key, workload, kind in runs:
            if progress:
                print(f"{key}: {workload}, scheduler work = {kind}", file=sys.stderr)
            r = details[key] = measure(workload, kind=kind, quick=quick, progress=progress, device=device)
            out[key] = {
                "forward_ms": r["forward_ms"], "writes_ms": r["writes_ms"],
                "limit_steps_per_s": r["limit_steps_per_s"],
                **{f"{p.lower()}_steps_per_s": v for p, v in r["steps_per_s"].items()},
                **{f"{p.lower()}_vs_coarse": v for p, v in r["vs_coarse"].items() if p != "COARSE"},
                **{f"{p.lower()}_vs_limit": v for p, v in r["vs_limit"].items()},
                **({"parallel_speedup": r["parallel_speedup"]} if r["parallel_speedup"] is not None else {}),
                **({"serial_steps_per_s": r["serial_steps_per_s"], "serial_vs_limit": r["serial_vs_limit"],
                    **{f"{p.lower()}_vs_serial": v for p, v in r["vs_serial"].items()}}
                   if r["vs_serial"] is not None else {}),
            }
        main.details = details  # type: ignore[attr-defined]
        return out
    finally:
        torch.set_num_threads(threads)


def _print(details: dict[str, Any]) -> None:
    for key, r in details.items():
        s = r["settings"]
        print(f"[{key}] {r['workload']} on {r['device']}, scheduler work: {r['write_kind']}  "
              f"(batch {s['batch_size']}, hidden {s['hidden']}, mlp {s['mlp']}, "
              f"{s['layers']} layers; {s['steps']} steps x {s['reps']} reps, median)")
        work = (f"matmul {r['write_cost']}x{r['write_cost']}" if r["write_kind"] == "matmul"
                else f"wait {r['write_wait_ms']:.1f} ms" if r["write_kind"] == "wait" else "no extra work")
        print(f"  forward alone {r['forward_ms']:.1f} ms/step, writes alone {r['writes_ms']:.1f} ms/step "
              f"({work}), limit {r['limit_steps_per_s']:.1f} steps/s")
        if r["parallel_speedup"] is not None:
            print(f"  two streams run the write's matmul {r['parallel_speedup']:.2f}x as fast as one "
                  "(2.00: room for both; below it, forward and writes slow each other down)")
        serial = r["vs_serial"]
        if serial is not None:
            print(f"  {'serial':10} {r['serial_steps_per_s']:6.1f} steps/s  (eager, one thread, no overlap)  "
                  f"{r['serial_vs_limit']:5.2f}x limit")
        for p in POLICIES:
            ends = ", ".join(f"{b}={e}" for b, e in r["plans"][p.name].items())
            vs = f"{serial[p.name]:5.2f}x serial  " if serial is not None else ""
            print(f"  {p.name:10} {r['steps_per_s'][p.name]:6.1f} steps/s  {r['vs_coarse'][p.name]:5.2f}x COARSE  "
                  f"{vs}{r['vs_limit'][p.name]:5.2f}x limit   [{ends}]")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps and repetitions")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--only", choices=[k for k, _, _ in RUNS], action="append",
                        help="run only this measurement (repeatable)")
    parser.add_argument("--device", choices=DEVICE_KINDS, default="cpu",
                        help="device to run on (default cpu; auto = CUDA when available)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (torch.cuda.is_available() is False)")
    runs = tuple(r for r in RUNS if not args.only or r[0] in args.only)
    main(quick=args.quick, runs=runs, progress=not args.json, device=args.device)
    details = main.details  # type: ignore[attr-defined]
    if args.json:
        print(json.dumps(details, indent=2))
    else:
        _print(details)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
