"""A write of a shared buffer that only a run of the engine's code shows: an op whose schema declares
no write (registered in ``aten`` or a user namespace) writing memory the class keeps from its
runner, in an out-of-graph method, an in-graph one or ``forward``. No trace sees it (the op is handed
no shared buffer, or its schema says it only reads); the scheduler steps' read observer runs the
op's kernel under itself and sees the write, and ``audit_engine`` refuses it as a
``StageWriteError`` naming the method's stage and the buffer (``verify_engine`` reports it under
every fence). The calls the adapter makes once, outside any step (the capture-time call, the
warm-up), run watched as well: a write there is refused too. The check that shares nothing with
the observer, the guard comparing the buffers' bytes, is shown catching such a write in
``tests/core/test_observed_writes.py``."""

from __future__ import annotations

import enum

import pytest
import torch

from readfence.backends import softmax_attention
from readfence.core import ForwardMode, StageWriteError
from readfence.engine import adapt, audit_engine, verify_engine
from readfence.graph import Policy, lower

from .conftest import CFG


class _Ends(enum.Enum):
    PRE_REPLAY = 1
    IN_REPLAY = 2
    POST_REPLAY = 3
    UNKNOWN = 4


#: (namespace, method, buffer) -> the class whose method writes ``buffer`` through such an op
_LIBS: dict[str, torch.library.Library] = {}
_KEPT: dict[str, torch.Tensor] = {}  # what a kernel writes by a reference of its own (a closure)


def _op(namespace: str, name: str, schema: str, kernel) -> object:
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.define(f"{name}{schema}")
    lib.impl(name, kernel, "CPU")
    lib.impl(name, lambda x, *a, **k: torch.empty_like(x), "Meta")
    return getattr(getattr(torch.ops, namespace), name).default


def _bump_out(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    out.add_(1)  # the schema below declares no write of ``out``
    return x.clone()


def _bump_kept(x: torch.Tensor) -> torch.Tensor:
    _KEPT["buffer"].add_(1)  # memory no argument hands it
    return x.clone()


def _read_kept(x: torch.Tensor) -> torch.Tensor:
    return x + _KEPT["buffer"][:1].sum() * 0  # reads what it keeps, writes nothing


_OPS = {
    ("aten", "out"): _op("aten", "rf_unmarked_bump_out", "(Tensor x, *, Tensor out) -> Tensor", _bump_out),
    ("rf_unmarked_user", "out"): _op("rf_unmarked_user", "bump_out", "(Tensor x, *, Tensor out) -> Tensor", _bump_out),
    ("aten", "kept"): _op("aten", "rf_unmarked_bump_kept", "(Tensor x) -> Tensor", _bump_kept),
    ("rf_unmarked_user", "kept"): _op("rf_unmarked_user", "bump_kept", "(Tensor x) -> Tensor", _bump_kept),
    ("aten", "read"): _op("aten", "rf_unmarked_read_kept", "(Tensor x) -> Tensor", _read_kept),
}

#: the engine method -> the stage it is
STAGES = {"init_forward_metadata_out_graph": "prepare_out_graph", "init_forward_metadata_in_graph": "prepare_in_graph",
          "forward": "body"}


class _PageReader:
    """An engine class that reads the page table and the lengths before the replay and declares its
    reads to end at POST_REPLAY; the classes below add one write each. ``target`` is the runner's
    buffer ``buffer`` it keeps."""

    buffer = "seq_lens"

    def __init__(self, runner):
        pool = runner.req_to_token_pool
        self.table, self.target = pool.req_to_token, getattr(pool, self.buffer)

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.idx = self.table.index_select(0, fb.req_pool_indices).long()
        self.lens = fb.seq_lens.long().clone()

    def init_forward_metadata_in_graph(self, fb):
        pass

    def shared_read_ends(self, mode):
        return _Ends.POST_REPLAY

    def body_lens(self) -> torch.Tensor:
        return self.lens

    def forward(self, q, k, v, layer, fb, save_kv_cache=True):
        lens = self.body_lens()
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        return softmax_attention(fb.forward_mode.readfence, q, {"k_cache": pool.k_buffer, "v_cache": pool.v_buffer},
                                 layer.layer_id, self.idx, lens)


def _named(cls: type, name: str) -> type:
    cls.__name__ = cls.__qualname__ = name
    return cls


def _writer(namespace: str, how: str, method: str, buffer: str) -> type:
    op = _OPS[(namespace, how)]

    class Writes(_PageReader):
        def __init__(self, runner):
            self.buffer = buffer
            super().__init__(runner)
            _KEPT["buffer"] = self.target

        def _bump(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, out=self.target) if how == "out" else op(x)

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            super().init_forward_metadata_out_graph(fb, in_capture)
            if method == "init_forward_metadata_out_graph":
                self.lens = self._bump(self.lens)

        def init_forward_metadata_in_graph(self, fb):
            if method == "init_forward_metadata_in_graph":
                self.lens = self._bump(self.lens)

        def body_lens(self) -> torch.Tensor:
            return self._bump(self.lens) if method == "forward" else self.lens

    return _named(Writes, f"Writes_{how}_{method}")


CASES = [("aten", "out", "init_forward_metadata_out_graph", "seq_lens"),
         ("rf_unmarked_user", "out", "init_forward_metadata_out_graph", "seq_lens"),
         ("aten", "kept", "init_forward_metadata_out_graph", "req_to_token"),
         ("rf_unmarked_user", "kept", "init_forward_metadata_in_graph", "seq_lens"),
         ("aten", "kept", "forward", "seq_lens"),
         ("rf_unmarked_user", "kept", "forward", "req_to_token")]


@pytest.mark.parametrize(("namespace", "how", "method", "buffer"), CASES)
def test_a_write_only_a_run_of_the_code_shows_is_refused_naming_stage_and_buffer(namespace, how, method, buffer):
    engine = adapt(_writer(namespace, how, method, buffer), cfg=CFG)
    with pytest.raises(StageWriteError) as e:
        audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1)
    assert (e.value.stage, e.value.buffer) == (STAGES[method], buffer), str(e.value)
    assert "saw it written" in str(e.value) and "test_unmarked_writes.py" in e.value.source, str(e.value)


def test_verify_engine_reports_the_write_under_every_fence(dev):
    # (the capture-time call writes too, in the serial reference: refused there, a finding per fence)
    engine = adapt(_writer("aten", "out", "init_forward_metadata_out_graph", "seq_lens"), cfg=CFG)
    found = verify_engine(engine, device=dev, steps=2, batch_size=2).failure()
    assert found.report.rows and all((r.finding.kind, r.finding.buffer, r.finding.stage) == (
        "write", "seq_lens", "prepare_out_graph") for r in found.report.rows), str(found.report)


def test_the_same_op_reading_what_it_keeps_is_no_write():
    # precision: the kernel reads the kept buffer in forward (declared POST_REPLAY): sound, not refused
    engine = adapt(_writer("aten", "read", "forward", "seq_lens"), cfg=CFG)
    report = audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1).unwrap()
    assert "seq_lens" in str(report)


def _once_writer(when: str, buffer: str) -> type:
    """A class that writes ``buffer`` of its runner once: in its capture-time call, in its first
    call of any kind (with the old bytes put back: no guard comparing bytes afterwards sees it), in
    the first call of its in-graph method, or in EXTEND's first (warm-up) call."""

    class WritesOnce(_PageReader):
        calls = in_calls = 0

        def __init__(self, runner):
            self.buffer = buffer
            super().__init__(runner)

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            self.calls += 1
            if (when == "capture" and in_capture) or (when == "extend_first" and self.calls == 1
                                                      and fb.forward_mode.is_extend()):
                self.target.fill_(1)
            if when == "first_call" and self.calls == 1:
                self.target.add_(1)
                self.target.sub_(1)
            super().init_forward_metadata_out_graph(fb, in_capture)

        def init_forward_metadata_in_graph(self, fb):
            self.in_calls += 1
            if when == "in_graph_first" and self.in_calls == 1:
                self.target.mul_(1)

    return _named(WritesOnce, f"WritesOnce_{when}")


ONCE = [("capture", "seq_lens", ForwardMode.DECODE, "prepare_out_graph", "capture-time call"),
        ("first_call", "req_to_token", ForwardMode.DECODE, "prepare_out_graph", "capture-time call"),
        ("in_graph_first", "seq_lens", ForwardMode.DECODE, "prepare_in_graph", "capture-time call"),
        ("extend_first", "seq_lens", ForwardMode.EXTEND, "prepare_out_graph", "warm-up call")]


@pytest.mark.parametrize(("when", "buffer", "mode", "stage", "call"), ONCE, ids=[c[0] for c in ONCE])
def test_a_write_in_a_call_no_step_makes_is_refused_by_the_audit_and_by_lower(when, buffer, mode, stage, call, dev):
    # the capture-time call and the warm-up run once per mode and batch size, outside any step: they
    # run watched too, and a write there is refused however often it is asked again
    engine = adapt(_once_writer(when, buffer), cfg=CFG)
    with pytest.raises(StageWriteError) as e:
        audit_engine(engine, mode, batch_sizes=[2], steps=1)
    assert (e.value.stage, e.value.buffer) == (stage, buffer) and call in str(e.value), str(e.value)
    assert "test_unmarked_writes.py" in e.value.source, e.value.source
    with pytest.raises(StageWriteError) as again:
        lower(engine, mode, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG, state=engine.state)
    assert (again.value.stage, again.value.buffer) == (stage, buffer), str(again.value)
    fresh = adapt(_once_writer(when, buffer), cfg=CFG)  # lowered first, no audit before it
    with pytest.raises(StageWriteError):
        lower(fresh, mode, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG, state=fresh.state)


def _method_writer(method: str) -> type:
    """A class whose ``method``, one readfence calls outside any step, writes the live lengths."""

    class WritesOutside(_PageReader):
        def _write(self, name: str) -> None:
            if name == method:
                self.target.fill_(3)

        def init_cuda_graph_state(self, max_bs, max_num_tokens):
            self._write("init_cuda_graph_state")

        def shared_read_ends(self, mode):
            self._write("shared_read_ends")
            return _Ends.POST_REPLAY

        def resolve_prefill_shared_read_ends(self, forward_batch, num_qo_tokens, build_snapshot=True):
            self._write("resolve_prefill_shared_read_ends")
            return _Ends.POST_REPLAY

    return _named(WritesOutside, f"WritesIn_{method}")


@pytest.mark.parametrize("method", ["init_cuda_graph_state", "shared_read_ends"])
def test_a_write_in_a_method_asked_while_adapting_is_refused_there(method):
    with pytest.raises(StageWriteError) as e:
        adapt(_method_writer(method), cfg=CFG)
    assert e.value.buffer == "seq_lens" and f"call of {method}" in str(e.value), str(e.value)


def test_a_write_in_the_prefill_s_resolution_is_refused_by_the_audit():
    # asked on the live state before an EXTEND step (what the engine's runner publishes from)
    engine = adapt(_method_writer("resolve_prefill_shared_read_ends"), cfg=CFG)
    with pytest.raises(StageWriteError) as e:
        audit_engine(engine, ForwardMode.EXTEND, batch_sizes=[2], steps=1)
    assert e.value.buffer == "seq_lens" and "resolve_prefill_shared_read_ends" in str(e.value), str(e.value)


def test_the_extend_warm_up_is_watched_on_the_example_state_its_batch_is_over():
    # the warm-up's forward batch is over an example state of its own, not the live one
    class WarmUpWrites(_method_writer("none")):
        calls = 0

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            type(self).calls += 1
            if type(self).calls == 1:
                fb.req_to_token_pool.req_to_token.zero_()
            super().init_forward_metadata_out_graph(fb, in_capture)

    engine = adapt(WarmUpWrites, cfg=CFG)
    with pytest.raises(StageWriteError) as e:
        audit_engine(engine, ForwardMode.EXTEND, batch_sizes=[2], steps=1)
    assert e.value.buffer == "req_to_token" and "warm-up call" in str(e.value), str(e.value)
