"""An engine object's step, lowered, is the engine's step: its out-of-graph hook runs as Python
every step, and a Python value it keeps on ``self`` for ``forward`` is the one a CUDA graph would use.

SGLang's FlashAttention backend keeps ``max_seq_len_k = int(seq_lens_cpu.max())`` in its
out-of-graph hook and uses it in ``forward``. In a replayed mode the engine's ``forward`` runs
from a graph captured once: the Python value it used is the capture-time call's, on every step.
The adapter runs the object's in-graph code over what the capture-time call left on it, in the
serial run as in the lowered one, so both use that value, and they agree bit for bit; kept as a
tensor instead, the value is read on every step by both.
"""

from __future__ import annotations

import pytest
import torch

from readfence.core import ForwardMode
from readfence.engine import adapt
from readfence.graph import Policy, run_overlapped, run_serial

from .classes import Ends, attention
from .conftest import CFG

M = ForwardMode


class KeepsHostMax:
    """Keeps the batch's longest length as a Python int on ``self`` before the replay (read on
    the host from ``seq_lens_cpu``) and clamps the lengths with it in ``forward``."""

    as_tensor = False

    def __init__(self, runner):
        self.seen: list = []  # what forward used, step by step (the serial run's Python)
        self.table = runner.req_to_token_pool.req_to_token
        self.lengths = runner.req_to_token_pool.seq_lens

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        rows = forward_batch.req_pool_indices
        self.indices = self.table.index_select(0, rows).long()
        self.lens = self.lengths.index_select(0, rows).long()
        longest = int(forward_batch.seq_lens_cpu.max())
        self.max_seq_len_k = torch.full((1,), longest) if self.as_tensor else longest

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def shared_read_ends(self, mode):
        return Ends.UNKNOWN if mode.is_idle() else Ends.PRE_REPLAY

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.seen.append(self.max_seq_len_k if not self.as_tensor else self.max_seq_len_k.clone())
        lens = torch.minimum(self.lens, (self.max_seq_len_k - 1).clamp(min=1)) if self.as_tensor else (
            self.lens.clamp(max=max(self.max_seq_len_k - 1, 1)))
        lens = lens.clamp(min=1)
        return attention(forward_batch, layer, q, k, v, self.indices, lens)


class KeepsTensorMax(KeepsHostMax):
    """The same, the longest length kept as a tensor: a capture reads it every replay."""

    as_tensor = True


@pytest.mark.parametrize("cls", [KeepsHostMax, KeepsTensorMax], ids=lambda c: c.__name__)
def test_a_value_kept_on_self_for_forward_is_used_as_the_engine_uses_it(cls, dev):
    engine = adapt(cls, cfg=CFG)
    serial = run_serial(engine, steps=4, batch_size=2, cfg=CFG, state=engine.state)
    used = [int(v) for v in engine.object.seen[-8:]]  # two layers a step
    if cls is KeepsHostMax:  # the capture-time call's value, on every step
        assert len(set(used)) == 1, used
    else:  # read on every step: the lengths grow
        assert len(set(used)) > 1, used
    for policy in (Policy.COARSE, Policy.EXACT):
        run = run_overlapped(engine, M.DECODE, steps=4, policy=policy, device=dev, batch_size=2, cfg=CFG,
                             state=engine.state)
        assert run.matches(serial) and run.violations == (), policy
        assert not any(torch.isnan(t).any() for t in serial.logits)  # not vacuous: NaN never equals NaN
