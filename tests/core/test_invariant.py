"""Batch invariance: a request's logits do not depend on how many requests share the step.

The serving loop runs a batch in the graph of a larger captured size, padded, and compares each
request with the serial run of the exact batch: every reference leaf, in every mode, at every
batch size, gives each request the bits the full batch gives it. The check can fail: the plain
matmul it replaces does not have the property.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import REFERENCE_LEAVES
from readfence.core import ForwardMode, ModelConfig, run_step
from readfence.core.internal import example_step, matmul_rows, pad_rows, tokens_per_request

CFG = ModelConfig(layers=2)
MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.EXTEND]


def _first(step, b: int, n: int):
    s = step.clone()
    s.batch = {k: (v[:b] if k == "req_pool_indices" else v[: b * n]).clone() for k, v in s.batch.items()}
    return s


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize("name", sorted(REFERENCE_LEAVES))
def test_each_request_gets_the_same_bits_at_every_batch_size(name, mode):
    n = tokens_per_request(mode)
    full = example_step(CFG, mode, CFG.max_reqs)
    ref = run_step(REFERENCE_LEAVES[name](), mode, CFG, full.clone())
    bad = [b for b in range(1, CFG.max_reqs)
           if not torch.equal(run_step(REFERENCE_LEAVES[name](), mode, CFG, _first(full, b, n)), ref[: b * n])]
    assert bad == [], f"{name} in {mode.name}: a request's logits change with the batch size at {bad}"


def test_the_plain_matmul_is_not_batch_invariant_here():
    # what matmul_rows is for: without it, some row count changes a row's bits on this machine
    # (if this ever fails, the padding is no longer needed here, not wrong)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 96, generator=g), torch.randn(16, 32, generator=g)
    plain = [t for t in range(1, 17) if not torch.equal(x[:t] @ w, (x @ w)[:t])]
    fixed = [t for t in range(1, 17) if not torch.equal(matmul_rows(x[:t], w), matmul_rows(x, w)[:t])]
    assert plain and not fixed, (plain, fixed)
    assert pad_rows(x[:5]).shape[0] == 8 and pad_rows(x[:8]) is not None
