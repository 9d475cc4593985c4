"""Every way a tensor's value reaches Python is an escape the tracer sees, in every stage.

``item()`` and ``int(t)`` are methods; ``torch.equal``, ``torch.allclose``, ``is_nonzero``,
``x in t`` and a 0-d tensor used as a slice bound (``req_to_token[row, start:end]``, as SGLang's
torch-native backend writes it) reach the host inside C++. The tracer marks any op tagged
``data_dependent_output`` at the dispatcher, so each is a value escape: the stage runs as Python.
In the graph it reads every buffer until POST_REPLAY; out of it the escape counts for the buffers
it reaches (``Stage.escape_end``). Declared so, each runs bit-identical to serial; declared
earlier, it is refused.
"""

from __future__ import annotations

import pytest
import torch

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, STAGES, ForwardMode, Stage, audit, trace
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, FaultInjector, Policy, UnsoundLowering, lower, run_overlapped, run_serial
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode.DECODE
BUFFERS = ("req_to_token", "seq_lens", "swa_map", "state_slots")

HOST_READS = {
    "equal": lambda s: torch.equal(s["seq_lens"][:2], s["seq_lens"][2:4]),
    "allclose": lambda s: torch.allclose(s["seq_lens"][:2].float(), s["seq_lens"][2:4].float()),
    "is_nonzero": lambda s: s["seq_lens"][1].is_nonzero(),
    "bool": lambda s: bool(s["seq_lens"][1] > 2),
    "contains": lambda s: 3 in s["seq_lens"],
    "slice_bound": lambda s: int(s["req_to_token"][1, s["seq_lens"][0]:s["seq_lens"][1]].numel() > 0),
}


def _backend(name: str, stage: Stage, end: ReadEnd):
    read = HOST_READS[name]

    def flag(shared) -> torch.Tensor:
        return torch.tensor(2.0 if read(shared) else 1.0)  # the host read decides the output

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        m = page_meta(shared, batch)
        out = softmax_attention(mode, q, pools, layer, m["kv_indices"], m["kv_lens"])
        return out * (flag(shared) if stage == BODY else meta["flag"])

    stages = {PREPARE_OUT_GRAPH: {"prepare_out_graph": lambda mode, shared, batch: {"flag": flag(shared)}},
              PREPARE_IN_GRAPH: {"prepare_in_graph": lambda mode, shared, batch, meta: {"flag": flag(shared)}},
              BODY: {}}[stage]
    effect = ReadEffect.uniform(BUFFERS, end)
    return leaf(f"{name}_{stage}", attend, declare={M: effect}, **stages)


@pytest.mark.parametrize("stage", STAGES, ids=str)
@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_a_host_read_is_an_escape_in_every_stage(name: str, stage: Stage) -> None:
    program = trace(_backend(name, stage, ReadEnd.POST_REPLAY), M, cfg=CFG)
    escapes = program.unfaithful()
    assert escapes and {e[0] for e in escapes} == {stage}, escapes
    # swa_map, which no stage reads: in the graph every buffer is read until the stage's escape
    # end; out of it the host read counts for the lengths it reaches, not the map (NONE)
    assert program.traced()["swa_map"] is program.stage(stage).escape_end


@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_declared_before_its_escape_it_is_refused(name: str) -> None:
    early = _backend(name, PREPARE_IN_GRAPH, ReadEnd.IN_REPLAY)  # its Python may hand the body a view of any
    assert audit(early, M, cfg=CFG).failure().observed is ReadEnd.POST_REPLAY
    with CpuDevice() as dev, pytest.raises(UnsoundLowering):
        lower(early, M, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)


@pytest.mark.parametrize("stage", STAGES, ids=str)
@pytest.mark.parametrize("name", ["slice_bound", "contains", "equal"])
def test_declared_right_it_runs_as_python_bit_identical_to_serial(name: str, stage: Stage) -> None:
    backend = _backend(name, stage, ReadEnd.POST_REPLAY)
    serial = run_serial(backend, M, steps=4, batch_size=3, cfg=CFG)
    with CpuDevice(timeout=30.0, faults=FaultInjector(3, 0.002, streams=["forward"], probability=0.3)) as dev:
        run = run_overlapped(backend, M, steps=4, policy=Policy.EXACT, device=dev, batch_size=3, cfg=CFG)
    assert run.matches(serial) and run.violations == ()


def test_the_host_read_changes_the_output() -> None:
    # not vacuous: the flag the host read decides differs between steps of the schedule
    backend = _backend("bool", BODY, ReadEnd.POST_REPLAY)
    logits = run_serial(backend, M, steps=4, batch_size=3, cfg=CFG).logits
    assert any(not torch.equal(logits[0] * 2, x) for x in logits)


@pytest.mark.parametrize("name", ["equal", "contains"])
def test_on_fake_tensors_the_trace_stops_at_a_host_read(name: str) -> None:
    program = trace(_backend(name, BODY, ReadEnd.POST_REPLAY), M, cfg=CFG, device="cuda")
    assert program.aborted is not None and "host read by aten." in program.aborted, program.aborted
    assert program.traced() == ReadEffect.unknown()


def test_on_fake_tensors_the_trace_stops_at_a_tensor_slice_bound() -> None:
    program = trace(_backend("slice_bound", PREPARE_IN_GRAPH, ReadEnd.POST_REPLAY), M, cfg=CFG, device="cuda")
    assert program.aborted is not None and "a tensor used as a slice bound" in program.aborted
    assert program.traced() == ReadEffect.unknown()
