"""Every run of a step's code that readfence makes for evidence goes through the ledger's one entry.

The backend here notes, at every call of each of its stages, whether the call is inside a trace
(the program's own analysis) or inside ``Ledger.watch`` (every other run: the audit's observer, the
generated states, the validation replays, the rehearsal, check mode's watcher). A call inside
neither is a run whose reads no verdict sees: a new kind of run that forgot the entry fails here,
whatever it is, since the test counts the user's calls rather than listing readfence's runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, audit, clear_trace_cache
from readfence.core.internal import Ledger, RunKind
from readfence.core.tracing import _trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CheckState, CpuDevice, LoopOptions, Policy, decode_loop, make_state
from readfence.graph.verification import LateReadWatch
from tests.conftest import SMALL as CFG

M = ForwardMode


class Calls:
    """Each call of the backend's stages: (stage, inside a trace or a watched run)."""

    def __init__(self) -> None:
        self.depth = threading.local()  # a loop runs its stages on the forward stream's thread
        self.seen: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.depth.n = getattr(self.depth, "n", 0) + 1
        try:
            yield
        finally:
            self.depth.n -= 1

    def note(self, stage: str) -> None:
        self.seen.append((stage, getattr(self.depth, "n", 0) > 0))

    def unrecorded(self) -> list[str]:
        return [stage for stage, recorded in self.seen if not recorded]


@pytest.fixture
def calls(monkeypatch) -> Calls:
    calls = Calls()
    watch, trace_stage = Ledger.watch, _trace._trace_stage

    @contextlib.contextmanager
    def watched(self: Ledger, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with calls.inside(), watch(self, *args, **kwargs) as observer:
            yield observer

    def traced(*args: Any, **kwargs: Any) -> Any:
        with calls.inside():
            return trace_stage(*args, **kwargs)

    monkeypatch.setattr(Ledger, "watch", watched)
    monkeypatch.setattr(_trace, "_trace_stage", traced)
    clear_trace_cache()  # (a trace cached before the patch ran the code unwatched by this test)
    yield calls
    clear_trace_cache()


def noting(calls: Calls) -> Any:
    """A paged backend (both modes) whose every stage notes its call in ``calls``."""

    def out(mode, shared, batch):
        calls.note("prepare_out_graph")
        return {"lens": shared["seq_lens"].index_select(0, batch["req_pool_indices"])}

    def inside(mode, shared, batch, meta):
        calls.note("prepare_in_graph")
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        calls.note("attend")
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + 0 * meta["lens"].sum()

    ends = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf("noting", attend, prepare_out_graph=out, prepare_in_graph=inside,
                declare={M.DECODE: ends, M.EXTEND: ends})


@pytest.mark.parametrize("mode", [M.DECODE, M.EXTEND])
def test_every_run_of_the_step_s_code_for_evidence_is_recorded_by_its_ledger(calls, mode) -> None:
    backend, state = noting(calls), make_state(CFG)
    assert audit(backend, mode, cfg=CFG, state=state, batch_sizes=[2]).map(lambda r: r.sound).value_or(False)
    watch = LateReadWatch(state["shared"])
    with CpuDevice(timeout=60.0) as dev:
        loop = decode_loop(backend, mode, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG, state=state,
                           options=LoopOptions(check=CheckState(state["shared"], CFG, watcher=watch)))
        loop.run(2)
    ledger = loop.lowered.ledger
    kinds = {r.kind for r in ledger.runs()}
    # the runs are there (not vacuous): the generated states, the rehearsal, check mode's steps ...
    assert {RunKind.REHEARSAL, RunKind.CHECK} <= kinds and kinds & {RunKind.VARIED, RunKind.VALIDATION}, kinds
    assert {"prepare_out_graph", "prepare_in_graph", "attend"} <= {stage for stage, _ in calls.seen}
    # ... and no call of the step's code was outside the entry
    assert calls.unrecorded() == [], calls.unrecorded()
