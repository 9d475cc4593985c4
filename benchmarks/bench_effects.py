"""Time computing the effect table of 10,000-leaf backend trees (wide and deep), all modes.

Effects are computed once, bottom-up, when a tree is built, so "computing the effects" is
building the tree; querying all modes afterwards is a lookup. Prints medians of several runs.

    python benchmarks/bench_effects.py [--leaves 10000] [--runs 7] [--json]
    python benchmarks/bench_effects.py --quick     # 200 leaves, 2 runs: a smoke run

``main(quick=False)`` returns the figures per tree shape (``readfence bench`` prints them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from readfence.backends import MODES, deepseek_v4, hybrid, join, linear, paged, parse, sparse, tbo, trtllm_mha

LEAVES = (paged, deepseek_v4, linear, trtllm_mha, sparse)


def wide(n: int):
    return join(*[LEAVES[i % len(LEAVES)]() for i in range(n)])


def deep(n: int):
    tree = paged()
    for i in range(n - 1):
        leaf = LEAVES[i % len(LEAVES)]()
        kind = i % 3
        if kind == 0:
            tree = tbo(tree, leaf)
        elif kind == 1:
            tree = join(leaf, tree)
        else:
            tree = hybrid(decode=tree, prefill=leaf)
    return tree


def balanced(n: int):
    level = [LEAVES[i % len(LEAVES)]() for i in range(n)]
    while len(level) > 1:
        level = [tbo(*level[i:i + 2]) for i in range(0, len(level), 2)]
    return level[0]


def _effects(tree) -> list:
    return [tree.read_effect(m) for m in MODES]


def _median(f, runs: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(runs):
        start = clock()
        f()
        times.append(clock() - start)
    return statistics.median(times)


def measure(n: int, runs: int) -> dict[str, dict[str, float]]:
    """Per tree shape: medians of building it (effects computed bottom-up) and reading every
    mode (wall and process CPU, ms), querying every mode again (us), ``str``, ``parse`` and
    ``==`` (ms)."""
    out = {}
    for name, make in (("wide", wide), ("deep", deep), ("balanced", balanced)):
        tree = make(n)
        text = str(tree)
        other = make(n)
        out[name] = {
            "build_ms": _median(lambda make=make: _effects(make(n)), runs) * 1e3,
            "build_cpu_ms": _median(lambda make=make: _effects(make(n)), runs, time.process_time) * 1e3,
            "query_us": _median(lambda tree=tree: _effects(tree), runs) * 1e6,
            "str_ms": _median(lambda tree=tree: str(tree), runs) * 1e3,
            "parse_ms": _median(lambda text=text: parse(text, max_depth=n).unwrap(), max(1, runs // 2)) * 1e3,
            "eq_ms": _median(lambda tree=tree, other=other: tree == other, runs) * 1e3,
        }
    return out


def main(quick: bool = False, *, leaves: int | None = None, runs: int | None = None) -> dict[str, object]:
    """The figures of :func:`measure` for ``leaves`` leaves (10,000; 200 with ``quick``), median
    of ``runs`` runs (7; 2 with ``quick``)."""
    n, runs = leaves or (200 if quick else 10_000), runs or (2 if quick else 7)
    return {"leaves": n, "runs": runs, **measure(n, runs)}


def _cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200 leaves, 2 runs: a smoke run")
    ap.add_argument("--leaves", type=int, default=None)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    for flag, value in (("--leaves", args.leaves), ("--runs", args.runs)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    r = main(args.quick, leaves=args.leaves, runs=args.runs)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"{r['leaves']} leaves, median of {r['runs']} runs, {len(MODES)} modes")
    print("build+effects: construct the tree (effects computed bottom-up) and read every mode;")
    print("wall and process CPU time (the CPU column is robust to a loaded machine)")
    print(f"{'tree':<10} {'build+effects':>14} {'(cpu)':>10} {'query all modes':>16} {'str':>9} "
          f"{'parse':>9} {'==':>9}")
    for name in ("wide", "deep", "balanced"):
        f = r[name]
        print(f"{name:<10} {f['build_ms']:>11.1f} ms {f['build_cpu_ms']:>7.1f} ms {f['query_us']:>13.1f} us "
              f"{f['str_ms']:>6.1f} ms {f['parse_ms']:>6.1f} ms {f['eq_ms']:>6.1f} ms")


if __name__ == "__main__":
    _cli()
