"""No verdict outlives what it was made for: a cached trace, validation or verdict belongs to the
Python values the backend's code reads, and a captured graph to the very tensors the backend keeps.

Each backend here changes something between two lowerings that readfence caches by: a setting its
code reads (a module's flag, a closure's variable, an attribute of the kernel object, a config
dataclass's field, a class attribute, a default argument, an attribute of a module it imports), or
a buffer it keeps (regrown, replaced or resized in place while a larger batch size is lowered).
Every check compares the lowered run with the serial run of the backend as it is now.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, NotGraphSafe, StepInputs, audit, clear_trace_cache, run_step
from readfence.core.internal import CACHES, StaleCaptureError, UnkeptCaptureError, code_key
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import (
    LowerOptions,
    Policy,
    Traffic,
    lower,
    lower_capture_list,
    run_overlapped,
    run_serial,
    run_serve,
    run_serve_serial,
)
from readfence.graph.devices import StreamError
from readfence.graph.fuzz import FUZZ_CONFIG as CFG
from readfence.graph.lowering import UnsoundLowering, make_state

M = ForwardMode
PRE = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})
DECLARED = {M.DECODE: PRE, M.EXTEND: PRE}


def _snapshot(mode, shared, batch):
    return page_meta(shared, batch)


def _attention(pools, layer, batch, meta, mode, q, k, v, lens=None):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"] if lens is None else lens)


# -- settings the code reads ---------------------------------------------------------------------
SCALE = 1.0


@dataclasses.dataclass
class Config:
    scale: float = 1.0


CONFIG = Config()
SETTINGS = types.ModuleType("stale_settings")  # a module the code imports and reads an attribute of
SETTINGS.scale = 1.0


def _global_flag() -> tuple[Any, Callable[[float], None]]:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * SCALE

    def change(value: float) -> None:
        global SCALE
        SCALE = value

    return leaf("by_global", attend, prepare_out_graph=_snapshot, declare=DECLARED), change


def _closure_cell() -> tuple[Any, Callable[[float], None]]:
    scale = 1.0

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * scale

    def change(value: float) -> None:
        nonlocal scale
        scale = value

    return leaf("by_closure", attend, prepare_out_graph=_snapshot, declare=DECLARED), change


class _Kernel:
    bias = 0.0  # a class attribute

    def __init__(self) -> None:
        self.scale = 1.0

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * self.scale + self.bias


def _attribute() -> tuple[Any, Callable[[float], None]]:
    kernel = _Kernel()
    return (leaf("by_attribute", kernel.attend, prepare_out_graph=_snapshot, declare=DECLARED),
            lambda value: setattr(kernel, "scale", value))


def _class_attribute() -> tuple[Any, Callable[[float], None]]:
    class Kernel(_Kernel):
        pass

    return (leaf("by_class", Kernel().attend, prepare_out_graph=_snapshot, declare=DECLARED),
            lambda value: setattr(Kernel, "bias", value))


def _config_field() -> tuple[Any, Callable[[float], None]]:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * CONFIG.scale

    CONFIG.scale = 1.0
    return (leaf("by_config", attend, prepare_out_graph=_snapshot, declare=DECLARED),
            lambda value: setattr(CONFIG, "scale", value))


def _module_attribute() -> tuple[Any, Callable[[float], None]]:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * SETTINGS.scale

    SETTINGS.scale = 1.0
    return (leaf("by_module", attend, prepare_out_graph=_snapshot, declare=DECLARED),
            lambda value: setattr(SETTINGS, "scale", value))


def _default_argument() -> tuple[Any, Callable[[float], None]]:
    def attend(mode, layer, q, k, v, pools, shared, batch, meta, scale=1.0):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * scale

    def change(value: float) -> None:
        attend.__defaults__ = (value,)

    return leaf("by_default", attend, prepare_out_graph=_snapshot, declare=DECLARED), change


SETTING_SPELLINGS = [_global_flag, _closure_cell, _attribute, _class_attribute, _config_field, _module_attribute,
                     _default_argument]


@pytest.fixture(autouse=True)
def _settings_restored():
    global SCALE
    clear_trace_cache()
    yield
    SCALE, CONFIG.scale, SETTINGS.scale, _Kernel.bias = 1.0, 1.0, 1.0, 0.0
    clear_trace_cache()


def _matches_serial(backend: Any, dev: Any, policy: Policy = Policy.PER_BUFFER) -> bool:
    run = run_overlapped(backend, steps=2, policy=policy, device=dev, batch_size=2, cfg=CFG)
    return run.matches(run_serial(backend, steps=2, batch_size=2, cfg=CFG)) and run.violations == ()


@pytest.mark.parametrize("spelling", SETTING_SPELLINGS, ids=lambda f: f.__name__.strip("_"))
def test_a_setting_changed_between_two_lowerings_is_lowered_anew(spelling, dev) -> None:
    backend, change = spelling()
    assert _matches_serial(backend, dev)
    change(2.0)
    assert _matches_serial(backend, dev)  # not the graph of the first value, replayed
    change(1.0)
    assert _matches_serial(backend, dev)


@pytest.mark.parametrize("spelling", [_global_flag, _attribute, _config_field], ids=lambda f: f.__name__.strip("_"))
def test_a_setting_changed_between_an_audit_and_a_lowering_is_traced_anew(spelling, dev) -> None:
    backend, change = spelling()
    assert audit(backend, M.DECODE, cfg=CFG, batch_sizes=[2]).unwrap().sound
    change(3.0)
    assert _matches_serial(backend, dev)  # neither refused (a stale trace beside new Python) nor wrong


def test_an_unchanged_backend_hits_every_cache_and_a_setting_set_back_hits_its_first_trace(dev) -> None:
    backend, change = _attribute()
    traces, validated = CACHES["traces"], CACHES["validated"]
    state = make_state(CFG)

    def lowered() -> tuple[int, int]:
        before = (traces.stats.misses, validated.stats.misses)
        lower(backend, M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG, state=state)
        return traces.stats.misses - before[0], validated.stats.misses - before[1]

    assert lowered() == (1, 1)  # traced and validated once
    assert lowered() == (0, 0) and lowered() == (0, 0)  # unchanged: every cache hit
    change(2.0)
    assert lowered() == (1, 1)
    change(1.0)
    assert lowered() == (0, 0)  # the first value's trace and validation again


class _Holder:
    scale = 1.0


HOLDER = _Holder()


def _unseen_setting() -> tuple[Any, Callable[[float], None]]:
    name = "".join(["sc", "ale"])  # read through a name no code spells: no walk of the code finds it

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * getattr(HOLDER, name)

    return (leaf("unseen", attend, prepare_out_graph=_snapshot, declare=DECLARED),
            lambda value: setattr(HOLDER, "scale", value))


def test_a_setting_no_key_holds_is_caught_where_a_validated_capture_is_checked_again(dev) -> None:
    backend, change = _unseen_setting()
    traces = CACHES["traces"]
    try:
        assert _matches_serial(backend, dev)
        key = code_key(backend)
        change(2.0)
        assert code_key(backend) == key  # the key cannot see it ...
        made = traces.stats.misses
        assert _matches_serial(backend, dev)  # ... the check of the capture on one more state does
        assert traces.stats.misses == made + 1  # traced again, once
    finally:
        HOLDER.scale = 1.0


def test_a_setting_no_key_holds_is_caught_where_the_capture_passed_before_with_other_code(dev) -> None:
    # the trace passed with the compiled code; lowered without the compile passes, its plain code
    # is validated for the first time: a difference there, in a program that passed before, is
    # the stale trace's (traced again), not the backend's (refused)
    backend, change = _unseen_setting()
    traces = CACHES["traces"]
    try:
        first = lower(backend, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG)
        change(2.0)
        made = traces.stats.misses
        plain = lower(backend, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG,
                      lowering=LowerOptions(optimize=False))
        assert traces.stats.misses == made + 1 and plain.program is not first.program
        assert not plain.optimized
    finally:
        HOLDER.scale = 1.0


# -- a setting that moves a read ---------------------------------------------------------------------
SNAPSHOT = True


def _moving_read() -> Any:
    # with SNAPSHOT the lengths are copied before the replay (PRE_REPLAY, as declared); without it
    # the body reads the live lengths: the same values, read later than declared
    def prepare(mode, shared, batch):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        lens = meta["kv_lens"] if SNAPSHOT else shared["seq_lens"].index_select(0, batch["req_pool_indices"])
        return _attention(pools, layer, batch, meta, mode, q, k, v, lens)

    return leaf("moving", attend, prepare_out_graph=prepare, declare=DECLARED)


@pytest.mark.parametrize("first", ["lower", "audit"])
def test_a_setting_that_moves_a_read_past_the_declaration_is_refused_after_it_changed(first: str, dev) -> None:
    global SNAPSHOT
    backend, state = _moving_read(), make_state(CFG)
    try:
        if first == "lower":
            lower(backend, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=state)
        else:
            assert audit(backend, M.DECODE, cfg=CFG, batch_sizes=[2], state=state).unwrap().sound
        SNAPSHOT = False
        with pytest.raises(UnsoundLowering, match="seq_lens"):
            lower(backend, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=state)
        assert audit(backend, M.DECODE, cfg=CFG, batch_sizes=[2], state=state).failure().buffer == "seq_lens"
    finally:
        SNAPSHOT = True


# -- buffers the backend keeps -----------------------------------------------------------------------
class _Regrown:
    """Keeps the lengths in a metadata buffer of its own, sized for the largest batch it has seen:
    written out of the graph every step, read in the graph. ``how`` is how it grows the buffer:
    ``replace`` (a new tensor on ``self``), ``dict`` (a new tensor in a dict it keeps), ``resize``
    (``resize_`` in place; the body reads it through a shape taken from the buffer), ``global`` (a
    module global rebound), ``deque`` (a new tensor appended to a one-slot deque it keeps)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.lens = torch.zeros(1, dtype=torch.int64)
        self.meta = {"lens": torch.zeros(1, dtype=torch.int64)}
        self.lens_queue = collections.deque([torch.zeros(1, dtype=torch.int64)], maxlen=1)

    def buffer(self) -> torch.Tensor:
        if self.how == "dict":
            return self.meta["lens"]
        if self.how == "deque":
            return self.lens_queue[-1]
        return _BUFFERS[id(self)] if self.how == "global" else self.lens

    def prepare_out_graph(self, mode, shared, batch):
        meta = page_meta(shared, batch)
        n = meta["kv_lens"].shape[0]
        if self.buffer().shape[0] < n:
            grown = torch.zeros(n, dtype=torch.int64)
            if self.how == "replace":
                self.lens = grown
            elif self.how == "dict":
                self.meta["lens"] = grown
            elif self.how == "global":
                _BUFFERS[id(self)] = grown
            elif self.how == "deque":
                self.lens_queue.append(grown)
            else:
                self.lens.resize_(n)
        self.buffer()[:n].copy_(meta["kv_lens"])
        return {"kv_indices": meta["kv_indices"]}

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        n = meta["kv_indices"].shape[0]
        held = self.buffer()
        lens = held.reshape(held.shape[0], 1)[:n, 0]  # (a shape taken from the buffer: a graph bakes it)
        return _attention(pools, layer, batch, meta, mode, q, k, v, lens)


_BUFFERS: dict[int, torch.Tensor] = {}


def _regrown(how: str) -> Any:
    kernel = _Regrown(how)
    _BUFFERS[id(kernel)] = torch.zeros(1, dtype=torch.int64)
    return leaf("regrown", kernel.attend, prepare_out_graph=kernel.prepare_out_graph, declare=DECLARED)


GROWN = ["replace", "dict", "resize", "global", "deque"]
TRAFFIC = Traffic(rate=1.0, prompt=(4, 8), output=(2, 6))


@pytest.mark.slow
@pytest.mark.parametrize("how", GROWN)
def test_the_serving_loop_never_replays_a_graph_over_a_buffer_regrown_since(how: str, dev) -> None:
    res = run_serve(_regrown(how), steps=14, policy=Policy.PER_BUFFER, device=dev, traffic=TRAFFIC,
                    capture_sizes=[1, 2, 4], cfg=CFG)
    ref = run_serve_serial(_regrown(how), steps=14, traffic=TRAFFIC, capture_sizes=[1, 2, 4], cfg=CFG)
    assert res.decode_steps > 0 and min(res.batch_sizes) < 4  # the smaller graphs ran
    assert res.matches(ref), res.first_difference(ref)


@pytest.mark.parametrize("how", ["replace", "resize", "deque"])
def test_a_capture_list_lowers_again_the_sizes_whose_buffer_was_regrown(how: str, dev) -> None:
    backend = _regrown(how)
    graphs = lower_capture_list(backend, M.DECODE, [1, 2, 4], device=dev, policy=Policy.PER_BUFFER, cfg=CFG)
    assert all(graphs[size].stale() is None for size in graphs)
    assert graphs.seconds[1] > 0  # (lowered twice: its seconds add up)
    for size in graphs:  # each graph reads what the backend's Python writes now: as the serial step
        low = graphs[size]
        batch = _batch(low)
        pools = {k: v.clone() for k, v in low.pools.items()}
        out = low.run(batch, step=0).result(30.0)
        expected = run_step(backend, M.DECODE, low.cfg, StepInputs(
            shared={k: v.clone() for k, v in low.shared.items()}, batch=batch, pools=pools, params=low.params))
        assert torch.equal(out, expected)


def _batch(low: Any) -> dict[str, torch.Tensor]:
    from readfence.graph import Scheduler

    nxt = Scheduler(low.cfg, M.DECODE, low.batch_size, seed=low.batch_size).next_step()
    for b, t in nxt.shared.items():
        low.shared[b].copy_(t)
    return nxt.batch


@pytest.mark.parametrize("how", GROWN)
def test_a_lowered_graph_refuses_to_replay_over_a_buffer_regrown_since(how: str, dev) -> None:
    backend, state = _regrown(how), make_state(CFG)
    small = lower(backend, M.DECODE, batch_size=1, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=state)
    assert small.stale() is None
    lower(backend, M.DECODE, batch_size=4, device=dev, policy=Policy.PER_BUFFER, cfg=CFG, state=state)
    stale = small.stale()
    assert isinstance(stale, StaleCaptureError) and stale.backend == "regrown" and stale.stage == "body"
    assert ("lens" in stale.kept or "_BUFFERS" in stale.kept) and "would read the old buffer" in str(stale)
    run = small.run(_batch(small), step=0)
    with pytest.raises(StreamError) as refused:
        run.result(30.0)
    assert isinstance(refused.value.original, StaleCaptureError)


class _Unkept(_Regrown):
    """:class:`_Regrown`'s buffer kept where no walk of the backend's values finds it again: ``cache``
    (a one-entry ``functools.lru_cache`` keyed by the size), ``thread`` (a ``threading.local``),
    ``computed`` (an attribute whose name is built at run time), filled by ``prepare_out_graph``."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.local = threading.local()
        self.sized = functools.lru_cache(maxsize=1)(lambda n: torch.zeros(n, dtype=torch.int64))
        setattr(self, "".join(["kept", "_lens"]), torch.zeros(1, dtype=torch.int64))

    def held(self, n: int) -> torch.Tensor:
        if self.how == "cache":
            return self.sized(n)
        name = "".join(["kept", "_lens"])
        now = getattr(self.local, "lens", None) if self.how == "thread" else getattr(self, name)
        if now is None or now.shape[0] < n:
            now = torch.zeros(n, dtype=torch.int64)
            if self.how == "thread":
                self.local.lens = now
            else:
                setattr(self, name, now)
        return now

    def prepare_out_graph(self, mode, shared, batch):
        meta = page_meta(shared, batch)
        self.held(meta["kv_lens"].shape[0])[: meta["kv_lens"].shape[0]].copy_(meta["kv_lens"])
        return meta

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        n = meta["kv_indices"].shape[0]
        return _attention(pools, layer, batch, meta, mode, q, k, v, self.held(n)[:n])


def _unkept(how: str) -> Any:
    kernel = _Unkept(how)
    return leaf("unkept", kernel.attend, prepare_out_graph=kernel.prepare_out_graph, declare=DECLARED)


def _matches_eager(backend: Any, graphs: Any) -> bool:
    """Whether every graph of ``graphs`` computes the serial step of ``backend`` on a fresh batch."""
    same = []
    for size in graphs:
        low = graphs[size]
        batch = _batch(low)
        expected = run_step(backend, M.DECODE, low.cfg, StepInputs(
            shared={k: v.clone() for k, v in low.shared.items()}, batch=batch,
            pools={k: v.clone() for k, v in low.pools.items()}, params=low.params))
        same.append(torch.equal(low.run(batch, step=0).result(30.0), expected))
    return all(same)


@pytest.mark.parametrize("how", ["cache", "thread", "computed"])
def test_a_buffer_the_step_s_python_fills_kept_where_no_walk_finds_it_is_refused_under_every_policy(how, dev) -> None:
    for policy in Policy:
        with pytest.raises(UnkeptCaptureError) as refused:
            lower(_unkept(how), M.DECODE, batch_size=2, device=dev, policy=policy, cfg=CFG)
        assert refused.value.backend == "unkept" and refused.value.stage == "body"
        assert "prepare_out_graph fills on every step" in str(refused.value)


def test_an_unkept_buffer_the_refusal_lets_through_is_read_stale_by_a_smaller_size(dev, monkeypatch) -> None:
    # the refusal off: the size-1 graph reads the buffer the size-4 lowering replaced (the serial step,
    # an independent check, differs), so the refusal is what keeps it from running
    from readfence.graph.lowering import _kept

    monkeypatch.setattr(_kept, "kept_tensors", lambda *a: ())
    backend = _unkept("cache")
    graphs = lower_capture_list(backend, M.DECODE, [1, 4], device=dev, policy=Policy.COARSE, cfg=CFG)
    assert not _matches_eager(backend, graphs)


def test_a_backend_that_allocates_for_the_largest_batch_is_lowered_once_per_size(dev) -> None:
    class Preallocated(_Regrown):
        def __init__(self) -> None:
            super().__init__("replace")
            self.lens = torch.zeros(CFG.max_reqs, dtype=torch.int64)

    kernel = Preallocated()
    backend = leaf("preallocated", kernel.attend, prepare_out_graph=kernel.prepare_out_graph, declare=DECLARED)
    traces = CACHES["traces"]
    before = traces.stats.misses
    graphs = lower_capture_list(backend, M.DECODE, [1, 2, 4], device=dev, policy=Policy.PER_BUFFER, cfg=CFG)
    assert traces.stats.misses - before == 3 and all(graphs[s].stale() is None for s in graphs)
    res = run_serve(backend, steps=10, policy=Policy.PER_BUFFER, device=dev, traffic=TRAFFIC, capture_sizes=[1, 2, 4],
                    cfg=CFG)
    kernel2 = Preallocated()
    again = leaf("preallocated", kernel2.attend, prepare_out_graph=kernel2.prepare_out_graph, declare=DECLARED)
    assert res.matches(run_serve_serial(again, steps=10, traffic=TRAFFIC, capture_sizes=[1, 2, 4], cfg=CFG))


def test_an_attribute_of_an_engine_object_changed_between_two_lowerings_is_lowered_anew(dev) -> None:
    from readfence.engine import adapt
    from tests.engine.classes import KeptCopies
    from tests.engine.conftest import CFG as ENGINE_CFG

    class Scaled(KeptCopies):
        def __init__(self, runner) -> None:
            super().__init__(runner)
            self.scale = 1.0

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            return super().forward(q, k, v, layer, forward_batch, save_kv_cache) * self.scale

    engine = adapt(Scaled, cfg=ENGINE_CFG)
    traces = CACHES["traces"]

    def matches() -> bool:
        serial = run_serial(engine, steps=2, batch_size=2, cfg=ENGINE_CFG, state=engine.state)
        run = run_overlapped(engine, steps=2, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=ENGINE_CFG,
                             state=engine.state)
        return run.matches(serial) and run.violations == ()

    assert matches()
    key = code_key(engine)
    engine.object.scale = 2.0
    assert code_key(engine) != key  # the object's attribute is part of the key
    made = traces.stats.misses
    assert matches() and traces.stats.misses > made


# -- a setting no key holds, whose change shows on some states only ------------------------------
class _Metadata:
    """What a backend fills every step (an engine's per-step metadata object)."""

    window = 0


WINDOWS = numpy.array([1])  # a setting changed in place: no key holds an array's contents


class _Windowed:
    """A body that scales the requests shorter than a window (a threshold only short requests
    cross): its window is an attribute whose name the out-of-graph stage assigns on another object
    every step (per-step state, to the walk of its code), or an array's entry."""

    def __init__(self, window: int, by_array: bool) -> None:
        self.window, self.by_array = window, by_array

    def out(self, mode, shared, batch):
        md = _Metadata()
        md.window = 0  # the same name, another object
        return page_meta(shared, batch)

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        out = _attention(pools, layer, batch, meta, mode, q, k, v)
        window = int(WINDOWS[0]) if self.by_array else self.window
        scale = (meta["kv_lens"] < window).to(out.dtype) + 1
        return out * scale.repeat_interleave(out.shape[0] // scale.shape[0]).view(-1, *([1] * (out.dim() - 1)))


@pytest.mark.parametrize("by_array", [False, True], ids=["attribute_assigned_elsewhere", "array_entry"])
def test_a_setting_no_key_holds_whose_change_shows_on_short_requests_only_is_caught(by_array, dev) -> None:
    # a validated capture used again is checked on every generated state, not on one: the change
    # shows where a request is short, which the longest-context state alone never has
    windowed = _Windowed(1, by_array)
    backend = leaf("windowed", windowed.attend, prepare_out_graph=windowed.out, declare=DECLARED)
    traces = CACHES["traces"]
    before = run_serial(backend, steps=2, batch_size=2, cfg=CFG).logits
    try:
        assert _matches_serial(backend, dev, Policy.COARSE)
        key = code_key(backend)
        windowed.window, WINDOWS[0] = 10, 10
        assert code_key(backend) == key  # the key cannot see it ...
        after = run_serial(backend, steps=2, batch_size=2, cfg=CFG).logits
        assert not all(torch.equal(a, b) for a, b in zip(before, after))  # (the change matters on this traffic)
        made = traces.stats.misses
        assert _matches_serial(backend, dev, Policy.COARSE)  # ... the capture's check on every state does
        assert traces.stats.misses == made + 1  # traced again, once
    finally:
        WINDOWS[0] = 1


def _rows_in_order(mode, shared, batch, meta):
    # a Python value from the order of the batch's rows (a count the tracer cannot see), baked
    rows = batch["req_pool_indices"]
    steps = rows[1:] - rows[:-1]
    ordered = int(torch.nonzero(((steps >= 0).all() | (steps <= 0).all()).reshape(1)).shape[0])
    return {**page_meta(shared, batch), "scale": torch.tensor(1.0 if ordered else 0.5)}


def test_a_capture_found_wrong_on_a_state_stays_refused_whatever_is_asked_later(dev) -> None:
    # at batch size 3 the rows are in order on the trace's example and on every generated state,
    # not on the state a later lowering checks again: the first lowering accepts it (a documented
    # limit), the next finds the difference, traces again, checks the fresh trace there too, and
    # refuses it; so does every later lowering, on whatever states it asks
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return _attention(pools, layer, batch, meta, mode, q, k, v) * meta["scale"]

    backend = leaf("rows_in_order", attend, prepare_in_graph=_rows_in_order, reads=["req_to_token", "seq_lens"])
    lower(backend, M.DECODE, batch_size=3, device=dev, policy=Policy.COARSE, cfg=CFG)
    for policy in (Policy.COARSE, Policy.COARSE, Policy.PER_BUFFER):
        with pytest.raises(NotGraphSafe, match="meta_in.scale") as refused:
            lower(backend, M.DECODE, batch_size=3, device=dev, policy=policy, cfg=CFG)
        assert type(refused.value) is NotGraphSafe and "_rows_in_order" in refused.value.line, refused.value


class _OutOfOrder:
    """A setting (``scale``, read by an attribute whose name the out-of-graph stage assigns on another
    object) applied to the requests whose rows are out of order: at batch size 3 only the state a
    later lowering checks again has such rows."""

    def __init__(self) -> None:
        self.scale = 1.0

    def out(self, mode, shared, batch):
        md = _Metadata()
        md.scale = 0.0  # the same name, another object
        return page_meta(shared, batch)

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        rows = batch["req_pool_indices"]
        steps = rows[1:] - rows[:-1]
        unordered = ~((steps >= 0).all() | (steps <= 0).all())
        return _attention(pools, layer, batch, meta, mode, q, k, v) * torch.where(unordered, self.scale, 1.0)


def test_a_stale_trace_is_traced_again_not_taken_for_readfence_s_miscompile(dev) -> None:
    # the changed setting shows on the recheck's state alone: the old trace differs there, which is
    # its staleness (traced again, and the fresh trace validated there too), not a fault of the
    # compile passes (whose fallback, the code without them, would pass on the other states)
    kept = _OutOfOrder()
    backend = leaf("out_of_order", kept.attend, prepare_out_graph=kept.out, declare=DECLARED)
    assert lower(backend, M.DECODE, batch_size=3, device=dev, policy=Policy.COARSE, cfg=CFG).optimized
    kept.scale = 2.0
    traces = CACHES["traces"]
    made = traces.stats.misses
    assert lower(backend, M.DECODE, batch_size=3, device=dev, policy=Policy.COARSE, cfg=CFG).optimized
    assert traces.stats.misses == made + 1
