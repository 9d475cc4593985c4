"""The serving scheduler: requests arrive, are admitted, prefilled in chunks, decoded, finished.

Each step it takes the requests that arrived (:class:`Traffic`), frees the rows, state slots and
KV slots of the requests that finished, admits waiting requests while a row, a state slot and
a place in the largest batch are free (the model's limits), and runs one of two kinds of step:

* ``prefill`` (EXTEND): every admitted request with prompt left gets its next chunk of
  ``tokens_per_request(EXTEND)`` tokens (a prompt is rounded up to whole chunks), at most
  ``max_prefill`` requests, oldest first;
* ``decode``: every request whose prompt is done gets ``decode_tokens`` new tokens.

A prefill runs when one is due and the previous step was not a prefill, or nothing can
decode: prefills come between decode steps. The batch size follows the traffic, and so
do row, slot and state-slot reuse: a row freed this step is handed to a request admitted
this step, while the previous step may still read it (what the fences are for).

The last row, one state slot and a chunk of KV slots are never handed out: they are the
padding request's. A graph captured for ``n`` requests runs a smaller batch padded with copies
of it (:meth:`ServeScheduler.pad`), which read and write only the padding's own slots.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator, Mapping

import attrs
import torch
from torch import Tensor

from readfence.core import ForwardMode, ModelConfig
from readfence.core.internal import positive_int, tokens_per_request

from ._arrivals import Request, Traffic
from ._scheduler import StepState, _int32s, step_tensors

PREFILL, DECODE = "prefill", "decode"
#: Tokens per request of a prefill step (one chunk of a prompt).
CHUNK = tokens_per_request(ForwardMode.EXTEND)


@attrs.frozen
class ServeStep(StepState):
    """One step of the serving scheduler: the shared state and the (unpadded) batch, as
    :class:`StepState`, plus its ``kind`` (``"prefill"`` or ``"decode"``), the ``requests`` in
    batch order (ids), the ``tokens`` each one brings and the ticks that passed idle before it."""

    kind: str = PREFILL
    requests: tuple[int, ...] = ()
    tokens: int = 1
    idle_ticks: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@attrs.define
class _Live:
    request: Request
    row: int
    state_slot: int
    prompt: int  # tokens, rounded up to whole chunks
    slots: list[int] = attrs.Factory(list)
    decoded: int = 0

    @property
    def length(self) -> int:
        return len(self.slots)

    @property
    def prefilling(self) -> bool:
        return self.length < self.prompt

    @property
    def done(self) -> bool:
        return not self.prefilling and self.decoded >= self.request.output


def prompt_tokens(prompt: int) -> int:
    """A prompt's length rounded up to whole prefill chunks.

    >>> prompt_tokens(5), prompt_tokens(8)
    (8, 8)
    """
    return -(-prompt // CHUNK) * CHUNK


class ServeScheduler:
    """The host side of the serving loop (see the module docstring).

    ``decode_tokens`` are the tokens a decode step brings per request (``tokens_per_request``
    of the step's scheduling mode), ``max_batch`` the most requests running at once (the
    largest captured batch size), ``max_prefill`` the most requests in one prefill step.

    >>> s = ServeScheduler(ModelConfig(), 1, Traffic(rate=1.0, prompt=(4, 8), output=(1, 3), seed=0), max_batch=4)
    >>> [(x.kind, x.requests) for x in (s.next_step() for _ in range(6))]  # doctest: +NORMALIZE_WHITESPACE
    [('prefill', (0,)), ('prefill', (0, 1, 2)), ('decode', (0,)), ('prefill', (1, 2, 3, 4)), ('decode', (1, 2)),
     ('prefill', (3, 4))]
    """

    def __init__(self, cfg: ModelConfig, decode_tokens: int, traffic: Traffic, *, max_batch: int,
                 max_prefill: int | None = None) -> None:
        if not isinstance(traffic, Traffic):
            raise TypeError(f"traffic must be a readfence.graph.Traffic, got {traffic!r}")
        positive_int("decode_tokens", decode_tokens, at_most=cfg.max_ctx, limit="cfg.max_ctx")
        if cfg.max_reqs < 2:
            raise ValueError(f"serving needs cfg.max_reqs >= 2 (one row is the padding request's), got {cfg.max_reqs}")
        positive_int("max_batch", max_batch, at_most=cfg.max_reqs - 1, limit="cfg.max_reqs - 1 (one row pads)")
        max_prefill = max_batch if max_prefill is None else positive_int("max_prefill", max_prefill)
        need = prompt_tokens(traffic.prompt[1]) + traffic.output[1] * decode_tokens
        if need > cfg.max_ctx:
            raise ValueError(
                f"a request of the traffic may need {prompt_tokens(traffic.prompt[1])} prompt positions (prompts up "
                f"to {traffic.prompt[1]} tokens, in chunks of {CHUNK}) + {traffic.output[1]} decode steps x "
                f"{decode_tokens} tokens = {need} positions; the model holds cfg.max_ctx={cfg.max_ctx}: give shorter "
                f"prompts or outputs")
        self.cfg, self.decode_tokens, self.traffic = cfg, decode_tokens, traffic
        self.max_batch, self.max_prefill = max_batch, max_prefill
        self.rng = random.Random(traffic.seed + 1)
        self._arrivals: Iterator[Request] = traffic.arrivals()
        self._next_arrival: Request = next(self._arrivals)
        self.tick, self.step = 0, -1
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[_Live] = []
        self.last_kind: str | None = None
        self.pad_row = cfg.max_reqs - 1
        self.free_rows = list(range(cfg.max_reqs - 1))
        slots = list(range(cfg.num_slots))
        swa = list(range(cfg.num_swa_slots))
        self.rng.shuffle(slots)
        self.rng.shuffle(swa)
        pad_tokens = max(CHUNK, decode_tokens)
        self.pad_slots, self.free_slots = slots[:pad_tokens], slots[pad_tokens:]
        pad_swa, self.free_swa = swa[:pad_tokens], swa[pad_tokens:]
        self.pad_state, self.free_state = cfg.num_state_slots - 1, list(range(cfg.num_state_slots - 1))
        self.req_to_token = _int32s(cfg.max_reqs * cfg.max_ctx)
        self.seq_lens = _int32s(cfg.max_reqs)
        self.swa_map = _int32s(cfg.num_slots)
        self.state_slots = _int32s(cfg.max_reqs)
        for i, (slot, w) in enumerate(zip(self.pad_slots, pad_swa)):
            self.req_to_token[self.pad_row * cfg.max_ctx + i] = slot
            self.swa_map[slot] = w
        self.state_slots[self.pad_row] = self.pad_state
        self.finished = 0

    # -- the step's plan (host bookkeeping only) ----------------------------------------------
    def _take(self, pool: list[int]) -> int:
        return pool.pop(self.rng.randrange(len(pool)))

    def _arrive(self) -> None:
        while self._next_arrival.arrival < self.tick + 1:
            self.waiting.append(self._next_arrival)
            self._next_arrival = next(self._arrivals)

    def _finish(self) -> int:
        done = [live for live in self.running if live.done]
        for live in done:
            self.free_rows.append(live.row)
            self.free_state.append(live.state_slot)
            for slot in live.slots:
                self.free_swa.append(self.swa_map[slot])
                self.free_slots.append(slot)
            self.running.remove(live)
        self.finished += len(done)
        return len(done)

    def _admit(self) -> int:
        admitted = 0
        while self.waiting and len(self.running) < self.max_batch and self.free_rows and self.free_state:
            request = self.waiting.popleft()
            live = _Live(request, self._take(self.free_rows), self._take(self.free_state), prompt_tokens(request.prompt))
            self.state_slots[live.row] = live.state_slot
            self.running.append(live)
            admitted += 1
        return admitted

    def _choose(self) -> tuple[str, list[_Live]] | None:
        prefill = [r for r in self.running if r.prefilling][: self.max_prefill]
        decode = [r for r in self.running if not r.prefilling and not r.done]
        if prefill and (self.last_kind != PREFILL or not decode):
            return PREFILL, prefill
        if decode:
            return DECODE, decode
        return None

    def plan(self) -> tuple[str, list[_Live], int, int, int]:
        """Advance to the next step: ``(kind, requests, admitted, finished, idle ticks)``;
        writes nothing but the scheduler's own bookkeeping (a dry run of the schedule)."""
        self.step += 1
        idle = admitted = finished = 0
        while True:
            self._arrive()
            finished += self._finish()
            admitted += self._admit()
            chosen = self._choose()
            self.tick += 1
            if chosen is not None:
                break
            idle += 1
            if not self.running and not self.waiting:  # nothing changes before the next arrival: go to its tick
                ahead = max(int(self._next_arrival.arrival) - self.tick, 0)
                self.tick += ahead
                idle += ahead
        kind, reqs = chosen
        self.last_kind = kind
        n = CHUNK if kind == PREFILL else self.decode_tokens
        for live in reqs:
            for _ in range(n):
                slot = self._take(self.free_slots)
                self.swa_map[slot] = self._take(self.free_swa)
                self.req_to_token[live.row * self.cfg.max_ctx + live.length] = slot
                live.slots.append(slot)
            self.seq_lens[live.row] = live.length
            if kind == DECODE:
                live.decoded += 1
        return kind, reqs, admitted, finished, idle

    # -- the step itself ---------------------------------------------------------------------
    def next_step(self) -> ServeStep:
        """Advance one step; returns its full shared state and its batch (fresh host tensors)."""
        kind, reqs, admitted, finished, idle = self.plan()
        n = CHUNK if kind == PREFILL else self.decode_tokens
        cfg = self.cfg
        self.seq_lens[self.pad_row] = n
        ids, positions, rows, locs = [], [], [], []
        for live in reqs:
            rows.append(live.row)
            for i in range(live.length - n, live.length):
                positions.append(i)
                locs.append(live.slots[i])
                ids.append(self.rng.randrange(cfg.vocab))
        shared, batch = step_tensors(cfg, (self.req_to_token, self.seq_lens, self.swa_map, self.state_slots),
                                     ids=ids, positions=positions, rows=rows, locs=locs)
        return ServeStep(self.step, shared, batch, admitted, finished, kind, tuple(r.request.id for r in reqs), n, idle)

    def pad(self, step: ServeStep, size: int) -> dict[str, Tensor]:
        """``step``'s batch padded to ``size`` requests with copies of the padding request (its
        own row, state slot and KV slots: positions ``0..n-1``, ``n`` tokens each).

        >>> s = ServeScheduler(ModelConfig(), 1, Traffic(rate=1.0, prompt=(4, 4), output=(1, 1)), max_batch=4)
        >>> step = s.next_step()
        >>> padded = s.pad(step, 2)
        >>> padded["req_pool_indices"].tolist() == [*step.batch["req_pool_indices"].tolist(), s.pad_row]
        True
        >>> padded["positions"].tolist()[-4:]
        [0, 1, 2, 3]
        """
        missing = size - step.batch_size
        if missing < 0:
            raise ValueError(f"step {step.step} has {step.batch_size} requests: it cannot be padded to {size}")
        if missing == 0:
            return step.batch
        return pad_batch(step.batch, step.tokens, missing, self.pad_row, self.pad_slots)


def pad_batch(batch: Mapping[str, Tensor], tokens: int, missing: int, row: int, slots: list[int]) -> dict[str, Tensor]:
    """``batch`` (request-major, ``tokens`` per request) with ``missing`` padding requests of
    row ``row`` appended, their tokens at positions ``0..tokens-1`` in KV slots ``slots``."""
    i64 = torch.int64
    extra = {
        "input_ids": torch.zeros(missing * tokens, dtype=i64),
        "positions": torch.arange(tokens, dtype=i64).repeat(missing),
        "req_pool_indices": torch.full((missing,), row, dtype=i64),
        "out_cache_loc": torch.tensor(slots[:tokens], dtype=i64).repeat(missing),
    }
    return {k: torch.cat([v, extra[k]]) for k, v in batch.items()}
