"""The model's pieces around ``attend`` are recorded once per shape and spliced after that.

A spliced step must be the step recorded op by op and the step traced with make_fx, node for
node (names, values, source lines, reads, memory facts); the splice must really happen (fewer
ops reach the recorder); and a piece whose input is memory of a shared buffer (an ``attend``
that returns a view of one) must be recorded and observed op by op, its read found by the
trace, by the observer and by the audit alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from readfence.backends import (
    hybrid_linear,
    leaf,
    linear,
    page_meta,
    paged,
    softmax_attention,
    sparse,
    store_kv,
    tbo,
    trtllm_mha,
)
from readfence.core import BODY, ForwardMode, ModelConfig, _read_observer, audit, observe, step_functions
from readfence.core._program import SOURCE_KEY
from readfence.core._state import example_step
from readfence.core.tracing import _record, _segment
from readfence.core.tracing._trace import trace_step
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import lower
from tests.core.test_record import _same

M = ForwardMode


def _plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments run as the plain functions they wrap (no splice, nothing unobserved)."""
    monkeypatch.setattr(_segment.Segment, "__call__", lambda self, *tensors: self.fn(*tensors))


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ops reach the recorder, counted as they are recorded."""
    count = [0]
    record = _record.GraphRecorder._record

    def counting(self: Any, func: Any, args: Any, kwargs: Any) -> Any:
        count[0] += 1
        return record(self, func, args, kwargs)

    monkeypatch.setattr(_record.GraphRecorder, "_record", counting)
    return count


def _step(make: Any, mode: ForwardMode, layers: int, batch_size: int, *, recorded: bool = True) -> Any:
    cfg = ModelConfig(layers=layers)
    fns = step_functions(make(), mode, cfg)
    return trace_step(fns, mode, example_step(cfg, mode, batch_size).groups(), recorded=recorded)


def _sources(program: Any) -> list[list[str]]:
    """Every node's source line, stage by stage."""
    return [[str(n.meta.get(SOURCE_KEY)) for n in s.graph.gm.graph.nodes if n.op == "call_function"] for s in program.stages]


_TARGETS = [(lambda: hybrid_linear(trtllm_mha(), linear()), M.DECODE), (lambda: tbo(paged(), trtllm_mha()), M.TARGET_VERIFY),
            (paged, M.EXTEND), (sparse, M.DECODE)]


@pytest.mark.parametrize(("make", "mode", "batch_size"), [(*_TARGETS[0], 1), (*_TARGETS[0], 3), (*_TARGETS[1], 3), (*_TARGETS[2], 1),
                                                       (*_TARGETS[3], 2)],
                         ids=["hybrid_linear-1", "hybrid_linear-3", "tbo-3", "paged-extend-1", "sparse-2"])
def test_a_spliced_step_is_the_recorded_step_and_the_traced_step(make: Any, mode: ForwardMode, batch_size: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _segment.clear_templates()
    count = _counted(monkeypatch)
    forgotten: list[str] = []  # a template whose call does not match its run is forgotten
    forget = _segment._TEMPLATES.forget
    monkeypatch.setattr(_segment._TEMPLATES, "forget", lambda key: (forgotten.append(key.name), forget(key)))
    first = _step(make, mode, 2, batch_size)  # layer 0 records the templates, layer 1 splices
    count[0] = 0
    spliced = _step(make, mode, 2, batch_size)  # every layer splices
    assert not forgotten  # every piece's run matched its record, call for call
    spliced_ops = count[0]
    traced = _step(make, mode, 2, batch_size, recorded=False)
    for program in (first, spliced):
        _same(program, traced)
    count[0] = 0
    with monkeypatch.context() as patch:
        _plain(patch)
        whole = _step(make, mode, 2, batch_size)
    _same(whole, traced)
    assert _sources(first) == _sources(spliced) == _sources(whole) == _sources(traced)
    # the splice happened: the second step sent fewer ops to the recorder than a whole record
    assert 0 < spliced_ops < count[0] and len(_segment._TEMPLATES) >= 2


def test_under_inference_mode_a_piece_is_spliced_as_its_composites_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    # below autograd, composite ops (``linear``, ``softmax``...) reach the recorder whole and are
    # recorded decomposed; a splice's eager run must list them decomposed as well, or no
    # template would ever match its run and every call would be recorded again
    make, mode = _TARGETS[0]
    _segment.clear_templates()
    count = _counted(monkeypatch)
    with torch.inference_mode():
        first = _step(make, mode, 2, 2)
        count[0] = 0
        spliced = _step(make, mode, 2, 2)
        spliced_ops, count[0] = count[0], 0
        traced = _step(make, mode, 2, 2, recorded=False)
        with monkeypatch.context() as patch:
            _plain(patch)
            whole = _step(make, mode, 2, 2)
    for program in (first, spliced, whole):
        _same(program, traced)
    assert _sources(spliced) == _sources(whole) == _sources(traced)
    assert 0 < spliced_ops < count[0], (spliced_ops, count[0])  # the splice happened


def _view_of_a_buffer(mode, layer, q, k, v, pools, shared, batch, meta):
    """Attends, then returns as its output a float view of ``req_to_token``'s memory: the model's
    next piece reads the buffer in the body, through memory the backend handed it."""
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
    view = shared["req_to_token"].view(torch.float32).flatten().narrow(0, 0, out.numel()).view(out.shape)
    return view if layer == 1 else out


def _viewer() -> Any:
    effect = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf("viewer", _view_of_a_buffer, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                declare={M.DECODE: effect})


def _buffer_lengths(copy: bool) -> Any:
    """An ``attend`` whose lengths are the first rows of ``seq_lens`` itself (not a copy made in
    a prepare stage; with ``copy``, a copy made in the body): the attention's own math, the
    model piece after the gather, reads the buffer."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = shared["seq_lens"].narrow(0, 0, meta["kv_indices"].shape[0])
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens.clone() if copy else lens)

    return attend


def _lengths_reader(copy: bool = False) -> Any:
    return leaf("lengths_reader", _buffer_lengths(copy), prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                declare={M.DECODE: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})})


@pytest.mark.parametrize(("make", "warm", "buffer", "piece"), [
    (_viewer, _viewer, "req_to_token", "/readfence/core/_"),
    (_lengths_reader, lambda: _lengths_reader(copy=True), "seq_lens", "/readfence/backends/_attention.py"),
], ids=["model-piece-given-attends-view", "attention-given-seq_lens"])
def test_a_piece_given_a_buffers_memory_is_recorded_op_by_op(make: Any, warm: Any, buffer: str, piece: str) -> None:
    # the templates of every piece made first (the attention's from a backend that copies: a
    # template of the same signature is not spliced over the buffer's memory); the body then
    # reads the buffer in a later layer's piece: POST_REPLAY, its last reader a node of the piece
    _step(warm, M.DECODE, 3, 2)
    spliced, traced = _step(make, M.DECODE, 3, 2), _step(make, M.DECODE, 3, 2, recorded=False)
    _same(spliced, traced)
    assert spliced.traced()[buffer] is ReadEnd.POST_REPLAY
    stage, node = spliced.last_reader(buffer)
    assert stage == BODY and piece in spliced.stages[-1].graph.source(node)
    # the observer, which reads memory itself, sees the read in the body whether or not the
    # pieces run unobserved where they can touch nothing
    seen = observe(make(), M.DECODE, steps=1)
    assert seen.observed()[buffer] is ReadEnd.POST_REPLAY and seen.last_reader(buffer)[0] == "body"
    assert audit(make(), M.DECODE, cfg=ModelConfig(layers=3), batch_sizes=[2]).failure().buffer == buffer


class _Selector:
    """Keeps every key: a selector that is no value (equal by its fields, no hash)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Selector)

    __hash__ = None  # type: ignore[assignment]

    def __call__(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return mask


def test_an_attention_whose_selector_is_no_value_runs_its_math_op_by_op() -> None:
    # a key that cannot be hashed keys no record: under the recorder and the observer alike the
    # math runs as the code it is (it raised TypeError looking its record up), and computes what
    # the math without a selector computes (this one keeps every key)
    from readfence.core.internal import example_step as make_step

    step = make_step(ModelConfig(), M.DECODE, 2)
    meta = page_meta(step.shared, step.batch)
    q = torch.randn(2, 2, 16)
    args = (M.DECODE, q, step.pools, 0, meta["kv_indices"], meta["kv_lens"])
    assert torch.equal(softmax_attention(*args, select=_Selector()), softmax_attention(*args))

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"], select=_Selector())

    def make() -> Any:
        return leaf("unkeyed", attend, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch))

    _same(_step(make, M.DECODE, 2, 2), _step(make, M.DECODE, 2, 2, recorded=False))
    assert audit(make(), M.DECODE, cfg=ModelConfig(layers=2), batch_sizes=[2]).unwrap().observed == \
        audit(paged(), M.DECODE, cfg=ModelConfig(layers=2), batch_sizes=[2]).unwrap().observed


class _Peeking:
    """A selector (a value, so it keys the attention's record) that in layers above 0 hands its
    value of ``seq_lens`` to the host, where the page count comes from (``spelling``): the calls
    reach no dispatcher, so the piece's ops are those of layer 0's record."""

    def __init__(self, spelling: str) -> None:
        self.spelling, self.src = spelling, None

    def __call__(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k = 1
        if self.src is not None:
            host = {"tolist": lambda t: t.tolist()[0], "numpy": lambda t: int(t.numpy()[0]),
                    "data_ptr": lambda t: t.data_ptr() % 2, "item": lambda t: t[0].item()}[self.spelling](self.src)
            k = 2 if host in (5, 6, 1) else 1
        pages = scores.masked_fill(mask.logical_not(), float("-inf")).view(*scores.shape[:-1], -1, 8).amax(-1)
        keep = torch.zeros_like(pages, dtype=torch.bool).scatter(-1, torch.topk(pages, k, dim=-1).indices, True)
        return mask & keep.repeat_interleave(8, dim=-1)


def _peeker(spelling: str, declared: ReadEnd = ReadEnd.PRE_REPLAY) -> Any:
    select = _Peeking(spelling)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        select.src = shared["seq_lens"] if layer > 0 else None
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"], select=select)

    return leaf("peeker", attend, prepare_out_graph=lambda mode, shared, batch: page_meta(shared, batch),
                declare={M.DECODE: ReadEffect.of({"req_to_token": declared, "seq_lens": declared})})


@pytest.mark.parametrize("spelling", ["tolist", "numpy", "data_ptr", "item"])
def test_a_host_read_inside_a_piece_is_seen_when_its_ops_are_its_records(spelling: str) -> None:
    # layer 0 records the attention's math (no host read); layer 1's run makes the same ops and
    # hands seq_lens to the host above the dispatcher: its splice, and the observer's unobserved
    # run of it, must see the escape as a run of the code would (a listing taken with
    # torch-function modes off saw nothing, and the loop baked layer 0's page count)
    cfg = ModelConfig(layers=3)
    program = _step(lambda: _peeker(spelling), M.DECODE, 3, 2)
    assert program.traced()["seq_lens"] > ReadEnd.PRE_REPLAY  # the trace's line
    seen = observe(_peeker(spelling), M.DECODE, cfg=cfg, steps=1)
    assert seen.observed()["seq_lens"] > ReadEnd.PRE_REPLAY  # the observer's own
    failure = audit(_peeker(spelling), M.DECODE, cfg=cfg, batch_sizes=[2]).failure()
    assert failure.buffer in ("req_to_token", "seq_lens")


def test_a_piece_hiding_a_host_read_is_refused_and_runs_as_serial_under_coarse() -> None:
    from readfence.graph import CpuDevice, LoopOptions, Policy, UnsoundLowering, make_state, run_overlapped, run_serial

    cfg = ModelConfig(layers=2, max_reqs=8, max_ctx=16)
    with CpuDevice(timeout=60.0) as dev:
        with pytest.raises(UnsoundLowering, match="seq_lens|req_to_token"):
            lower(_peeker("tolist"), M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=cfg)
        options = LoopOptions(finish_prob=0.3)
        serial = run_serial(_peeker("tolist"), M.DECODE, steps=8, batch_size=2, cfg=cfg, state=make_state(cfg), options=options)
        run = run_overlapped(_peeker("tolist"), M.DECODE, steps=8, policy=Policy.COARSE, device=dev, batch_size=2, cfg=cfg,
                             state=make_state(cfg), options=options)
    assert run.matches(serial) and not run.violations


def test_a_piece_that_calls_a_factory_function_is_spliced(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch detaches a factory function's result on return when a mode holds it strongly: a
    # listing that held it saw a call its record has not, and never spliced such a piece
    forgotten: list[str] = []
    forget = _segment._TEMPLATES.forget
    monkeypatch.setattr(_segment._TEMPLATES, "forget", lambda key: (forgotten.append(key.name), forget(key)))
    piece = _segment.Segment("positions", lambda x, y: x * torch.arange(x.shape[-1]) + torch.zeros(1) - y)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _segment.clear_templates()
    recorded = _spliced_graph(piece, x, y)
    spliced = _spliced_graph(piece, x, y)
    assert not forgotten and len(_segment._TEMPLATES) == 1
    assert any(isinstance(n.meta.get(_segment.SPLICED_KEY), _segment.Spliced) for n in spliced.graph.nodes)
    assert torch.equal(spliced(x, y)[0], recorded(x, y)[0]) and torch.equal(spliced(x, y)[0], piece.fn(x, y))


def _accesses(obs: Any) -> list[tuple[Any, ...]]:
    return [(a.buffer, a.stage, a.op, a.kind, a.note, a.step) for a in obs.accesses]


@pytest.mark.parametrize(("make", "mode"), [*_TARGETS, (_viewer, M.DECODE)],
                         ids=["hybrid_linear", "tbo", "paged-extend", "sparse", "viewer"])
def test_the_observer_sees_the_same_accesses_with_pieces_unobserved(make: Any, mode: ForwardMode,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(layers=2)
    skipped = observe(make(), mode, cfg=cfg, steps=1, batch_size=[1, 3])
    with monkeypatch.context() as patch:
        _plain(patch)
        whole = observe(make(), mode, cfg=cfg, steps=1, batch_size=[1, 3])
    assert _accesses(skipped) == _accesses(whole) and skipped.accesses
    assert skipped.observed() == whole.observed()


def test_the_observer_runs_a_piece_unobserved_only_where_no_input_is_a_buffer() -> None:
    from readfence.core import ReadObserver

    table = torch.arange(8, dtype=torch.int32)
    obs = ReadObserver({"table": table})
    piece = _segment.Segment("sum", lambda x: x.sum())
    with obs, obs.stage("body"):
        piece(torch.ones(3))  # touches no buffer: unobserved
        piece(table.narrow(0, 0, 4))  # a view of the buffer: observed, and read
    assert [(a.buffer, a.op) for a in obs.accesses] == [("table", "aten.sum.default")]


def test_the_observer_observes_a_piece_again_once_its_ops_change() -> None:
    # the piece closes over what it calls; replaced by a function that reads the buffer, it
    # dispatches other ops than its observed run did, and its run is observed again
    from readfence.core import ReadObserver

    table = torch.arange(8, dtype=torch.int32)
    obs = ReadObserver({"table": table})
    calls = {"act": torch.sigmoid}
    piece = _segment.Segment("act", lambda x: calls["act"](x))
    x = torch.ones(3)
    with obs, obs.stage("body"):
        piece(x)  # observed: its ops kept
        seen = obs._seq
        piece(x)  # the same ops: unobserved
        assert obs._seq == seen and not obs.accesses
        calls["act"] = lambda x: torch.sigmoid(x) + 0 * table.sum()
        out = piece(x)
    assert [(a.buffer, a.op) for a in obs.accesses] == [("table", "aten.sum.default")]
    assert torch.equal(out, torch.sigmoid(torch.ones(3)))


def test_the_observer_observes_every_run_of_a_piece_that_reads_a_buffer_it_closes_over() -> None:
    # replaced before the piece's first run: its observed run touched the buffer, so no run of
    # it is ever unobserved, and each one's read is recorded
    from readfence.core import ReadObserver

    table = torch.arange(8, dtype=torch.int32)
    obs = ReadObserver({"table": table})
    piece = _segment.Segment("reads", lambda x: torch.sigmoid(x) + 0 * table.sum())
    x = torch.ones(3)
    with obs, obs.stage("body"):
        for _ in range(3):
            piece(x)
    assert [(a.buffer, a.op) for a in obs.accesses] == [("table", "aten.sum.default")] * 3


def test_the_observer_observes_a_piece_given_a_tensor_from_outside_it_at_every_run() -> None:
    # the piece reads a tensor it closes over (through a dict): a scratch tensor on its first run,
    # the buffer on the next, with the very same ops. Its calls are listed with their arguments, and
    # a call given a tensor from outside the piece makes a run no other is taken for: observed
    from readfence.core import ReadObserver

    table = torch.arange(8, dtype=torch.float32)
    source = {"t": torch.zeros(8)}
    obs = ReadObserver({"table": table})
    piece = _segment.Segment("mix", lambda x: x + source["t"].sum())
    x = torch.ones(3)
    with obs, obs.stage("body"):
        piece(x)
        source["t"] = table
        out = piece(x)
    assert [(a.buffer, a.op) for a in obs.accesses] == [("table", "aten.sum.default")]
    assert torch.equal(out, torch.full((3,), 29.0))


def test_the_observer_observes_a_piece_calling_an_op_that_is_not_torch_s_at_every_run() -> None:
    # a custom op's kernel reads what a plan kept, not an argument: on the second run the plan holds
    # the buffer. The ops and their arguments are the same; the op is not torch's own, so no run of
    # the piece is taken for another
    from readfence.core import ReadObserver

    table = torch.arange(8, dtype=torch.float32)
    plan = {"rows": torch.zeros(8)}
    name = "rf_segment_planned_sum"

    @torch.library.custom_op(f"rf_segment::{name}", mutates_args=())
    def planned(x: torch.Tensor) -> torch.Tensor:
        return x + plan["rows"].sum()

    @planned.register_fake
    def _(x):
        return torch.empty_like(x)

    op = getattr(torch.ops.rf_segment, name).default
    obs = ReadObserver({"table": table})
    piece = _segment.Segment("planned", lambda x: op(x * 2))
    x = torch.ones(3)
    with obs, obs.stage("body"):
        piece(x)
        plan["rows"] = table
        out = piece(x)
    assert [(a.buffer, a.op) for a in obs.accesses] == [("table", f"rf_segment.{name}.default/aten.sum.default")]
    assert torch.equal(out, torch.full((3,), 30.0))
    # and a piece with such an op is never a reference, even one whose kernel reads nothing but its
    # argument (a kernel may read without an op of its own: a raw pointer, a compiled library)

    @torch.library.custom_op("rf_segment::rf_segment_doubled", mutates_args=())
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @doubled.register_fake
    def _(x):
        return torch.empty_like(x)

    pure = _segment.Segment("pure", lambda x: torch.ops.rf_segment.rf_segment_doubled.default(x + 1))
    with obs, obs.stage("body"):
        pure(x)
    assert _read_observer._SEGMENT_OPS.get(_segment.segment_signature(pure, (x,))) is None


def test_the_observer_observes_a_piece_whose_input_s_storage_holds_a_buffer() -> None:
    # the input's own elements touch no buffer, its storage does: a strided view of it reaches the
    # buffer (its first run, on memory of its own, touched none and made the reference)
    from readfence.core import ReadObserver

    arena = torch.arange(16, dtype=torch.float32)
    obs = ReadObserver({"table": arena[:4]})
    piece = _segment.Segment("strided", lambda x: torch.as_strided(x, (4,), (1,), 0).sum() + x)
    with obs, obs.stage("body"):
        piece(torch.arange(8, 16, dtype=torch.float32))
        out = piece(arena[8:])
    assert [(a.buffer, a.op) for a in obs.accesses] == [("table", "aten.sum.default")]
    assert torch.equal(out, arena[8:] + 6)


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
def test_the_observer_runs_a_piece_of_composite_ops_unobserved_after_its_first_run(inference: bool) -> None:
    # under inference mode ``linear`` and ``softmax`` reach the observer whole; its unobserved
    # run lists them as its observed run does (decomposed), so the two runs compare equal
    from readfence.core import ReadObserver

    table = torch.arange(8, dtype=torch.int32)  # held: memory a freed buffer left would be reused by x or w
    obs = ReadObserver({"table": table})
    piece = _segment.Segment("head", lambda x, w: torch.nn.functional.linear(x, w).softmax(-1))
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with torch.inference_mode(inference), obs, obs.stage("body"):
        first = piece(x, w)
        seen = obs._seq
        again = piece(x, w)
    assert seen > 0 and obs._seq == seen  # the second run: unobserved
    assert torch.equal(first, again) and torch.equal(again, torch.nn.functional.linear(x, w).softmax(-1))


def test_a_template_is_kept_per_signature_key_and_code() -> None:
    import contextlib

    from torch.fx.experimental.proxy_tensor import make_fx

    from tests.core.test_record import _signature

    def scaled(k: float) -> Any:
        return _segment.Segment("scaled", lambda x: (x * k).sum(-1), key=k)

    other = _segment.Segment("scaled", lambda x: (x - 1.0).sum(-1), key=2.0)  # same name and key, other code

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wide, narrow = x * 1.0, x.narrow(0, 0, 2).contiguous()
        return scaled(2.0)(wide), scaled(3.0)(wide), scaled(2.0)(narrow), other(wide), scaled(2.0)(wide)

    _segment.clear_templates()
    x = torch.arange(12.0).view(3, 4)
    graphs = [_record.record(fn, [x], ["x"], outputs=lambda out: out, context=lambda r: contextlib.nullcontext(),
                             escape_op=None)[0] for _ in range(2)]
    assert len(_segment._TEMPLATES) == 4  # (2.0, wide), (3.0, wide), (2.0, narrow), other's code
    traced = make_fx(lambda *args: fn(*args))(x)  # (placeholders named as the record names them)
    assert _signature(graphs[0]) == _signature(graphs[1]) == _signature(traced)
    assert all(torch.equal(a, b) for a, b in zip(graphs[1](x), fn(x), strict=True))


def test_a_piece_whose_ops_changed_since_its_record_is_recorded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # the template of the MLP piece holds ``silu``; once ``F.silu`` is replaced, the piece
    # dispatches other ops: a splice would write a graph of ops that no longer run
    import torch.nn.functional as F

    make = lambda: hybrid_linear(trtllm_mha(), linear())  # noqa: E731
    _step(make, M.DECODE, 2, 2)  # templates made with the real silu
    monkeypatch.setattr(F, "silu", lambda x, inplace=False: torch.sigmoid(x) * x)
    recorded, traced = _step(make, M.DECODE, 2, 2), _step(make, M.DECODE, 2, 2, recorded=False)
    _same(recorded, traced)
    body = recorded.stages[-1].graph.gm.graph
    assert not any(n.target is torch.ops.aten.silu.default for n in body.nodes)
    assert sum(n.target is torch.ops.aten.sigmoid.default for n in body.nodes) == 2  # one per layer


def _spliced_graph(piece: _segment.Segment, x: torch.Tensor, y: torch.Tensor) -> Any:
    import contextlib

    return _record.record(lambda a, b: piece(a, b), [x, y], ["x", "y"], outputs=lambda out: [out],
                          context=lambda r: contextlib.nullcontext(), escape_op=None)[0]


@pytest.mark.parametrize("change", ["a scalar", "the order of two arguments", "the value returned"])
def test_a_piece_that_makes_the_same_ops_on_other_arguments_is_recorded_again(change: str) -> None:
    # the ops a piece dispatches, in order, are its template's, but a value its code reads changed
    # (an epsilon, a module setting), a function it calls swaps its arguments, or it returns another
    # of its values: a splice would write the old calls. Each call is compared with its record,
    # arguments and results included; the graph spliced must compute what the piece now computes
    settings = {"eps": 1e-6, "swap": False, "last": True}

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = (y, x) if settings["swap"] else (x, y)
        d = torch.sub(a, b).add(settings["eps"])
        e = d.mul(2.0)
        return e if settings["last"] else d

    piece = _segment.Segment("changing", fn)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _segment.clear_templates()
    _spliced_graph(piece, x, y)  # the template, with the settings as they were
    before = _spliced_graph(piece, x, y)(x, y)[0]
    assert torch.equal(before, fn(x, y))
    settings.update({"a scalar": {"eps": 0.5}, "the order of two arguments": {"swap": True},
                     "the value returned": {"last": False}}[change])
    after = _spliced_graph(piece, x, y)(x, y)[0]
    assert torch.equal(after, fn(x, y)) and not torch.equal(after, before)


def test_the_model_s_pieces_follow_a_module_setting_they_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # the decoder's norm reads its epsilon from the module: changed, a lowering must trace and
    # validate the new value (a stale template baked the old one, and the validation then refused
    # a correct backend, blaming it)
    from readfence.core import _model, clear_trace_cache
    from readfence.graph import CpuDevice, Policy, lower

    cfg = ModelConfig(layers=2)
    _step(paged, M.DECODE, 2, 2)  # templates made with the module's epsilon
    monkeypatch.setattr(_model, "_EPS", 1e-2)
    clear_trace_cache()
    program = _step(paged, M.DECODE, 2, 2)
    eps = [n.args[1] for n in program.stage(BODY).graph.gm.graph.nodes
           if n.target is torch.ops.aten.add.Tensor and not isinstance(n.args[1], torch.fx.Node)]
    assert eps and set(eps) == {1e-2}
    with CpuDevice() as dev:
        lowered = lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=cfg)
    assert lowered.optimized


def _written(template: Any, write: Any) -> tuple[torch.fx.Graph, list[Any]]:
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"input_{i}") for i in range(1 + max(
        (ref.index for node in template.nodes for ref in _refs((node[1], node[2])) if isinstance(ref, _segment._In)),
        default=0))]
    made = write(graph, inputs)
    graph.output(tuple(made))
    return graph, made


def _refs(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    return [value]


def test_a_template_s_generated_writer_writes_what_its_nodes_say() -> None:
    # every template a hybrid step records, written by its generated writer and node by node from
    # its nodes (``Template.write_each``, the writer's reference): the same graph, node for node
    _segment.clear_templates()
    _step(lambda: hybrid_linear(trtllm_mha(), linear()), M.DECODE, 2, 2)
    templates = [entry.value for entry in _segment._TEMPLATES._entries.values()]
    assert len(templates) >= 3
    for template in templates:
        (fast, made), (slow, _) = _written(template, template.write), _written(template, template.write_each)
        assert [(n.op, n.target, n.name, str(n.args), str(n.kwargs), n.meta.keys(), sorted(u.name for u in n.users))
                for n in fast.nodes] == \
               [(n.op, n.target, n.name, str(n.args), str(n.kwargs), n.meta.keys(), sorted(u.name for u in n.users))
                for n in slow.nodes]
        assert all(node.meta["val"] is meta["val"] for node, (*_, meta) in zip(made, template.nodes, strict=True))
        # each write makes its own lists (a pass that edits one node's arguments edits no other's)
        (_, again) = _written(template, template.write)
        assert all(x is not y for a, b in zip(made, again) for x, y in zip(a.args, b.args) if isinstance(x, list))


def _twice(case: str, plain: bool) -> tuple[list[Any], Any]:
    """A piece run twice under one observer (a reference, then a run something changed for), as
    the observer runs pieces (``plain``: as the code it is, every op observed)."""
    from readfence.core import ReadObserver

    _read_observer._SEGMENT_OPS.clear()
    table = torch.arange(8, dtype=torch.float32)
    state: dict[str, Any] = {"memo": 1.0, "limits": None, "k": 2, "src": torch.zeros(3)}

    def memo(x):  # a host value it keeps, made again once it was dropped (a new step)
        if state["memo"] is None:
            state["memo"] = table.max().item()
        return x * state["memo"]

    def raises(x):  # a check of the buffer that raises, caught by the caller
        if state["limits"] is not None and bool((state["limits"] > 5).any()):
            raise OverflowError("past the limit")
        return x * 2

    def data(x):  # a tensor re-pointed without an op
        y = x * 1
        y.data = state["src"]
        return x + y.sum()

    storage = table.untyped_storage()  # (taken before any observer)

    def stored(x):  # memory reached through a storage, no tensor
        return x + torch.empty(0).set_(storage, 4, (4,), (1,)).sum()

    fn = {"memo": memo, "raises": raises, "in place": lambda x: x.add_(1) * state["k"], "data": data,
          "storage": stored}[case]
    piece = _segment.Segment(case, fn)
    call = (lambda *t: piece.fn(*t)) if plain else piece
    x = torch.ones(3)
    if case == "storage":  # the reference made under an observer of other buffers
        with ReadObserver({"other": torch.zeros(4)}) as first, first.stage("body"):
            call(x)
    obs = ReadObserver({"table": table})
    with obs, obs.stage("body"):
        if case != "storage":
            call(x)
        state.update(memo=None, limits=table, k=3, src=table[:3])
        try:
            out = call(x)
        except OverflowError:
            out = x * 3
    return [(a.buffer, a.op, a.kind) for a in obs.accesses], (out, x)


@pytest.mark.parametrize("case", ["memo", "raises", "in place", "data", "storage"])
def test_a_piece_run_is_one_run_observed_from_its_first_call_not_its_reference_s(case: str) -> None:
    # the observer held to the piece as the code it is, every op observed: the same accesses and
    # values. A run is never made twice (an unobserved attempt, then an observed one: what the first
    # did, a cache filled, an error raised, an in-place op, was never seen or was done twice); it is
    # observed from its first call that is not the reference's (a tensor from outside, a storage, a
    # tensor re-pointed without an op)
    spliced, plain = _twice(case, False), _twice(case, True)
    assert spliced[0] == plain[0], (spliced[0], plain[0])
    assert (case == "in place") != any(b == "table" for b, _, _ in plain[0])  # (the in-place piece reads no buffer)
    assert all(torch.equal(a, b) for a, b in zip(spliced[1], plain[1]))


def _recorded_twice(case: str, plain: bool) -> tuple[list[str], Any, Any]:
    """A step that calls a piece twice (its template made on the first call, something changed
    before the second), recorded with the buffer given (``plain``: the piece as the code it is)."""
    import contextlib

    from readfence.core.tracing._trace import OPAQUE_OP

    _segment.clear_templates()
    table = torch.arange(8, dtype=torch.float32)
    state: dict[str, Any] = {"memo": 1.0, "limits": None, "k": 2}

    def memo(x):
        if state["memo"] is None:
            state["memo"] = table.max().item()
        return x * state["memo"]

    def raises(x):
        if state["limits"] is not None and bool((state["limits"] > 5).any()):
            raise OverflowError("past the limit")
        return x * 2

    fn = {"memo": memo, "raises": raises, "in place": lambda x: x.add_(1) * state["k"]}[case]
    piece = _segment.Segment(case, fn)
    call = (lambda *t: piece.fn(*t)) if plain else piece

    def step(x):
        first = call(x)
        state.update(memo=None, limits=table, k=3)
        try:
            return call(x) + first
        except OverflowError:
            return x * 3 + first

    gm, out, probe = _record.record(step, [torch.ones(3)], ["x"], outputs=lambda o: [o],
                                    context=lambda r: contextlib.nullcontext(), escape_op=OPAQUE_OP,
                                    shared={"table": table})
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"], probe.touched, out


@pytest.mark.parametrize("case", ["memo", "raises", "in place"])
def test_a_spliced_piece_s_run_is_recorded_from_its_first_call_not_its_template_s(case: str) -> None:
    # the trace held to the piece recorded as the code it is: the same ops, the same buffers read,
    # the same value. The run is never made twice (an unrecorded attempt, then a recorded one lost
    # what the first did: a cache filled, an error raised); the calls before the first that is not
    # the template's are written from it, and the rest recorded
    spliced, plain = _recorded_twice(case, False), _recorded_twice(case, True)
    assert spliced[0] == plain[0] and spliced[1] == plain[1], (spliced, plain)
    assert (case == "in place") != bool(plain[1])
    assert torch.equal(spliced[2], plain[2])


def test_a_piece_whose_input_s_storage_holds_a_buffer_is_recorded_op_by_op() -> None:
    # the input's elements touch no buffer, its storage does: the piece strides into the buffer,
    # so its call is recorded op by op (its template was made on memory of its own), and the trace
    # finds the read as the plain record does
    import contextlib

    from readfence.core.tracing._trace import OPAQUE_OP

    arena = torch.arange(16, dtype=torch.float32)
    touched = []
    for plain in (False, True):
        _segment.clear_templates()
        piece = _segment.Segment("strided", lambda x: torch.as_strided(x, (4,), (1,), 0).sum() + x)
        call = piece.fn if plain else piece
        gm, out, probe = _record.record(lambda own, back, call=call: call(own) + call(back),
                                        [torch.arange(8, 16, dtype=torch.float32), arena[8:]], ["own", "back"],
                                        outputs=lambda o: [o], context=lambda r: contextlib.nullcontext(),
                                        escape_op=OPAQUE_OP, shared={"table": arena[:4]})
        touched.append(sorted(set().union(*probe.touched.values())))
    assert touched[0] == touched[1] == ["table"], touched


class _Calibrated:
    """A selector that keeps a host scale, made again from ``seq_lens`` once dropped (by identity:
    one key of the attention's piece)."""

    def __init__(self) -> None:
        self.scale: float | None = 1.0
        self.source: torch.Tensor | None = None

    def __call__(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = float(self.source.max())  # a read of seq_lens in the body
        return mask & (scores * self.scale > float("-inf"))


def _calibrated() -> Any:
    # a paged backend whose selector recalibrates at layer 1 of every step (its other layers run
    # the attention's piece as recorded): seq_lens read in the body, declared IN_REPLAY
    from readfence.backends import kv_indices, kv_lens

    selector = _Calibrated()

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        selector.source = shared["seq_lens"]
        if layer == 1:
            selector.scale = None
        return softmax_attention(mode, q, pools, layer, kv_indices(shared, batch), meta["kv_lens"], select=selector)

    declared = ReadEffect.of({"req_to_token": ReadEnd.POST_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf("calibrated", attend, prepare_in_graph=lambda mode, shared, batch, meta: {"kv_lens": kv_lens(shared, batch)},
                declare={M.DECODE: declared})


def test_a_selector_that_reads_a_buffer_once_per_step_is_refused_with_its_pieces_spliced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # end to end: the audit (trace and observer alike) finds the body's read of seq_lens whether the
    # attention's piece is spliced and run unobserved or run as the code it is
    cfg = ModelConfig(layers=3)
    found = []
    for plain in (False, True):
        with monkeypatch.context() as patch:
            if plain:
                _plain(patch)
            verdict = audit(_calibrated(), M.DECODE, cfg=cfg)
            seen = observe(_calibrated(), M.DECODE, cfg=cfg, steps=1).observed()
        found.append((not verdict.map(lambda r: r.sound).value_or(False), seen["seq_lens"]))
    assert found[0] == found[1] == (True, ReadEnd.POST_REPLAY), found
