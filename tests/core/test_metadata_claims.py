"""A buffer that lends only its shape, dtype and strides is not read, and that claim is checked on
memory, by the tracer and by the read observer alike.

``torch.zeros_like(lens)``, ``lens.new_zeros(n)``, ``torch.empty_like(table)``: the ops torch's
own fake tensors build from metadata alone. Counted as reads, a body that only sized its scratch
from a shared buffer was refused and the sanitizer reported write-after-read races on it. The
claim comes from the op (torch's classification), and each memory check holds it to the op's real
run: an output that shares the argument's memory, or changes with its bytes, read it.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import kv_indices, leaf, softmax_attention, store_kv
from readfence.core import BODY, ForwardMode, audit, observe, trace
from readfence.core.tracing._memory import metadata_claim_holds
from readfence.core.tracing._schema import _aliasing, _metadata_ops, op_aliasing
from readfence.effects import ReadEffect, ReadEnd
from tests.conftest import SMALL as CFG

M = ForwardMode.DECODE


def _backend(name: str, lens_of, declared: ReadEnd = ReadEnd.IN_REPLAY):
    """The page table and lengths read in the graph's prelude; the body takes its lengths from
    ``lens_of(shared, meta, batch)``."""

    def inn(mode, shared, batch, meta):
        rows = batch["req_pool_indices"]
        return {"kv_indices": kv_indices(shared, batch), "kv_lens": shared["seq_lens"].index_select(0, rows).long()}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens_of(shared, meta, batch))

    effect = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": declared})
    return leaf(name, attend, prepare_in_graph=inn, declare={M: effect})


TEMPLATES = {
    "zeros_like": lambda s, m, b: m["kv_lens"] + torch.zeros_like(s["seq_lens"]).sum(),
    "new_zeros": lambda s, m, b: m["kv_lens"] + s["seq_lens"].new_zeros(3).sum(),
    "empty_like": lambda s, m, b: m["kv_lens"] + torch.empty_like(s["seq_lens"]).fill_(0).sum(),
    "full_like": lambda s, m, b: m["kv_lens"] + torch.full_like(s["seq_lens"], 2).sum() * 0,
    "new_full": lambda s, m, b: m["kv_lens"] + s["seq_lens"].new_full((2,), 5).sum() * 0,
}


def test_torch_classifies_the_templates_and_nothing_that_reads() -> None:
    for op in (torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
               torch.ops.aten.ones_like.default):
        assert op_aliasing(op).metadata_args == (0,), op
    for op in (torch.ops.aten.clone.default, torch.ops.aten.add.Tensor, torch.ops.aten._to_copy.default,
               torch.ops.aten.index_select.default):
        assert op_aliasing(op).metadata_args == (), op
    # randint_like's tensor bound is a value: read
    assert op_aliasing(torch.ops.aten.randint_like.Tensor).data_args(2) == (1,)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_template_is_not_a_read_for_the_trace_nor_for_the_observer(name: str) -> None:
    backend = _backend(name, TEMPLATES[name])
    program = trace(backend, M, cfg=CFG)
    assert program.stage(BODY).analysis.buffers_read() == frozenset(), program.stage(BODY).analysis.reads
    assert observe(backend, M, cfg=CFG, steps=1).observed()["seq_lens"] is ReadEnd.IN_REPLAY
    assert audit(backend, M, cfg=CFG).map(lambda r: r.sound).value_or(False)


def test_without_memory_torchs_classification_is_taken() -> None:
    # a plan for CUDA is traced on fake tensors: no memory to hold the claim to
    program = trace(_backend("zeros_like", TEMPLATES["zeros_like"]), M, cfg=CFG, device="cuda")
    assert program.stage(BODY).analysis.buffers_read() == frozenset()


@pytest.fixture
def clone_claims_metadata(monkeypatch):
    """A claim torch never makes: ``clone`` uses its argument for its metadata only."""
    import readfence.core.tracing._schema as schema

    claims = _metadata_ops() | {torch.ops.aten.clone.default}
    monkeypatch.setattr(schema, "_metadata_ops", lambda: claims)
    _aliasing.cache_clear()
    assert op_aliasing(torch.ops.aten.clone.default).metadata_args == (0,)
    yield
    _aliasing.cache_clear()


def _cloned(s, m, b):
    return s["seq_lens"].clone().index_select(0, b["req_pool_indices"]).long()


def test_a_false_claim_is_refuted_by_the_trace_alone(clone_claims_metadata) -> None:
    failure = audit(_backend("cloned", _cloned), M, cfg=CFG, batch_sizes=[2], observe_steps=0).failure()
    assert failure is not None and not failure.report.disagreements
    assert (failure.buffer, failure.observed, failure.reader[0]) == ("seq_lens", ReadEnd.POST_REPLAY, "body")


def test_a_false_claim_is_refuted_by_the_observer_alone(clone_claims_metadata) -> None:
    seen = observe(_backend("cloned", _cloned), M, cfg=CFG, steps=1)
    assert seen.observed()["seq_lens"] is ReadEnd.POST_REPLAY
    reads = [a for a in seen.accesses if a.buffer == "seq_lens" and a.stage == "body"]
    assert reads and all(a.op == "aten.clone.default" and "metadata only" in a.note for a in reads), reads


def test_the_check_holds_outputs_to_memory_and_to_values_and_leaves_the_random_state() -> None:
    lens = torch.arange(6, dtype=torch.int32)
    assert metadata_claim_holds(torch.zeros_like(lens), [lens], lambda ts: torch.zeros_like(ts[0]))
    assert not metadata_claim_holds(lens[:2], [lens], lambda ts: ts[0][:2])  # shares its memory
    assert not metadata_claim_holds(lens + 1, [lens], lambda ts: ts[0] + 1)  # changes with its bytes
    # uninitialised outputs are defined while the check runs (torch fills them), random ones are
    # drawn from one state: neither is made from the input, whatever memory they were given
    for _ in range(20):
        assert metadata_claim_holds(torch.empty_like(lens), [lens], lambda ts: torch.empty_like(ts[0]))
    assert not torch.are_deterministic_algorithms_enabled()  # put back as it was
    torch.manual_seed(3)
    out = torch.randint_like(lens, 9)
    after = torch.get_rng_state()
    assert metadata_claim_holds(out, [lens], lambda ts: torch.randint_like(ts[0], 9))
    assert torch.equal(torch.get_rng_state(), after)
