"""SGLang 0.5.23's real attention backends, adapted with SGLang's profile, and adversarial subclasses.

The first use of ``MODULES``, ``REASON``, the classes or a factory imports SGLang's attention
modules (with the stand-ins of ``sglang_standins`` for its GPU-only imports), once: importing this
module does not, so that collecting tests that never build an SGLang backend does not pay SGLang's
import. ``REASON`` says why not where they cannot be imported. Every factory here is
``MODULE:FACTORY`` for ``readfence audit --engine`` too.

The wrappers are built over children CPU can run: SGLang's torch-native backend, or ``LateNative``,
a subclass whose one change is the honest declaration of what torch-native's ``forward`` does
(it slices the live page table in every layer: POST_REPLAY) under a name SGLang does not turn
CUDA graphs off for, so that its declaration is one the engine uses. Where the real triton is
installed, SGLang's ``TritonAttnBackend`` runs as shipped, its kernels in triton's interpreter
(``TRITON_REASON`` says why not where it is not), alone and as the children of TBO and HybridLinear.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from readfence.core import ModelConfig
from readfence.engine import EngineBackend, adapt, sglang_profile

from .sglang_standins import import_sglang


@functools.cache
def _sglang() -> tuple[dict[str, Any], str]:
    return import_sglang()


def _modules() -> dict[str, Any]:
    return _sglang()[0]


#: Two layers, four requests of at most 16 tokens: every trace and run stays cheap.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)


@functools.cache
def _classes() -> dict[str, Any]:
    modules = _modules()
    if not modules:
        return {}
    base = modules["base_attn_backend"]
    native = modules["torch_native_backend"].TorchNativeAttnBackend
    ends, fm = base.SharedReadEnds, modules["base_attn_backend"].ForwardMode

    class LateNative(native):  # type: ignore[misc, valid-type]
        """torch-native, declaring what its forward does: the page table is read until the replay ends."""

        def shared_read_ends(self, mode: Any) -> Any:
            return ends.POST_REPLAY

    class EarlyPrefillNative(LateNative):  # type: ignore[misc, valid-type]
        """Declares PRE_REPLAY for EXTEND (SGLang's eager runner publishes it before the forward), while
        its forward_extend slices the live page table in every layer."""

        def shared_read_ends(self, mode: Any) -> Any:
            return ends.PRE_REPLAY if mode == fm.EXTEND else super().shared_read_ends(mode)

    class ForgetfulTbo(modules["tbo_backend"].TboAttnBackend):  # type: ignore[misc, name-defined]
        """SGLang's TBO with its ``shared_read_ends`` put back to the base class's default."""

        shared_read_ends = base.AttentionBackend.shared_read_ends

    class BrokenNative(LateNative):  # type: ignore[misc, valid-type]
        """A bug of the engine's own code in forward_decode (a missing metadata key)."""

        def forward_decode(self, *args: Any, **kwargs: Any) -> Any:
            return {}["decode_plan"]

    return {"LateNative": LateNative, "EarlyPrefillNative": EarlyPrefillNative, "ForgetfulTbo": ForgetfulTbo,
            "BrokenNative": BrokenNative}


def _triton_reason() -> str:
    """Why SGLang's Triton backend is not here ("" where it is)."""
    modules, reason = _sglang()
    return reason or ("" if "triton_backend" in modules else
                      "triton is not installed (pip install -e '.[triton]'): SGLang's TritonAttnBackend runs "
                      "its kernels in triton's interpreter on a machine without a GPU")


@functools.cache
def _triton_classes() -> dict[str, Any]:
    if _triton_reason():
        return {}
    modules = _modules()
    base = modules["base_attn_backend"]
    triton = modules["triton_backend"].TritonAttnBackend
    ends, fm = base.SharedReadEnds, base.ForwardMode
    from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton

    class HonestTriton(triton):  # type: ignore[misc, valid-type]
        """SGLang's Triton backend declaring what its code does: its page table is read by a triton
        kernel in init_forward_metadata_out_graph (init_forward_metadata in EXTEND), before the replay
        (before the forward, in EXTEND)."""

        def shared_read_ends(self, mode: Any) -> Any:
            return ends.PRE_REPLAY if mode in (fm.DECODE, fm.TARGET_VERIFY, fm.EXTEND) else super().shared_read_ends(mode)

    class LateTriton(HonestTriton):
        """Declares PRE_REPLAY, while its forward_decode gathers the batch's page-table rows again from the
        live table, with SGLang's own kernel, into its metadata: a read in every layer."""

        def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any,
                           **kwargs: Any) -> Any:
            meta = self.forward_metadata
            bs = forward_batch.batch_size
            create_flashinfer_kv_indices_triton[(bs,)](
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, meta.kv_indptr, None,
                meta.kv_indices, self.req_to_token.stride(0))
            return super().forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)

        def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any,
                           **kwargs: Any) -> Any:
            meta = self.forward_metadata  # the prefix's rows gathered again from the live table, as above
            create_flashinfer_kv_indices_triton[(forward_batch.batch_size,)](
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.extend_prefix_lens, meta.kv_indptr,
                None, meta.kv_indices, self.req_to_token.stride(0))
            return super().forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)

    class LazyTriton(HonestTriton):
        """Keeps the prefix's kv_indices in a buffer of its own, allocated on its first step (not in
        init_cuda_graph_state) and refilled in place every step: the backend's own state."""

        lazy_indices: Any = None

        def init_forward_metadata(self, forward_batch: Any) -> None:
            super().init_forward_metadata(forward_batch)
            self._keep(self.forward_metadata)

        def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            self._keep(self.forward_metadata)

        def _keep(self, meta: Any) -> None:
            n = meta.kv_indices.numel()  # at most the page table's size, or the graph's static buffer's
            if self.lazy_indices is None:  # first use
                self.lazy_indices = torch.zeros(max(n, self.req_to_token.numel()), dtype=torch.int64,
                                                device=self.device)
            self.lazy_indices[:n].copy_(meta.kv_indices)
            self.forward_metadata = dataclasses.replace(meta, kv_indices=self.lazy_indices[:n])

    class LazyViewTriton(HonestTriton):
        """Keeps, from its first step on, a view of the live page table it made then (not in its
        constructor), and gathers the prefix's rows from it in forward_extend under an early declaration."""

        lazy_table: Any = None

        def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any,
                           **kwargs: Any) -> Any:
            if self.lazy_table is None:  # first use
                self.lazy_table = self.req_to_token[:]
            meta = self.forward_metadata
            create_flashinfer_kv_indices_triton[(forward_batch.batch_size,)](
                self.lazy_table, forward_batch.req_pool_indices, forward_batch.extend_prefix_lens, meta.kv_indptr,
                None, meta.kv_indices, self.lazy_table.stride(0))
            return super().forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)

    return {"TritonAttnBackend": triton, "HonestTriton": HonestTriton, "LateTriton": LateTriton,
            "LazyTriton": LazyTriton, "LazyViewTriton": LazyViewTriton}


#: The Triton backends' model: in triton's interpreter every attention kernel of a layer is most of
#: a step's time, and one layer runs each of them (the page table is still read by a kernel before
#: the replay, a late read still in the forward).
TRITON_CFG = ModelConfig(layers=1, max_reqs=4, max_ctx=16)
#: SGLang's Triton decode splits each request's context over ``triton_attention_num_kv_splits``
#: programs per head (8 shipped, as the CPU reports no cores to size it by), and in the interpreter
#: each program is a whole run of the kernel. Two still split every context and reduce the parts
#: (the same kernels, the same reads of the page table and of the metadata), at a quarter of the
#: runs. The CLI test audits the class by name, with the shipped default and two layers.
TRITON_ARGS = {"triton_attention_num_kv_splits": 2}


def _adapt(factory: Any, name: str, cfg: ModelConfig = CFG, **server_args: Any) -> EngineBackend:
    return adapt(factory, cfg=cfg, profile=sglang_profile(**server_args), name=name)


def _triton(factory: Any, name: str) -> EngineBackend:
    return _adapt(factory, name, TRITON_CFG, **TRITON_ARGS)


def torch_native() -> EngineBackend:
    """SGLang's TorchNativeAttnBackend as shipped."""
    return _adapt(_modules()["torch_native_backend"].TorchNativeAttnBackend, "TorchNativeAttnBackend")


def late_native() -> EngineBackend:
    return _adapt(_classes()["LateNative"], "LateNative")


def early_prefill() -> EngineBackend:
    return _adapt(_classes()["EarlyPrefillNative"], "EarlyPrefillNative")


def broken() -> EngineBackend:
    return _adapt(_classes()["BrokenNative"], "BrokenNative")


def tbo() -> EngineBackend:
    """SGLang's TboAttnBackend as shipped, over three LateNative."""
    late = _classes()["LateNative"]
    return _adapt(lambda r: _modules()["tbo_backend"].TboAttnBackend.init_new(lambda: late(r)), "tbo")


def forgetful_tbo() -> EngineBackend:
    """The seed's bug: TBO declaring the base default over children that read until POST_REPLAY."""
    late = _classes()["LateNative"]
    return _adapt(lambda r: _classes()["ForgetfulTbo"].init_new(lambda: late(r)), "forgetful_tbo")


def hybrid() -> EngineBackend:
    """SGLang's HybridAttnBackend: torch-native for prefill, LateNative for decode."""
    native = _modules()["torch_native_backend"].TorchNativeAttnBackend
    late = _classes()["LateNative"]
    return _adapt(lambda r: _modules()["hybrid_attn_backend"].HybridAttnBackend(r, native(r), late(r)), "hybrid")


def hybrid_linear() -> EngineBackend:
    """SGLang's HybridLinearAttnBackend with every layer a full-attention one (its linear child
    prepares metadata but attends no layer: no linear kernel runs on CPU)."""
    late = _classes()["LateNative"]
    wrapper = _modules()["hybrid_linear_attn_backend"].HybridLinearAttnBackend
    return _adapt(lambda r: wrapper(late(r), late(r), list(range(CFG.layers))), "hybrid_linear")


def minimax() -> EngineBackend:
    """SGLang's MiniMaxHybridAttnBackend (dense, sparse) over LateNative, no layer sparse."""
    late = _classes()["LateNative"]
    wrapper = _modules()["minimax_sparse_backend"].MiniMaxHybridAttnBackend
    return _adapt(lambda r: wrapper(late(r), late(r), []), "minimax")


def dots() -> EngineBackend:
    """SGLang's DotsHybridAttnBackend (dsa, swa) over LateNative."""
    late = _classes()["LateNative"]
    return _adapt(lambda r: _modules()["dots_hybrid_backend"].DotsHybridAttnBackend(late(r), late(r)), "dots")


def triton_attn() -> EngineBackend:
    """SGLang's TritonAttnBackend as shipped: its kernels run in triton's interpreter."""
    return _triton(_triton_classes()["TritonAttnBackend"], "TritonAttnBackend")


def honest_triton() -> EngineBackend:
    return _triton(_triton_classes()["HonestTriton"], "HonestTriton")


def late_triton() -> EngineBackend:
    return _triton(_triton_classes()["LateTriton"], "LateTriton")


def lazy_triton() -> EngineBackend:
    return _triton(_triton_classes()["LazyTriton"], "LazyTriton")


def lazy_view_triton() -> EngineBackend:
    return _triton(_triton_classes()["LazyViewTriton"], "LazyViewTriton")


def tbo_triton() -> EngineBackend:
    """SGLang's TboAttnBackend over three of SGLang's Triton backends."""
    triton = _triton_classes()["TritonAttnBackend"]
    return _triton(lambda r: _modules()["tbo_backend"].TboAttnBackend.init_new(lambda: triton(r)), "tbo_triton")


def hybrid_linear_triton() -> EngineBackend:
    """SGLang's HybridLinearAttnBackend over two of SGLang's Triton backends, every layer full."""
    triton = _triton_classes()["TritonAttnBackend"]
    wrapper = _modules()["hybrid_linear_attn_backend"].HybridLinearAttnBackend
    return _triton(lambda r: wrapper(triton(r), triton(r), list(range(TRITON_CFG.layers))), "hybrid_linear_triton")


def _triton_engines() -> dict[str, Any]:
    """SGLang's Triton backends, for ``readfence audit --engine tests.engine.sglang_engines:TRITON``."""
    return {"triton": triton_attn, "tbo_triton": tbo_triton, "hybrid_linear_triton": hybrid_linear_triton} \
        if not _triton_reason() else {}


#: The names whose value needs SGLang imported, and what computes each (on first use).
_LAZY = {"MODULES": _modules, "REASON": lambda: _sglang()[1], "CLASSES": _classes, "TRITON_REASON": _triton_reason,
         "TRITON_CLASSES": _triton_classes, "TRITON": _triton_engines}


def __getattr__(name: str) -> Any:
    # (no ``__dir__`` listing these: pytest's collection reads every name ``dir`` gives)
    if name in _LAZY:
        return _LAZY[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
