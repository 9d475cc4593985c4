"""Races of SGLang's runners and their publish points, with engine-style backends.

The backends here follow SGLang's TRT-LLM MHA backend (``layers/attention/trtllm_mha_backend.py``)
on the paths that matter: its CUDA-graph metadata gathered from the live page table inside the
graph at every replay, its prefill snapshot, its sliding-window cache writes. They are written
in the reference engine's style (``readfence.engine.reference``: SGLang's contract, CPU kernels)
because the real class runs FlashInfer's and TRT-LLM's CUDA kernels; the runners are SGLang's as
:class:`~readfence.engine.RunnerModel` describes them (where each records its read-done event,
which runner's event the scheduler waits on, whether the mailbox is cleared).
"""

from __future__ import annotations

from typing import Any

import torch

from readfence.backends import remap
from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEnd
from readfence.engine import EngineBackend, RunnerModel, RunnerPhase, adapt
from readfence.engine.reference import AttentionBackend, ForwardMetadata, TritonBackend, TrtllmMhaBackend

from ._case import Case, Source, Story
from ._subjects import EngineSubject, StepSubject

M = ForwardMode
PRE, IN, POST = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY

#: Two layers (one full, one sliding-window), four requests of at most 16 tokens.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)


class TRTLLMHAGraphMetadata(TritonBackend):
    """SGLang's TRT-LLM MHA backend on its CUDA-graph paths: ``init_forward_metadata_in_graph`` runs
    ``_apply_cuda_graph_metadata``, which gathers the batch's page-table rows from the shared
    ``req_to_token`` inside the captured graph, at every replay; it declares the base class's
    default (``IN_REPLAY`` for decode and verify, ``UNKNOWN`` for the draft extend) and its
    draft-extend metadata is not captured in the graph."""

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        return False


class TRTLLMHALiveSwaWrite(TrtllmMhaBackend):
    """SGLang's TRT-LLM MHA backend before its sliding-window write locations were snapshotted:
    prefill metadata is snapshotted before the forward (it declares ``PRE_REPLAY`` for EXTEND), but
    each sliding-window layer's cache write looks its locations up in the live full-to-SWA mapping."""

    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True) -> Any:
        md = self.forward_metadata
        if layer.layer_id % 2 == 1 and md is not None:  # the live mapping, read in this layer
            live = ForwardMetadata(kv_indices=md.kv_indices, kv_lens=md.kv_lens, swa_indices=md.swa_indices,
                                   swa_loc=remap(self.swa_map, forward_batch.out_cache_loc))
            self.forward_metadata = live
            try:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                self.forward_metadata = md
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    forward_decode = forward_extend


class SWADraftExtend(TrtllmMhaBackend):
    """An EAGLE draft-extend backend with sliding-window layers that can stage its shared reads
    before the target verifies (``stage_shared_reads``: the page-table rows, the lengths and the
    sliding-window indices of the history, copied into buffers of its own), as SGLang's backends
    that opt in do. What it cannot stage are its sliding-window cache write locations: they come
    from the verify's own products (the accepted tokens' ``out_cache_loc``), so its graph still
    looks them up in the live full-to-SWA mapping. It declares the base default (``UNKNOWN`` for a
    draft extend)."""

    shared_read_ends = AttentionBackend.shared_read_ends

    def __init__(self, runner: Any, window: int = 8) -> None:
        super().__init__(runner, window)
        rows, ctx, device = runner.req_to_token_pool.size, runner.model_config.context_len, runner.device
        self.staged_indices = torch.zeros(rows, ctx, dtype=torch.int64, device=device)
        self.staged_swa = torch.zeros(rows, ctx, dtype=torch.int64, device=device)
        self.staged_lens = torch.zeros(rows, dtype=torch.int64, device=device)

    def stage_shared_reads(self, forward_batch: Any) -> None:
        n = forward_batch.req_pool_indices.shape[0]
        rows = self.req_to_token.index_select(0, forward_batch.req_pool_indices).long()
        self.staged_indices[:n].copy_(rows)
        self.staged_swa[:n].copy_(remap(self.swa_map, rows))
        self.staged_lens[:n].copy_(forward_batch.seq_lens)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        pass  # staged before the verify

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        n = forward_batch.req_pool_indices.shape[0]
        self.forward_metadata = ForwardMetadata(
            kv_indices=self.staged_indices[:n], kv_lens=self.staged_lens[:n], swa_indices=self.staged_swa[:n],
            swa_loc=remap(self.swa_map, forward_batch.out_cache_loc))  # the verify's products: live


class StagingTarget(TRTLLMHAGraphMetadata):
    """The target verify of a staged step: before its replay it has the draft backend stage its
    shared reads (SGLang's ``stage_shared_reads`` before the verify launch)."""

    def __init__(self, runner: Any, draft: SWADraftExtend) -> None:
        super().__init__(runner)
        self.draft = draft

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        self.draft.stage_shared_reads(forward_batch)


def _adapt(cls: Any, first: EngineBackend | None = None) -> EngineBackend:
    return adapt(cls, cfg=CFG) if first is None else adapt(cls, cfg=CFG, state=first.state)


def decode_runner(*, fallback: ReadEnd) -> RunnerModel:
    """SGLang's decode CUDA-graph runner on a platform without an in-graph marker event (HIP):
    ``_resolve_shared_read_ends`` moves a declared ``IN_REPLAY`` to ``fallback``."""
    return RunnerModel(in_graph_marker=False, no_marker=fallback)


def draft_extend_runner(engine: EngineBackend, *, after_replay: bool) -> RunnerModel:
    """SGLang's EAGLE draft-extend CUDA-graph runner: before the fix it keyed where it records the
    read-done event on the backend's ``draft_extend_metadata_captured_in_graph()`` (not captured:
    before the replay); after it, the runner records after the replay, whatever is declared."""
    captured = bool(engine.object.draft_extend_metadata_captured_in_graph())
    at = POST if after_replay or captured else PRE
    return RunnerModel(places=dict.fromkeys(ReadEnd, at))


DECODE_NO_MARKER = Case(
    name="sglang-decode-no-marker",
    title="IN_REPLAY resolved to PRE_REPLAY where the graph has no in-graph marker",
    source=Source("sgl-project/sglang", None, "model_executor/runner/decode_cuda_graph_runner.py",
                  "DecodeCudaGraphRunner._resolve_shared_read_ends (a TODO: this lands EARLIER than declared)"),
    story=Story(
        did="without an in-graph marker event (HIP, older torch) the decode runner resolved a declared IN_REPLAY "
            "to PRE_REPLAY and recorded the read-done event before the replay",
        wrong="TRT-LLM MHA's in-graph metadata gathers the page table inside the graph at every replay: the "
              "scheduler's next write could land while the replay still read the table",
        says="audit_runner: the event is recorded at PRE_REPLAY, req_to_token is read until IN_REPLAY by "
             "init_forward_metadata_in_graph; poison and the observer catch the late read, the sanitizer the race"),
    buggy=lambda: EngineSubject("the fallback resolves IN_REPLAY to PRE_REPLAY", lambda: _adapt(TRTLLMHAGraphMetadata),
                                M.DECODE, decode_runner(fallback=PRE)),
    fixed=lambda: EngineSubject("the fallback resolves IN_REPLAY to POST_REPLAY (SGLang 0.5.23)",
                                lambda: _adapt(TRTLLMHAGraphMetadata), M.DECODE, decode_runner(fallback=POST)),
    quick=True,
)

TRTLLM_MHA_DRAFT_EXTEND = Case(
    name="sglang-trtllm-mha-draft-extend",
    title="The draft-extend graph re-reads req_to_token after a read-done recorded before its replay",
    source=Source("sgl-project/sglang", 36335, "speculative/eagle_draft_extend_cuda_graph_runner.py",
                  "EAGLEDraftExtendCudaGraphRunner._replay_and_publish_read_done", also=(31686,)),
    story=Story(
        did="the draft-extend runner keyed where it records the read-done event on "
            "draft_extend_metadata_captured_in_graph(), which TRT-LLM MHA leaves False: before the replay",
        wrong="TRT-LLM MHA's init_forward_metadata_in_graph is recorded into the captured graph and gathers the "
              "page table from the live req_to_token at every replay: a torn page table, wrong attention inputs",
        says="audit_runner: the event is recorded at PRE_REPLAY, req_to_token is read until IN_REPLAY by "
             "init_forward_metadata_in_graph; verify and the sanitizer agree"),
    buggy=lambda: EngineSubject("read-done keyed on the in-graph capability: before the replay",
                                lambda: _adapt(TRTLLMHAGraphMetadata), M.DRAFT_EXTEND,
                                lambda e: draft_extend_runner(e, after_replay=False)),
    fixed=lambda: EngineSubject("the runner records read-done after the replay", lambda: _adapt(TRTLLMHAGraphMetadata),
                                M.DRAFT_EXTEND, lambda e: draft_extend_runner(e, after_replay=True)),
)


def _multi_eagle(*, final_publishes: bool) -> list[RunnerPhase]:
    target = _adapt(TRTLLMHAGraphMetadata)
    # the final draft runner records read-done after its replay (the draft extend declares UNKNOWN)
    final = RunnerModel(places={ReadEnd.UNKNOWN: POST}) if final_publishes else RunnerModel()
    return [RunnerPhase("target_verify", target, M.TARGET_VERIFY),
            RunnerPhase("draft_extend[0]", _adapt(TRTLLMHAGraphMetadata, target), M.DRAFT_EXTEND),
            RunnerPhase("draft_extend[1]", _adapt(TRTLLMHAGraphMetadata, target), M.DRAFT_EXTEND, final)]


MULTI_EAGLE_OWNER = Case(
    name="sglang-multi-eagle-owner",
    title="Multi-layer EAGLE's scheduler waits on a runner that is not the last to read",
    source=Source("sgl-project/sglang", 36752, "speculative/multi_layer_eagle_worker_v2.py",
                  "MultiLayerEagleWorkerV2.last_shared_read_runner", also=(35057,)),
    story=Story(
        did="multi-layer EAGLE verifies on the target runner, then extends on each draft runner in turn; the "
            "worker inherited last_shared_read_runner, which names the target runner",
        wrong="the scheduler's WAR barrier then waits on the verify's event while the draft extends still read "
              "the page table; the fix publishes after the final draft step and names the final draft runner",
        says="audit_runner: req_to_token read until IN_REPLAY in draft_extend[1] against target_verify's "
             "event; the final draft runner's event, recorded after its replay, covers every read"),
    buggy=lambda: StepSubject("the scheduler waits on the target runner",
                              lambda: _multi_eagle(final_publishes=False), "target_verify"),
    fixed=lambda: StepSubject("the scheduler waits on the final draft runner, which publishes after its replay",
                              lambda: _multi_eagle(final_publishes=True), "draft_extend[1]"),
)


def _staged(*, opted_in: bool) -> list[RunnerPhase]:
    draft = _adapt(SWADraftExtend)
    target = adapt(lambda r: StagingTarget(r, draft.object), cfg=CFG, state=draft.state, name="StagingTarget")
    # not opted in, the draft runner publishes after its replay and the scheduler waits on it
    draft_model = RunnerModel() if opted_in else RunnerModel(places={ReadEnd.UNKNOWN: POST})
    return [RunnerPhase("target_verify", target, M.TARGET_VERIFY),
            RunnerPhase("draft_extend", draft, M.DRAFT_EXTEND, draft_model)]


DRAFT_EXTEND_STAGED = Case(
    name="sglang-draft-extend-staged",
    title="A draft extend staged before verify while its graph still reads the live SWA mapping",
    source=Source("sgl-project/sglang", 35289, "speculative/multi_layer_eagle_worker_v2.py",
                  "MultiLayerEagleWorkerV2.last_shared_read_runner (staged steps answer the target runner)",
                  also=(35126, 38169)),
    story=Story(
        did="DRAFT_EXTEND_V2's shared reads are staged into draft-owned buffers before the verify launch, and on "
            "a staged step last_shared_read_runner answers the target runner: the verify's record releases the "
            "scheduler",
        wrong="only backends whose reads can all be staged may opt in: a sliding-window draft still looks its "
              "cache write locations up in the live full-to-SWA mapping inside its graph, after that record "
              "(flashinfer opts in only without SWA)",
        says="audit_runner: swa_map read until IN_REPLAY in draft_extend against target_verify's event; not "
             "opted in, the draft runner's event covers it"),
    buggy=lambda: StepSubject("a sliding-window draft opted in: the scheduler waits on the verify",
                              lambda: _staged(opted_in=True), "target_verify"),
    fixed=lambda: StepSubject("not opted in: the scheduler waits on the draft runner",
                              lambda: _staged(opted_in=False), "draft_extend"),
)


def _prefill_phases() -> list[RunnerPhase]:
    target = _adapt(TrtllmMhaBackend)
    draft = _adapt(TRTLLMHAGraphMetadata, target)
    return [RunnerPhase("target_extend", target, M.EXTEND, RunnerModel()),
            RunnerPhase("draft_extend", draft, M.EXTEND, RunnerModel())]


def _prefill_phases_excluded() -> list[RunnerPhase]:
    phases = _prefill_phases()
    # supports_prefill_shared_read_done() is False for EAGLE: the target prefill publishes nothing
    phases[0] = RunnerPhase("target_extend", phases[0].engine, M.EXTEND, RunnerModel(prefill_read_done=False))
    return phases


PREFILL_SPEC_READER = Case(
    name="sglang-prefill-spec-reader",
    title="Prefill read-done published before a speculative draft prefill reads the page table",
    source=Source("sgl-project/sglang", 38554, "speculative/spec_info.py",
                  "SpeculativeAlgorithm.supports_prefill_shared_read_done", also=(33587,)),
    story=Story(
        did="a prefill whose backend snapshots every shared input before the forward publishes its read-done "
            "event at PRE_REPLAY (maybe_publish_prefill_shared_read_done)",
        wrong="with EAGLE the draft model's prefill runs after the target's and reads the page table again: an "
              "early event lets the scheduler rewrite it under the draft; SGLang excludes such algorithms",
        says="audit_runner: the scheduler waits on target_extend's PRE_REPLAY event, draft_extend reads "
             "req_to_token later; excluded (nothing published), the whole step is waited for"),
    buggy=lambda: StepSubject("EAGLE's target prefill publishes PRE_REPLAY", _prefill_phases, "target_extend"),
    fixed=lambda: StepSubject("EAGLE excluded from the prefill read-done", _prefill_phases_excluded, "target_extend"),
)

PREFILL_SWA_SNAPSHOT = Case(
    name="sglang-prefill-swa-snapshot",
    title="A prefill snapshot published at PRE_REPLAY while the SWA cache write re-reads the live mapping",
    source=Source("sgl-project/sglang", 33587, "layers/attention/trtllm_mha_backend.py",
                  "TRTLLMHAAttnBackend.forward_extend (its sliding-window cache write)"),
    story=Story(
        did="prefill's metadata init snapshots the page table and the full-to-SWA mapping before the forward, "
            "and the runner publishes read-done at PRE_REPLAY: a pattern that must stay accepted",
        wrong="TRT-LLM MHA's sliding-window cache writes looked their locations up in the live full-to-SWA "
              "mapping in every SWA layer, after the early fence",
        says="audit_runner: swa_map read until POST_REPLAY by forward (aten.index_select) against a PRE_REPLAY "
             "event; with the write locations snapshotted too, the same PRE_REPLAY event is exact"),
    buggy=lambda: EngineSubject("the SWA cache write reads the live mapping", lambda: _adapt(TRTLLMHALiveSwaWrite),
                                M.EXTEND),
    fixed=lambda: EngineSubject("the SWA write locations snapshotted before the forward",
                                lambda: _adapt(TrtllmMhaBackend), M.EXTEND),
    quick=True,
)


def _every_other(step: int) -> bool:
    return step % 2 == 0


STALE_READ_DONE = Case(
    name="sglang-stale-read-done",
    title="A read-done event left for the scheduler after a step that publishes nothing",
    source=Source("sgl-project/sglang", None, "managers/scheduler.py",
                  "Scheduler._apply_war_barrier (\"Clearing matters: a phase that skips the publish then falls back to "
                  "coarse\")"),
    story=Story(
        did="the scheduler's WAR barrier takes the runner's read-done event; prefill publishes one only for some "
            "batches (the fast path is off past a snapshot limit, with hierarchical caching...)",
        wrong="an event the scheduler takes and leaves in place is handed out again for a later step that "
              "published nothing: its writes wait on an event that fired before that step read anything",
        says="audit_runner: step 1 publishes nothing and is handed step 0's event; check mode poisons what that "
             "step releases before it runs, and readfence refuses to bind a wait to an event recorded again"),
    buggy=lambda: EngineSubject("the mailbox is not cleared when taken", lambda: _adapt(TrtllmMhaBackend), M.EXTEND,
                                RunnerModel(prefill_read_done=_every_other, clear_mailbox=False), steps=4),
    fixed=lambda: EngineSubject("the scheduler clears the event it takes", lambda: _adapt(TrtllmMhaBackend), M.EXTEND,
                                RunnerModel(prefill_read_done=_every_other), steps=4),
)

CASES = (DECODE_NO_MARKER, TRTLLM_MHA_DRAFT_EXTEND, MULTI_EAGLE_OWNER, DRAFT_EXTEND_STAGED, PREFILL_SPEC_READER,
         PREFILL_SWA_SNAPSHOT, STALE_READ_DONE)
