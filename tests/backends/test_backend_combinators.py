"""Combinators: outputs equal their children on their parts; effects are the wrapper table."""

from __future__ import annotations

import pytest
import torch

from readfence.backends import (
    Backend,
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
from readfence.core import ForwardMode, run_step
from readfence.core._batch_split import request_ranges
from readfence.core._state import tokens_per_request
from readfence.core.internal import example_step, prepare, split_batch
from readfence.effects import ReadEffect, ReadEnd
from tests.conftest import DEFAULT as CFG

M = ForwardMode
WORK_MODES = [M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND, M.EXTEND]
PRE, IN, POST, UNK = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY, ReadEnd.UNKNOWN


def _qkv(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, CFG.heads, CFG.head_dim, generator=g) for _ in range(3))


def _attend(backend, mode, layer, step, q, k, v):
    """Run ``backend``'s prepare stages and one layer's attend on a copy of ``step``."""
    step = step.clone()
    meta = prepare(backend, mode, step.shared, step.batch)
    return backend.attend(mode, layer, q, k, v, step.pools, step.shared, step.batch, meta), step


# -- outputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
def test_layer_routed_combinators_attend_with_the_owner_child(mode):
    step = example_step(CFG, mode, 5, seed=1)
    q, k, v = _qkv(step.num_tokens, 7)
    cases = [
        (hybrid_linear(trtllm_mha(), linear(), pattern="0111"), [0, 1, 1, 1]),
        (hybrid_linear(paged(), linear()), [0, 1, 0, 1]),
        (minimax(sparse(), dense()), [0, 1, 0, 1]),
        (join(deepseek_v4(), linear(), sparse()), [0, 1, 2, 0]),
    ]
    for combo, owners in cases:
        kids = [c for _, c in combo.children()]
        for layer, owner in enumerate(owners):
            got, got_step = _attend(combo, mode, layer, step, q, k, v)
            want, want_step = _attend(kids[owner], mode, layer, step, q, k, v)
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"{combo} layer {layer}")
            for name in step.pools:
                assert torch.equal(got_step.pools[name], want_step.pools[name]), name


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_tbo_equals_children_on_their_micro_batches(mode, batch_size):
    combo = tbo(deepseek_v4(), paged(), linear())
    step = example_step(CFG, mode, batch_size, seed=2)
    q, k, v = _qkv(step.num_tokens, 3)
    got, got_step = _attend(combo, mode, 1, step, q, k, v)
    n = tokens_per_request(mode)
    parts = split_batch(step.batch, mode, 2)
    outs, work = [], step.clone()
    for child, part, (lo, hi) in zip([paged(), linear()], parts, request_ranges(batch_size, 2)):
        cut = [x[lo * n:hi * n] for x in (q, k, v)]
        meta = prepare(child, mode, work.shared, part)
        outs.append(child.attend(mode, 1, *cut, work.pools, work.shared, part, meta))
    torch.testing.assert_close(got, torch.cat(outs), atol=0, rtol=0)
    for name in step.pools:
        assert torch.equal(got_step.pools[name], work.pools[name]), name


def test_a_tbo_child_handed_no_request_runs_nothing():
    # a batch smaller than the children leaves a micro-batch empty: that child is not called
    # (an engine runs no micro-batch of no request), so a child whose metadata needs a request
    # (a maximum over its lengths, as an engine's max_seq_len) is fine inside tbo at every size
    from readfence.backends import leaf, page_meta, softmax_attention, store_kv
    from readfence.core import audit

    def longest(mode, shared, batch):
        meta = page_meta(shared, batch)
        return {**meta, "longest": meta["kv_lens"].max()}  # raises on a micro-batch of no request

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"].clamp(max=meta["longest"]))

    needs_a_request = leaf("needs_a_request", attend, prepare_out_graph=longest)
    step = example_step(CFG, M.DECODE, 1, seed=3)
    got = run_step(tbo(paged(), paged(), needs_a_request), M.DECODE, CFG, step.clone())
    assert torch.equal(got, run_step(paged(), M.DECODE, CFG, step.clone()))
    assert audit(tbo(paged(), paged(), needs_a_request), M.DECODE, cfg=CFG).unwrap().counts()["unsound"] == 0
    with pytest.raises(RuntimeError):  # (the child alone, handed no request, would raise)
        prepare(needs_a_request, M.DECODE, step.shared, split_batch(step.batch, M.DECODE, 2)[1])


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
def test_tbo_of_one_backend_equals_that_backend_end_to_end(mode):
    step = example_step(CFG, mode, 5, seed=4)
    want = run_step(trtllm_mha(), mode, CFG, step.clone())
    got = run_step(tbo(trtllm_mha(), trtllm_mha(), trtllm_mha()), mode, CFG, step.clone())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    alone = run_step(tbo(deepseek_v4()), mode, CFG, step.clone())
    torch.testing.assert_close(alone, run_step(deepseek_v4(), mode, CFG, step.clone()), atol=0, rtol=0)


@pytest.mark.parametrize("mode", list(M), ids=str)
def test_select_and_hybrid_run_the_selected_child(mode):
    h = hybrid(decode=trtllm_mha(), prefill=deepseek_v4(), verify=sparse())
    s = select({M.DECODE: linear(), M.EXTEND: dense()}, default=paged())
    step = example_step(CFG, mode, 3, seed=5)
    for combo, chosen in ((h, {M.DECODE: trtllm_mha(), M.TARGET_VERIFY: sparse(), M.DRAFT_EXTEND: trtllm_mha(),
                               M.EXTEND: deepseek_v4(), M.IDLE: trtllm_mha()}),
                          (s, {M.DECODE: linear(), M.EXTEND: dense()})):
        child = chosen.get(mode, paged())
        assert combo.selected(mode) == child
        got = run_step(combo, mode, CFG, step.clone())
        torch.testing.assert_close(got, run_step(child, mode, CFG, step.clone()), atol=0, rtol=0)


@pytest.mark.parametrize("mode", WORK_MODES, ids=str)
def test_per_stream_runs_as_its_first_member(mode):
    ps = per_stream(paged(), trtllm_mha())
    step = example_step(CFG, mode, 3)
    assert ps.members == (paged(), trtllm_mha())
    torch.testing.assert_close(run_step(ps, mode, CFG, step.clone()), run_step(paged(), mode, CFG, step.clone()),
                               atol=0, rtol=0)


def test_children_metadata_is_namespaced():
    step = example_step(CFG, M.DECODE, 2)
    meta = prepare(tbo(paged(), paged(), hybrid_linear(paged(), linear())), M.DECODE, step.shared, step.batch)
    assert sorted(meta) == [
        "children[0]/kv_indices", "children[0]/kv_lens",
        "children[1]/children[0]/kv_indices", "children[1]/children[0]/kv_lens",
        "children[1]/children[1]/state_slots",
        "primary/kv_indices", "primary/kv_lens",
    ]


def test_children_labels_and_paths():
    b = per_stream(tbo(deepseek_v4(), hybrid(decode=paged(), prefill=dense()), join(linear(), sparse())), paged())
    assert [label for label, _ in b.children()] == ["members[0]", "members[1]"]
    assert [p for p, _ in b.walk()] == [
        "per_stream", "per_stream/members[0]/tbo", "per_stream/members[0]/tbo/primary/deepseek_v4",
        "per_stream/members[0]/tbo/children[0]/hybrid", "per_stream/members[0]/tbo/children[0]/hybrid/decode/paged",
        "per_stream/members[0]/tbo/children[0]/hybrid/prefill/dense", "per_stream/members[0]/tbo/children[1]/join",
        "per_stream/members[0]/tbo/children[1]/join/children[0]/linear",
        "per_stream/members[0]/tbo/children[1]/join/children[1]/sparse", "per_stream/members[1]/paged",
    ]


@pytest.mark.parametrize("wrap", [
    lambda g: tbo(paged(), g), lambda g: join(g, paged()), lambda g: hybrid_linear(g, linear()),
    lambda g: minimax(g, paged()), lambda g: select({M.DECODE: g}, default=paged()),
    lambda g: hybrid(decode=paged(), prefill=g), lambda g: per_stream(paged(), g),
    lambda g: tbo(paged(), paged()).with_children([paged(), g]),
])
def test_a_per_stream_group_is_no_child_of_another_backend(wrap):
    # run as a backend, a group is its first member: nested, its other members would never run
    with pytest.raises(TypeError, match=r"is a per_stream group \(per_stream\(paged, linear\)\).*put per_stream at the top"):
        wrap(per_stream(paged(), linear()))


# -- the wrapper table -------------------------------------------------------------------------


def test_tbo_deepseek_paged_ends_post_replay_for_verify():
    b = tbo(deepseek_v4(), paged())
    assert b.read_end(M.TARGET_VERIFY) is POST
    assert b.read_effect(M.TARGET_VERIFY) == ReadEffect.of({"req_to_token": POST, "seq_lens": IN})
    assert b.read_end(M.DECODE) is IN
    assert tbo(deepseek_v4(dspark=True), paged()).read_end(M.TARGET_VERIFY) is IN


def test_a_wrapper_cannot_forget_to_delegate():
    """The production bug: the wrapper said IN_REPLAY while a child read until POST_REPLAY."""
    for wrap in (tbo, join, per_stream, hybrid_linear):
        assert wrap(paged(), deepseek_v4()).read_end(M.TARGET_VERIFY) is POST, wrap.__name__


@pytest.mark.parametrize("mode", list(M), ids=str)
def test_hybrid_gives_exactly_the_selected_childs_effect(mode):
    d, p, v, x = trtllm_mha(), deepseek_v4(), sparse(), linear()
    full = hybrid(decode=d, prefill=p, verify=v, draft_extend=x)
    want = {M.DECODE: d, M.TARGET_VERIFY: v, M.DRAFT_EXTEND: x, M.EXTEND: p, M.IDLE: d}[mode]
    assert full.read_effect(mode) == want.read_effect(mode)
    short = hybrid(decode=d, prefill=p)
    want = p if mode is M.EXTEND else d
    assert short.read_effect(mode) == want.read_effect(mode)


def test_hybrid_decode_is_not_joined_with_prefill():
    h = hybrid(decode=trtllm_mha(), prefill=deepseek_v4())
    assert h.read_effect(M.DECODE) == ReadEffect.of(
        {"req_to_token": PRE, "seq_lens": PRE, "swa_map": PRE})
    assert h.read_effect(M.EXTEND) == ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE})


@pytest.mark.parametrize("mode", list(M), ids=str)
def test_hybrid_linear_and_minimax_give_the_join(mode):
    a, b = trtllm_mha(), linear()
    assert hybrid_linear(a, b, pattern="0111").read_effect(mode) == a.read_effect(mode) | b.read_effect(mode)
    s, d = sparse(), dense()
    assert minimax(s, d).read_effect(mode) == s.read_effect(mode) | d.read_effect(mode)


def test_buffers_end_at_different_stages_in_one_composition():
    """What the per-buffer fence policy exploits."""
    e = hybrid_linear(trtllm_mha(), linear()).read_effect(M.DECODE)
    assert e == ReadEffect.of({"req_to_token": PRE, "seq_lens": PRE, "swa_map": PRE, "state_slots": IN})
    e = minimax(sparse(), dense()).read_effect(M.DECODE)
    assert e == ReadEffect.of({"req_to_token": POST, "seq_lens": IN})


def test_leaf_declaration_table():
    table = {
        "paged": [{"r": IN, "l": IN}, {"r": IN, "l": IN}, UNK, UNK, UNK],
        "trtllm_mha": [{"r": PRE, "l": PRE, "s": PRE}, {"r": IN, "l": IN, "s": IN},
                       {"r": POST, "l": PRE, "s": PRE}, UNK, UNK],
        "deepseek_v4": [{"r": IN, "l": IN}, {"r": POST, "l": IN}, UNK, {"r": PRE, "l": PRE}, UNK],
        "linear": [{"t": IN}, {"t": IN}, UNK, UNK, UNK],
        "sparse": [{"r": POST, "l": IN}, {"r": POST, "l": IN}, UNK, UNK, UNK],
        "dense": [{"r": PRE, "l": PRE}] * 4 + [UNK],
    }
    names = {"r": "req_to_token", "l": "seq_lens", "s": "swa_map", "t": "state_slots"}
    ctors = {"paged": paged, "trtllm_mha": trtllm_mha, "deepseek_v4": deepseek_v4, "linear": linear,
             "sparse": sparse, "dense": dense}
    for name, row in table.items():
        for mode, want in zip(M, row):
            want = ReadEffect.unknown() if want is UNK else ReadEffect.of({names[k]: e for k, e in want.items()})
            assert ctors[name]().read_effect(mode) == want, (name, mode)


# -- bad input ---------------------------------------------------------------------------------


def test_read_effect_rejects_a_string_mode_by_name():
    with pytest.raises(TypeError, match=r"'decode'.*ForwardMode.DECODE"):
        paged().read_effect("decode")
    with pytest.raises(TypeError, match="ForwardMode"):
        tbo(paged()).read_end(3)


def test_combinators_reject_non_backends_and_bad_shapes():
    with pytest.raises(TypeError, match="argument 1 must be a Backend"):
        join(paged(), "paged")
    with pytest.raises(ValueError, match="no backend for modes"):
        select({M.DECODE: paged()})
    with pytest.raises(ValueError, match="at least one"):
        join()
    with pytest.raises(ValueError, match="pattern"):
        hybrid_linear(paged(), linear(), pattern="012")
    with pytest.raises(TypeError, match="combinator"):
        from readfence.backends import redeclare
        redeclare(tbo(paged()), lambda m: ReadEffect.none())


def test_backends_are_immutable_values():
    b = tbo(paged(), linear())
    with pytest.raises(AttributeError):
        b.head = "x"
    assert b == tbo(paged(), linear()) and hash(b) == hash(tbo(paged(), linear()))
    assert b != tbo(linear(), paged())
    assert isinstance(b, Backend) and len({b, tbo(paged(), linear())}) == 1
