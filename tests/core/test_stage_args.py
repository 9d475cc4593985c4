"""A stage's arguments are read-only, and a dict it returns is the same output in any key order.

The serial step hands one step's dicts to every stage; a lowered step hands each stage its own;
the scheduler owns the ``shared`` dict. A stage that rebinds a key of one of them changes what the
next stage sees in one run and not the other (or the live state, outside any fence): each spelling
below is refused naming stage, key and line, and with the refusal taken away the serial run and the
lowered loop really differ (the check that shares nothing with it).
"""

from __future__ import annotations

import collections

import pytest
import torch

import readfence.core._step as step_module
from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, StageArgumentError, audit
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import LoopOptions, Policy, Scheduler, lower, make_state, run_overlapped, run_serial, verify
from tests.conftest import SMALL as CFG

M = ForwardMode
PRE = ReadEnd.PRE_REPLAY
DECLARED = ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE})


def _attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
    rows = batch["req_pool_indices"]
    per_token = rows.repeat_interleave(out.shape[0] // rows.shape[0]).float().view(-1, 1, 1)
    return out + 1e-2 * per_token + 1e-3 * len(meta.get("extra", ()))


def _out(mode, shared, batch):
    return {**page_meta(shared, batch), "extra": [torch.ones(1)]}


# each: (stage changed, what the message names, prepare_out_graph, prepare_in_graph)
def _rebind_meta(mode, shared, batch, meta):
    meta["kv_lens"] = meta["kv_lens"].clamp(max=2)
    return {}


def _rebind_batch(mode, shared, batch, meta):
    batch["req_pool_indices"] = batch["req_pool_indices"].flip(0)
    return {}


def _append(mode, shared, batch, meta):
    meta["extra"].append(torch.ones(1))
    return {}


def _update(mode, shared, batch, meta):
    meta.update(kv_lens=meta["kv_lens"].clamp(max=2))
    return {}


def _rebind_shared(mode, shared, batch):
    shared["seq_lens"] = torch.zeros_like(shared["seq_lens"])  # the live state's buffer replaced, no byte written
    return _out(mode, shared, batch)


def _add_shared(mode, shared, batch):
    shared.setdefault("my_cache", torch.zeros(1))
    return _out(mode, shared, batch)


CHANGES = {
    "meta assigned": ("prepare_in_graph", "meta['kv_lens'] (assigned", _out, _rebind_meta),
    "batch assigned": ("prepare_in_graph", "batch['req_pool_indices'] (assigned", _out, _rebind_batch),
    "list appended": ("prepare_in_graph", "meta['extra'] (append", _out, _append),
    "meta updated": ("prepare_in_graph", "meta (update", _out, _update),
    "shared rebound": ("prepare_out_graph", "shared['seq_lens'] (assigned", _rebind_shared, None),
    "shared key added": ("prepare_out_graph", "shared['my_cache'] (setdefault", _add_shared, None),
}


def _backend(name: str):
    _, _, out, prep = CHANGES[name]
    return leaf(name.replace(" ", "_"), _attend, prepare_out_graph=out, declare={M.DECODE: DECLARED},
                **({} if prep is None else {"prepare_in_graph": prep}))


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_stage_changing_its_arguments_is_refused_naming_stage_key_and_line(name, dev) -> None:
    stage, what, *_ = CHANGES[name]
    backend = _backend(name)
    for run in (lambda: audit(backend, M.DECODE, cfg=CFG),
                lambda: lower(backend, M.DECODE, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG),
                lambda: run_serial(backend, M.DECODE, steps=2, batch_size=2, cfg=CFG, state=make_state(CFG))):
        with pytest.raises(StageArgumentError, match=r"stage_args\.py:\d+ in _") as e:
            run()
        assert e.value.stage == stage and what in str(e.value) and f"stage {stage} changed" in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["meta assigned", "batch assigned", "shared rebound"])
def test_without_the_refusal_the_serial_run_and_the_lowered_loop_differ(name, dev, monkeypatch) -> None:
    # what the refusal prevents is real: handed plain dicts, the serial step passes the change on
    # (to the next stage, or to the caller's live state) and the lowered loop does not
    monkeypatch.setattr(step_module, "read_only", lambda value, *args, **kwargs: value)
    backend = _backend(name)
    serial_state, lowered_state = make_state(CFG), make_state(CFG)
    held, kept = serial_state["shared"]["seq_lens"], lowered_state["shared"]["seq_lens"]
    reference = run_serial(backend, M.DECODE, steps=4, batch_size=2, cfg=CFG, state=serial_state,
                           options=LoopOptions(finish_prob=0.3))
    run = run_overlapped(backend, M.DECODE, steps=4, policy=Policy.COARSE, device=dev, batch_size=2, cfg=CFG,
                         state=lowered_state, options=LoopOptions(finish_prob=0.3))
    if name == "shared rebound":
        assert serial_state["shared"]["seq_lens"] is not held  # the scheduler's buffer replaced under it
        assert lowered_state["shared"]["seq_lens"] is kept
    else:
        assert not run.matches(reference)


def _reads_without_changing(mode, shared, batch, meta):
    mine = dict(meta)  # a copy of its own is the stage's to change
    mine["kv_lens"] = mine["kv_lens"] + 0
    flipped = torch.utils._pytree.tree_map(lambda t: t.flip(0) if t.dim() else t, dict(batch))
    return {**meta, "kv_lens": mine["kv_lens"], "extra": meta.get("extra", []) + [flipped["req_pool_indices"][:1] * 0.0]}


@pytest.mark.parametrize("mode", [M.DECODE, M.EXTEND])
def test_a_stage_reading_copying_and_returning_its_arguments_is_accepted_and_bit_identical(mode, dev) -> None:
    backend = leaf("reads_only", _attend, prepare_out_graph=_out, prepare_in_graph=_reads_without_changing,
                   declare={mode: DECLARED})
    report = audit(backend, mode, cfg=CFG).unwrap()
    assert {r["buffer"]: r["verdict"] for r in report.rows()}["seq_lens"] == "exact", report.rows()
    checked = verify(backend, mode, device=dev, cfg=CFG, state=make_state(CFG), policy=Policy.PER_BUFFER, steps=4,
                     batch_size=2, options=LoopOptions(finish_prob=0.3))
    assert checked.map(lambda r: len(r.checks)).value_or(None) == 1, checked


def _out_in_data_order(mode, shared, batch):
    meta = page_meta(shared, batch)
    pos = batch["positions"]
    if pos[pos == 0].numel():  # the same keys, another insertion order, on some steps
        return {"kv_lens": meta["kv_lens"], "kv_indices": meta["kv_indices"]}
    return {"kv_indices": meta["kv_indices"], "kv_lens": meta["kv_lens"]}


@pytest.mark.parametrize("mode", [M.DECODE, M.EXTEND])
def test_the_same_keys_in_another_order_are_the_same_output(mode, dev) -> None:
    backend = leaf("key_order", _attend, prepare_out_graph=_out_in_data_order, declare={mode: DECLARED})
    assert audit(backend, mode, cfg=CFG).unwrap()
    reference = run_serial(backend, mode, steps=6, batch_size=2, cfg=CFG, state=make_state(CFG),
                           options=LoopOptions(finish_prob=0.3))
    run = run_overlapped(backend, mode, steps=6, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                         state=make_state(CFG), options=LoopOptions(finish_prob=0.3))
    assert run.matches(reference) and not run.violations
    # the scheduler's traffic takes both orders (a request at its first token, and none)
    scheduler = Scheduler(CFG, mode, 2, seed=3, finish_prob=0.3)
    orders = {tuple(_out_in_data_order(mode, step.shared, step.batch))
              for step in (scheduler.next_step() for _ in range(6))}
    assert len(orders) == 2, orders


def _around_the_refusal(mode, shared, batch, meta):
    dict.__setitem__(meta, "kv_lens", meta["kv_lens"].clamp(max=2))  # the base class's own method
    dict.__setitem__(meta["table"], "kv_lens", meta["kv_lens"])
    meta["ordered"]["kv_lens"] = meta["kv_lens"]  # an OrderedDict: its own methods, on a copy of its own
    return {}


def _out_with_a_table(mode, shared, batch):
    meta = page_meta(shared, batch)
    return {**meta, "table": {"kv_lens": meta["kv_lens"]}, "ordered": collections.OrderedDict(kv_lens=meta["kv_lens"])}


def test_a_change_made_around_the_refusal_reaches_no_other_stage(dev) -> None:
    # each stage's arguments are copies of its own, as a lowered step's are: the serial run and the
    # loop both compute what the same backend without the change computes
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):  # the lengths from both places
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = torch.minimum(torch.minimum(meta["kv_lens"], meta["table"]["kv_lens"]), meta["ordered"]["kv_lens"])
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    def make(prep):
        return leaf("around", attend, prepare_out_graph=_out_with_a_table, declare={M.DECODE: DECLARED},
                    **({} if prep is None else {"prepare_in_graph": prep}))

    def serial(backend):
        return run_serial(backend, M.DECODE, steps=4, batch_size=2, cfg=CFG, state=make_state(CFG),
                          options=LoopOptions(finish_prob=0.3))

    unchanged = serial(make(None))
    assert serial(make(_around_the_refusal)).matches(unchanged)
    run = run_overlapped(make(_around_the_refusal), M.DECODE, steps=4, policy=Policy.COARSE, device=dev, batch_size=2,
                         cfg=CFG, state=make_state(CFG), options=LoopOptions(finish_prob=0.3))
    assert run.matches(unchanged) and not run.violations
    # and the change, had it reached the body, would show: clamping the lengths changes the logits
    assert not serial(make(lambda mode, shared, batch, meta: {"kv_lens": meta["kv_lens"].clamp(max=2)})).matches(unchanged)


def _body_caching(mode, layer, q, k, v, pools, shared, batch, meta):
    if "scale" not in meta:  # the body, the last stage: its meta is a dict of its own
        meta["scale"] = torch.full((1,), 0.5)
    return _attend(mode, layer, q, k, v, pools, shared, batch, meta) * meta["scale"]


def _rebuilt(mode, shared, batch, meta):
    mine = type(meta)((k, v) for k, v in meta.items())  # a container the stage builds is its own to change
    mine["kv_lens"] = mine["kv_lens"].clamp(min=1)
    return {"kv_lens": mine["kv_lens"]}


@pytest.mark.parametrize("name", ["body caching", "rebuilt"])
def test_a_body_caching_in_its_meta_and_a_stage_changing_a_container_it_built_are_accepted(name, dev) -> None:
    backend = (leaf("body_caching", _body_caching, prepare_out_graph=_out, declare={M.DECODE: DECLARED})
               if name == "body caching" else
               leaf("rebuilt", _attend, prepare_out_graph=_out, prepare_in_graph=_rebuilt, declare={M.DECODE: DECLARED}))
    assert audit(backend, M.DECODE, cfg=CFG).unwrap()
    reference = run_serial(backend, M.DECODE, steps=4, batch_size=2, cfg=CFG, state=make_state(CFG),
                           options=LoopOptions(finish_prob=0.3))
    run = run_overlapped(backend, M.DECODE, steps=4, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                         state=make_state(CFG), options=LoopOptions(finish_prob=0.3))
    assert run.matches(reference) and not run.violations
