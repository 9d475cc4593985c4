"""Jobs the tensor-parallel tests run on every rank (module level: each rank imports them)."""

from __future__ import annotations

import hashlib
import os
import time

import torch.distributed as dist

from readfence.backends import hybrid_linear, linear, paged, redeclare, trtllm_mha
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import LoopOptions, Policy, run_overlapped, run_serial, verify

STEPS, BATCH = 4, 2


def _digest(logits) -> str:
    h = hashlib.sha256()
    for t in logits:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def every_check(rank) -> dict:
    """On one rank: the serial reference with the rank's sharding, verify under every policy
    (each policy's overlapped run bit-identical to it, poison and observer clean), and a
    declaration one step early."""
    backend = hybrid_linear(trtllm_mha(), linear())
    reference = run_serial(backend, steps=STEPS, batch_size=BATCH, cfg=rank.cfg)
    out = {"reference": [t.tolist() for t in reference.logits], "digest": _digest(reference.logits)}
    with rank.open_device() as dev:
        report = verify(backend, steps=STEPS, batch_size=BATCH, device=dev, cfg=rank.cfg).unwrap()
        out["verified"] = [c.policy.name for c in report.checks]
        early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                            "seq_lens": ReadEnd.IN_REPLAY}))
        caught = verify(early, steps=3, batch_size=BATCH, device=dev, cfg=rank.cfg, policy=Policy.PER_BUFFER,
                        options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
        out["caught"] = (caught.kind, caught.buffer, caught.step, caught.stage, caught.evidence)
    out["collectives"] = dist.group.WORLD._get_sequence_number_for_group()
    out["shard"] = (rank.cfg.tp.rank, rank.cfg.tp.size, rank.cfg.local_heads, rank.cfg.local_mlp)
    return out


class FailAt:
    """Fault injection: on the ``at``-th replay of the model body, raise or stall the stream."""

    def __init__(self, action: str, at: int) -> None:
        self.action, self.at, self.count = action, at, 0

    def maybe_delay(self, stream: str, label: str) -> float:
        if stream == "forward" and label.endswith("/body"):
            self.count += 1
            if self.count == self.at:
                if self.action == "raise":
                    raise RuntimeError("injected failure in the model body")
                time.sleep(600)  # the stream's worker thread is a daemon: it dies with the rank
        return 0.0


def faulty_loop(rank, fail_rank: int, action: str) -> None:
    """The overlapped loop of ``paged``; rank ``fail_rank``'s forward raises or stalls in its
    third step (``"raise"``, ``"stall"``), or its host hangs before the loop (``"hang"``)."""
    if rank.rank == fail_rank and action == "hang":
        time.sleep(600)  # its partners wait in their first collective; the launcher ends it
    faults = FailAt(action, 3) if rank.rank == fail_rank else None
    with rank.open_device(faults=faults) as dev:
        run_overlapped(paged(), steps=6, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=rank.cfg)


def returns_early(rank, early_rank: int) -> str:
    """The overlapped loop of ``paged`` on every rank but ``early_rank``, which returns at once:
    the others wait in an all-reduce it never joins."""
    if rank.rank == early_rank:
        return "skipped"
    with rank.open_device() as dev:
        run_overlapped(paged(), steps=3, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=rank.cfg)
    return "ran"


def nothing(rank) -> int:
    """Only the launch: the rank's number."""
    return rank.rank


def environment(rank, name: str) -> str | None:
    """The rank's value of the environment variable ``name`` (``None``: not set)."""
    return os.environ.get(name)


def fails(rank) -> None:
    """Raises once the process group is up."""
    raise RuntimeError(f"failure on rank {rank.rank} after init")
