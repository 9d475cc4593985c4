"""The cycle collector is held off while an audit or a lowering runs, and left as it was found.

An audit's and a lowering's traces and runs keep most of what they make until they return; a
collection in between walks all of it and frees next to nothing. What must hold: the collector
is off inside (the step's own code sees it off), back on after (a refusal included), and a
collector the user turned off stays off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from returns.result import Success

from readfence.backends import leaf, page_meta, paged, softmax_attention, store_kv
from readfence.core import ForwardMode, ModelConfig, audit
from readfence.core.tracing import collection_paused
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, UnsoundLowering, lower

M = ForwardMode
CFG = ModelConfig(layers=2)


@pytest.fixture
def collector() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def _watching(seen: list[bool], declared: ReadEnd = ReadEnd.IN_REPLAY) -> Any:
    """``paged``, noting whether the collector is on each time its ``attend`` runs."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        seen.append(gc.isenabled())
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    return leaf("watching", attend, prepare_in_graph=lambda mode, shared, batch, meta: page_meta(shared, batch),
                declare={M.DECODE: ReadEffect.of({"req_to_token": declared, "seq_lens": declared})})


def test_an_audit_and_a_lowering_run_with_the_collector_off_and_turn_it_back_on(collector: None) -> None:
    seen: list[bool] = []
    assert isinstance(audit(_watching(seen), M.DECODE, cfg=CFG, batch_sizes=[2]), Success)
    with CpuDevice() as dev:
        lower(_watching(seen), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)
    assert seen and not any(seen) and gc.isenabled()


def test_a_refused_lowering_turns_the_collector_back_on(collector: None) -> None:
    with CpuDevice() as dev, pytest.raises(UnsoundLowering):
        lower(_watching([], ReadEnd.PRE_REPLAY), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(collector: None) -> None:
    gc.disable()
    audit(paged(), M.DECODE, cfg=CFG, batch_sizes=[2])
    with CpuDevice() as dev:
        lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)
    assert not gc.isenabled()


def test_overlapping_phases_on_two_threads_turn_it_back_on_when_the_last_ends(collector: None) -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collection_paused():
            inside.set()
            leave.wait(timeout=60)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(timeout=60)
    with collection_paused():
        pass
    still_off = not gc.isenabled()  # the other thread's phase is still running
    leave.set()
    thread.join(timeout=60)
    assert still_off and gc.isenabled() and not thread.is_alive()
