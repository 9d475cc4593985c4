"""A deterministic scheduler: the host side that writes each step's shared state.

Each step it advances the running requests by ``tokens_per_request(mode)`` tokens, finishes
some (seeded coin flips, or a full context) and admits new ones into freed rows, so that
page-table rows, KV slots and state slots are reused. It returns fresh host tensors for the
next step's shared buffers and batch; the runtime copies them into the live buffers behind
the previous step's fence.

Its own copy of the shared state is kept in ``array('i')`` buffers, not tensors: setting one
element of a tensor from Python is a dispatched op that gives the GIL away (and, on a CPU
device, to the forward stream's thread, which then keeps it until its next op). A step made
about 45 such calls (60-100 us); now it makes one ``torch.frombuffer`` per buffer.
"""

from __future__ import annotations

import random
from array import array
from typing import Protocol

import attrs
import torch
from torch import Tensor

from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.core.internal import positive_int, tokens_per_request


@attrs.define
class _Request:
    row: int
    state_slot: int
    slots: list[int] = attrs.Factory(list)

    @property
    def length(self) -> int:
        return len(self.slots)


@attrs.frozen
class StepState:
    """One step's scheduler output: the whole shared state and the batch, as host tensors."""

    step: int
    shared: dict[str, Tensor]
    batch: dict[str, Tensor]
    admitted: int
    finished: int


class StepSource(Protocol):
    """What a loop takes its steps from: a :class:`Scheduler`, or the serving loop's scheduler."""

    def next_step(self) -> StepState:
        """The next step's shared state and batch."""
        ...


class Scheduler:
    """Seeded request churn over a fixed batch size (the graph's static shape).

    >>> from readfence.core import ModelConfig, ForwardMode
    >>> s = Scheduler(ModelConfig(), ForwardMode.DECODE, batch_size=2, seed=0)
    >>> first, second = s.next_step(), s.next_step()
    >>> second.batch["positions"].tolist() == [p + 1 for p in first.batch["positions"].tolist()]
    True
    """

    def __init__(
        self,
        cfg: ModelConfig,
        mode: ForwardMode,
        batch_size: int,
        *,
        seed: int = 0,
        finish_prob: float = 0.1,
    ) -> None:
        positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
        if not 0.0 <= finish_prob <= 1.0:
            raise ValueError(f"finish_prob must be in [0, 1], got {finish_prob!r}")
        self.cfg, self.mode, self.batch_size = cfg, mode, batch_size
        self.tokens = tokens_per_request(mode)
        if self.tokens == 0:
            raise ValueError(f"{mode} steps carry no tokens: nothing to schedule")
        self.finish_prob = finish_prob
        self.rng = random.Random(seed)
        self.step = -1
        self.free_rows = list(range(cfg.max_reqs))
        self.free_slots = list(range(cfg.num_slots))
        self.free_state = list(range(cfg.num_state_slots))
        self.free_swa = list(range(cfg.num_swa_slots))
        self.rng.shuffle(self.free_slots)
        self.rng.shuffle(self.free_swa)
        # int32 buffers, req_to_token row-major (see the module docstring)
        self.req_to_token = _int32s(cfg.max_reqs * cfg.max_ctx)
        self.seq_lens = _int32s(cfg.max_reqs)
        self.swa_map = _int32s(cfg.num_slots)
        self.state_slots = _int32s(cfg.max_reqs)
        self.running: list[_Request | None] = [None] * batch_size

    def _take(self, pool: list[int]) -> int:
        return pool.pop(self.rng.randrange(len(pool)))

    def _finish(self, req: _Request) -> None:
        self.free_rows.append(req.row)
        self.free_state.append(req.state_slot)
        for slot in req.slots:
            self.free_swa.append(self.swa_map[slot])
            self.free_slots.append(slot)

    def _admit(self) -> _Request:
        req = _Request(row=self._take(self.free_rows), state_slot=self._take(self.free_state))
        self.state_slots[req.row] = req.state_slot
        return req

    def next_step(self) -> StepState:
        """Advance one step; returns the full next shared state and batch (fresh tensors)."""
        self.step += 1
        admitted = finished = 0
        n, cfg = self.tokens, self.cfg
        for i, req in enumerate(self.running):
            full = req is not None and req.length + n > cfg.max_ctx
            if req is not None and (full or self.rng.random() < self.finish_prob):
                self._finish(req)
                self.running[i] = req = None
                finished += 1
            if req is None:
                self.running[i] = self._admit()
                admitted += 1
        ids, positions, rows, locs = [], [], [], []
        for req in self.running:
            assert req is not None
            rows.append(req.row)
            for _ in range(n):
                slot = self._take(self.free_slots)
                self.swa_map[slot] = self._take(self.free_swa)
                self.req_to_token[req.row * cfg.max_ctx + req.length] = slot
                positions.append(req.length)
                locs.append(slot)
                ids.append(self.rng.randrange(cfg.vocab))
                req.slots.append(slot)
            self.seq_lens[req.row] = req.length
        shared, batch = step_tensors(cfg, (self.req_to_token, self.seq_lens, self.swa_map, self.state_slots),
                                     ids=ids, positions=positions, rows=rows, locs=locs)
        return StepState(self.step, shared, batch, admitted, finished)


def _int32s(n: int) -> array:
    """``n`` zeros as a C int32 buffer."""
    out = array("i", bytes(4 * n))
    assert out.itemsize == 4, "array('i') is not 32-bit on this platform"
    return out


def step_tensors(cfg: ModelConfig, pools: tuple[array, array, array, array], *, ids: list[int],
                 positions: list[int], rows: list[int], locs: list[int]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A step's shared state (fresh copies of the host pools ``req_to_token``, ``seq_lens``,
    ``swa_map``, ``state_slots``, in that order) and its per-batch tensors."""
    req_to_token, seq_lens, swa_map, state_slots = pools
    shared = {
        "req_to_token": _tensor(req_to_token).view(cfg.max_reqs, cfg.max_ctx),
        "seq_lens": _tensor(seq_lens),
        "swa_map": _tensor(swa_map),
        "state_slots": _tensor(state_slots),
    }
    assert tuple(shared) == SHARED_BUFFERS
    i64 = torch.int64
    batch = {
        "input_ids": torch.tensor(ids, dtype=i64),
        "positions": torch.tensor(positions, dtype=i64),
        "req_pool_indices": torch.tensor(rows, dtype=i64),
        "out_cache_loc": torch.tensor(locs, dtype=i64),
    }
    return shared, batch


def _tensor(values: array) -> Tensor:
    """A fresh int32 tensor holding a copy of ``values`` (the tensor keeps the copy alive)."""
    return torch.frombuffer(array("i", values), dtype=torch.int32)
