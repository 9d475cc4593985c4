"""Seeded random stream delays: make races show up, reproducibly.

Each stream draws from its own generator seeded by ``(seed, stream)``, so the sequence of
delays a stream sees depends only on the seed and on the order of that stream's own ops, not
on thread interleaving.

>>> a = FaultInjector(seed=7, max_delay_s=0.001)
>>> b = FaultInjector(seed=7, max_delay_s=0.001)
>>> [a.delay_for("forward", "op") for _ in range(3)] == [b.delay_for("forward", "op") for _ in range(3)]
True
>>> FaultInjector(seed=7, max_delay_s=0.001, streams=["schedule"]).delay_for("forward", "op")
0.0
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable


class FaultInjector:
    """Random delays of up to ``max_delay_s`` before ops on ``streams`` (all when ``None``).

    ``probability`` is the chance that a given op is delayed at all. A device given
    ``faults=FaultInjector(...)`` calls :meth:`maybe_delay` before every op it runs, including
    between the ops of a graph replay; the lowering may add more points with
    ``device.delay_point(label)`` (e.g. between FX nodes). ``log`` keeps, per stream, the
    ``(label, delay)`` pairs drawn, for reproducibility checks.
    """

    def __init__(
        self,
        seed: int,
        max_delay_s: float,
        streams: Iterable[str] | None = None,
        *,
        probability: float = 0.5,
    ) -> None:
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        self.seed = seed
        self.max_delay_s = max_delay_s
        self.streams = None if streams is None else frozenset(streams)
        self.probability = probability
        self.log: dict[str, list[tuple[str, float]]] = {}
        self._rngs: dict[str, random.Random] = {}
        self._lock = threading.Lock()

    def applies_to(self, stream: str) -> bool:
        """Whether ops on ``stream`` are delayed at all."""
        return self.streams is None or stream in self.streams

    def delay_for(self, stream: str, label: str) -> float:
        """Draw the next delay for ``stream`` (logged, not slept)."""
        if not self.applies_to(stream):
            return 0.0
        with self._lock:
            rng = self._rngs.get(stream)
            if rng is None:
                rng = self._rngs[stream] = random.Random(f"{self.seed}:{stream}")
            hit = rng.random() < self.probability
            delay = rng.uniform(0.0, self.max_delay_s) if hit else 0.0
            self.log.setdefault(stream, []).append((label, delay))
        return delay

    def maybe_delay(self, stream: str, label: str) -> float:
        """Sleep for the next delay drawn for ``stream``; returns it."""
        delay = self.delay_for(stream, label)
        if delay > 0.0:
            time.sleep(delay)
        return delay

    def __repr__(self) -> str:
        which = "all streams" if self.streams is None else sorted(self.streams)
        return f"FaultInjector(seed={self.seed}, max_delay_s={self.max_delay_s}, streams={which})"
