"""Jobs the tensor-parallel tests run on every rank (module level: each rank imports them)."""

from __future__ import annotations

import time

from readfence.backends import parse
from readfence.graph import Policy, run_overlapped


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
                time.sleep(600)  # a stall: the stream's worker thread is a daemon, it dies with the rank
        return 0.0


def faulty_loop(rank, fail_rank: int, action: str, steps: int) -> dict:
    """The overlapped loop of ``paged`` under PER_BUFFER; rank ``fail_rank``'s forward raises or
    stalls at its third step."""
    faults = FailAt(action, 3) if rank.rank == fail_rank else None
    t0 = time.monotonic()
    with rank.open_device(faults=faults) as dev:
        run_overlapped(parse("paged").unwrap(), steps=steps, policy=Policy.PER_BUFFER, device=dev, batch_size=2,
                       cfg=rank.cfg)
    return {"seconds": time.monotonic() - t0}


def nothing(rank) -> int:
    return rank.rank
