"""Races of host staging buffers: vLLM's and TensorRT-LLM's, each ring in the shape the engine had.

Each class below follows the engine's code for the one thing that matters here: which host buffer
a step's inputs are staged in, and which earlier step the host has waited for before it refills
it. readfence runs the engine's ring as the scheduler side of its loop (``LoopOptions(staging=...)``): the copy
of each step reads the host buffer when it runs, the host refills it when the engine's code
does. What the attention reads is readfence's own paged backend over the staged page table.
"""

from __future__ import annotations

from collections import deque

from readfence.backends import paged

from ._case import Case, Source, Story
from ._subjects import StagingSubject


class KVCacheManager:
    """TensorRT-LLM's KV cache manager shipping a batch's KV block offsets to the device
    (``tensorrt_llm/_torch/pyexecutor/resource_manager.py``): ``copy_batch_block_offsets`` writes
    the batch's offsets into a host table and launches an asynchronous host-to-device copy of it.
    The executor's overlap scheduler prepares iteration ``i + 1`` before it waits for iteration
    ``i``: the host has waited only for iteration ``i - 1`` when it refills the table.

    ``fresh_host_buffer=False`` is the shipped bug (one persistent pinned table,
    ``host_kv_cache_block_offsets``, overwritten in place); ``True`` the fix (a fresh host buffer
    per call).

    >>> KVCacheManager(fresh_host_buffer=False).slot(3), KVCacheManager(fresh_host_buffer=True).slot(3)
    (0, 3)
    """

    held = False

    def __init__(self, *, fresh_host_buffer: bool) -> None:
        self.fresh_host_buffer = fresh_host_buffer

    @property
    def slots(self) -> int | None:
        return None if self.fresh_host_buffer else 1

    def copy_batch_block_offsets(self, step: int) -> int:
        """The host buffer this iteration's block offsets are staged in before the copy."""
        return step if self.fresh_host_buffer else 0

    slot = copy_batch_block_offsets

    def waited(self, step: int) -> int | None:
        # the overlap scheduler: iteration i + 1 is prepared before iteration i's outputs are awaited
        w = step - 2
        return w if w >= 0 else None


class UvaBufferPool:
    """vLLM's pool of pinned host buffers the device reads in place (the V2 model runner): exactly
    ``max_concurrency`` of them, handed out round robin, refilled with no wait of its own (the batch
    queue is what bounds the steps in flight)."""

    def __init__(self, max_concurrency: int) -> None:
        self.max_concurrency = max_concurrency

    def copy_to_uva(self, step: int) -> int:
        """The buffer ``step``'s inputs are written into."""
        return step % self.max_concurrency


class EngineCore:
    """vLLM's engine core loop with a batch queue (``vllm/v1/engine/core.py``,
    ``EngineCore.step_with_batch_queue``), on an encoder-only instance: a step is executed and its
    future queued; only a full queue makes the loop pop (and wait on) the oldest future. The pool
    has as many buffers as the queue has places and no spare.

    An encoder-only step's future is built on the host (``make_empty_encoder_model_runner_output``):
    it resolves as soon as the step is launched, so popping it waits for no device work.
    ``waits_for_prior_step=True`` is the fix: the pop waits for that step's end.

    >>> core = EngineCore(max_concurrent_batches=2, waits_for_prior_step=True)
    >>> [core.waited(i) for i in range(5)]
    [None, None, 0, 1, 2]
    >>> [EngineCore(max_concurrent_batches=2, waits_for_prior_step=False).waited(i) for i in range(5)]
    [None, None, None, None, None]
    """

    held = False

    def __init__(self, *, max_concurrent_batches: int = 2, waits_for_prior_step: bool) -> None:
        self.batch_queue_size = max_concurrent_batches
        self.pool = UvaBufferPool(max_concurrency=max_concurrent_batches)
        self.waits_for_prior_step = waits_for_prior_step

    @property
    def slots(self) -> int:
        return self.pool.max_concurrency

    def slot(self, step: int) -> int:
        return self.pool.copy_to_uva(step)

    def step_with_batch_queue(self, steps: int) -> dict[int, int | None]:
        """Per step, the step whose future the loop popped last before executing it."""
        batch_queue: deque[int] = deque()
        popped: int | None = None
        before: dict[int, int | None] = {}
        for step in range(steps):
            before[step] = popped
            batch_queue.appendleft(step)  # execute_model(non_block=True), its future queued
            if len(batch_queue) < self.batch_queue_size:
                continue  # don't block on a result unless the queue is full
            popped = batch_queue.pop()  # future.result(): the oldest step
        return before

    def waited(self, step: int) -> int | None:
        popped = self.step_with_batch_queue(step + 1)[step]
        return popped if self.waits_for_prior_step else None


class InputBatch:
    """vLLM's V1 GPU model runner's per-step inputs (``vllm/v1/worker/gpu_model_runner.py``,
    ``_prepare_inputs``): one persistent pinned host tensor per input (``num_computed_tokens`` and
    the query start locations), copied to the device with ``non_blocking=True``. Under async
    scheduling the host prepares step ``i + 1`` while step ``i`` runs; a pooling model's
    intermediate prefill chunk returns with no device sync, so the host has waited only for step
    ``i - 1`` when it rewrites the buffer. ``sync_before_update=True`` is the fix merged for it: a
    device sync before the buffer is rewritten.

    >>> InputBatch(sync_before_update=False).waited(3), InputBatch(sync_before_update=True).waited(3)
    (1, 2)
    """

    held = False
    slots = 1  # Runner V1 has one input buffer

    def __init__(self, *, sync_before_update: bool) -> None:
        self.sync_before_update = sync_before_update

    def _update_states(self, step: int) -> int:
        """The host buffer ``step``'s inputs are written into (the one there is)."""
        return 0

    slot = _update_states

    def waited(self, step: int) -> int | None:
        w = step - 1 if self.sync_before_update else step - 2
        return w if w >= 0 else None


def _subject(name: str, ring: object, buffer: str, filled_by: object) -> StagingSubject:
    return StagingSubject(name, paged, lambda: ring, buffer=buffer, filled_by=filled_by)  # type: ignore[arg-type, return-value]


TRTLLM_BLOCK_OFFSETS = Case(
    name="trtllm-block-offsets",
    title="KV block offsets staged through a reused host buffer whose copy is still in flight",
    source=Source("NVIDIA/TensorRT-LLM", 15546, "tensorrt_llm/_torch/pyexecutor/resource_manager.py",
                  "KVCacheManager.copy_batch_block_offsets", also=(15607,)),
    story=Story(
        did="copy_batch_block_offsets wrote each iteration's KV block offsets into one persistent pinned host "
            "table and shipped it to the device with an asynchronous copy",
        wrong="the overlap scheduler runs an iteration ahead: the next iteration overwrote the table while the "
              "previous iteration's copy, which reads its source when it runs, was still queued; attention then "
              "indexed another batch's blocks",
        says="check_staging: the host refills buffer 0 while step 0's copy may not have run (one buffer for two "
             "steps in flight); the sanitizer sees the host write racing the copy; held copies read the next "
             "step's offsets"),
    buggy=lambda: _subject("one persistent pinned table, refilled in place", KVCacheManager(fresh_host_buffer=False),
                           "host_kv_cache_block_offsets", KVCacheManager.copy_batch_block_offsets),
    fixed=lambda: _subject("a fresh host buffer per call", KVCacheManager(fresh_host_buffer=True),
                           "host_kv_cache_block_offsets", KVCacheManager.copy_batch_block_offsets),
    quick=True,
)

VLLM_UVA_POOL = Case(
    name="vllm-uva-pool",
    title="A buffer pool with as many slots as batches in flight and a step whose wait waits for nothing",
    source=Source("vllm-project/vllm", 53057, "vllm/v1/engine/core.py", "EngineCore.step_with_batch_queue"),
    story=Story(
        did="UvaBufferPool held exactly max_concurrent_batches pinned buffers, refilled with no wait: the batch "
            "queue, popping the oldest future when full, was the only bound on the steps in flight",
        wrong="an encoder-only step's future resolves on the host as soon as the step is launched, so popping it "
              "waits for nothing; a slot came round again while the step that last used it still read it (the "
              "deferred structured-output path escapes the count the same way)",
        says="check_staging: step 2 refills buffer 0 while the host waited for no step; the sanitizer and the "
             "held run agree"),
    buggy=lambda: _subject("the pop of an encoder-only step waits for nothing",
                           EngineCore(waits_for_prior_step=False), "UVA input buffers", EngineCore.step_with_batch_queue),
    fixed=lambda: _subject("the pop waits for the prior step to end", EngineCore(waits_for_prior_step=True),
                           "UVA input buffers", EngineCore.step_with_batch_queue),
)

VLLM_ONE_INPUT_BUFFER = Case(
    name="vllm-one-input-buffer",
    title="One input buffer rewritten while the previous step still reads it",
    source=Source("vllm-project/vllm", 48901, "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._prepare_inputs",
                  also=(48214,)),
    story=Story(
        did="the V1 model runner keeps one pinned host tensor per input and copies it to the device "
            "non-blocking; under async scheduling the host prepares the next step while the current one runs",
        wrong="a pooling model's intermediate prefill chunk returns with no device sync, so the next step's "
              "update overwrote the inputs while the previous step's copy still read them: positions past the "
              "model's maximum, wrong scores",
        says="check_staging: one buffer for two steps in flight; the sanitizer sees the rewrite racing the copy; "
             "the held run reads the next step's inputs"),
    buggy=lambda: _subject("one buffer, no sync before the update", InputBatch(sync_before_update=False),
                           "num_computed_tokens (pinned host input)", InputBatch._update_states),
    fixed=lambda: _subject("a device sync before the update", InputBatch(sync_before_update=True),
                           "num_computed_tokens (pinned host input)", InputBatch._update_states),
)

CASES = (TRTLLM_BLOCK_OFFSETS, VLLM_UVA_POOL, VLLM_ONE_INPUT_BUFFER)
