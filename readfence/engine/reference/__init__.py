"""A CPU reference engine in SGLang's style: stateful backend objects readfence audits as they are.

The engine's own pieces are the model runner, its request-to-token pool and KV pool and the
forward batch (:mod:`readfence.engine`'s views of readfence's state), a base class with the
default declaration (:class:`AttentionBackend`), leaf backends (``_leaves``) and wrappers
(``_wrappers``). Each function below builds one backend tree, adapted: a zero-argument
factory (``cfg`` optional), so ``readfence audit --engine readfence.engine.reference:NAME``
reaches it; :data:`ENGINES` lists them all (``--engine readfence.engine.reference:ENGINES``).

>>> from readfence.core import ForwardMode
>>> engine = minimax_hybrid_engine()
>>> [(path, node.read_end(ForwardMode.DECODE).name) for path, node in engine.walk()]  # doctest: +NORMALIZE_WHITESPACE
[('MiniMaxHybridAttnBackend', 'IN_REPLAY'),
 ('MiniMaxHybridAttnBackend/attn_backend_list[0]/MiniMaxSparseBackend', 'IN_REPLAY'),
 ('MiniMaxHybridAttnBackend/attn_backend_list[1]/FlashInferBackend', 'PRE_REPLAY')]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from readfence.core import ModelConfig

from .._adapter import EngineBackend, adapt
from ._base import AttentionBackend, ForwardMetadata, SharedReadEnds
from ._kernels import PagedWrapper
from ._leaves import (
    DeepSeekV4Backend,
    FlashInferBackend,
    FlashInferReferenceBackend,
    LinearAttnBackend,
    MiniMaxSparseBackend,
    TorchNativeBackend,
    TritonBackend,
    TrtllmMhaBackend,
)
from ._wrappers import (
    DotsHybridAttnBackend,
    HybridAttnBackend,
    HybridLinearAttnBackend,
    MiniMaxHybridAttnBackend,
    TboAttnBackend,
)


def _engine(factory: Callable[[Any], Any], cfg: ModelConfig | None, **kw: Any) -> EngineBackend:
    return adapt(factory, cfg=cfg, **kw)


def trtllm_mha_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """Snapshots with copies out of the graph: PRE_REPLAY, sound."""
    return _engine(TrtllmMhaBackend, cfg)


def triton_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """Metadata built inside the graph from the page table: the default IN_REPLAY, sound."""
    return _engine(TritonBackend, cfg)


def flashinfer_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """plan/run copying into its own buffers: PRE_REPLAY, sound."""
    return _engine(FlashInferBackend, cfg)


def flashinfer_reference_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """plan/run keeping a reference to the live page table: PRE_REPLAY, unsound (only the runtime
    checks see it)."""
    return _engine(FlashInferReferenceBackend, cfg)


def torch_native_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """Host-read bounds over the live page table in forward: untraceable, POST_REPLAY by observation."""
    return _engine(TorchNativeBackend, cfg)


def minimax_sparse_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """The live page table in every layer's kernel, inheriting IN_REPLAY: unsound."""
    return _engine(MiniMaxSparseBackend, cfg)


def linear_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """State slots looked up inside the graph: the default IN_REPLAY, sound."""
    return _engine(LinearAttnBackend, cfg)


def deepseek_v4_engine(cfg: ModelConfig | None = None, *, dspark: bool = False) -> EngineBackend:
    """POST_REPLAY for TARGET_VERIFY (IN_REPLAY with dspark); prefill resolved per batch."""
    return _engine(lambda runner: DeepSeekV4Backend(runner, snapshot_tokens=8), cfg,
                   name="DeepSeekV4Backend", server_args={"speculative_algorithm": "dspark" if dspark else None})


def hybrid_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """Prefill on DeepSeek-V4, the graph modes on TRT-LLM MHA: the selected child's declaration."""
    return _engine(lambda runner: HybridAttnBackend(DeepSeekV4Backend(runner, snapshot_tokens=8),
                                                    TrtllmMhaBackend(runner)), cfg, name="HybridAttnBackend")


def tbo_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """Two-batch overlap of two Triton backends, prepared also by DeepSeek-V4: conservative by one
    in TARGET_VERIFY (the primary only prepares, yet its POST_REPLAY is joined)."""
    return _engine(lambda runner: TboAttnBackend(DeepSeekV4Backend(runner), [TritonBackend(runner),
                                                                             TritonBackend(runner)]),
                   cfg, name="TboAttnBackend")


def hybrid_linear_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """TRT-LLM MHA on layer 0, linear attention on the others: the latest of both."""
    return _engine(lambda runner: HybridLinearAttnBackend(TrtllmMhaBackend(runner), LinearAttnBackend(runner)),
                   cfg, name="HybridLinearAttnBackend")


def minimax_hybrid_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """MiniMax's pair: the sparse backend (unsound) and a FlashInfer-like dense one."""
    return _engine(lambda runner: MiniMaxHybridAttnBackend(MiniMaxSparseBackend(runner), FlashInferBackend(runner)),
                   cfg, name="MiniMaxHybridAttnBackend")


def dots_hybrid_engine(cfg: ModelConfig | None = None) -> EngineBackend:
    """Triton and TRT-LLM MHA layers; UNKNOWN for EXTEND (its padding path re-reads the tables)."""
    return _engine(lambda runner: DotsHybridAttnBackend(TritonBackend(runner), TrtllmMhaBackend(runner)),
                   cfg, name="DotsHybridAttnBackend")


#: Every reference engine backend, by name (each a zero-argument factory of the adapted backend).
ENGINES: dict[str, Callable[..., EngineBackend]] = {
    "trtllm_mha": trtllm_mha_engine,
    "triton": triton_engine,
    "flashinfer": flashinfer_engine,
    "flashinfer_reference": flashinfer_reference_engine,
    "torch_native": torch_native_engine,
    "minimax_sparse": minimax_sparse_engine,
    "linear": linear_engine,
    "deepseek_v4": deepseek_v4_engine,
    "hybrid": hybrid_engine,
    "tbo": tbo_engine,
    "hybrid_linear": hybrid_linear_engine,
    "minimax_hybrid": minimax_hybrid_engine,
    "dots_hybrid": dots_hybrid_engine,
}

__all__ = [
    "ENGINES",
    "AttentionBackend",
    "DeepSeekV4Backend",
    "DotsHybridAttnBackend",
    "FlashInferBackend",
    "FlashInferReferenceBackend",
    "ForwardMetadata",
    "HybridAttnBackend",
    "HybridLinearAttnBackend",
    "LinearAttnBackend",
    "MiniMaxHybridAttnBackend",
    "MiniMaxSparseBackend",
    "PagedWrapper",
    "SharedReadEnds",
    "TboAttnBackend",
    "TorchNativeBackend",
    "TritonBackend",
    "TrtllmMhaBackend",
    "deepseek_v4_engine",
    "dots_hybrid_engine",
    "flashinfer_engine",
    "flashinfer_reference_engine",
    "hybrid_engine",
    "hybrid_linear_engine",
    "linear_engine",
    "minimax_hybrid_engine",
    "minimax_sparse_engine",
    "tbo_engine",
    "torch_native_engine",
    "trtllm_mha_engine",
    "triton_engine",
]
