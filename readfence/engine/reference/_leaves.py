"""The reference engine's leaf backends: stateful objects built from a model runner.

Each keeps references to the runner's live pools from construction and its per-step metadata
on ``self``, as engine backends do; each reads the shared buffers in one characteristic way:

====================  ==========================================================  ==============================
backend               reads                                                       declares (``shared_read_ends``)
====================  ==========================================================  ==============================
TrtllmMhaBackend      snapshots every metadata tensor out of the graph, as copies PRE_REPLAY (every mode)
TritonBackend         builds its metadata inside the graph from the page table    default (IN_REPLAY / UNKNOWN)
FlashInferBackend     plan() copies rows into its own buffers; run() is a kernel   PRE_REPLAY (every mode)
FlashInferReference   plan() keeps the live page table; run() reads it in graph   PRE_REPLAY: unsound, unseen
TorchNativeBackend    slices the live table per request, host-read bounds,        POST_REPLAY (DECODE, VERIFY)
                      in forward (nothing the tracer can follow)
MiniMaxSparseBackend  passes the live page table to its kernel in every layer     default IN_REPLAY: unsound
LinearAttnBackend     looks its state slots up inside the graph                   default
DeepSeekV4Backend     TARGET_VERIFY re-reads the table every layer (not dspark);  POST_REPLAY for VERIFY unless
                      prefill snapshots its plan when asked to                    dspark; per batch for EXTEND
====================  ==========================================================  ==============================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from readfence.backends import linear_attention, remap, top_pages

from ._base import AttentionBackend, ForwardMetadata, SharedReadEnds
from ._kernels import PagedWrapper, page_rows, paged_attention, save_kv

if TYPE_CHECKING:
    from .._contract import EngineMode
    from .._view import AttentionLayer, ForwardBatch

PRE, IN, POST, UNKNOWN = (SharedReadEnds.PRE_REPLAY, SharedReadEnds.IN_REPLAY, SharedReadEnds.POST_REPLAY,
                          SharedReadEnds.UNKNOWN)


def _every_mode(end: SharedReadEnds, mode: EngineMode) -> SharedReadEnds:
    return UNKNOWN if mode.is_idle() else end


class _Paged(AttentionBackend):
    """Attention over ``forward_metadata.kv_indices`` / ``kv_lens`` (what the stages computed)."""

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        md = self.forward_metadata
        assert md is not None and md.kv_indices is not None and md.kv_lens is not None
        if save_kv_cache:
            save_kv(forward_batch, layer, k, v)
        return paged_attention(forward_batch, layer, q, md.kv_indices, md.kv_lens)

    forward_decode = forward_extend


class TrtllmMhaBackend(AttentionBackend):
    """TRT-LLM MHA-like: full layers and sliding-window layers (odd layers, through ``swa_map``);
    every metadata tensor snapshotted out of the graph as a copy, so its reads end PRE_REPLAY."""

    def __init__(self, runner: Any, window: int = 8) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.swa_map = runner.token_to_kv_pool.full_to_swa_index_mapping
        self.window = window

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        indices = page_rows(self.req_to_token, forward_batch)
        self.forward_metadata = ForwardMetadata(
            kv_indices=indices, kv_lens=forward_batch.seq_lens.long(), swa_indices=remap(self.swa_map, indices),
            swa_loc=remap(self.swa_map, forward_batch.out_cache_loc))

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        return _every_mode(PRE, mode)

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        md = self.forward_metadata
        assert md is not None and md.kv_lens is not None
        if layer.layer_id % 2 == 0:
            assert md.kv_indices is not None
            save_kv(forward_batch, layer, k, v)
            return paged_attention(forward_batch, layer, q, md.kv_indices, md.kv_lens)
        assert md.swa_indices is not None and md.swa_loc is not None
        save_kv(forward_batch, layer, k, v, swa_loc=md.swa_loc)
        return paged_attention(forward_batch, layer, q, md.swa_indices, md.kv_lens, swa=True, window=self.window)

    forward_decode = forward_extend


class TritonBackend(_Paged):
    """Triton-like: builds its metadata from the page table inside the graph; declares nothing
    (the default: IN_REPLAY for DECODE and TARGET_VERIFY, UNKNOWN otherwise)."""

    def __init__(self, runner: Any) -> None:
        self.req_to_token_pool = runner.req_to_token_pool

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.forward_metadata = ForwardMetadata(kv_indices=page_rows(self.req_to_token_pool.req_to_token, forward_batch),
                                                kv_lens=forward_batch.seq_lens.long())


class FlashInferBackend(AttentionBackend):
    """FlashInfer-like plan/run: ``plan`` copies the batch's page-table rows and lengths into the
    wrapper's own buffers before the replay; the run kernel reads those (PRE_REPLAY)."""

    keep_reference = False

    def __init__(self, runner: Any) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.wrapper = PagedWrapper(runner.req_to_token_pool.size, runner.model_config.context_len, runner.device,
                                    keep_reference=self.keep_reference)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        self.wrapper.plan(self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens)

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        return _every_mode(PRE, mode)

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        if save_kv_cache:
            save_kv(forward_batch, layer, k, v)
        return self.wrapper.run(forward_batch, layer, q)

    forward_decode = forward_extend


class FlashInferReferenceBackend(FlashInferBackend):
    """The FlashInfer-like backend planning by *reference*: the wrapper keeps the live page table
    and the run kernel reads it inside the graph, while the declaration still says PRE_REPLAY.
    Unsound, and invisible to any static analysis (the kernel's arguments never include it)."""

    keep_reference = True


class TorchNativeBackend(AttentionBackend):
    """torch-native-like: no metadata at all; ``forward`` slices the live page table per request
    with bounds read on the host (data-dependent shapes: the tracer cannot follow it). Its reads
    end with the replay: it declares POST_REPLAY for DECODE and TARGET_VERIFY."""

    def __init__(self, runner: Any) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        return POST if mode.is_decode() or mode.is_target_verify() else UNKNOWN

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        import torch

        if save_kv_cache:
            save_kv(forward_batch, layer, k, v)
        pool, n = forward_batch.token_to_kv_pool, forward_batch.tokens_per_request
        keys, values = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        rows, lens = forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens_cpu.tolist()
        outs = []
        for i, (row, length) in enumerate(zip(rows, lens)):
            slots = self.req_to_token[row, :length].long()  # [length]: a shape read on the host
            qi = q.narrow(0, i * n, n)  # [n, H, D]
            scores = torch.einsum("nhd,lhd->hnl", qi, keys.index_select(0, slots)) * layer.scaling
            causal = torch.arange(length).unsqueeze(0) <= (length - n + torch.arange(n)).unsqueeze(1)
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            outs.append(torch.einsum("hnl,lhd->nhd", probs, values.index_select(0, slots)))
        return torch.cat(outs) if outs else q.new_zeros(q.shape)

    forward_decode = forward_extend


class MiniMaxSparseBackend(AttentionBackend):
    """MiniMax-sparse-like: lengths built inside the graph, but ``forward_decode`` hands the live
    page table to its kernel in every layer (it picks the best pages per layer), while the
    class overrides no declaration: the default IN_REPLAY is unsound (the read ends POST_REPLAY)."""

    def __init__(self, runner: Any, top_k: int = 2, page_size: int = 8) -> None:
        if runner.model_config.context_len % page_size:
            raise ValueError(f"page_size {page_size} must divide the context length {runner.model_config.context_len}")
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.select = top_pages(top_k, page_size)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.forward_metadata = ForwardMetadata(kv_lens=forward_batch.seq_lens.long())

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        md = self.forward_metadata
        assert md is not None and md.kv_lens is not None
        if save_kv_cache:
            save_kv(forward_batch, layer, k, v)
        indices = page_rows(self.req_to_token, forward_batch)  # the live page table, every layer
        return paged_attention(forward_batch, layer, q, indices, md.kv_lens, select=self.select)

    forward_decode = forward_extend


class LinearAttnBackend(AttentionBackend):
    """Linear attention (mamba-like): each request's state slot looked up inside the graph; the
    recurrent state lives in the model's state pool (the default declaration)."""

    def __init__(self, runner: Any, decay: float = 0.9) -> None:
        self.state_slots = runner.req_to_token_pool.state_slots
        self.decay = decay

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.forward_metadata = ForwardMetadata(state_indices=remap(self.state_slots, forward_batch.req_pool_indices))

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        md = self.forward_metadata
        assert md is not None and md.state_indices is not None
        pool = forward_batch.state_pool.get_state(layer.layer_id)
        out, state = linear_attention(forward_batch.forward_mode.readfence, q, k, v,
                                      pool.index_select(0, md.state_indices), decay=self.decay)
        pool.index_copy_(0, md.state_indices, state)
        return out

    forward_decode = forward_extend


class DeepSeekV4Backend(_Paged):
    """DeepSeek-V4-like. DECODE builds its metadata in the graph; TARGET_VERIFY re-reads the page
    table in every layer (POST_REPLAY) unless the speculative algorithm is dspark (IN_REPLAY);
    prefill (EXTEND) snapshots its plan out of the graph when ``resolve_prefill_shared_read_ends``
    is asked to build it, for at most ``snapshot_tokens`` query tokens (past them, a batch
    condition such as context parallelism prevents the snapshot: UNKNOWN, the forward reads
    the live table)."""

    def __init__(self, runner: Any, snapshot_tokens: int | None = None) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.dspark = getattr(runner.server_args, "speculative_algorithm", None) == "dspark"
        self.snapshot_tokens = snapshot_tokens
        self.prefill_snapshot: ForwardMetadata | None = None

    def _rereads(self, mode: EngineMode) -> bool:
        return mode.is_target_verify() and not self.dspark

    def shared_read_ends(self, mode: EngineMode) -> SharedReadEnds:
        if mode.is_target_verify():
            return IN if self.dspark else POST
        return super().shared_read_ends(mode)

    def resolve_prefill_shared_read_ends(self, forward_batch: ForwardBatch, *, num_qo_tokens: int,
                                         build_snapshot: bool = True) -> SharedReadEnds:
        if forward_batch.forward_mode.name != "EXTEND":
            return UNKNOWN
        can = self.snapshot_tokens is None or num_qo_tokens <= self.snapshot_tokens
        if build_snapshot:  # asked only whether it can (build_snapshot=False), it changes nothing
            self.prefill_snapshot = ForwardMetadata(kv_indices=page_rows(self.req_to_token, forward_batch),
                                                    kv_lens=forward_batch.seq_lens.long()) if can else None
        return PRE if can else UNKNOWN

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.name == "EXTEND":
            self.forward_metadata = self.prefill_snapshot  # None: the forward reads the live table
        elif self._rereads(mode):
            self.forward_metadata = ForwardMetadata(kv_lens=forward_batch.seq_lens.long())
        else:
            self.forward_metadata = ForwardMetadata(kv_indices=page_rows(self.req_to_token, forward_batch),
                                                    kv_lens=forward_batch.seq_lens.long())

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> Tensor:
        md = self.forward_metadata
        if md is None:  # prefill without a snapshot: the live table and lengths, now
            md = ForwardMetadata(kv_indices=page_rows(self.req_to_token, forward_batch),
                                 kv_lens=forward_batch.seq_lens.long())
        elif self._rereads(forward_batch.forward_mode):
            md = ForwardMetadata(kv_indices=page_rows(self.req_to_token, forward_batch), kv_lens=md.kv_lens)
        if save_kv_cache:
            save_kv(forward_batch, layer, k, v)
        assert md.kv_indices is not None and md.kv_lens is not None
        return paged_attention(forward_batch, layer, q, md.kv_indices, md.kv_lens)

    forward_decode = forward_extend
