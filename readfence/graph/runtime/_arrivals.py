"""Seeded serving traffic: Poisson arrivals, prompt and output lengths drawn per request.

Time is counted in scheduler ticks: the serving loop runs one step per tick, and a tick in
which no request can run (no request waiting, none running) passes without a step. Arrivals
are a Poisson process of ``rate`` requests per tick (exponential gaps), each request with a
prompt length and an output length drawn uniformly from their ranges, all from one seeded
``random.Random``: the same seed gives the same requests, whatever runs them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import attrs

from readfence.core.internal import positive_int


def _length_range(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    ok = (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in value))
    if not ok or not 1 <= value[0] <= value[1]:  # type: ignore[index]
        raise ValueError(f"Traffic.{attribute.name} must be a (low, high) pair of ints with 1 <= low <= high, "
                         f"got {value!r}")


#: The most requests a step may see arrive on average: far beyond any batch (a higher rate only fills
#: the queue, and each arrival is drawn one by one).
MAX_RATE = 1024.0


def _rate(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (math.isfinite(value) and 0 < value <= MAX_RATE)):
        raise ValueError(f"Traffic.rate must be a positive number of requests per step, at most {MAX_RATE:g}, "
                         f"got {value!r}")


def _seed(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Traffic.seed must be an int, got {value!r} ({type(value).__name__})")


@attrs.frozen
class Request:
    """One request of the traffic: ``id`` in arrival order, its arrival tick, its prompt length
    (tokens) and its output length (decode steps)."""

    id: int
    arrival: float
    prompt: int
    output: int


@attrs.frozen
class Traffic:
    """What arrives: ``rate`` requests per tick on average (Poisson), prompts of ``prompt``
    tokens and outputs of ``output`` decode steps (inclusive ranges, uniform), from ``seed``.

    >>> t = Traffic(rate=0.5, prompt=(4, 16), output=(2, 8), seed=3)
    >>> [(r.id, r.prompt, r.output) for r in t.requests(3)]
    [(0, 12, 3), (1, 13, 5), (2, 5, 6)]
    >>> Traffic(rate=0)
    Traceback (most recent call last):
    ...
    ValueError: Traffic.rate must be a positive number of requests per step, at most 1024, got 0
    """

    rate: float = attrs.field(default=0.5, validator=_rate)
    prompt: tuple[int, int] = attrs.field(default=(4, 24), validator=_length_range)
    output: tuple[int, int] = attrs.field(default=(1, 12), validator=_length_range)
    seed: int = attrs.field(default=0, validator=lambda _i, _a, v: _seed(v))

    def arrivals(self) -> Arrivals:
        """The requests in arrival order, forever (an iterator over one seeded draw)."""
        return Arrivals(self)

    def requests(self, n: int) -> list[Request]:
        """The first ``n`` requests."""
        positive_int("n", n)
        it = self.arrivals()
        return [next(it) for _ in range(n)]


class Arrivals(Iterator[Request]):
    """The requests of a :class:`Traffic`, in arrival order (a plain object: a copy of it goes on
    from where it was, which a dry run of a schedule needs)."""

    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic
        self.rng = random.Random(traffic.seed)
        self.time, self.count = 0.0, 0

    def __next__(self) -> Request:
        t = self.traffic
        self.time += self.rng.expovariate(t.rate)
        request = Request(self.count, self.time, self.rng.randint(*t.prompt), self.rng.randint(*t.output))
        self.count += 1
        return request
