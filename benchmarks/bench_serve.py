"""Serving: tokens/s of each fence policy on mixed traffic, against the serial run and COARSE.

The serving loop (``run_serve``) runs seeded Poisson traffic: requests arrive, are prefilled in
chunks (eager EXTEND steps) between decode steps, decode until their output length, and finish;
each decode step replays the graph of the smallest captured batch size that fits. Each
page-table write takes ``WRITE_WAIT_MS`` without using the CPU (a copy engine's stand-in, as in
``readfence demo``): the work a fence lets overlap the forward. The serial reference
(``run_serve_serial``) runs the same schedule eagerly, waiting as long per step.

Measured side by side in each repetition (the policies in a rotated order): the serial run,
then each policy (sanitizer on, every run checked bit for bit against the serial one, request
by request). Per policy: tokens/s (steady state: from the end of step 0 to the last step's end,
device timestamps), its ratio to serial and to COARSE (the median over repetitions of each
repetition's ratio), the mean fence slack (time from a buffer's last read to its release) and
the median host time per step (scheduling, writes and launches).

Workloads: ``hybrid_linear(trtllm_mha, linear)`` (decode metadata out of graph and state slots in
graph; its prefill declares nothing, so a prefill step publishes the coarse fence) and
``deepseek_v4`` (in-graph decode metadata; its prefill snapshots its reads: a ``PRE_REPLAY``
prefill fence).

    python benchmarks/bench_serve.py            # full run (a few minutes on 2 cores)
    python benchmarks/bench_serve.py --quick    # smoke run of seconds
    python benchmarks/bench_serve.py --json

``main(quick=False)`` returns the figures as a dict (``readfence bench`` prints it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from readfence.backends import deepseek_v4, hybrid_linear, linear, trtllm_mha
from readfence.core import ModelConfig
from readfence.graph import DEVICE_KINDS, Policy, ServeOptions, Traffic, open_device, run_serve, run_serve_serial
from readfence.graph.lowering import torch_device

POLICIES = (Policy.COARSE, Policy.JOINED, Policy.PER_BUFFER, Policy.EXACT)
WORKLOADS = {"hybrid_linear": lambda: hybrid_linear(trtllm_mha(), linear()), "deepseek_v4": deepseek_v4}
TRAFFIC = Traffic(rate=0.5, prompt=(4, 24), output=(2, 12), seed=0)
WRITE_WAIT_MS = 2.0


def measure(name: str, *, steps: int, reps: int, device: str = "cpu", policies: tuple[Policy, ...] = POLICIES,
            capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), cfg: ModelConfig | None = None) -> dict[str, Any]:
    """One workload: per policy (COARSE first) the median figures over ``reps`` repetitions."""
    target = WORKLOADS[name]()
    common: dict[str, Any] = dict(steps=steps, traffic=TRAFFIC, capture_sizes=capture_sizes, cfg=cfg)
    wait = WRITE_WAIT_MS / 1e3
    with open_device(device) as dev:
        kind = torch_device(dev)
    per: dict[str, dict[str, list[float]]] = {p.name: {"tps": [], "vs_serial": [], "vs_coarse": [], "slack": [],
                                                       "host": []} for p in policies}
    serial_tps: list[float] = []
    matches = True
    mix: dict[str, Any] = {}
    for rep in range(reps):
        ref = run_serve_serial(target, device=kind, options=ServeOptions(write_wait_s=wait), **common)
        serial_tps.append(ref.tokens_per_s)
        order = policies[rep % len(policies):] + policies[:rep % len(policies)]
        tps: dict[str, float] = {}
        for policy in order:
            with open_device(kind) as dev:
                res = run_serve(target, policy=policy, device=dev, options=ServeOptions(write_wait_s=wait), **common)
            matches = matches and res.matches(ref) and not res.violations
            tps[policy.name] = res.tokens_per_s
            f = per[policy.name]
            f["tps"].append(res.tokens_per_s)
            f["vs_serial"].append(res.tokens_per_s / ref.tokens_per_s)
            if res.mean_slack is not None:
                f["slack"].append(res.mean_slack * 1e3)
            if res.host_per_step is not None:
                f["host"].append(res.host_per_step * 1e3)
            mix = {"prefill_steps": res.prefill_steps, "decode_steps": res.decode_steps,
                   "decode_steps_by_size": {f"b{k}": v for k, v in res.batch_sizes.items()},
                   "prefill_sizes": len(res.prefill_sizes)}
        for p in policies:
            per[p.name]["vs_coarse"].append(tps[p.name] / tps["COARSE"])

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    out: dict[str, Any] = {"serial_tokens_per_s": med(serial_tps)}
    for p in policies:
        f = per[p.name]
        key = p.name.lower()
        out[f"{key}_tokens_per_s"] = med(f["tps"])
        out[f"{key}_vs_serial"] = med(f["vs_serial"])
        if p is not Policy.COARSE:
            out[f"{key}_vs_coarse"] = med(f["vs_coarse"])
        out[f"{key}_mean_slack_ms"] = med(f["slack"])
        out[f"{key}_host_ms_per_step"] = med(f["host"])
    out["matches_serial"] = matches
    out["mix"] = mix
    return out


def main(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """The figures of every workload (nested ``name: number`` entries, for ``readfence bench``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # streams are the parallelism: one intra-op thread
    try:
        if quick:  # one workload, two policies, a one-layer model with three captured sizes
            return {"deepseek_v4": measure("deepseek_v4", steps=8, reps=1, device=device,
                                           policies=(Policy.COARSE, Policy.EXACT), capture_sizes=(1, 2, 4),
                                           cfg=ModelConfig(layers=1))}
        return {name: measure(name, steps=300, reps=3, device=device) for name in WORKLOADS}
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--device", choices=DEVICE_KINDS, default="cpu")
    args = parser.parse_args()
    figures = main(quick=args.quick, device=args.device)
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
    else:
        for workload, values in figures.items():
            print(f"[{workload}]")
            for key, value in values.items():
                print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
