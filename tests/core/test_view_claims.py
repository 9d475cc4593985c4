"""A view claim is checked on memory, by the tracer and by the read observer alike.

torch's schema alias oracle takes an unannotated ``Tensor[] -> Tensor[]`` (functional
``_foreach_*`` ops, a ``list[Tensor]`` custom op registered with ``mutates_args=()``) to be a
view, while such an op copies. A copy of a shared buffer handed to the body then looked like a
read of nothing: accepted at PRE_REPLAY, raced. Written as a user would, each variant below must
be refused when declared too early and run bit-identical to serial when declared right; real
views stay views (no false alarm), and each check catches the case with the other one off.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import kv_indices, leaf, softmax_attention, store_kv
from readfence.core import BODY, PREPARE_IN_GRAPH, ForwardMode, audit, observe, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, FaultInjector, Policy, UnsoundLowering, lower, run_overlapped, run_serial
from tests.conftest import SMALL as CFG

M = ForwardMode.DECODE


@torch.library.custom_op("readfence_test_views::lens_pair", mutates_args=())
def lens_pair(lens: torch.Tensor) -> list[torch.Tensor]:
    """A list-returning kernel that copies (custom ops may not return views of their inputs)."""
    return [lens.clone(), lens.clone() * 0]


@lens_pair.register_fake
def _(lens: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(lens), torch.empty_like(lens)]


COPIES = {
    "foreach_add": lambda lens: torch._foreach_add([lens], 0)[0],
    "foreach_mul_pair": lambda lens: torch._foreach_mul([lens, lens], 1)[1],
    "foreach_abs": lambda lens: torch._foreach_abs([lens])[0],
    "list_custom_op": lambda lens: lens_pair(lens)[0],
}


def _backend(name: str, copy, declared: ReadEnd):
    """The page table snapshotted before the replay; the lengths copied in the graph's prelude by
    ``copy`` and handed to the body, which indexes them."""

    def out(mode, shared, batch):
        return {"kv_indices": kv_indices(shared, batch)}

    def inn(mode, shared, batch, meta):
        return {"lens": copy(shared["seq_lens"])}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = meta["lens"].index_select(0, batch["req_pool_indices"]).long()
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    effect = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": declared})
    return leaf(name, attend, prepare_out_graph=out, prepare_in_graph=inn, declare={M: effect})


@pytest.mark.parametrize("name", sorted(COPIES))
def test_a_copy_claimed_as_a_view_reads_its_input_where_it_copies(name: str) -> None:
    program = trace(_backend(name, COPIES[name], ReadEnd.IN_REPLAY), M, cfg=CFG)
    assert program.traced()["seq_lens"] is ReadEnd.IN_REPLAY
    stage, node = program.last_reader("seq_lens")
    assert stage == PREPARE_IN_GRAPH
    assert program.stage(BODY).analysis.buffers_read() == frozenset()  # the body reads the copy, not the buffer


@pytest.mark.parametrize("name", sorted(COPIES))
def test_declared_before_the_copy_it_is_refused_by_audit_and_lower(name: str) -> None:
    early = _backend(name, COPIES[name], ReadEnd.PRE_REPLAY)
    failure = audit(early, M, cfg=CFG).failure()
    assert (failure.buffer, failure.observed) == ("seq_lens", ReadEnd.IN_REPLAY), failure.message
    with CpuDevice() as dev, pytest.raises(UnsoundLowering, match="seq_lens"):
        lower(early, M, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG)


@pytest.mark.parametrize("name", sorted(COPIES))
def test_the_observer_alone_sees_the_copy_read(name: str) -> None:
    seen = observe(_backend(name, COPIES[name], ReadEnd.IN_REPLAY), M, cfg=CFG, steps=1)
    assert seen.observed()["seq_lens"] is ReadEnd.IN_REPLAY
    assert seen.last_reader("seq_lens")[0] == "prepare_in_graph"


@pytest.mark.parametrize("name", ["foreach_add", "list_custom_op"])
@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT])
def test_declared_right_it_runs_bit_identical_to_serial(name: str, policy: Policy) -> None:
    backend = _backend(name, COPIES[name], ReadEnd.IN_REPLAY)
    serial = run_serial(backend, M, steps=5, batch_size=3, cfg=CFG)
    with CpuDevice(timeout=30.0, faults=FaultInjector(7, 0.002, streams=["forward"], probability=0.3)) as dev:
        run = run_overlapped(backend, M, steps=5, policy=policy, device=dev, batch_size=3, cfg=CFG)
    assert run.matches(serial) and run.violations == ()


def test_real_views_stay_views() -> None:
    # pieces of split and chunk handed to the body are read there: POST_REPLAY, not at the view
    def inn(mode, shared, batch, meta):
        first, _ = shared["seq_lens"].split(4)
        return {"lens": first, "halves": list(shared["seq_lens"].chunk(2))}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = torch.cat(meta["halves"]).index_select(0, batch["req_pool_indices"]).long() + meta["lens"].sum() * 0
        return softmax_attention(mode, q, pools, layer, kv_indices(shared, batch), lens)

    program = trace(leaf("views", attend, prepare_in_graph=inn), M, cfg=CFG)
    assert program.traced()["seq_lens"] is ReadEnd.POST_REPLAY
    assert program.stage(PREPARE_IN_GRAPH).analysis.buffers_read() == frozenset()
    assert not program.stage(PREPARE_IN_GRAPH).analysis.copies


def test_without_memory_an_unannotated_claim_counts_both_ways() -> None:
    # on fake tensors (a trace for CUDA) there is no memory to check: the op may copy, so it
    # reads, and may alias, so the body's consumers read too
    program = trace(_backend("foreach_add", COPIES["foreach_add"], ReadEnd.POST_REPLAY), M, cfg=CFG, device="cuda")
    assert program.stage(PREPARE_IN_GRAPH).analysis.copies is None
    assert "seq_lens" in program.stage(PREPARE_IN_GRAPH).analysis.buffers_read()
    assert program.traced()["seq_lens"] is ReadEnd.POST_REPLAY


def test_lower_refuses_what_audit_refuses_through_the_same_verdict() -> None:
    # a run kernel reading what a plan kept by reference: the observer sees the body's read, the
    # trace does not; the audit counts the observed read, and so does lower, which asks it
    from tests.core.test_observe import CASES, ONE_LAYER

    backend = CASES["plan_run"].backend
    failure = audit(backend, M, cfg=ONE_LAYER).failure()
    assert failure is not None and failure.report.disagreements and failure.observed is ReadEnd.POST_REPLAY
    assert trace(backend, M, cfg=ONE_LAYER).traced() <= backend.read_effect(M)  # the trace alone would accept it
    with CpuDevice() as dev:
        with pytest.raises(UnsoundLowering) as refused:
            lower(backend, M, batch_size=2, device=dev, policy=Policy.EXACT, cfg=ONE_LAYER)
        assert (refused.value.failure.buffer, refused.value.failure.observed) == (failure.buffer, failure.observed)
        lower(backend, M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=ONE_LAYER)  # COARSE places no fence from it


@pytest.mark.parametrize("name", ["foreach_add", "list_custom_op"])
def test_the_trace_alone_refuses_the_early_declaration(name: str) -> None:
    # the observer off: the memory probe's own check of the claim is what refuses it
    early = _backend(name, COPIES[name], ReadEnd.PRE_REPLAY)
    failure = audit(early, M, cfg=CFG, observe_steps=0).failure()
    assert failure is not None and not failure.report.disagreements
    assert (failure.buffer, failure.observed, failure.reader[0]) == ("seq_lens", ReadEnd.IN_REPLAY, "prepare_in_graph")
