"""Time computing the effect table of 10,000-leaf backend trees (wide and deep), all modes.

Effects are computed once, bottom-up, when a tree is built, so "computing the effects" is
building the tree; querying all modes afterwards is a lookup. Prints medians of several runs.

    python benchmarks/bench_effects.py [--leaves 10000] [--runs 7]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    n, runs = args.leaves, args.runs
    print(f"{n} leaves, median of {runs} runs, {len(MODES)} modes")
    print("build+effects: construct the tree (effects computed bottom-up) and read every mode;")
    print("wall and process CPU time (the CPU column is robust to a loaded machine)")
    print(f"{'tree':<10} {'build+effects':>14} {'(cpu)':>10} {'query all modes':>16} {'str':>9} "
          f"{'parse':>9} {'==':>9}")
    for name, make in (("wide", wide), ("deep", deep), ("balanced", balanced)):
        tree = make(n)
        build = _median(lambda make=make: _effects(make(n)), runs)
        build_cpu = _median(lambda make=make: _effects(make(n)), runs, time.process_time)
        query = _median(lambda tree=tree: _effects(tree), runs)
        text = str(tree)
        to_str = _median(lambda tree=tree: str(tree), runs)
        parsing = _median(lambda text=text: parse(text, max_depth=n).unwrap(), max(1, runs // 2))
        other = make(n)
        compare = _median(lambda tree=tree, other=other: tree == other, runs)
        print(f"{name:<10} {build * 1e3:>11.1f} ms {build_cpu * 1e3:>7.1f} ms {query * 1e6:>13.1f} us "
              f"{to_str * 1e3:>6.1f} ms {parsing * 1e3:>6.1f} ms {compare * 1e3:>6.1f} ms")


if __name__ == "__main__":
    main()
