"""SGLang 0.5.23's real attention backends, adapted with SGLang's profile, and adversarial subclasses.

Importing this module imports SGLang's attention modules (with the stand-ins of
``sglang_standins`` for its GPU-only imports); ``REASON`` says why not where they cannot be.
Every factory here is ``MODULE:FACTORY`` for ``readfence audit --engine`` too.

The wrappers are built over children CPU can run: SGLang's torch-native backend, or ``LateNative``,
a subclass whose one change is the honest declaration of what torch-native's ``forward`` does
(it slices the live page table in every layer: POST_REPLAY) under a name SGLang does not turn
CUDA graphs off for, so that its declaration is one the engine uses.
"""

from __future__ import annotations

from typing import Any

from readfence.core import ModelConfig
from readfence.engine import EngineBackend, adapt, sglang_profile

from .sglang_standins import import_sglang

MODULES, REASON = import_sglang()

#: Two layers, four requests of at most 16 tokens: every trace and run stays cheap.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)


def _classes() -> dict[str, Any]:
    if not MODULES:
        return {}
    base = MODULES["base_attn_backend"]
    native = MODULES["torch_native_backend"].TorchNativeAttnBackend
    ends, fm = base.SharedReadEnds, MODULES["base_attn_backend"].ForwardMode

    class LateNative(native):  # type: ignore[misc, valid-type]
        """torch-native, declaring what its forward does: the page table is read until the replay ends."""

        def shared_read_ends(self, mode: Any) -> Any:
            return ends.POST_REPLAY

    class EarlyPrefillNative(LateNative):  # type: ignore[misc, valid-type]
        """Declares PRE_REPLAY for EXTEND (SGLang's eager runner publishes it before the forward), while
        its forward_extend slices the live page table in every layer."""

        def shared_read_ends(self, mode: Any) -> Any:
            return ends.PRE_REPLAY if mode == fm.EXTEND else super().shared_read_ends(mode)

    class ForgetfulTbo(MODULES["tbo_backend"].TboAttnBackend):  # type: ignore[misc, name-defined]
        """SGLang's TBO with its ``shared_read_ends`` put back to the base class's default."""

        shared_read_ends = base.AttentionBackend.shared_read_ends

    class BrokenNative(LateNative):  # type: ignore[misc, valid-type]
        """A bug of the engine's own code in forward_decode (a missing metadata key)."""

        def forward_decode(self, *args: Any, **kwargs: Any) -> Any:
            return {}["decode_plan"]

    return {"LateNative": LateNative, "EarlyPrefillNative": EarlyPrefillNative, "ForgetfulTbo": ForgetfulTbo,
            "BrokenNative": BrokenNative}


CLASSES = _classes()


def _adapt(factory: Any, name: str, **server_args: Any) -> EngineBackend:
    return adapt(factory, cfg=CFG, profile=sglang_profile(**server_args), name=name)


def torch_native() -> EngineBackend:
    """SGLang's TorchNativeAttnBackend as shipped."""
    return _adapt(MODULES["torch_native_backend"].TorchNativeAttnBackend, "TorchNativeAttnBackend")


def late_native() -> EngineBackend:
    return _adapt(CLASSES["LateNative"], "LateNative")


def early_prefill() -> EngineBackend:
    return _adapt(CLASSES["EarlyPrefillNative"], "EarlyPrefillNative")


def broken() -> EngineBackend:
    return _adapt(CLASSES["BrokenNative"], "BrokenNative")


def tbo() -> EngineBackend:
    """SGLang's TboAttnBackend as shipped, over three LateNative."""
    late = CLASSES["LateNative"]
    return _adapt(lambda r: MODULES["tbo_backend"].TboAttnBackend.init_new(lambda: late(r)), "tbo")


def forgetful_tbo() -> EngineBackend:
    """The seed's bug: TBO declaring the base default over children that read until POST_REPLAY."""
    late = CLASSES["LateNative"]
    return _adapt(lambda r: CLASSES["ForgetfulTbo"].init_new(lambda: late(r)), "forgetful_tbo")


def hybrid() -> EngineBackend:
    """SGLang's HybridAttnBackend: torch-native for prefill, LateNative for decode."""
    native = MODULES["torch_native_backend"].TorchNativeAttnBackend
    late = CLASSES["LateNative"]
    return _adapt(lambda r: MODULES["hybrid_attn_backend"].HybridAttnBackend(r, native(r), late(r)), "hybrid")


def hybrid_linear() -> EngineBackend:
    """SGLang's HybridLinearAttnBackend with every layer a full-attention one (its linear child
    prepares metadata but attends no layer: no linear kernel runs on CPU)."""
    late = CLASSES["LateNative"]
    wrapper = MODULES["hybrid_linear_attn_backend"].HybridLinearAttnBackend
    return _adapt(lambda r: wrapper(late(r), late(r), list(range(CFG.layers))), "hybrid_linear")


def minimax() -> EngineBackend:
    """SGLang's MiniMaxHybridAttnBackend (dense, sparse) over LateNative, no layer sparse."""
    late = CLASSES["LateNative"]
    wrapper = MODULES["minimax_sparse_backend"].MiniMaxHybridAttnBackend
    return _adapt(lambda r: wrapper(late(r), late(r), []), "minimax")


def dots() -> EngineBackend:
    """SGLang's DotsHybridAttnBackend (dsa, swa) over LateNative."""
    late = CLASSES["LateNative"]
    return _adapt(lambda r: MODULES["dots_hybrid_backend"].DotsHybridAttnBackend(late(r), late(r)), "dots")
