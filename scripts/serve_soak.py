"""A long serving run with fault injection on every stream: bit-identical and flat in memory?

Runs ``serve_loop`` (sanitizer on, seeded random delays on the forward and schedule streams) for
``--steps`` steps in chunks, compares each chunk with the serial reference's (``SerialServe``,
the same schedule) request by request, keeps no outputs past a chunk, and samples the process's
resident memory after each chunk. Prints the figures: mismatches, sanitizer findings, the step
mix, and the resident memory after warm-up (the first 10% of the steps) and at the end. (The
fault injector logs every delay it draws, for reproducibility checks: the script counts them
and empties the log after each chunk, so that the figure is the loop's memory, not the log's.)

    python scripts/serve_soak.py                    # 10,000 steps
    python scripts/serve_soak.py --steps 2000 --spec "eagle(paged, trtllm_mha)"
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

import torch

from readfence.graph import CpuDevice, FaultInjector, Policy, Sanitizer, ServeResult, Traffic, parse_target, serve_loop
from readfence.graph.runtime import SerialServe


def rss_mb() -> float:
    """Resident set size of this process (MiB), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="hybrid_linear(trtllm_mha, linear)")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--chunk", type=int, default=250)
    parser.add_argument("--policy", default="exact")
    parser.add_argument("--rate", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = parse_target(args.spec).unwrap()
    traffic = Traffic(rate=args.rate, prompt=(4, 24), output=(2, 12), seed=7)
    policy = Policy.parse(args.policy)
    serial = SerialServe(target, traffic=traffic)
    san = Sanitizer()
    faults = FaultInjector(seed=7, max_delay_s=0.0005)  # every stream: forward and schedule
    mismatches, steps_done, kinds, sizes = 0, 0, collections.Counter(), collections.Counter()
    delays: collections.Counter[str] = collections.Counter()
    memory: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    with CpuDevice(timeout=60, faults=faults, observers=[san]) as dev:
        loop = serve_loop(target, policy=policy, device=dev, traffic=traffic)
        loop.prepare(args.steps)  # every prefill size of the run lowered before it starts: part of the warm-up
        while steps_done < args.steps:
            n = min(args.chunk, args.steps - steps_done)
            _, records, outputs, _, _ = loop.run(n)
            ref = serial.run(n)
            run = ServeResult(policy, tuple(records), outputs, 0.0)
            for i, rec in enumerate(records):  # request by request, step by step
                if ServeResult(policy, (rec,), [outputs[i]], 0.0).first_difference(
                        ServeResult(None, (ref.records[i],), [ref.logits[i]], 0.0)) is not None:
                    mismatches += 1
                kinds[rec.kind] += 1
                if rec.kind == "decode":
                    sizes[rec.padded] += 1
            steps_done += n
            for stream, log in faults.log.items():  # the injector logs every draw: count, then forget
                delays[stream] += sum(d > 0 for _, d in log)
            faults.log.clear()
            del records, outputs, ref, run
            gc.collect()
            memory.append((steps_done, rss_mb()))
    seconds = time.perf_counter() - t0
    warm = next(m for s, m in memory if s >= args.steps // 10)
    print(f"{args.spec} under {policy.name}: {steps_done} steps in {seconds:.0f} s "
          f"({kinds['prefill']} prefill, {kinds['decode']} decode; decode steps by graph "
          f"{dict(sorted(sizes.items()))}; prefill graphs lowered: {sorted(loop.prefill)})")
    print(f"mismatches against serial: {mismatches}; sanitizer findings: {san.count}; "
          f"sanitizer reads tracked at the end: {san.tracked_reads}; delays injected per stream: {dict(delays)}")
    print(f"resident memory: {memory[0][1]:.1f} MiB after {memory[0][0]} steps, {warm:.1f} MiB after warm-up "
          f"({args.steps // 10} steps), {memory[-1][1]:.1f} MiB at the end; max {max(m for _, m in memory):.1f} MiB")
    every = max(1, len(memory) // 10)
    print("resident memory (MiB) by step: " + ", ".join(f"{s}: {m:.1f}" for s, m in memory[::every]))


if __name__ == "__main__":
    main()
