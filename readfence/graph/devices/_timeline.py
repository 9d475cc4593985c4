"""A timeline of one run: spans and instants per track (streams and the host), for traces.

``to_chrome_trace()`` gives Chrome trace-event JSON (open it in Perfetto or chrome://tracing):
one track (thread) per stream plus the host.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import attrs

_P = ParamSpec("_P")
_R = TypeVar("_R")


@attrs.frozen
class Span:
    """``name`` on ``track`` (a stream, or ``host``) from ``start`` to ``end`` (``perf_counter``
    seconds; equal for an instant); ``category`` groups spans (colours, filters), ``args`` go to
    the trace viewer."""

    track: str
    name: str
    start: float
    end: float
    category: str
    args: dict[str, object] = attrs.field(factory=dict)


class Timeline:
    """Thread-safe recorder of spans (``perf_counter`` seconds) on named tracks.

    >>> tl = Timeline()
    >>> tl.timed("host", "plan", lambda: 1 + 1, category="scheduler")()
    2
    >>> [e["name"] for e in tl.to_chrome_trace()["traceEvents"] if e["ph"] == "X"]
    ['plan']
    """

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def span(self, track: str, name: str, start: float, end: float, category: str = "op", **args: object) -> None:
        with self._lock:
            self.spans.append(Span(track, name, start, end, category, args))

    def instant(self, track: str, name: str, at: float, category: str = "event", **args: object) -> None:
        self.span(track, name, at, at, category, **args)

    def timed(self, track: str, name: str, fn: Callable[_P, _R], category: str = "op", **args: object) -> Callable[_P, _R]:
        """``fn`` wrapped to record a span on ``track`` each time it runs."""

        def run(*a: _P.args, **kw: _P.kwargs) -> _R:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.span(track, name, t0, time.perf_counter(), category, **args)

        return run

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON: complete events (``X``) and instants (``i``), in µs."""
        tracks = sorted({s.track for s in self.spans}, key=lambda t: (t != "host", t))
        tid = {t: i for i, t in enumerate(tracks)}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid[t], "args": {"name": t}} for t in tracks
        ]
        for s in sorted(self.spans, key=lambda s: s.start):
            base = {"name": s.name, "cat": s.category, "pid": 0, "tid": tid[s.track],
                    "ts": (s.start - self.origin) * 1e6, "args": s.args}
            if s.end > s.start:
                events.append({**base, "ph": "X", "dur": (s.end - s.start) * 1e6})
            else:
                events.append({**base, "ph": "i", "s": "t"})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
