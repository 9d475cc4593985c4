"""Traces of a demo run: waits and graph replays added to a ``Timeline``; Chrome trace JSON.

The runtime's :class:`~readfence.graph.Timeline` records stage spans, scheduler writes, host
scheduling and fence instants. :class:`WaitRecorder` (a device observer) adds the stream
waits, and :func:`add_replays` turns each ``prepare_in_graph`` + ``body`` pair into a
``graph replay`` span. :func:`chrome_trace` merges one timeline per policy into one file:
one process per policy, one thread track per stream plus the host.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from readfence.core import BODY, PREPARE_IN_GRAPH
from readfence.graph import DeviceObserver, Event, Op, Timeline


def short_event_name(name: str) -> str:
    """The readable tail of a device event name.

    >>> short_event_name("hybrid_linear/DECODE/b4/PER_BUFFER/forward#3/PRE_REPLAY#0")
    'PRE_REPLAY'
    >>> short_event_name("scheduler/written")
    'scheduler/written'
    """
    if name.count("/") <= 1:
        return name
    return re.sub(r"#\d+$", "", name.rsplit("/", 1)[-1])


def span_name(label: str) -> str:
    """The timeline span a launch label shows up as (``scheduler/write:seq_lens`` -> ``write seq_lens``).

    >>> span_name("scheduler/write:seq_lens"), span_name("paged/DECODE/b4/EXACT/forward#0/prepare_out_graph")
    ('write seq_lens', 'prepare_out_graph')
    """
    return label.rsplit("/", 1)[-1].replace(":", " ")


@attrs.frozen
class Wait:
    """One ``stream.wait(event)``: when it was enqueued, and which launches followed it."""

    stream: str
    event: str
    enqueued: float
    position: int  # how many launches were enqueued on the stream before it


class WaitRecorder(DeviceObserver):
    """Remembers every wait with its enqueue time, and every launch's order per stream.

    >>> rec = WaitRecorder()
    >>> rec.on_wait("schedule", type("E", (), {"name": "scheduler/written"})())
    >>> rec.on_launch("schedule", "scheduler/write:seq_lens", ())
    >>> [(w.stream, w.event, w.position) for w in rec.waits], rec.launches
    ([('schedule', 'scheduler/written', 0)], {'schedule': ['write seq_lens']})
    """

    def __init__(self) -> None:
        self.waits: list[Wait] = []
        self.launches: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def on_launch(self, stream: str, label: str, ops: Sequence[Op]) -> None:
        with self._lock:
            self.launches.setdefault(stream, []).append(span_name(label))

    def on_wait(self, stream: str, event: Event) -> None:
        with self._lock:
            position = len(self.launches.get(stream, ()))
            self.waits.append(Wait(stream, getattr(event, "name", repr(event)), time.perf_counter(), position))


def add_waits(timeline: Timeline, recorder: WaitRecorder, *, min_s: float = 1e-5) -> int:
    """Add a ``wait <event>`` span per wait that held its stream back; returns how many.

    Streams run their work in enqueue order, so the n-th launch named ``write seq_lens`` on a
    stream is the n-th such span on its track. A wait is drawn from when its stream was idle
    (the later of its enqueue time and the end of the previous span on the track) to the start
    of the first traced launch enqueued after it. Waits that held it back less than ``min_s``
    seconds are left out.

    >>> tl, rec = Timeline(), WaitRecorder()
    >>> rec.on_launch("schedule", "scheduler/write:a", ())
    >>> rec.on_wait("schedule", type("E", (), {"name": "m/DECODE/b4/JOINED/forward#0/IN_REPLAY#0"})())
    >>> rec.on_launch("schedule", "scheduler/write:a", ())
    >>> t = rec.waits[0].enqueued
    >>> tl.span("schedule", "write a", t - 0.5, t - 0.4, "write")
    >>> tl.span("schedule", "write a", t + 3.0, t + 3.5, "write")
    >>> add_waits(tl, rec)
    1
    >>> [(s.name, s.end - s.start) for s in tl.spans if s.category == "wait"]
    [('wait IN_REPLAY', 3.0)]
    """
    by_name: dict[tuple[str, str], list[Any]] = {}
    by_track: dict[str, list[Any]] = {}
    for s in timeline.spans:
        if s.end > s.start:
            by_name.setdefault((s.track, s.name), []).append(s)
            by_track.setdefault(s.track, []).append(s)
    for spans in [*by_name.values(), *by_track.values()]:
        spans.sort(key=lambda s: s.start)
    held: dict[int, tuple[float, Any, list[str]]] = {}
    for w in recorder.waits:
        launches = recorder.launches.get(w.stream, [])
        target = None
        for j in range(w.position, len(launches)):
            named = by_name.get((w.stream, launches[j]))
            if named:
                ordinal = launches[:j].count(launches[j])
                target = named[ordinal] if ordinal < len(named) else None
                break
        if target is None:
            continue
        before = [s.end for s in by_track[w.stream] if s.end <= target.start]
        idle = max([w.enqueued] + before)
        if target.start - idle < min_s:
            continue
        start, _, names = held.get(id(target), (idle, target, []))
        held[id(target)] = (min(start, idle), target, names + [short_event_name(w.event)])
    for start, target, names in held.values():
        timeline.span(target.track, "wait " + ", ".join(dict.fromkeys(names)), start, target.start, "wait",
                      events=sorted(set(names)))
    return len(held)


def stage_tracks(timeline: Timeline) -> list[str]:
    """The tracks that run stages (the forward streams: one, or one per ``per_stream`` member).

    >>> tl = Timeline()
    >>> tl.span("forward[1]", "body", 0, 1, "stage"); tl.span("host", "schedule next step", 0, 1, "host")
    >>> stage_tracks(tl)
    ['forward[1]']
    """
    return sorted({s.track for s in timeline.spans if s.category == "stage"})


def add_replays(timeline: Timeline, *, graphed: Sequence[bool] = (True,), phases: Sequence[str] = ()) -> int:
    """Add one span around each ``prepare_in_graph`` .. ``body`` pair on every forward stream.

    A step runs ``len(graphed)`` such pairs on each stream, one per phase (several for a
    speculative step); ``graphed[k]`` says whether phase ``k`` replays a graph, ``phases[k]``
    names it. Each span carries its ``step`` (and ``phase``). Returns how many were added.

    >>> tl = Timeline()
    >>> for name, a, b in [("prepare_in_graph", 1, 2), ("body", 2, 5), ("prepare_in_graph", 6, 7), ("body", 7, 8)]:
    ...     tl.span("forward", name, a, b, "stage")
    >>> add_replays(tl, graphed=(True, False), phases=("verify", "extend"))
    2
    >>> [(s.name, s.start, s.end, s.args) for s in tl.spans if s.category == "replay"]  # doctest: +NORMALIZE_WHITESPACE
    [('graph replay', 1, 5, {'step': 0, 'phase': 'verify'}),
     ('in-graph work (eager)', 6, 8, {'step': 0, 'phase': 'extend'})]
    """
    graphed = tuple(graphed) or (True,)
    count = 0
    for track in stage_tracks(timeline):
        stages = sorted((s for s in timeline.spans if s.track == track and s.category == "stage"),
                        key=lambda s: s.start)
        pairs, start = 0, None
        for s in stages:
            if s.name == PREPARE_IN_GRAPH.name:
                start = s.start
            elif s.name == BODY.name and start is not None:
                k = pairs % len(graphed)
                args: dict[str, Any] = {"step": pairs // len(graphed)}
                if k < len(phases):
                    args["phase"] = phases[k]
                timeline.span(track, "graph replay" if graphed[k] else "in-graph work (eager)", start, s.end,
                              "replay", **args)
                pairs, start = pairs + 1, None
        count += pairs
    return count


def chrome_trace(timelines: Mapping[str, Timeline], **meta: object) -> dict[str, Any]:
    """One Chrome trace-event document: a process per key (e.g. policy), tracks per stream.

    >>> tl = Timeline(); tl.span("host", "schedule next step", tl.origin, tl.origin + 1e-3, "host")
    >>> doc = chrome_trace({"EXACT": tl}, spec="paged")
    >>> [e["name"] for e in doc["traceEvents"]], doc["otherData"]
    (['process_name', 'process_sort_index', 'thread_name', 'schedule next step'], {'spec': 'paged'})
    """
    events: list[dict[str, Any]] = []
    for pid, (label, timeline) in enumerate(timelines.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for e in timeline.to_chrome_trace()["traceEvents"]:
            events.append({**e, "pid": pid})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta)}
