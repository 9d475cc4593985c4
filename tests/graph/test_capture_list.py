"""A capture list: one lowered graph per batch size on one live state, each its own events."""

from __future__ import annotations

import pytest
import torch

from readfence.backends import hybrid_linear, linear, paged, trtllm_mha
from readfence.core import SHARED_BUFFERS, ForwardMode, StepInputs, run_step
from readfence.graph import Policy, Scheduler, eagle, lower_capture_list, serve_loop
from readfence.graph.runtime._serve import graph_labels
from tests.conftest import DEFAULT as CFG

M = ForwardMode
T = 10.0


def test_each_size_is_lowered_once_on_one_state(dev):
    backend = hybrid_linear(trtllm_mha(), linear())
    graphs = lower_capture_list(backend, M.DECODE, [4, 1, 2, 4], device=dev, policy=Policy.EXACT, cfg=CFG)
    assert graphs.sizes == (1, 2, 4) and list(graphs) == [1, 2, 4] and len(graphs) == 3
    assert [graphs[s].batch_size for s in graphs] == [1, 2, 4]
    assert all(graphs[s].shared is graphs.state["shared"] for s in graphs)  # one live state
    assert set(graphs.seconds) == {1, 2, 4} and all(t > 0 for t in graphs.seconds.values())
    labels = [graph_labels(graphs[s]) for s in graphs]
    assert len(set(labels)) == 3  # never one event for two sizes
    for size in graphs:
        low = graphs[size]
        nxt = Scheduler(low.cfg, M.DECODE, size, seed=size).next_step()
        for b in SHARED_BUFFERS:
            low.shared[b].copy_(nxt.shared[b])
        pools = {k: v.clone() for k, v in low.pools.items()}
        out = low.run(nxt.batch, step=0).result(T)
        expected = run_step(backend, M.DECODE, low.cfg, StepInputs(
            shared={k: v.clone() for k, v in low.shared.items()}, batch=nxt.batch, pools=pools, params=low.params))
        assert torch.equal(out, expected)


def test_the_smallest_graph_that_holds_a_batch(dev):
    graphs = lower_capture_list(paged(), M.DECODE, [2, 4], device=dev, policy=Policy.PER_BUFFER, cfg=CFG)
    assert [graphs.for_batch(n)[0] for n in (1, 2, 3, 4)] == [2, 2, 4, 4]
    assert graphs.for_batch(3)[1] is graphs[4]
    with pytest.raises(ValueError, match=r"no captured graph holds a batch of 5 requests: the capture list is \[2, 4\]"):
        graphs.for_batch(5)
    with pytest.raises(TypeError, match="positive int"):
        graphs.for_batch(0)


def test_bad_sizes_are_named(dev):
    with pytest.raises(ValueError, match="capture size"):
        lower_capture_list(paged(), M.DECODE, [1, CFG.max_reqs + 1], device=dev, policy=Policy.EXACT, cfg=CFG)
    with pytest.raises(TypeError, match="capture_sizes must be a collection"):
        lower_capture_list(paged(), M.DECODE, 4, device=dev, policy=Policy.EXACT, cfg=CFG)  # type: ignore[arg-type]


def test_step_shapes_and_the_serving_loop_use_it(dev):
    graphs = lower_capture_list(eagle(trtllm_mha(), paged()), M.DECODE, [1, 2], device=dev, policy=Policy.EXACT,
                                cfg=CFG)
    assert graphs.sizes == (1, 2)
    loop = serve_loop(paged(), policy=Policy.EXACT, device=dev, capture_sizes=[1, 4], cfg=CFG)
    assert sorted(loop.decode) == [1, 4]
    assert all(id(low) in loop.writers for low in loop.decode.values())
