"""Time to trace and audit every reference backend and composition in every mode.

Tracing runs once per graph shape (backend, mode, batch size, device), so seconds are fine and
minutes are not. Prints, for CPU tensors and for fake CUDA tensors: the cold time (trace
cache cleared) as the median of a few runs, the number of distinct traces, the mean time
per trace, and the warm time (every trace cached: the audit comparison alone).

    python benchmarks/bench_audit.py [--runs 3] [--layers 4] [--json]
    python benchmarks/bench_audit.py --quick     # smoke run: paged in DECODE at batch size 2
    python benchmarks/bench_audit.py --varied    # what the generated-state runs add to an audit
    python benchmarks/bench_audit.py --guards    # what walking the Python a backend's code reads costs

``main(quick=False, *, runs=3, layers=None)`` returns ``{"cpu": {...}, "cuda": {...}}``, each
with ``cold_s``, ``traces``, ``ms_per_trace``, ``warm_ms`` and ``unsound`` (``readfence bench``
prints it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

from readfence.backends import REFERENCE_LEAVES, deepseek_v4, paged, reference_compositions, tbo
from readfence.core import ForwardMode, ModelConfig, audit, clear_trace_cache, default_batch_sizes, trace
from readfence.core.internal import ledger_of, trace_cache_size


def backends(quick: bool = False) -> list:
    if quick:
        return [paged()]
    leaves = [make() for make in REFERENCE_LEAVES.values()] + [deepseek_v4(dspark=True)]
    return leaves + list(reference_compositions().values())


def audit_all(targets: Sequence[Any], modes: Sequence[ForwardMode], cfg: ModelConfig, device: str,
              batch_sizes: Sequence[int] | None = None) -> int:
    unsound = 0
    for backend in targets:
        for mode in modes:
            result = audit(backend, mode, cfg=cfg, device=device, batch_sizes=batch_sizes)
            if not result.map(lambda r: r.sound).value_or(False):
                unsound += 1
    return unsound


def main(quick: bool = False, *, runs: int | None = None, layers: int | None = None) -> dict[str, Any]:
    """Cold and warm audit times per tensor device (``quick``: paged in DECODE at batch size 2,
    one run; otherwise each audit traces batch sizes 1, 2 and the model's maximum)."""
    cfg = ModelConfig() if layers is None else ModelConfig(layers=layers)
    runs = runs or (1 if quick else 3)
    targets = backends(quick)
    modes = (ForwardMode.DECODE,) if quick else tuple(ForwardMode)
    sizes = (2,) if quick else None
    out: dict[str, Any] = {"backends": len(targets), "modes": len(modes), "layers": cfg.layers, "runs": runs}
    for device in ("cpu", "cuda"):
        cold = []
        for _ in range(runs):
            clear_trace_cache()
            start = time.perf_counter()
            unsound = audit_all(targets, modes, cfg, device, sizes)
            cold.append(time.perf_counter() - start)
        traces = trace_cache_size()
        start = time.perf_counter()
        audit_all(targets, modes, cfg, device, sizes)
        warm = time.perf_counter() - start
        med = statistics.median(cold)
        out[device] = {"cold_s": med, "traces": traces, "ms_per_trace": med / max(traces, 1) * 1e3,
                       "warm_ms": warm * 1e3, "unsound": unsound}
    return out


def varied(runs: int = 3, layers: int | None = None) -> dict[str, dict[str, float]]:
    """Per backend and mode (EXTEND, which runs every stage's Python, and DECODE, which runs only
    its out-of-graph stage's), side by side in each run (median of ``runs``): a cold audit (its
    trace cache cleared) and, again cold, the part of it that runs the step's Python on the
    generated states (``Ledger.observe_varied`` of the backend itself at each audited batch size, on
    programs traced beforehand; a combinator's audit also runs its children's)."""
    cfg = ModelConfig() if layers is None else ModelConfig(layers=layers)
    sizes = default_batch_sizes(cfg)
    out = {}
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        for backend in (paged(), deepseek_v4(), tbo(deepseek_v4(), paged())):
            whole, part = [], []
            for _ in range(runs):
                clear_trace_cache()
                start = time.perf_counter()
                audit(backend, mode, cfg=cfg)
                whole.append(time.perf_counter() - start)
                clear_trace_cache()
                programs = [trace(backend, mode, cfg=cfg, batch_size=n) for n in sizes]
                start = time.perf_counter()
                for n, program in zip(sizes, programs):
                    ledger_of(program, cfg, n).observe_varied()
                part.append(time.perf_counter() - start)
            out[f"{backend} {mode.name}"] = {"audit_ms": statistics.median(whole) * 1e3,
                                             "varied_ms": statistics.median(part) * 1e3}
    return out


@contextlib.contextmanager
def _walks_timed() -> Iterator[list[float]]:
    """Every walk of what a backend's code reads (``core.tracing._guards.reach``, which keys the
    caches) timed while the block runs: the list of their seconds."""
    import readfence.core._backend_trace as tracing
    import readfence.core.tracing._cache as cache
    import readfence.core.tracing._kernel_access as kernels
    import readfence.core.tracing._kernel_ir as kernel_ir
    import readfence.graph.lowering._lower as lowering

    seconds: list[float] = []
    real = cache.reach

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    modules = (cache, tracing, kernels, kernel_ir, lowering)
    for module in modules:
        module.reach = timed  # type: ignore[attr-defined]
    try:
        yield seconds
    finally:
        for module in modules:
            module.reach = real  # type: ignore[attr-defined]


def guards(runs: int = 3, layers: int | None = None) -> dict[str, dict[str, float]]:
    """What keying the caches by the Python values a backend's code reads costs, side by side in
    each run (median of ``runs``): a cold audit of every reference backend in every mode (CPU
    tensors) and a cold 64-layer ``lower`` of ``hybrid_linear(trtllm_mha, linear)`` under EXACT,
    each with the walks it made and their seconds."""
    from readfence.backends import hybrid_linear, linear, trtllm_mha
    from readfence.graph import CpuDevice, Policy, lower

    cfg = ModelConfig() if layers is None else ModelConfig(layers=layers)
    deep = ModelConfig(layers=64)
    rows: dict[str, list[tuple[float, int, float]]] = {"audit_all": [], "lower_64": []}
    with CpuDevice() as dev:
        for _ in range(runs):
            clear_trace_cache()
            with _walks_timed() as walks:
                start = time.perf_counter()
                audit_all(backends(), tuple(ForwardMode), cfg, "cpu")
                rows["audit_all"].append((time.perf_counter() - start, len(walks), sum(walks)))
            clear_trace_cache()
            with _walks_timed() as walks:
                start = time.perf_counter()
                lower(hybrid_linear(trtllm_mha(), linear()), ForwardMode.DECODE, batch_size=2, device=dev,
                      policy=Policy.EXACT, cfg=deep)
                rows["lower_64"].append((time.perf_counter() - start, len(walks), sum(walks)))
    out = {}
    for name, measured in rows.items():
        total, count, walked = (statistics.median(m[i] for m in measured) for i in range(3))
        out[name] = {"seconds": total, "walks": count, "walk_ms": walked * 1e3, "share": walked / total}
    return out


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="paged in DECODE at batch size 2, one cold run: a smoke run")
    parser.add_argument("--runs", type=int, default=None, help="cold runs (median; default 3, 1 with --quick)")
    parser.add_argument("--layers", type=int, default=ModelConfig().layers)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--varied", action="store_true", help="what the generated-state runs add to an audit")
    parser.add_argument("--guards", action="store_true", help="what walking the Python a backend's code reads costs")
    args = parser.parse_args()
    if args.runs is not None and args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.guards:
        g = guards(args.runs or 3, args.layers)
        if args.json:
            print(json.dumps(g, indent=2))
            return
        for name, d in g.items():
            print(f"{name:10} {d['seconds']:7.2f} s, of which {d['walks']:4.0f} walks {d['walk_ms']:7.1f} ms "
                  f"({d['share']:.1%})")
        return
    if args.varied:
        v = varied(args.runs or 3, args.layers)
        if args.json:
            print(json.dumps(v, indent=2))
            return
        for name, d in v.items():
            print(f"{name:34} audit {d['audit_ms']:7.1f} ms, of which generated-state runs {d['varied_ms']:6.1f} ms "
                  f"({d['varied_ms'] / d['audit_ms']:.0%})")
        return
    r = main(args.quick, runs=args.runs, layers=args.layers)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"{r['backends']} backends x {r['modes']} modes, model with {r['layers']} layers, "
          f"median of {r['runs']} cold runs")
    for device in ("cpu", "cuda"):
        d = r[device]
        label = "cpu tensors" if device == "cpu" else "fake cuda tensors"
        print(f"{label:18} cold {d['cold_s']:6.2f} s  ({d['traces']} traces, {d['ms_per_trace']:5.0f} ms/trace)  "
              f"warm {d['warm_ms']:6.1f} ms  unsound={d['unsound']}")


if __name__ == "__main__":
    _cli()
