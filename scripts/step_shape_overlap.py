"""Side-by-side throughput and fence slack of each policy on a speculative step shape.

What ``readfence demo --spec SHAPE`` runs (sanitizer on, each page-table write a 5 ms CPU-free
wait, batch size 4, one intra-op thread), repeated: each repetition runs the serial reference
and every policy one after another, the policies in a rotated order, and its ratios compare
runs of that repetition; the printed figures are medians over repetitions (and their range).

    python scripts/step_shape_overlap.py                       # multi_eagle(paged, trtllm_mha, trtllm_mha)
    python scripts/step_shape_overlap.py --spec "eagle(paged, trtllm_mha)" --reps 7 --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from readfence.graph import CpuDevice, LoopOptions, Policy, parse_step, run_overlapped, run_serial

POLICIES = tuple(Policy)


def main(spec: str, reps: int, steps: int, batch_size: int, write_wait_ms: float) -> dict:
    torch.set_num_threads(1)  # as the demo: the device's streams are the parallelism
    shape = parse_step(spec).unwrap()
    wait = write_wait_ms / 1e3
    rate: dict[str, list[float]] = {p.name: [] for p in POLICIES} | {"serial": []}
    ratio: dict[str, list[float]] = {p.name: [] for p in POLICIES}
    slack: dict[str, list[float]] = {p.name: [] for p in POLICIES}
    by_buffer: dict[str, dict[str, list[float]]] = {p.name: {} for p in POLICIES}
    for rep in range(reps):
        order = POLICIES[rep % len(POLICIES):] + POLICIES[:rep % len(POLICIES)]
        rate["serial"].append(run_serial(shape, steps=steps, batch_size=batch_size,
                                         options=LoopOptions(write_wait_s=wait, seed=rep)).steps_per_s)
        seen = {}
        for policy in order:
            with CpuDevice() as dev:
                res = run_overlapped(shape, steps=steps, policy=policy, device=dev, batch_size=batch_size,
                                     options=LoopOptions(write_wait_s=wait, seed=rep, sanitize=True))
            assert not res.violations
            seen[policy.name] = res
            rate[policy.name].append(res.steps_per_s)
            slack[policy.name].append(res.mean_slack * 1e3)
            for b, s in res.slack.items():
                by_buffer[policy.name].setdefault(b, []).append(s * 1e3)
        for name, res in seen.items():
            ratio[name].append(res.steps_per_s / seen["COARSE"].steps_per_s)
        print(f"rep {rep}: " + ", ".join(f"{n} {seen[n].steps_per_s:.1f}/s ({ratio[n][-1]:.2f}x, slack "
                                         f"{slack[n][-1]:.2f} ms)" for n in (p.name for p in POLICIES))
              + f"; serial {rate['serial'][-1]:.1f}/s", flush=True)
    med = statistics.median
    print(f"\n{spec}: {reps} repetitions of {steps} steps, batch size {batch_size}, writes {write_wait_ms:g} ms")
    print(f"{'policy':<11} {'steps/s':>8} {'vs COARSE (median, range)':>28} {'mean slack ms (median, range)':>32}")
    for p in POLICIES:
        n = p.name
        print(f"{n:<11} {med(rate[n]):>8.1f} {med(ratio[n]):>10.2f}x ({min(ratio[n]):.2f}-{max(ratio[n]):.2f})"
              f"{med(slack[n]):>16.2f} ({min(slack[n]):.2f}-{max(slack[n]):.2f})")
    print(f"{'serial':<11} {med(rate['serial']):>8.1f}")
    print("\nmedian slack per buffer (ms):")
    for p in POLICIES:
        print(f"  {p.name:<11} " + ", ".join(f"{b} {med(v):.2f}" for b, v in sorted(by_buffer[p.name].items())))
    return {"rate": rate, "ratio": ratio, "slack": slack}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="multi_eagle(paged, trtllm_mha, trtllm_mha)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--write-wait-ms", type=float, default=5.0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    main(args.spec, args.reps, args.steps, args.batch_size, args.write_wait_ms)
    print(f"({time.perf_counter() - t0:.0f} s)")
