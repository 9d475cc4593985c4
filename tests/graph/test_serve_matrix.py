"""The serving loop over every reference backend, combinator and step shape, under EXACT and
another policy in turn (every policy on a third of the targets; ``verify`` on every policy).

Forty steps of mixed traffic (arrivals, finishes, prefill between decodes, several
captured sizes, every row busy) with random delays on every stream: each request's outputs bit-identical to
the serial reference, the sanitizer clean, the fences never before the last read, and
``verify`` (poison, guard, observer) clean on the same loop. That the traffic is mixed is
asserted from each run's own counts. Slow tier: one test per target.
"""

from __future__ import annotations

import zlib

import pytest

from readfence.backends import (
    REFERENCE_LEAVES,
    deepseek_v4,
    dense,
    hybrid,
    hybrid_linear,
    join,
    linear,
    minimax,
    paged,
    per_stream,
    select,
    sparse,
    tbo,
    trtllm_mha,
)
from readfence.core import ForwardMode, ModelConfig
from readfence.graph import CpuDevice, FaultInjector, Policy, Traffic, eagle, multi_eagle, ngram, run_serve, run_serve_serial, verify_serve

from ._live_state import LiveState

M = ForwardMode
# Three usable rows and three captured sizes: each graph of a run is a lowering (most of a run's
# time), and these still give every case the matrix is about: a padded decode (3 rows in b4),
# every captured size, prefill at every batch size the rows allow, rows freed and handed out again.
CFG = ModelConfig(layers=1, max_reqs=4, max_ctx=32)
SIZES = (1, 2, 4)
TRAFFIC = Traffic(rate=0.5, prompt=(4, 12), output=(2, 6), seed=11)
# The schedule is the same for every target: by step 40 it has decoded in every captured size
# (4 from step 11, 1 at step 33), prefilled at every batch size the rows allow (1 to 3), handed
# out 13 requests over the 3 usable rows and decoded with all 3 busy from step 11 (asserted).
STEPS = 40
VERIFY_STEPS = 20

TARGETS = {
    **{name: make for name, make in REFERENCE_LEAVES.items()},
    "tbo(deepseek_v4,paged)": lambda: tbo(deepseek_v4(), paged()),
    "hybrid_linear(trtllm_mha,linear)": lambda: hybrid_linear(trtllm_mha(), linear()),
    "minimax(sparse,dense)": lambda: minimax(sparse(), dense()),
    "hybrid(decode=paged,prefill=deepseek_v4)": lambda: hybrid(decode=paged(), prefill=deepseek_v4()),
    "join(paged,linear)": lambda: join(paged(), linear()),
    "select(DECODE:trtllm_mha,default=paged)": lambda: select({M.DECODE: trtllm_mha()}, default=paged()),
    "per_stream(paged,trtllm_mha)": lambda: per_stream(paged(), trtllm_mha()),
    "eagle(paged,trtllm_mha)": lambda: eagle(paged(), trtllm_mha()),
    "multi_eagle(deepseek_v4,trtllm_mha)": lambda: multi_eagle(deepseek_v4(), trtllm_mha()),
    "ngram(deepseek_v4)": lambda: ngram(deepseek_v4()),
}


def _policies(name: str) -> tuple[Policy, ...]:
    # EXACT (the finest fences) for every target, and one of the other policies in turn: each
    # of them runs on a third of the targets (verify below checks every policy on each)
    others = [p for p in Policy if p is not Policy.EXACT]
    return (Policy.EXACT, others[list(TARGETS).index(name) % len(others)])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TARGETS))
def test_serve_is_bit_identical_clean_and_verified(name):
    ref = run_serve_serial(TARGETS[name](), steps=STEPS, traffic=TRAFFIC, capture_sizes=SIZES, cfg=CFG)
    # every run on one live state, given back its fresh values before each (see ``_live_state``)
    live = LiveState(CFG)
    for policy in _policies(name):
        seed = zlib.crc32(f"{name}/{policy.name}".encode()) % 10_000
        with CpuDevice(timeout=30, faults=FaultInjector(seed=seed, max_delay_s=0.0005)) as dev:
            res = run_serve(TARGETS[name](), steps=STEPS, policy=policy, device=dev, traffic=TRAFFIC,
                            capture_sizes=SIZES, cfg=CFG, state=live.fresh())
        assert res.violations == (), f"{name} {policy.name}: " + "\n".join(map(str, res.violations[:5]))
        assert res.first_difference(ref) is None, f"{name} {policy.name}: differs at {res.first_difference(ref)}"
        # every captured size ran (a per_stream pair pads a batch of one to two)
        sizes = set(SIZES) - ({1} if name.startswith("per_stream") else set())
        assert set(res.batch_sizes) == sizes and res.prefill_steps >= 10, (res.batch_sizes, res.prefill_steps)
        assert max(r.batch_size for r in res.records if r.kind == "decode") == CFG.max_reqs - 1  # every row busy
        assert all(s >= 0 for s in res.slack.values()), res.slack
    with CpuDevice(timeout=30) as dev:
        report = verify_serve(TARGETS[name](), steps=VERIFY_STEPS, device=dev, cfg=CFG, traffic=TRAFFIC,
                              capture_sizes=SIZES, state=live.fresh())
    checked = report.unwrap()  # a finding raises, naming the policy, buffer, step and op
    assert [c.policy for c in checked.checks] == list(Policy)
    assert checked.ran() == ["poison", "guard", "observer"]
