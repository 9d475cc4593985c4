"""A write of a live shared buffer that only a run of the step's code shows: a custom op's kernel
(its schema declares no write, in ``aten`` or a user namespace) writing a buffer the backend keeps
in a closure, which no argument hands it. The trace cannot see it; the audit's observer, watching
the live buffers it is given, runs the kernel under itself and sees the write. ``audit`` and
``lower`` refuse it alike (one verdict: a write any run saw is a write), naming the stage and the
buffer. Independently of any observer, the buffer's bytes compared around a plain serial run
show the write."""

from __future__ import annotations

import pytest
import torch

from readfence.backends import kv_indices, kv_lens, leaf, softmax_attention, store_kv
from readfence.core import ForwardMode, StageWriteError, audit
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, LoopOptions, Policy, lower, make_state, run_serial, verify
from tests.conftest import SMALL as CFG

M = ForwardMode.DECODE
_LIBS: dict[str, torch.library.Library] = {}
_KEPT: dict[str, torch.Tensor] = {}


def _bump_kept(x: torch.Tensor) -> torch.Tensor:
    _KEPT["buffer"].add_(1)  # memory no argument hands it
    return x.clone()


def _op(namespace: str) -> object:
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    name = "rf_observed_bump_kept"
    lib.define(f"{name}(Tensor x) -> Tensor")
    lib.impl(name, _bump_kept, "CPU")
    lib.impl(name, lambda x: torch.empty_like(x), "Meta")
    return getattr(getattr(torch.ops, namespace), name).default


OPS = {ns: _op(ns) for ns in ("aten", "rf_observed_user")}


def _writer(namespace: str, stage: str, buffer: str, state):
    op = OPS[namespace]
    _KEPT["buffer"] = state["shared"][buffer]

    def out(mode, shared, batch):
        lens = kv_lens(shared, batch)
        return {"kv_lens": op(lens) if stage == "prepare_out_graph" else lens}

    def inn(mode, shared, batch, meta):
        rows = kv_indices(shared, batch)
        return {"kv_indices": op(rows) if stage == "prepare_in_graph" else rows}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = op(meta["kv_lens"]) if stage == "body" else meta["kv_lens"]
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    declared = ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY, "seq_lens": ReadEnd.POST_REPLAY})
    return leaf(f"writes_{stage}", attend, prepare_out_graph=out, prepare_in_graph=inn, declare={M: declared})


CASES = [("aten", "prepare_out_graph", "seq_lens"), ("rf_observed_user", "prepare_out_graph", "req_to_token"),
         ("rf_observed_user", "prepare_in_graph", "seq_lens"), ("aten", "body", "req_to_token")]


@pytest.mark.parametrize(("namespace", "stage", "buffer"), CASES)
def test_audit_and_lower_refuse_a_write_only_a_run_shows_naming_stage_and_buffer(namespace, stage, buffer):
    for policy in (Policy.COARSE, Policy.EXACT):  # lowered first (no audit ran), on a state of its own
        state = make_state(CFG)
        backend = _writer(namespace, stage, buffer, state)
        with CpuDevice(timeout=30.0) as dev, pytest.raises(StageWriteError) as lowered:
            lower(backend, M, batch_size=2, cfg=CFG, device=dev, policy=policy, state=state)
        assert (lowered.value.stage, lowered.value.buffer) == (stage, buffer), (policy, str(lowered.value))
    state = make_state(CFG)
    backend = _writer(namespace, stage, buffer, state)
    with pytest.raises(StageWriteError) as e:
        audit(backend, M, cfg=CFG, batch_sizes=[2], state=state)
    assert (e.value.stage, e.value.buffer) == (stage, buffer), str(e.value)
    assert "saw it written" in str(e.value), str(e.value)


def test_the_write_changes_the_buffer_in_a_serial_run_which_no_observer_watches():
    # the independent evidence: the buffer's bytes, compared around a plain serial run
    state = make_state(CFG)
    backend = _writer("aten", "prepare_out_graph", "seq_lens", state)
    before = state["shared"]["seq_lens"].clone()
    run_serial(backend, M, steps=1, batch_size=2, cfg=CFG, state=state)
    assert not torch.equal(state["shared"]["seq_lens"], before)


@pytest.mark.parametrize(("namespace", "stage", "buffer"), CASES[:2])
def test_the_guard_alone_which_shares_nothing_with_the_observer_catches_the_write(namespace, stage, buffer, dev):
    # lowered anyway (the unsafe flag): verify's guard, comparing the buffer's bytes between the
    # scheduler's write and the step's end, sees it with no observer and no audit
    state = make_state(CFG)
    backend = _writer(namespace, stage, buffer, state)
    refused = verify(backend, M, steps=2, batch_size=2, device=dev, cfg=CFG, state=state, policy=Policy.COARSE)
    assert (refused.failure().kind, refused.failure().evidence) == ("write", "audit"), str(refused)
    bad = verify(backend, M, steps=2, batch_size=2, device=dev, cfg=CFG, state=state, policy=Policy.COARSE,
                 options=LoopOptions(checks={"guard"}, UNSAFE_skip_soundness_check=True)).failure()
    assert (bad.kind, bad.evidence, bad.buffer) == ("write", "guard", buffer), str(bad)


#: torch's in-place view ops, as a stage may call them on a tensor (``t``: the page table or a view of it)
RESHAPES = {
    "t_": lambda t: t.t_().t_(),
    "unsqueeze_": lambda t: t.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda t: t.as_strided_(t.shape, t.stride()),
    "set_": lambda t: t.set_(t.detach()),
}


def _reshaper(name: str, itself: bool, stage: str):
    def reshaped(shared):
        table = shared["req_to_token"]
        RESHAPES[name](table if itself else table[:, :])

    def out(mode, shared, batch):
        if stage == "prepare_out_graph":
            reshaped(shared)
        return {"kv_lens": kv_lens(shared, batch)}

    def inn(mode, shared, batch, meta):
        if stage == "prepare_in_graph":
            reshaped(shared)
        return {"kv_indices": kv_indices(shared, batch)}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        if stage == "body":
            reshaped(shared)
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    return leaf(f"reshapes_{name}_{'itself' if itself else 'a_view'}", attend, prepare_out_graph=out,
                prepare_in_graph=inn, reads=["req_to_token", "seq_lens"])


@pytest.mark.parametrize("stage", ["prepare_out_graph", "prepare_in_graph", "body"])
@pytest.mark.parametrize("name", list(RESHAPES))
def test_an_in_place_view_op_writes_no_byte_of_a_view_but_reshapes_the_buffer_itself(name, stage):
    # precision: re-shaping or re-pointing a view the stage made writes nothing the scheduler owns,
    # and reads no byte of it either (in the body, declared IN_REPLAY, it is no late read): the
    # trace and every run agree; the buffer's own tensor object is the scheduler's: refused
    state = make_state(CFG)
    report = audit(_reshaper(name, False, stage), M, cfg=CFG, batch_sizes=[2], state=state).unwrap()
    assert report.sound and report.observed["req_to_token"] is ReadEnd.IN_REPLAY, str(report)
    with pytest.raises(StageWriteError) as e:
        audit(_reshaper(name, True, stage), M, cfg=CFG, batch_sizes=[2], state=make_state(CFG))
    assert (e.value.stage, e.value.buffer) == (stage, "req_to_token"), str(e.value)


def test_a_stage_reshaping_a_view_runs_bit_identical_to_serial(dev):
    backend = _reshaper("unsqueeze_", False, "prepare_in_graph")
    serial = run_serial(backend, M, steps=3, batch_size=2, cfg=CFG)
    result = verify(backend, M, steps=3, batch_size=2, device=dev, cfg=CFG, policy=[Policy.PER_BUFFER, Policy.EXACT])
    assert result.unwrap() and len(serial.logits) == 3
