"""Poison on release (``graph.lowering._poison``): the poisons break every relation a late reader
could use, not only the values, and stay in range.

* the family: every poison lies in the buffer's range with its shape and dtype; the constant ones
  are the ends of the range; the reversed ones reverse every strict comparison, order ties one
  way and the other, and are distinct when the range holds the buffer;
* the guarantee: every comparison of two elements (``==``, ``<``, ``<=``) changes under some
  poison, every monotone aggregate of any subset of in-range values (sum, max, min, a count above
  a threshold) under a constant one, and each poison is the only one to change some reader;
* :class:`CheckState` takes the poisons in turn, restores what the scheduler wrote, holds the
  buffers ``only`` leaves out, and switches poison or the guard off on its own;
* end to end, as a user writes them: four backends that read ``seq_lens`` after its fence and use
  the late value only through equalities, only its order, only its sum, only its maximum. Poison
  alone (observer and guard off) catches each, declared too early or reading through a plan/run
  kernel no static analysis sees; the rotation poison this family replaced verifies every one
  of them clean (kept here as the oracle that shows these tests fail on it).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import readfence.graph.lowering._poison as poison_module
from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.backends.fuzz import keep, planned_gather
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig, make_shared_state
from readfence.core._state import buffer_ranges
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CheckState, LoopOptions, Policy, make_state, verify
from readfence.graph.lowering import POISONS, poison_family
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode
STEPS, BATCH = 4, 4
REVERSED, HIGHEST, SWAPPED, LOWEST = range(4)


@st.composite
def buffers(draw, *, in_range: bool = False):
    """``(values, lo, hi)``: a 1-d or 2-d int32 buffer and its range; values may lie outside
    the range (the scheduler leaves unused lengths at 0) unless ``in_range``."""
    lo = draw(st.integers(-3, 5))
    hi = lo + draw(st.integers(2, 40))
    shape = draw(st.sampled_from([(draw(st.integers(1, 24)),), (draw(st.integers(1, 4)), draw(st.integers(1, 6)))]))
    n = shape[0] * (shape[1] if len(shape) > 1 else 1)
    low, high = (lo, hi - 1) if in_range else (lo - 2, hi + 1)
    values = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.int32).view(shape), lo, hi


def _pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = values.reshape(-1).long()
    return flat.unsqueeze(1), flat.unsqueeze(0)  # [n, 1], [1, n]: pair (i, j) at [i, j]


# -- the family ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None, database=None)
@given(buffers())
def test_every_poison_lies_in_the_range_with_the_buffers_shape_and_dtype(buf) -> None:
    values, lo, hi = buf
    family = poison_family(values, lo, hi)
    assert len(family) == len(POISONS)
    for p in family:
        assert p.shape == values.shape and p.dtype == values.dtype
        assert bool(((p >= lo) & (p < hi)).all()), (values.tolist(), lo, hi, p.tolist())


@settings(max_examples=200, deadline=None, database=None)
@given(buffers())
def test_the_constant_poisons_are_the_ends_of_the_range(buf) -> None:
    values, lo, hi = buf
    family = poison_family(values, lo, hi)
    assert set(family[HIGHEST].reshape(-1).tolist()) == {hi - 1}
    assert set(family[LOWEST].reshape(-1).tolist()) == {lo}


@settings(max_examples=200, deadline=None, database=None)
@given(buffers())
def test_the_reversed_poisons_reverse_every_strict_comparison_and_order_ties_both_ways(buf) -> None:
    values, lo, hi = buf
    family = poison_family(values, lo, hi)
    xi, xj = _pairs(values)
    n = xi.shape[0]
    before = torch.arange(n).unsqueeze(1) < torch.arange(n).unsqueeze(0)  # i < j
    distinct = hi - lo >= n
    for which, tie in ((REVERSED, 1), (SWAPPED, -1)):
        pi, pj = _pairs(family[which])
        # monotone reversal always; strict (and ties ordered) when the values can be distinct
        assert bool((pi >= pj)[xi < xj].all())
        if distinct:
            assert bool((pi > pj)[xi < xj].all())
            assert bool(((pi - pj) * tie > 0)[(xi == xj) & before].all())
            assert len(set(family[which].reshape(-1).tolist())) == n


@settings(max_examples=200, deadline=None, database=None)
@given(buffers())
def test_every_comparison_of_two_elements_changes_under_some_poison(buf) -> None:
    values, lo, hi = buf
    xi, xj = _pairs(values)
    n = xi.shape[0]
    if hi - lo < n:  # the reversed poisons cannot be distinct: the guarantee does not hold
        return
    other = ~torch.eye(n, dtype=torch.bool)
    for compare in (torch.eq, torch.lt, torch.le):
        truth = compare(xi, xj)
        changed = torch.zeros_like(truth)
        for p in poison_family(values, lo, hi):
            pi, pj = _pairs(p)
            changed |= compare(pi, pj) != truth
        assert bool(changed[other].all()), (compare.__name__, values.tolist(), lo, hi)


@settings(max_examples=200, deadline=None, database=None)
@given(buffers(in_range=True), st.data())
def test_every_monotone_aggregate_of_any_subset_changes_under_a_constant_poison(buf, data) -> None:
    values, lo, hi = buf
    flat = values.reshape(-1)
    subset = data.draw(st.lists(st.integers(0, flat.numel() - 1), min_size=1, unique=True))
    threshold = data.draw(st.integers(lo, hi - 2))  # a count above it is not constant on the range
    family = poison_family(values, lo, hi)
    aggregates = {"sum": lambda t: int(t.sum()), "max": lambda t: int(t.max()), "min": lambda t: int(t.min()),
                  "count above": lambda t: int((t > threshold).sum())}
    for name, g in aggregates.items():
        seen = g(flat[subset])
        assert seen != g(family[LOWEST].reshape(-1)[subset]) or seen != g(family[HIGHEST].reshape(-1)[subset]), name


def test_each_poison_is_the_only_one_to_change_some_reader() -> None:
    # four late readers of lengths [3, 1, 3, 8] within [1, 9); each one's output changes under
    # exactly one poison, so none of the four could be dropped
    lens = torch.tensor([3, 1, 3, 8], dtype=torch.int32)
    readers = {
        REVERSED: lambda t: bool(t[0] > t[2]),  # a tie, ordered by position
        HIGHEST: lambda t: bool(t.min() < 8),  # the shortest request is not full
        SWAPPED: lambda t: bool(t[2] > t[0]),  # the same tie the other way
        LOWEST: lambda t: bool(t.max() > 1),  # some request has more than one token
    }
    family = poison_family(lens, 1, 9)
    for which, reader in readers.items():
        changed = [k for k, p in enumerate(family) if reader(p) != reader(lens)]
        assert changed == [which], (POISONS[which], changed)


def _rotation(values: torch.Tensor, lo: int, hi: int, shift: int) -> torch.Tensor:
    return ((values.long() - lo + shift) % (hi - lo) + lo).to(values.dtype)


def test_a_rotation_keeps_every_equality_and_the_family_does_not() -> None:
    # why a bijection of the range is not enough: the equalities between lengths survive it
    lens = torch.tensor([3, 1, 3, 8], dtype=torch.int32)
    xi, xj = _pairs(lens)
    for shift in (1, 5):
        ri, rj = _pairs(_rotation(lens, 1, 9, shift))
        assert torch.equal(ri == rj, xi == xj)
    assert any(not torch.equal(pi == pj, xi == xj) for pi, pj in map(_pairs, poison_family(lens, 1, 9)))


def test_poison_family_refuses_an_empty_range() -> None:
    with pytest.raises(ValueError, match=r"lo < hi, got \[3, 3\)"):
        poison_family(torch.zeros(2, dtype=torch.int32), 3, 3)


# -- CheckState ----------------------------------------------------------------------------
def _scheduled(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    live = make_shared_state(cfg)
    live["seq_lens"].copy_(torch.arange(len(live["seq_lens"]), dtype=torch.int32) % 3 + 1)  # with ties
    return live


def _steps(check: CheckState, live, steps: int = 4) -> list[dict[str, list[int]]]:
    """What a body reading every buffer after its release point sees at each step."""
    for b in SHARED_BUFFERS:
        check.expected[b].copy_(live[b])
    seen = []
    for step in range(steps):
        check.start(step)
        check.arm(SHARED_BUFFERS)
        check.poisoner(SHARED_BUFFERS)()
        seen.append({b: live[b].reshape(-1).tolist() for b in SHARED_BUFFERS})
        check.restorer()()
        check.finish(step)
    return seen


def test_the_check_takes_the_poisons_in_turn_and_restores_what_the_scheduler_wrote() -> None:
    cfg = ModelConfig(max_reqs=4, max_ctx=8)
    live = _scheduled(cfg)
    before = {b: live[b].clone() for b in SHARED_BUFFERS}
    check = CheckState(live, cfg)
    seen = _steps(check, live, steps=8)
    ranges = buffer_ranges(cfg)
    for step, values in enumerate(seen):
        for b in SHARED_BUFFERS:
            lo, hi = ranges[b]
            want = poison_family(before[b], lo, hi)[step % len(POISONS)]
            assert values[b] == want.reshape(-1).tolist(), (step, b)
    assert all(torch.equal(live[b], before[b]) for b in SHARED_BUFFERS)
    assert check.moved_buffers() == []


def test_only_holds_every_other_buffer_and_poison_or_guard_switch_off_alone() -> None:
    cfg = ModelConfig(max_reqs=4, max_ctx=8)
    live = _scheduled(cfg)
    before = {b: live[b].reshape(-1).tolist() for b in SHARED_BUFFERS}
    held = _steps(CheckState(live, cfg, only=["seq_lens"]), live)
    assert all(s[b] == before[b] for s in held for b in SHARED_BUFFERS if b != "seq_lens")
    assert all(s["seq_lens"] != before["seq_lens"] for s in held)
    unpoisoned = _steps(CheckState(live, cfg, poison=False), live)
    assert all(s == before for s in unpoisoned)
    with pytest.raises(ValueError, match="names no shared buffer"):
        CheckState(live, cfg, only=["seq_len"])

    def written(guard: bool) -> list[tuple[int, str]]:
        check = CheckState(live, cfg, guard=guard)
        for b in SHARED_BUFFERS:
            check.expected[b].copy_(live[b])
        check.start(0)
        check.arm(SHARED_BUFFERS)
        live["state_slots"].add_(1).remainder_(cfg.num_state_slots)  # the forward writes before the release
        check.poisoner(SHARED_BUFFERS)()
        check.restorer()()
        check.finish(0)
        return check.moved_buffers()

    assert written(guard=True) == [(0, "state_slots")]
    assert written(guard=False) == []


# -- end to end: readers that use a late value only through one relation -------------------
def _equalities(late, out, lens):
    """Each request takes the output of the first request with the same length."""
    leader = (late.unsqueeze(0) == late.unsqueeze(1)).int().argmax(1)
    return out.index_select(0, leader), lens


def _order(late, out, lens):
    """The outputs come in the order of the lengths (shortest first, ties in batch order)."""
    return out.index_select(0, torch.argsort(late, stable=True)), lens


def _sum(late, out, lens):
    """A packed (varlen) kernel whose workspace holds the batch's total length: a request past
    it sees only the part that fits."""
    start = torch.cumsum(lens, 0) - lens
    return None, torch.minimum(torch.clamp(late.sum() - start, min=0), lens)


def _max(late, out, lens):
    """A kernel padding every request to the batch's longest length, masking past it."""
    return None, torch.minimum(lens, late.max())


READERS = {"equalities": _equalities, "order": _order, "sum": _sum, "max": _max}
VIAS = ("declared early", "plan/run")


def _reader(name: str, via: str, state) -> object:
    """A paged leaf whose body reads ``seq_lens`` again after its declared end (IN_REPLAY, where
    its metadata is read) and uses the late lengths only as ``READERS[name]`` does: through the
    stage's ``shared`` argument, or through a plan/run kernel reading the live buffer it keeps (no
    static analysis sees it; the audit's observer does, on the live state). Either declaration is
    unsound: lowered with the unsafe flag."""
    use = READERS[name]
    handle = keep(state["shared"]["seq_lens"]) if via == "plan/run" else None

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        rows = batch["req_pool_indices"]
        late = planned_gather(rows, handle) if handle is not None else shared["seq_lens"].index_select(0, rows).long()
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        picked, lens = use(late, out.reshape(rows.shape[0], -1, *out.shape[1:]), meta["kv_lens"])
        if picked is not None:
            return picked.reshape(out.shape)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    effect = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf(f"late_{name}", attend, prepare_in_graph=prep, declare={M.DECODE: effect, M.TARGET_VERIFY: effect})


def _verify(name: str, via: str, dev, seed: int = 0):
    state = make_state(CFG)
    return verify(_reader(name, via, state), M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                  state=state, policy=Policy.PER_BUFFER,
                  options=LoopOptions(seed=seed, checks={"poison"}, UNSAFE_skip_soundness_check=True))


CASES = list(itertools.product(READERS, VIAS))


@pytest.mark.parametrize(("name", "via"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_poison_alone_catches_a_reader_that_uses_the_late_value_only_through_one_relation(name, via, dev) -> None:
    for seed in (0, 1):
        bad = _verify(name, via, dev, seed).failure()
        assert (bad.kind, bad.evidence, bad.buffer) == ("late read", "poison", "seq_lens"), str(bad)
        assert bad.stage == "body" and 0 <= bad.step < STEPS  # the reader the step's ledger saw read it late


@pytest.mark.parametrize(("name", "via"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_the_rotation_poison_verifies_the_same_readers_clean(name, via, dev, monkeypatch) -> None:
    # The poison this family replaced: two rotations of the range, alternating step by step
    # (a bijection: equalities survive it, and on these small lengths nothing wraps, so order,
    # sum and maximum only grow). Every reader above races, yet verifies clean under it.
    def rotation(out, values, index, lo, span, which):
        out.copy_(_rotation(values, lo, lo + span, (1, span // 2 + 1)[which % 2] % span))

    monkeypatch.setattr(poison_module, "_poison_into", rotation)
    report = _verify(name, via, dev).unwrap()
    assert report.checks_run == ("poison",) and report.checks[0].poisoned
