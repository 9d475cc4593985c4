"""Per-step metadata on ``self`` crosses the stages as it does in the engine: fresh tensors as
outputs (copies out of the graph), views of live buffers as views of the next call's buffers."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from readfence.core import ForwardMode, cross_into_graph
from readfence.core.internal import example_step
from readfence.engine import EngineError, ForwardBatch, adapt
from readfence.engine._lift import leaves, path_text

from .classes import Ends, KeepsAView, KeptCopies
from .conftest import CFG

M = ForwardMode


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _stages(engine, mode=M.DECODE, batch_size=2, seed=0):
    """Run the three stages by hand on an example step (not the engine's state): the meta each
    stage hands on, and the example's shared buffers."""
    step = example_step(engine.cfg, mode, batch_size, seed=seed)
    out = cross_into_graph(engine.prepare_out_graph(mode, step.shared, step.batch))
    inner = engine.prepare_in_graph(mode, step.shared, step.batch, out)
    meta = {**out, **inner}
    q = torch.randn(step.num_tokens, engine.cfg.heads, engine.cfg.head_dim)
    engine.attend(mode, 0, q, q, q, step.pools, step.shared, step.batch, meta)
    return out, inner, step


def test_fresh_metadata_is_the_out_of_graph_stage_output_and_comes_back_as_its_copy():
    engine = adapt(KeptCopies, cfg=CFG)
    out, inner, _ = _stages(engine)
    assert sorted(out) == ["out/meta['indices']", "out/meta['lens']"] and inner == {}
    obj = engine.object
    # the body ran on the copies that crossed into the graph, not on the tensors the method made
    assert obj.meta["indices"] is out["out/meta['indices']"]
    assert _same_memory(obj.indices, out["out/meta['indices']"])  # what in_graph took of it: that copy, viewed


def test_a_view_of_a_live_buffer_stays_a_view_of_the_buffer_of_the_call():
    engine = adapt(KeepsAView, cfg=CFG)
    out, _, step = _stages(engine)
    assert not any("rows" in key for key in out)  # not copied: it is read where it is used
    assert _same_memory(engine.object.rows, step.shared["req_to_token"])  # this call's table, not the kept one
    assert not _same_memory(engine.object.rows, engine.state["shared"]["req_to_token"])


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    pair: Pair


class Containers(KeptCopies):
    """Metadata in a frozen dataclass holding a namedtuple; a view of its own buffer; the batch."""

    def __init__(self, runner):
        super().__init__(runner)
        self.workspace = torch.zeros(runner.req_to_token_pool.size, runner.model_config.context_len, dtype=torch.long)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        rows = forward_batch.req_pool_indices
        b = forward_batch.batch_size
        self.workspace.narrow(0, 0, b).copy_(self.table.index_select(0, rows))
        self.md = Frozen(Pair(self.workspace.narrow(0, 0, b), self.lengths.index_select(0, rows).long()))
        self.batch = forward_batch

    def init_forward_metadata_in_graph(self, forward_batch):
        self.indices, self.lens = self.md.pair.first, self.md.pair.second
        assert self.batch is forward_batch


def test_containers_views_of_own_buffers_and_the_forward_batch_come_back():
    engine = adapt(Containers, cfg=CFG)
    out, inner, _ = _stages(engine)
    obj = engine.object
    assert sorted(out) == ["out/md.pair.second"]  # the workspace view is the workspace again, not a copy
    assert _same_memory(obj.md.pair.first, obj.workspace) and isinstance(obj.md.pair, Pair)
    assert obj.md.pair.second is out["out/md.pair.second"]
    assert isinstance(obj.batch, ForwardBatch) and obj.batch.forward_mode.name == "DECODE"


def test_the_walk_lists_an_object_under_every_path_it_is_reachable_by():
    class Holder:
        pass

    h = Holder()
    t = torch.zeros(1)
    shared = Holder()
    shared.t = t
    h.a, h.b = shared, shared
    assert [path_text(p) for p, _ in leaves(h)] == ["a.t", "b.t"]


def test_metadata_that_changes_shape_in_a_replayed_mode_is_refused_naming_it():
    class Ragged(KeptCopies):
        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            longest = int(forward_batch.seq_lens.max())  # a host read: the shape is data
            self.meta["indices"] = self.meta["indices"].narrow(1, 0, longest).contiguous()

        def init_forward_metadata_in_graph(self, forward_batch):
            pass

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            return q

    engine = adapt(Ragged, cfg=CFG)
    step = example_step(CFG, M.DECODE, 2)
    engine.prepare_out_graph(M.DECODE, step.shared, step.batch)
    step.shared["seq_lens"].add_(1)
    with pytest.raises(EngineError, match=r"Ragged.init_forward_metadata_out_graph keeps per-step metadata "
                                          r"\"out/meta\['indices'\]\" of shape \(2, \d+\) now, \(2, \d+\) on its "
                                          r"first call in DECODE at batch size 2.*pad it"):
        engine.prepare_out_graph(M.DECODE, step.shared, step.batch)
    # prefill runs eagerly: its metadata may change shape from batch to batch
    extend = example_step(CFG, M.EXTEND, 2)
    engine.prepare_out_graph(M.EXTEND, extend.shared, extend.batch)
    extend.shared["seq_lens"].add_(1)
    engine.prepare_out_graph(M.EXTEND, extend.shared, extend.batch)


def test_metadata_whose_structure_changed_between_stages_is_named():
    class Vanishing(KeptCopies):
        def init_forward_metadata_in_graph(self, forward_batch):
            del self.meta
            self.indices = self.lens = torch.zeros(1)

    engine = adapt(Vanishing, cfg=CFG)
    with pytest.raises(EngineError, match=r"cannot put per-step metadata back at \"meta\['indices'\]\""):
        _stages(engine)


def test_the_declaration_is_the_scalar_for_every_buffer_it_covers():
    engine = adapt(KeptCopies, cfg=CFG, reads=["req_to_token", "seq_lens"])
    effect = engine.read_effect(M.DECODE)
    assert [effect[b].name for b in ("req_to_token", "seq_lens", "swa_map", "state_slots")] == [
        "PRE_REPLAY", "PRE_REPLAY", "NONE", "NONE"]
    everything = adapt(KeptCopies, cfg=CFG)
    assert {e.name for _, e in everything.read_effect(M.DECODE).items()} == {Ends.PRE_REPLAY.name}
    assert everything.read_end(M.IDLE).name == "UNKNOWN"
