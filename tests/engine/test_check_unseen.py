"""``verify_engine`` on a read no observer sees (a triton kernel reaching the live page table by an
address offset from memory the backend owns): poison finds it under every fence, the engine runner's
included, and the report names what each fence found (no run of the step saw the read)."""

from __future__ import annotations

import enum

import pytest
import torch

from readfence.backends import softmax_attention
from readfence.core import ForwardMode
from readfence.engine import RUNNER, adapt, audit_engine, verify_engine
from tests.conftest import NO_TRITON, TRITON

from .conftest import CFG

if not TRITON:
    pytest.skip(NO_TRITON, allow_module_level=True)

import triton
import triton.language as tl


class _Ends(enum.Enum):
    PRE_REPLAY = 1
    IN_REPLAY = 2
    POST_REPLAY = 3
    UNKNOWN = 4


@triton.jit
def _gather_at(anchor, offset, rows, out, stride, W: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(rows + b)
    i = tl.arange(0, W)
    tl.store(out + b * W + i, tl.load(anchor + offset + r * stride + i))


class ReadsByOffset:
    """Declares the page table read before the replay; its forward's kernel reads the live table
    through an offset from a tensor of its own (no tensor argument is the table)."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.anchor = torch.zeros(1, dtype=self.table.dtype)
        self.offset = (self.table.data_ptr() - self.anchor.data_ptr()) // self.table.element_size()

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.lens = fb.seq_lens.long().clone()

    def init_forward_metadata_in_graph(self, fb):
        pass

    def shared_read_ends(self, mode):
        return _Ends.PRE_REPLAY

    def forward(self, q, k, v, layer, fb, save_kv_cache=True):
        rows, width = fb.req_pool_indices, self.table.shape[1]
        out = torch.empty(rows.shape[0], width, dtype=self.table.dtype)
        _gather_at[(rows.shape[0],)](self.anchor, self.offset, rows, out, self.table.stride(0), width)
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        return softmax_attention(fb.forward_mode.readfence, q, {"k_cache": pool.k_buffer, "v_cache": pool.v_buffer},
                                 layer.layer_id, out.long(), self.lens)


def test_a_read_no_observer_sees_is_found_by_poison_under_every_fence_the_runners_too(dev):
    engine = adapt(ReadsByOffset, cfg=CFG)
    assert audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1).unwrap()  # (what the audit cannot see)
    found = verify_engine(engine, device=dev, steps=2, batch_size=2).failure()
    rows = {r.name: r for r in found.report.rows}
    assert rows["COARSE"].clean
    for name in ("PER_BUFFER", "EXACT", RUNNER):
        finding = rows[name].finding
        assert (finding.kind, finding.buffer, finding.evidence) == ("late read", "req_to_token", "poison"), name
        assert "no run of the step saw it read after its release" in finding.detail, name
