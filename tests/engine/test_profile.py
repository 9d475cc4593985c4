"""An engine's profile: its own mode enum (found from the object's module, or given), its own layers,
its runtime context, the backends it never graph-replays."""

from __future__ import annotations

import contextlib
import enum

import pytest

from readfence.core import ForwardMode as RF
from readfence.effects import ReadEnd
from readfence.engine import EngineError, EngineProfile, adapt, audit_engine
from readfence.engine._profile import Modes, find_modes

from .conftest import CFG


class ForwardMode(enum.IntEnum):
    """An engine's own enum, SGLang's names (DRAFT_EXTEND_V2), with a member readfence has not."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND_V2 = 6

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


class Ends(enum.Enum):
    PRE_REPLAY, IN_REPLAY, POST_REPLAY, UNKNOWN = 1, 2, 3, 4


CONTEXT: list[str] = []


class Compares:
    """Compares modes with its own enum, as SGLang's code does; reads the page table in forward."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.layers = []

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def shared_read_ends(self, mode):
        if CONTEXT[-1:] != ["published"]:
            raise RuntimeError("the runtime context is not published")
        return Ends.POST_REPLAY if mode == ForwardMode.DECODE else Ends.UNKNOWN

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        assert forward_batch.forward_mode.is_decode() == (forward_batch.forward_mode == ForwardMode.DECODE)
        self.layers.append(layer)
        return q + self.table.index_select(0, forward_batch.req_pool_indices).sum().to(q.dtype) * 0


@contextlib.contextmanager
def published(runner):
    CONTEXT.append("published")
    try:
        yield
    finally:
        CONTEXT.pop()


def test_the_engines_enum_is_found_from_the_objects_module_and_reaches_its_comparisons():
    assert find_modes(Compares.__new__(Compares)) is ForwardMode
    engine = adapt(Compares, cfg=CFG, profile=EngineProfile(context=published))
    assert engine.read_effect(RF.DECODE)["req_to_token"] is ReadEnd.POST_REPLAY  # == ForwardMode.DECODE held
    assert engine.read_effect(RF.TARGET_VERIFY)["req_to_token"] is ReadEnd.UNKNOWN
    assert engine.binding.modes.engine(RF.DRAFT_EXTEND) is ForwardMode.DRAFT_EXTEND_V2
    report = audit_engine(engine, RF.DECODE, batch_sizes=[2], steps=1).unwrap()
    assert report.sound and report.rows()[0].truth is ReadEnd.POST_REPLAY


def test_without_its_runtime_context_the_engines_code_fails_at_adapt():
    with pytest.raises(EngineError, match="Compares.shared_read_ends raised RuntimeError in DECODE: the runtime context"):
        adapt(Compares, cfg=CFG)


def test_the_users_own_layers_are_handed_to_forward():
    made = {}

    def layer(runner, layer_id):
        made[layer_id] = ("mine", layer_id)
        return made[layer_id]

    engine = adapt(Compares, cfg=CFG, profile=EngineProfile(context=published, layer=layer))
    audit_engine(engine, RF.DECODE, batch_sizes=[1], steps=1)
    assert set(map(id, engine.object.layers)) <= set(map(id, made.values())) and sorted(made) == [0, 1]


def test_a_backend_the_engine_never_replays_has_unused_declarations():
    engine = adapt(Compares, cfg=CFG, profile=EngineProfile(context=published, replays=lambda obj: False))
    assert not engine.replayed(RF.DECODE)
    node = audit_engine(engine, RF.DECODE, batch_sizes=[1], steps=1).unwrap().find("Compares", RF.DECODE)  # unused: not a failure
    assert "never graph-replays" in node.unused and not any(r.used for r in node.rows)


def test_an_enum_lacking_a_mode_and_a_bad_profile_are_refused_by_name():
    class Few(enum.Enum):
        DECODE, EXTEND = 1, 2

    with pytest.raises(ValueError, match="Few has no member for readfence's TARGET_VERIFY"):
        Modes.of_enum(Few)
    with pytest.raises(TypeError, match="modes must be the engine's mode enum"):
        Modes.of_enum(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EngineProfile.layer must be callable"):
        EngineProfile(layer=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EngineProfile.buffers must be a mapping"):
        EngineProfile(buffers=["seq_lens"])  # type: ignore[arg-type]


def test_capture_time_calls_run_once_before_the_replays_and_extend_takes_the_eager_entry(dev):
    from readfence.engine import verify_engine
    from readfence.graph import Policy

    from .classes import CaptureAllocated

    engine = adapt(CaptureAllocated, cfg=CFG)
    assert engine.object.calls == ["init_cuda_graph_state"]
    report = audit_engine(engine, [RF.DECODE, RF.EXTEND], batch_sizes=[2], steps=1).unwrap()
    assert report.sound, report.table()
    calls = engine.object.calls
    assert calls.count("capture DECODE b=2") == 1 and "eager EXTEND" in calls and "capture EXTEND b=2" not in calls
    rows = {(r.mode, r.buffer): r.truth for r in report.rows()}
    assert rows[(RF.DECODE, "req_to_token")] is ReadEnd.PRE_REPLAY and rows[(RF.EXTEND, "req_to_token")] is ReadEnd.PRE_REPLAY
    for mode in (RF.DECODE, RF.EXTEND):
        result = verify_engine(engine, mode, device=dev, policies=[Policy.EXACT], steps=3, batch_size=2).unwrap()
        assert result.ok, str(result)
