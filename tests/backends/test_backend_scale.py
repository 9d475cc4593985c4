"""10,000-leaf trees, wide and deep: correct effects, no recursion anywhere.

Timing is measured in ``benchmarks/bench_effects.py``, never asserted here (machines are noisy).
"""

from __future__ import annotations

import sys

from returns.result import Failure

from readfence.backends import MODES, deepseek_v4, join, linear, paged, parse, tbo, trtllm_mha

N = 10_000


def _deep(n: int):
    tree = paged()
    leaves = (deepseek_v4(), linear(), trtllm_mha())
    for i in range(n - 1):
        tree = tbo(tree, leaves[i % 3]) if i % 2 else join(leaves[i % 3], tree)
    return tree


def test_wide_tree_effects():
    tree = join(*[(paged(), deepseek_v4(), linear(), trtllm_mha())[i % 4] for i in range(N)])
    table = [tree.read_effect(m) for m in MODES]
    assert table == [join(paged(), deepseek_v4(), linear(), trtllm_mha()).read_effect(m) for m in MODES]


def test_deep_chain_builds_compares_prints_and_walks_without_recursion():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # anything recursive over 10,000 levels would now fail
    try:
        a, b = _deep(N), _deep(N)
        effects = [a.read_effect(m) for m in MODES]
        assert a == b and hash(a) == hash(b)
        assert a != _deep(N - 1)
        text = str(a)
        assert text.count("(") == N - 1
        assert sum(1 for _ in a.walk()) == 2 * N - 1
        assert effects == [join(paged(), deepseek_v4(), linear(), trtllm_mha()).read_effect(m) for m in MODES]
    finally:
        sys.setrecursionlimit(limit)
    assert isinstance(parse(text), Failure)  # deeper than the default max_depth
    assert parse(text, max_depth=N).unwrap() == a


def test_the_effect_caches_stay_bounded_however_many_effects_a_process_builds() -> None:
    # a fuzzer draws random declarations for hours: interning, joins and tables are bounded
    from readfence.backends import _effect_tables as tables
    from readfence.effects import ReadEffect, ReadEnd

    names = [f"b{i}" for i in range(2 * tables._CACHE_LIMIT)]
    effects = [tables.intern(ReadEffect.of({n: ReadEnd.IN_REPLAY})) for n in names]
    for a, b in zip(effects, effects[1:]):
        tables.join2(a, b)
        tables.intern_table((a, b))
    assert tables.intern.cache_info().currsize <= tables._CACHE_LIMIT
    assert len(tables._JOINS) <= tables._CACHE_LIMIT and len(tables._TABLES) <= tables._CACHE_LIMIT
    # an evicted entry only costs sharing: the join is still right
    assert tables.join2(effects[0], effects[1]) == effects[0] | effects[1]
