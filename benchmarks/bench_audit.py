"""Time to trace and audit every reference backend and composition in every mode.

Tracing runs once per graph shape (backend, mode, batch size, device), so seconds are fine and
minutes are not. Prints, for CPU tensors and for fake CUDA tensors: the cold time (trace
cache cleared) as the median of a few runs, the number of distinct traces, the mean time
per trace, and the warm time (every trace cached: the audit comparison alone).

    python benchmarks/bench_audit.py [--runs 3] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

from readfence.backends import REFERENCE_LEAVES, deepseek_v4, reference_compositions
from readfence.core import ForwardMode, ModelConfig, audit
from readfence.core._trace import _CACHE, clear_cache


def backends() -> list:
    leaves = [make() for make in REFERENCE_LEAVES.values()] + [deepseek_v4(dspark=True)]
    return leaves + list(reference_compositions().values())


def audit_all(cfg: ModelConfig, device: str) -> int:
    unsound = 0
    for backend in backends():
        for mode in ForwardMode:
            if not audit(backend, mode, cfg=cfg, device=device).map(lambda r: r.sound).value_or(False):
                unsound += 1
    return unsound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=ModelConfig().layers)
    args = parser.parse_args()
    cfg = ModelConfig(layers=args.layers)
    n_backends = len(backends())
    print(f"{n_backends} backends x {len(ForwardMode)} modes, model with {cfg.layers} layers, "
          f"median of {args.runs} cold runs")
    for device in ("cpu", "cuda"):
        cold = []
        for _ in range(args.runs):
            clear_cache()
            start = time.perf_counter()
            unsound = audit_all(cfg, device)
            cold.append(time.perf_counter() - start)
        traces = len(_CACHE)
        start = time.perf_counter()
        audit_all(cfg, device)
        warm = time.perf_counter() - start
        label = "cpu tensors" if device == "cpu" else "fake cuda tensors"
        med = statistics.median(cold)
        print(f"{label:18} cold {med:6.2f} s  ({traces} traces, {med / traces * 1000:5.0f} ms/trace)  "
              f"warm {warm * 1000:6.1f} ms  unsound={unsound}")


if __name__ == "__main__":
    main()
