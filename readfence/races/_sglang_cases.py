"""Races of SGLang's own classes, built on the CPU: its wrappers' declarations and its EAGLE runners.

SGLang 0.5.23's attention modules are imported with the stand-ins of ``_sglang_cpu``; the
classes are SGLang's (``TboAttnBackend``, ``HybridLinearAttnBackend``, ``DotsHybridAttnBackend``,
``TorchNativeAttnBackend``), adapted with SGLang's profile. The one change made to a child is
``LateNative``: torch-native declaring what its ``forward`` does (it slices the live page table in
every layer: ``POST_REPLAY``) under a name SGLang graph-replays, so that its declaration is one the
engine uses. A buggy version puts back what the engine shipped (a wrapper's ``shared_read_ends``
left at the base default; a draft-extend runner recording before its replay).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEnd
from readfence.engine import EngineBackend, RunnerModel, adapt, sglang_profile

from ._case import Case, Source, Story
from ._sglang_cpu import import_sglang
from ._subjects import EngineSubject

M = ForwardMode
PRE, POST = ReadEnd.PRE_REPLAY, ReadEnd.POST_REPLAY

#: Two layers, four requests of at most 16 tokens: every trace and run stays cheap.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)


class SGLangUnavailable(RuntimeError):
    """SGLang's modules cannot be imported here: the SGLang cases cannot be built."""


@functools.cache
def classes() -> dict[str, Any]:
    """SGLang's classes the cases use, and the versions of them the cases build (imported once)."""
    modules, reason = import_sglang()
    if not modules:
        raise SGLangUnavailable(reason)
    base = modules["base_attn_backend"]
    ends = base.SharedReadEnds
    native = modules["torch_native_backend"].TorchNativeAttnBackend
    tbo = modules["tbo_backend"].TboAttnBackend
    hybrid_linear = modules["hybrid_linear_attn_backend"].HybridLinearAttnBackend
    dots = modules["dots_hybrid_backend"].DotsHybridAttnBackend

    class LateNative(native):  # type: ignore[misc, valid-type]
        """torch-native declaring what its forward does: the page table is read until the replay ends."""

        def shared_read_ends(self, mode: Any) -> Any:
            return ends.POST_REPLAY

    class ForgetfulTbo(tbo):  # type: ignore[misc, valid-type]
        """TBO with its shared_read_ends put back to the base class's default."""

        shared_read_ends = base.AttentionBackend.shared_read_ends

    class ForgetfulHybridLinear(hybrid_linear):  # type: ignore[misc, valid-type]
        """HybridLinear with its shared_read_ends put back to the base class's default."""

        shared_read_ends = base.AttentionBackend.shared_read_ends

    class DelegatingDots(dots):  # type: ignore[misc, valid-type]
        """DotsHybrid declaring the latest of its children's ends, as TBO and HybridLinear do."""

        def shared_read_ends(self, fm: Any) -> Any:
            return ends.max_of(b.shared_read_ends(fm) for b in (self.dsa_backend, self.swa_backend))

    return {"TboAttnBackend": tbo, "HybridLinearAttnBackend": hybrid_linear, "DotsHybridAttnBackend": dots,
            "LateNative": LateNative, "ForgetfulTbo": ForgetfulTbo, "ForgetfulHybridLinear": ForgetfulHybridLinear,
            "DelegatingDots": DelegatingDots}


def _adapt(factory: Callable[[Any], Any], name: str, first: EngineBackend | None = None) -> EngineBackend:
    state = None if first is None else first.state
    return adapt(factory, cfg=CFG, profile=sglang_profile(), name=name, state=state)


def tbo(cls: str) -> EngineBackend:
    """SGLang's TBO (``cls``: as shipped, or forgetful) over three LateNative."""
    c = classes()
    late = c["LateNative"]
    return _adapt(lambda r: c[cls].init_new(lambda: late(r)), cls)


def hybrid_linear(cls: str) -> EngineBackend:
    """SGLang's HybridLinear over two LateNative, every layer a full-attention one (no linear kernel
    runs on the CPU)."""
    c = classes()
    late = c["LateNative"]
    return _adapt(lambda r: c[cls](late(r), late(r), list(range(CFG.layers))), cls)


def dots(cls: str) -> EngineBackend:
    """SGLang's DotsHybrid (dsa, swa) over LateNative."""
    c = classes()
    late = c["LateNative"]
    return _adapt(lambda r: c[cls](late(r), late(r)), cls)


def late_native(first: EngineBackend | None = None, name: str = "LateNative") -> EngineBackend:
    return _adapt(classes()["LateNative"], name, first)


TBO_FORGETS = Case(
    name="sglang-tbo-forgets",
    title="A wrapper that does not delegate its read end: TBO at the base default over children read later",
    source=Source("sgl-project/sglang", None, "layers/attention/tbo_backend.py", "TboAttnBackend.shared_read_ends",
                  also=()),
    story=Story(
        did="two-batch overlap wraps a primary and two children; the wrapper is what the runner asks for its "
            "read end",
        wrong="without its own shared_read_ends it declares the base default, IN_REPLAY, while its children "
              "read the page table until POST_REPLAY: the runner records read-done at the in-graph marker",
        says="audit_runner: req_to_token read until POST_REPLAY by forward against an IN_REPLAY event; "
             "SGLang 0.5.23's TBO joins its children (max_of) and is exact"),
    buggy=lambda: EngineSubject("TBO with the base default", lambda: tbo("ForgetfulTbo")),
    fixed=lambda: EngineSubject("TBO joining its children (SGLang 0.5.23)", lambda: tbo("TboAttnBackend")),
    quick=True,
)

HYBRID_LINEAR_FORGETS = Case(
    name="sglang-hybrid-linear-forgets",
    title="HybridLinear at the base default over a full-attention child read until POST_REPLAY",
    source=Source("sgl-project/sglang", None, "layers/attention/hybrid_linear_attn_backend.py",
                  "HybridLinearAttnBackend.shared_read_ends"),
    story=Story(
        did="HybridLinear dispatches each layer to a full-attention or a linear child",
        wrong="a wrapper that keeps the base default declares IN_REPLAY whatever its full-attention child reads",
        says="audit_runner names the child's forward and the page table; 0.5.23's join over attn_backend_list "
             "is exact"),
    buggy=lambda: EngineSubject("HybridLinear with the base default", lambda: hybrid_linear("ForgetfulHybridLinear")),
    fixed=lambda: EngineSubject("HybridLinear joining its children (SGLang 0.5.23)",
                                lambda: hybrid_linear("HybridLinearAttnBackend")),
)

DOTS_HYBRID = Case(
    name="sglang-dots-hybrid",
    title="DotsHybrid declares the base default over its DSA and SWA children",
    source=Source("sgl-project/sglang", None, "layers/attention/dots_hybrid_backend.py",
                  "DotsHybridAttnBackend (no shared_read_ends of its own in 0.5.23)"),
    story=Story(
        did="DotsHybrid routes each layer to its DSA or its sliding-window child and overrides no "
            "shared_read_ends (its inner DotsSWAMLA backend does delegate)",
        wrong="its declaration is the base class's IN_REPLAY whatever its children read: sound only while both "
              "end by IN_REPLAY",
        says="audit_runner: req_to_token read until POST_REPLAY against the IN_REPLAY event; a DotsHybrid joining "
             "its children is exact"),
    buggy=lambda: EngineSubject("DotsHybrid as shipped in SGLang 0.5.23", lambda: dots("DotsHybridAttnBackend")),
    fixed=lambda: EngineSubject("DotsHybrid joining its children", lambda: dots("DelegatingDots")),
)

EAGLE_DRAFT_EXTEND = Case(
    name="sglang-eagle-draft-extend",
    title="Single-layer EAGLE draft-extend publishes read-done before its graph replay",
    source=Source("sgl-project/sglang", 37988, "speculative/eagle_draft_extend_cuda_graph_runner.py",
                  "EAGLEDraftExtendCudaGraphRunner.execute", also=(37936,)),
    story=Story(
        did="under overlap scheduling the single-layer EAGLE draft-extend runner recorded the shared-read event "
            "before the CUDA-graph replay",
        wrong="the graph still read request rows after the WAR barrier passed: a vectorized_gather_kernel "
              "out-of-bounds assertion when a constrained tool-call request arrived during decode",
        says="audit_runner: the event is recorded at PRE_REPLAY, the draft backend reads req_to_token until "
             "POST_REPLAY (torch-native's forward, observed); 0.5.23 records after the replay"),
    buggy=lambda: EngineSubject("read-done recorded before the replay", late_native, M.DRAFT_EXTEND,
                                RunnerModel(places=dict.fromkeys(ReadEnd, PRE))),
    fixed=lambda: EngineSubject("read-done recorded after the replay (SGLang 0.5.23)", late_native, M.DRAFT_EXTEND,
                                RunnerModel(places={ReadEnd.IN_REPLAY: POST})),
    quick=True,
)


CASES = (TBO_FORGETS, HYBRID_LINEAR_FORGETS, DOTS_HYBRID, EAGLE_DRAFT_EXTEND)
