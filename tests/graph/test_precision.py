"""Correct backends written as FlashAttention and FlashInfer write them are accepted; each broken twin
is refused.

Before the replay, SGLang's FlashAttention backend reads ``max_seq_len_k`` on the host from a copy
of the batch's lengths; FlashInfer's plan reads its page count there too. Such a host read makes
``prepare_out_graph`` run as Python, and counts for the buffers the value read was computed from
(``Stage.escape_end``): the lengths, not the sliding-window map. Where the Python branches on that
value, the runs on varied states see the path the example did not take. What such a stage returns
for the host alone (the bound, a ``nan`` sentinel) is held to its traced value only where a captured
stage reads it (``OutputGuard.consuming``), and floats compare bit for bit, ``nan`` equal to ``nan``.

Each correct backend: the audit is sound, verify lowers it under every policy, poisons what each
fence releases and matches the serial run bit for bit. Each twin breaks what the precision relies on
and an independent check refuses it.
"""

from __future__ import annotations

import math

import pytest
import torch

from readfence.backends import leaf, page_meta, remap, softmax_attention, store_kv
from readfence.core import ForwardMode, NotGraphSafe, StageOutputError, audit, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, LoopOptions, Policy, UnsoundLowering, lower, run_overlapped, run_serial, verify
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode.DECODE
NONE, PRE = ReadEnd.NONE, ReadEnd.PRE_REPLAY
#: The page table and the lengths snapshotted before the replay; the sliding-window and state-slot maps never read.
SNAPSHOT = ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE})
WITH_MAP = ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE, "swa_map": PRE})
STEPS, BATCH = 3, 2


def _full(mode, layer, q, k, v, pools, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])


# -- FlashAttention: the longest length, read on the host from a copy -------------------------
def _flash_attention_meta(shared, batch):
    meta = page_meta(shared, batch)  # copies of the batch's page-table rows and lengths
    meta["max_seq_len_k"] = int(meta["kv_lens"].max())  # a host read of the copy, kept for the host
    return meta


def _flash_attention(name, *, out=None, attend=None, declare=SNAPSHOT):
    def prepare_out_graph(mode, shared, batch):
        return (out or _flash_attention_meta)(shared, batch)

    def default_attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _full(mode, layer, q, k, v, pools, batch, meta)

    return leaf(name, attend or default_attend, prepare_out_graph=prepare_out_graph, declare={M: declare})


def _late_map(shared, batch):
    # broken: after the host read, the stage goes on to read the sliding-window map, declared NONE
    meta = _flash_attention_meta(shared, batch)
    meta["kv_indices"] = remap(shared["swa_map"], meta["kv_indices"])
    return meta


def _map_at_the_longest_context(shared, batch):
    # broken where it branches: only when every request is at the longest context (never on the
    # trace's example, on the oldest varied state) does it read the sliding-window map
    meta = _flash_attention_meta(shared, batch)
    if int(meta["kv_lens"].min()) >= CFG.max_ctx:
        meta["kv_indices"] = remap(shared["swa_map"], meta["kv_indices"])
    return meta


def _map_past_the_example(shared, batch):
    # broken the same way, its host read of a tensor empty on the trace's example (its requests'
    # lengths are 4 and 11): the escape hands the Python nothing there, and values on other steps
    lens = page_meta(shared, batch)["kv_lens"]
    long = lens[lens >= 12].tolist()
    meta = page_meta(shared, batch)
    if long:
        meta["kv_indices"] = remap(shared["swa_map"], meta["kv_indices"])
    return meta


def _bounded_attend(mode, layer, q, k, v, pools, shared, batch, meta):
    # broken: the body reads the bound, which its graph bakes, and which changes from step to step
    bounded = {"kv_indices": meta["kv_indices"], "kv_lens": meta["kv_lens"].clamp(max=meta["max_seq_len_k"])}
    return _full(mode, layer, q, k, v, pools, batch, bounded)


def _unbound_read_attend(mode, layer, q, k, v, pools, shared, batch, meta):
    # the same, reaching the bound around the dict's own methods: only translation validation sees it
    bound = dict.__getitem__(meta, "max_seq_len_k")
    bounded = {"kv_indices": meta["kv_indices"], "kv_lens": meta["kv_lens"].clamp(max=bound)}
    return _full(mode, layer, q, k, v, pools, batch, bounded)


# -- FlashInfer: a plan, its page count read on the host, a nan sentinel ----------------------
def _plan(shared, batch, cap):
    meta = page_meta(shared, batch)
    kv_indptr = torch.cumsum(meta["kv_lens"], 0)
    meta["kv_indptr"] = kv_indptr
    meta["num_pages"] = int(kv_indptr[-1])  # a host read of a copy: the plan's size, for the host
    meta["logits_soft_cap"] = cap(meta)
    return meta


def _no_cap(meta):
    return float("nan")  # a fresh nan every step: "no cap", as the graph that reads it was traced


def _cap_from_the_data(meta):
    # broken: a number on some steps, nan on others; the graph baked the nan
    longest = int(meta["kv_lens"].max())
    return float("nan") if longest < CFG.max_ctx else float(longest)


def _capped_attend(mode, layer, q, k, v, pools, shared, batch, meta):
    out = _full(mode, layer, q, k, v, pools, batch, meta)
    cap = meta["logits_soft_cap"]  # read by the graph: held to its traced value, nan equal to nan
    return out if math.isnan(cap) else cap * torch.tanh(out / cap)


def _flash_infer(name, cap=_no_cap):
    return leaf(name, _capped_attend, prepare_out_graph=lambda mode, shared, batch: _plan(shared, batch, cap),
                declare={M: SNAPSHOT})


CORRECT = {
    "flash_attention": lambda: _flash_attention("flash_attention"),
    "flash_infer": lambda: _flash_infer("flash_infer"),
    # the branch declared as it reads: the map until PRE_REPLAY
    "map_at_the_longest_context_declared": lambda: _flash_attention(
        "map_declared", out=_map_at_the_longest_context, declare=WITH_MAP),
}


def _accepted(backend) -> None:
    report = audit(backend, M, cfg=CFG).unwrap()
    assert report.sound and report.observed["swa_map"] is report.declared["swa_map"], report.table()
    with CpuDevice(timeout=30.0) as dev:
        result = verify(backend, M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG).unwrap()
    assert [c.policy for c in result.checks] == list(Policy), result
    # every fence but COARSE released something before the forward's end, and poisoned it
    assert all(c.poisoned for c in result.checks if c.policy is not Policy.COARSE), result


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_backend_that_reads_on_the_host_is_accepted_verified_and_matches_serial(name) -> None:
    _accepted(CORRECT[name]())


def test_a_host_read_of_a_copy_counts_for_the_lengths_not_every_buffer() -> None:
    bounds: list[int] = []

    def recorded(shared, batch):
        meta = _flash_attention_meta(shared, batch)
        bounds.append(meta["max_seq_len_k"])
        return meta

    backend = _flash_attention("flash_attention_recorded", out=recorded)
    program = trace(backend, M, cfg=CFG)
    assert program.unfaithful()  # the host read: the stage runs as Python
    assert program.traced() == SNAPSHOT  # what the bound was computed from, not the window or state maps
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    bounds.clear()
    with CpuDevice(timeout=30.0) as dev:
        run = run_overlapped(backend, M, steps=STEPS, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG)
    assert run.matches(serial) and run.violations == ()
    # not vacuous: the bound it keeps for the host changed from step to step of the lowered run
    assert len(set(bounds[-STEPS:])) > 1, bounds


def test_a_read_after_the_host_read_is_refused_by_the_trace() -> None:
    backend = _flash_attention("late_map", out=_late_map)
    bad = audit(backend, M, cfg=CFG).failure()
    assert (bad.buffer, bad.declared, bad.observed) == ("swa_map", NONE, PRE), bad.message
    assert not next(b for b in bad.report.buffers if b.buffer == "swa_map").varied  # the trace itself reads it
    with CpuDevice(timeout=30.0) as dev:
        refused = verify(backend, M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                         policy=[Policy.PER_BUFFER]).failure()
        assert (refused.kind, refused.evidence, refused.buffer) == ("unsound declaration", "audit", "swa_map")
        # lowered anyway, the map is poisoned as the step begins and the snapshot reads the poison
        caught = verify(backend, M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=[Policy.PER_BUFFER],
                        options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    assert caught.buffer == "swa_map", str(caught)


def test_a_read_on_a_branch_the_example_does_not_take_is_seen_on_a_varied_state_and_refused() -> None:
    backend = _flash_attention("map_at_the_longest_context", out=_map_at_the_longest_context)
    assert trace(backend, M, cfg=CFG, batch_size=CFG.max_reqs).traced() == SNAPSHOT  # not on any traced example
    bad = audit(backend, M, cfg=CFG).failure()
    assert (bad.buffer, bad.declared, bad.observed) == ("swa_map", NONE, PRE), bad.message
    assert "stage prepare_out_graph's Python read it on a varied state" in bad.message, bad.message
    with CpuDevice(timeout=30.0) as dev:
        for policy in (Policy.PER_BUFFER, Policy.EXACT):
            with pytest.raises(UnsoundLowering, match="swa_map"):
                lower(backend, M, batch_size=BATCH, device=dev, policy=policy, cfg=CFG)


def test_a_host_read_of_what_is_empty_on_the_example_still_sends_the_stage_to_the_varied_states() -> None:
    backend = _flash_attention("map_past_the_example", out=_map_past_the_example)
    program = trace(backend, M, cfg=CFG, batch_size=BATCH)
    assert program.traced() == SNAPSHOT
    bad = audit(backend, M, cfg=CFG, batch_sizes=[BATCH]).failure()
    assert (bad.buffer, bad.observed) == ("swa_map", PRE) and "on a varied state" in bad.message, bad.message


def test_a_python_value_a_graph_reads_is_still_held_to_its_traced_value() -> None:
    backend = _flash_attention("bounded", attend=_bounded_attend)
    with CpuDevice(timeout=30.0) as dev, pytest.raises(StageOutputError, match=r"\['max_seq_len_k'\]") as e:
        lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.PER_BUFFER, cfg=CFG)
    assert "stage prepare_out_graph" in str(e.value) and "in _flash_attention_meta" in str(e.value), str(e.value)


def test_a_value_read_around_the_dict_is_refused_by_translation_validation() -> None:
    # the key the body reads is not seen, so the guard lets the bound change; the replay of the
    # body beside its Python on a varied state computes something else, and lower refuses it
    backend = _flash_attention("unbound_read", attend=_unbound_read_attend)
    with CpuDevice(timeout=30.0) as dev, pytest.raises(NotGraphSafe, match="stage body is not graph-safe"):
        lower(backend, M, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)


def test_a_nan_the_graph_reads_is_its_traced_nan_and_a_number_in_its_place_is_refused() -> None:
    program = trace(CORRECT["flash_infer"](), M, cfg=CFG)
    assert program.traced() == SNAPSHOT
    broken = _flash_infer("cap_from_the_data", cap=_cap_from_the_data)
    with CpuDevice(timeout=30.0) as dev, pytest.raises(StageOutputError, match=r"\['logits_soft_cap'\]") as e:
        lower(broken, M, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)
    assert "16.0 at key ['logits_soft_cap'] where the traced step returned nan" in str(e.value), str(e.value)
