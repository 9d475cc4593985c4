"""Engine backend classes written here, against the contract alone: their own enum, no base class,
no registration; each keeps state from ``__init__`` and per-step metadata on ``self``."""

from __future__ import annotations

import enum
from typing import Any

import torch

from readfence.backends import softmax_attention


class Ends(enum.Enum):
    """An engine's own declaration enum (the adapter matches its members by name)."""

    PRE_REPLAY = 1
    IN_REPLAY = 2
    POST_REPLAY = 3
    UNKNOWN = 4


def attention(fb: Any, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
    """Store this step's keys and values, then attend over ``indices`` (readfence's kernel)."""
    pool = fb.token_to_kv_pool
    pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
    return softmax_attention(fb.forward_mode.readfence, q, {"k_cache": pool.k_buffer, "v_cache": pool.v_buffer},
                             layer.layer_id, indices, lens)


class _Forward:
    """``forward`` over ``self.indices`` / ``self.lens`` (what the metadata stages leave on self)."""

    indices: torch.Tensor
    lens: torch.Tensor

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return attention(forward_batch, layer, q, k, v, self.indices_now(forward_batch), self.lens)

    def indices_now(self, fb: Any) -> torch.Tensor:
        return self.indices


class KeptCopies(_Forward):
    """Keeps the live page table and lengths from ``__init__``; snapshots the batch's rows as copies
    in a dict before the replay: PRE_REPLAY, sound."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.lengths = runner.req_to_token_pool.seq_lens
        self.meta: dict[str, torch.Tensor] = {}

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        rows = forward_batch.req_pool_indices
        self.meta = {"indices": self.table.index_select(0, rows).long(), "lens": self.lengths.index_select(0, rows).long()}

    def init_forward_metadata_in_graph(self, forward_batch):
        self.indices, self.lens = self.meta["indices"], self.meta["lens"]

    def shared_read_ends(self, mode):
        return Ends.UNKNOWN if mode.is_idle() else Ends.PRE_REPLAY


class KeepsAView(_Forward):
    """Keeps a *view* of the live page table across the replay boundary (no copy) and gathers from
    it in every layer, while declaring PRE_REPLAY: unsound, the read ends POST_REPLAY."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.rows = self.table.narrow(0, 0, self.table.shape[0])  # a view: reads nothing yet
        self.which = forward_batch.req_pool_indices.clone()
        self.lens = forward_batch.seq_lens.long()

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def indices_now(self, fb):
        return self.rows.index_select(0, self.which).long()

    def shared_read_ends(self, mode):
        return Ends.PRE_REPLAY


class HostBounds:
    """Data-dependent shapes: the prefix of each request is copied row by row with bounds read on
    the host (into a padded buffer of its own, sized in ``__init__``), and ``forward`` slices the
    live page table per request with host bounds again. Declares POST_REPLAY."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.padded = torch.zeros(runner.req_to_token_pool.size, runner.model_config.context_len, dtype=torch.long)
        self.scale = runner.model_config.head_dim ** -0.5

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.padded.zero_()
        rows, lens = forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens_cpu.tolist()
        for i, (row, n) in enumerate(zip(rows, lens)):
            self.padded[i, :n] = self.table[row, :n]  # a host-bounded slice: its shape is data

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def shared_read_ends(self, mode):
        return Ends.POST_REPLAY if mode.is_decode() or mode.is_target_verify() else Ends.UNKNOWN

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        pool, n = forward_batch.token_to_kv_pool, forward_batch.tokens_per_request
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        keys, values = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        outs = []
        for i, (row, length) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens_cpu.tolist())):
            slots = self.table[row, :length].long()
            assert slots.tolist() == self.padded[i, :length].tolist()  # the out-of-graph copy agrees
            qi = q.narrow(0, i * n, n)
            scores = torch.einsum("nhd,lhd->hnl", qi, keys.index_select(0, slots)) * self.scale
            causal = torch.arange(length).unsqueeze(0) <= (length - n + torch.arange(n)).unsqueeze(1)
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            outs.append(torch.einsum("hnl,lhd->nhd", probs, values.index_select(0, slots)))
        return torch.cat(outs)

    forward_extend = forward_decode


class RenamedSlots:
    """Finds the state-slot map where its engine keeps it (``runner.mamba.indices``: the layout
    names it) and looks its slots up inside the graph: the default IN_REPLAY, sound."""

    def __init__(self, runner):
        self.indices_of = runner.mamba.indices
        self.table = runner.req_to_token_pool.req_to_token

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def init_forward_metadata_in_graph(self, forward_batch):
        rows = forward_batch.req_pool_indices
        self.slots = self.indices_of.index_select(0, rows)
        self.indices = self.table.index_select(0, rows).long()
        self.lens = forward_batch.seq_lens.long()

    def shared_read_ends(self, mode):
        return Ends.IN_REPLAY if mode.is_decode() or mode.is_target_verify() else Ends.UNKNOWN

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return attention(forward_batch, layer, q, k, v, self.indices, self.lens) + 0 * self.slots.sum()


class ForgetfulWrapper:
    """A wrapper that does not delegate its declaration: it returns its first child's although its
    second child reads the page table until the replay ends (the bug class wrappers had)."""

    def __init__(self, runner):
        self.attn_backend_list = [KeptCopies(runner), KeepsAView(runner)]
        self.attn_backend_list[1].shared_read_ends = lambda mode: Ends.POST_REPLAY  # that child is honest

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        for child in self.attn_backend_list:
            child.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        for child in self.attn_backend_list:
            child.init_forward_metadata_in_graph(forward_batch)

    def shared_read_ends(self, mode):
        return self.attn_backend_list[0].shared_read_ends(mode)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        child = self.attn_backend_list[layer.layer_id % 2]
        return child.forward(q, k, v, layer, forward_batch, save_kv_cache)


class CaptureAllocated(_Forward):
    """Allocates its metadata buffers in ``init_cuda_graph_state`` and binds them at capture
    (``in_capture=True``), as graph-captured backends do; the replay-time call only fills them
    (copies of the page table's rows, PRE_REPLAY). Without the capture-time calls it fails.
    EXTEND runs its eager entry point, ``init_forward_metadata``, which snapshots on its own."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.lengths = runner.req_to_token_pool.seq_lens
        self.calls: list[str] = []
        self.buffers: dict[str, torch.Tensor] | None = None
        self.bound: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.calls.append("init_cuda_graph_state")
        self.buffers = {"indices": torch.zeros(max_bs, self.table.shape[1], dtype=torch.long),
                        "lens": torch.zeros(max_bs, dtype=torch.long)}

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        b = forward_batch.batch_size
        if in_capture:
            assert self.buffers is not None, "capture before init_cuda_graph_state"
            self.calls.append(f"capture {forward_batch.forward_mode.name} b={b}")
            self.bound[b] = (self.buffers["indices"][:b], self.buffers["lens"][:b])
            return
        indices, lens = self.bound[b]  # a KeyError without the capture-time call
        rows = forward_batch.req_pool_indices
        indices.copy_(self.table.index_select(0, rows))
        lens.copy_(self.lengths.index_select(0, rows))
        self.indices, self.lens = indices, lens

    def init_forward_metadata(self, forward_batch):
        self.calls.append(f"eager {forward_batch.forward_mode.name}")
        rows = forward_batch.req_pool_indices
        self.indices = self.table.index_select(0, rows).long()
        self.lens = self.lengths.index_select(0, rows).long()

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def shared_read_ends(self, mode):
        return Ends.UNKNOWN if mode.is_idle() else Ends.PRE_REPLAY


class StaticBuffers(_Forward):
    """The graph runner's static-buffer pattern: metadata buffers allocated on first use, for the
    largest batch, and refilled in place before every replay; ``forward`` reads views of them. The
    page table is copied into them out of the graph: PRE_REPLAY, sound."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.max_bs = runner.req_to_token_pool.size
        self.buffers: dict[str, torch.Tensor] | None = None

    def _fill(self, forward_batch):
        if self.buffers is None:
            self.buffers = {"indices": torch.zeros(self.max_bs, self.table.shape[1], dtype=torch.long),
                            "lens": torch.zeros(self.max_bs, dtype=torch.long)}
        n = forward_batch.batch_size
        self.buffers["indices"][:n].copy_(self.table.index_select(0, forward_batch.req_pool_indices))
        self.buffers["lens"][:n].copy_(forward_batch.seq_lens)
        self.indices, self.lens = self.buffers["indices"][:n], self.buffers["lens"][:n]

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self._fill(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def shared_read_ends(self, mode):
        return Ends.UNKNOWN if mode.is_idle() else Ends.PRE_REPLAY


class StaticBuffersInGraph(StaticBuffers):
    """The same buffers refilled in the graph's prelude while still declaring PRE_REPLAY: the page
    table is read until IN_REPLAY, unsound."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def init_forward_metadata_in_graph(self, forward_batch):
        self._fill(forward_batch)


class ByMode(_Forward):
    """Metadata kept in a dict keyed by the engine's own mode enum, nested under a tuple key in a list:
    copies made before the replay, PRE_REPLAY, sound."""

    def __init__(self, runner):
        self.table = runner.req_to_token_pool.req_to_token
        self.per_mode: dict[Any, dict[tuple[str, int], list[torch.Tensor]]] = {}

    def _rows(self, forward_batch):
        return self.table.index_select(0, forward_batch.req_pool_indices).long()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.per_mode[forward_batch.forward_mode] = {("kv", 0): [self._rows(forward_batch),
                                                                 forward_batch.seq_lens.long()]}

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        indices, lens = self.per_mode[forward_batch.forward_mode][("kv", 0)]
        return attention(forward_batch, layer, q, k, v, indices, lens)

    def shared_read_ends(self, mode):
        return Ends.UNKNOWN if mode.is_idle() else Ends.PRE_REPLAY


class ByModeKeepsAView(ByMode):
    """The same dict holding a *view* of the live page table, gathered in every layer, while
    declaring PRE_REPLAY: the read ends POST_REPLAY, unsound."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.per_mode[forward_batch.forward_mode] = {("kv", 0): [self.table.narrow(0, 0, self.table.shape[0]),
                                                                 forward_batch.seq_lens.long()]}

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        table, lens = self.per_mode[forward_batch.forward_mode][("kv", 0)]
        indices = table.index_select(0, forward_batch.req_pool_indices).long()
        return attention(forward_batch, layer, q, k, v, indices, lens)
