"""One tensor-parallel rank's step, lowered and run on CpuDevice: the all-reduces run inside the
replayed graph, on the stream's thread, and the fences, the sanitizer, poison and the observer
work on it as on any step.

The rank's partners are absent (a process group of one rank in this process), so its collectives
are real but sum one shard; the multi-process runs are in tests/parallel.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from readfence.backends import hybrid_linear, linear, paged, redeclare, trtllm_mha
from readfence.core import BODY, ForwardMode, ModelConfig, TensorParallel
from readfence.core.tracing._collectives import starts_collective
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import LoopOptions, Policy, Scheduler, lower, run_overlapped, run_serial, verify

DECODE = ForwardMode.DECODE


@pytest.fixture(scope="module")
def cfg(solo_group):
    return ModelConfig(tp=TensorParallel(size=2, rank=0, group=solo_group))


def test_the_collectives_run_inside_the_replayed_graph(cfg, dev):
    low = lower(paged(), DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg)
    assert low.graphed and sum(starts_collective(n.target) for n in low.program.stage(BODY).graph.gm.graph.nodes) == 8
    batch = Scheduler(cfg, DECODE, 2, seed=0).next_step().batch
    before = dist.group.WORLD._get_sequence_number_for_group()
    low.run(batch).result(10.0)
    assert dist.group.WORLD._get_sequence_number_for_group() - before == 2 * cfg.layers


@pytest.mark.parametrize("policy", list(Policy))
def test_every_policy_matches_the_serial_run_with_the_same_sharding(cfg, dev, policy):
    backend = hybrid_linear(trtllm_mha(), linear())
    run = run_overlapped(backend, steps=4, policy=policy, device=dev, batch_size=2, cfg=cfg)
    assert run.matches(run_serial(backend, steps=4, batch_size=2, cfg=cfg)) and run.violations == ()
    assert not run.matches(run_serial(backend, steps=4, batch_size=2))  # the unsharded model differs


def test_poison_and_the_observer_are_clean_and_catch_a_declaration_one_step_early(cfg, dev):
    report = verify(paged(), steps=3, batch_size=2, device=dev, cfg=cfg).unwrap()
    assert [c.policy for c in report.checks] == list(Policy)
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    caught = verify(early, steps=3, batch_size=2, device=dev, cfg=cfg, policy=Policy.PER_BUFFER,
                    options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    assert (caught.kind, caught.buffer, caught.step, caught.stage) == ("late read", "req_to_token", 0, "prepare_in_graph")


@pytest.mark.cuda
def test_on_cuda_the_all_reduces_are_captured_in_the_graph(solo_group):
    # a one-rank NCCL group beside the gloo world: the rank's all-reduces go into its CUDA graph
    import torch

    from readfence.graph import open_device

    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    cfg = ModelConfig(tp=TensorParallel(size=2, rank=0, group=nccl.group_name))
    try:
        with open_device("cuda") as dev:
            low = lower(paged(), DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg)
            assert low.graphed and dev.caps.graphs
            for policy in (Policy.COARSE, Policy.EXACT):
                run = run_overlapped(paged(), steps=4, policy=policy, device=dev, batch_size=2, cfg=cfg)
                assert run.matches(run_serial(paged(), steps=4, batch_size=2, cfg=cfg, device=dev))
                assert run.violations == ()
    finally:
        dist.destroy_process_group(nccl)
