"""Traces of a run: waits and graph replays added to a ``Timeline``; Chrome trace JSON.

The runtime's :class:`~readfence.graph.Timeline` records stage spans, scheduler writes, host
scheduling and fence instants. :class:`WaitRecorder` (a device observer) adds the stream
waits, and :func:`add_replays` turns each ``prepare_in_graph`` + ``body`` pair into a
``graph replay`` span. :func:`chrome_trace` merges one timeline per policy into one file:
one process per policy, one thread track per stream plus the host, every run on one clock.

A trace is for looking at steps, not for timing a long run: :class:`CappedTimeline` keeps the
first :data:`TRACE_STEPS` steps of a run and drops the rest (a trace of every step of a
2,000-step demo was 23 MB, and merging its waits took longer than the run).
"""

from __future__ import annotations

import bisect
import json
import pathlib
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor

from readfence.core import BODY, PREPARE_IN_GRAPH, ForwardMode, ModelConfig
from readfence.core.internal import replayed

from ..devices import Device, DeviceObserver, Timeline
from ..lowering import LowerOptions, Policy
from ..lowering.internal import for_a_loop, names_keywords
from ..steps import StepShape
from ..steps.internal import Target
from ._loop import run_overlapped
from ._options import LoopOptions, options_of, said_in
from ._result import LoopResult

#: Steps of each run a trace (and a plot) keeps.
TRACE_STEPS = 200


class CappedTimeline(Timeline):
    """A :class:`~readfence.graph.Timeline` that keeps the first ``max_steps`` steps: a span
    whose ``step`` is past them is dropped, and so is an untagged one (a stage, the host's
    scheduling) recorded after :meth:`stop`; :meth:`trim` then drops the untagged spans that
    start after the last kept step's end. (The host issues steps ahead of the streams that run
    them, so the caller stops a few steps late and trims to the exact cut.)

    >>> tl = CappedTimeline(max_steps=2)
    >>> for step in range(4):
    ...     tl.span("schedule", "write seq_lens", step, step + 0.5, "write", step=step)
    ...     tl.span("forward", "body", step + 0.5, step + 0.9, "stage")
    >>> tl.stop(); tl.span("forward", "body", 9, 10, "stage")
    >>> tl.trim()
    >>> [(s.name, s.start) for s in tl.spans], tl.dropped
    ([('write seq_lens', 0), ('body', 0.5), ('write seq_lens', 1), ('body', 1.5)], 5)
    """

    def __init__(self, max_steps: int = TRACE_STEPS) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.stopped = False
        self.dropped = 0

    def stop(self) -> None:
        """Record no untagged span from now on."""
        self.stopped = True

    def span(self, track: str, name: str, start: float, end: float, category: str = "op", **args: Any) -> None:
        step = args.get("step")
        if (step is None and self.stopped) or (isinstance(step, int) and step >= self.max_steps):
            self.dropped += 1
            return
        super().span(track, name, start, end, category, **args)

    def trim(self) -> None:
        """Drop the untagged spans that start after the end of the last kept step (its tagged
        spans' latest end), once the run is over; a run no longer than the cap is kept whole."""
        if not self.dropped:
            return
        with self._lock:
            last = [s.end for s in self.spans if s.args.get("step") == self.max_steps - 1]
            if not last:
                return
            cut = max(last)
            kept = [s for s in self.spans if "step" in s.args or s.start <= cut]
            self.dropped += len(self.spans) - len(kept)
            self.spans[:] = kept


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

    def __init__(self, timeline: CappedTimeline | None = None) -> None:
        self.waits: list[Wait] = []
        self.launches: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._timeline = timeline  # records nothing once it is stopped

    def on_launch(self, stream: str, label: str, ops: Any) -> None:
        if self._timeline is not None and self._timeline.stopped:
            return
        with self._lock:
            self.launches.setdefault(stream, []).append(span_name(label))

    def on_wait(self, stream: str, event: Any) -> None:
        if self._timeline is not None and self._timeline.stopped:
            return
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
    by_end = {t: sorted(sp.end for sp in spans) for t, spans in by_track.items()}  # to find the last end before a span
    ordinals: dict[str, list[int]] = {}  # per stream, how many earlier launches share each one's name
    for stream, launches in recorder.launches.items():
        seen: dict[str, int] = {}
        ordinals[stream] = []
        for name in launches:
            ordinals[stream].append(seen.get(name, 0))
            seen[name] = seen.get(name, 0) + 1
    held: dict[int, tuple[float, Any, list[str]]] = {}
    for w in recorder.waits:
        launches = recorder.launches.get(w.stream, [])
        target = None
        for j in range(w.position, len(launches)):
            named = by_name.get((w.stream, launches[j]))
            if named:
                ordinal = ordinals[w.stream][j]
                target = named[ordinal] if ordinal < len(named) else None
                break
        if target is None:
            continue
        done = by_end[w.stream]
        k = bisect.bisect_right(done, target.start)  # spans that ended by the time the target started
        idle = max(w.enqueued, done[k - 1]) if k else w.enqueued
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


def add_step_replays(timeline: Timeline, records: Sequence[Any]) -> int:
    """Add one span per step and forward stream around the stage runs the step made there,
    named after the graph it ran (``decode b8 (graph replay)``, ``prefill b3 (eager)``), with
    its ``step``, ``graph`` and ``kind``; ``records`` are the run's step records (each with
    ``step``, ``kind``, ``graph``, ``graphed`` and ``tracks``: per stream, its stage runs).
    Returns how many were added (a capped timeline holds only its first steps).

    >>> from types import SimpleNamespace as R
    >>> tl = Timeline()
    >>> for name, a, b in [("prepare_out_graph", 0, 1), ("prepare_in_graph", 1, 2), ("body", 2, 5),
    ...                    ("prepare_out_graph", 6, 7), ("prepare_in_graph", 7, 8), ("body", 8, 9)]:
    ...     tl.span("forward", name, a, b, "stage")
    >>> records = [R(step=0, kind="decode", graph="decode b4", graphed=True, tracks=(("forward", 1),)),
    ...            R(step=1, kind="prefill", graph="prefill b3", graphed=False, tracks=(("forward", 1),))]
    >>> add_step_replays(tl, records)
    2
    >>> [(s.name, s.start, s.end, s.args["step"]) for s in tl.spans if s.category == "replay"]
    [('decode b4 (graph replay)', 0, 5, 0), ('prefill b3 (eager)', 6, 9, 1)]
    """
    per_track: dict[str, list[tuple[Any, int]]] = {}
    for r in records:
        for track, runs in r.tracks:
            per_track.setdefault(track, []).append((r, runs))
    count = 0
    for track, items in per_track.items():
        stages = sorted((s for s in timeline.spans if s.track == track and s.category == "stage"),
                        key=lambda s: s.start)
        i = 0
        for r, runs in items:
            start, bodies = None, 0
            while i < len(stages) and bodies < runs:
                s = stages[i]
                start = s.start if start is None else start
                bodies += s.name == BODY.name
                i += 1
            if bodies < runs or start is None:
                break  # the timeline stopped recording here
            timeline.span(track, f"{r.graph} ({'graph replay' if r.graphed else 'eager'})", start, stages[i - 1].end,
                          "replay", step=r.step, graph=r.graph, kind=r.kind)
            count += 1
    return count


def track_order(track: str) -> tuple[int, str]:
    """Where a track goes, top to bottom: the host, the schedule stream, the forward streams,
    then the fences (the order a step's work flows in).

    >>> sorted(["fences", "forward[1]", "host", "forward[0]", "schedule"], key=track_order)
    ['host', 'schedule', 'forward[0]', 'forward[1]', 'fences']
    """
    return ({"host": 0, "schedule": 1}.get(track, 3 if track == "fences" else 2), track)


def chrome_trace(timelines: Mapping[str, Timeline], **meta: Any) -> dict[str, Any]:
    """One Chrome trace-event document: a process per key (e.g. policy, in the mapping's order),
    its tracks in :func:`track_order`, and every run on one clock (microseconds since the first
    span of any run), so runs that went one after another appear so.

    >>> first, second = Timeline(), Timeline()
    >>> first.span("host", "schedule next step", first.origin, first.origin + 1e-3, "host")
    >>> second.span("forward", "body", first.origin + 2.0, first.origin + 2.5, "stage")
    >>> doc = chrome_trace({"COARSE": first, "EXACT": second}, spec="paged")
    >>> [(e["args"]["name"], e["pid"]) for e in doc["traceEvents"] if e["name"] == "process_name"]
    [('COARSE', 0), ('EXACT', 1)]
    >>> [(e["name"], round(e["ts"])) for e in doc["traceEvents"] if e["ph"] == "X"], doc["otherData"]
    ([('schedule next step', 0), ('body', 2000000)], {'spec': 'paged'})
    """
    events: list[dict[str, Any]] = []
    starts = [s.start for tl in timelines.values() for s in tl.spans]
    origin = min(starts) if starts else min((tl.origin for tl in timelines.values()), default=0.0)
    for pid, (label, timeline) in enumerate(timelines.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tracks = sorted({s.track for s in timeline.spans}, key=track_order)
        tid = {t: i for i, t in enumerate(tracks)}
        for t in tracks:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[t], "args": {"name": t}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid[t],
                           "args": {"sort_index": tid[t]}})
        for s in sorted(timeline.spans, key=lambda s: s.start):
            base = {"name": s.name, "cat": s.category, "pid": pid, "tid": tid[s.track],
                    "ts": (s.start - origin) * 1e6, "args": s.args}
            if s.end > s.start:
                events.append({**base, "ph": "X", "dur": (s.end - s.start) * 1e6})
            else:
                events.append({**base, "ph": "i", "s": "t"})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta)}


def write_chrome_trace(path: pathlib.Path, timelines: Mapping[str, Timeline], **meta: Any) -> None:
    """Write :func:`chrome_trace` of ``timelines`` to ``path`` (compact JSON)."""
    path.write_text(json.dumps(chrome_trace(timelines, **meta), separators=(",", ":")))


def _labelled_timelines(timelines: Mapping[str, Timeline | TracedRun] | Timeline | TracedRun) -> dict[str, Timeline]:
    if isinstance(timelines, TracedRun):
        return {timelines.label: timelines.timeline}
    if isinstance(timelines, Timeline):
        return {"run": timelines}
    return {label: t.timeline if isinstance(t, TracedRun) else t for label, t in timelines.items()}


def write_trace(path: str | pathlib.Path, timelines: Mapping[str, Timeline | TracedRun] | Timeline | TracedRun,
                **meta: Any) -> pathlib.Path:
    """Write a Chrome trace-event file (open it in https://ui.perfetto.dev or ``chrome://tracing``)
    of one run or several: a :class:`TracedRun`, a ``Timeline``, or a mapping from a label (a
    policy's name) to either, one process each in the mapping's order, all on one clock.
    ``meta`` lands in the file's ``otherData``. Returns the path written (what ``readfence demo
    --trace`` writes).

    >>> import os, tempfile
    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, Policy
    >>> with CpuDevice() as dev:
    ...     runs = {p.name: run_traced(paged(), steps=3, policy=p, device=dev, batch_size=2)
    ...             for p in (Policy.COARSE, Policy.EXACT)}
    >>> out = write_trace(os.path.join(tempfile.mkdtemp(), "run.json"), runs, spec="paged")
    >>> doc = json.loads(out.read_text())
    >>> [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    ['COARSE', 'EXACT']
    """
    out = pathlib.Path(path)
    write_chrome_trace(out, _labelled_timelines(timelines), **meta)
    return out


@attrs.frozen
class TracedRun:
    """One run of the overlapped decode loop with its timeline: ``result`` is what
    :func:`~readfence.graph.run_overlapped` returns, ``timeline`` the first ``max_steps`` steps
    of the host, the schedule stream, the forward streams (stages, graph replays, waits) and
    the fences (releases and last reads), ``label`` the policy's name."""

    result: LoopResult
    timeline: Timeline
    label: str


@names_keywords(options=LoopOptions)
def run_traced(backend: Target, mode: ForwardMode = ForwardMode.DECODE, *, steps: int, policy: Policy, device: Device,
               batch_size: int = 4, cfg: ModelConfig | None = None, state: Mapping[str, dict[str, Tensor]] | None = None,
               options: LoopOptions | None = None, lowering: LowerOptions | None = None) -> TracedRun:
    """:func:`~readfence.graph.run_overlapped` that also records a timeline of the run, for
    :func:`write_trace` and :func:`~readfence.graph.plot_timelines`; it takes ``run_overlapped``'s
    keywords. The timeline is ``options.timeline`` when the :class:`~readfence.graph.LoopOptions`
    gives one (a :class:`CappedTimeline` keeps its first steps, a plain ``Timeline`` every step),
    else one that keeps the first :data:`TRACE_STEPS` steps: recording costs the run nothing
    measurable, but a trace of thousands of steps is tens of megabytes.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, LoopOptions, Policy
    >>> with CpuDevice() as dev:
    ...     run = run_traced(paged(), steps=4, policy=Policy.EXACT, device=dev, batch_size=2)
    ...     short = run_traced(paged(), steps=4, policy=Policy.EXACT, device=dev, batch_size=2,
    ...                        options=LoopOptions(timeline=CappedTimeline(max_steps=2)))
    >>> run.result.steps, run.label, sorted({s.track for s in run.timeline.spans})
    (4, 'EXACT', ['fences', 'forward', 'host', 'schedule'])
    >>> sorted({s.args["step"] for s in short.timeline.spans if "step" in s.args})
    [0, 1]
    """
    opts = options_of(options, LoopOptions, "run_traced")
    lowering = for_a_loop(lowering, "run_traced", said_in(LoopOptions))
    timeline = CappedTimeline(TRACE_STEPS) if opts.timeline is None else opts.timeline
    capped = timeline if isinstance(timeline, CappedTimeline) else None
    recorder = WaitRecorder(capped)
    progress = opts.progress

    def step_done(i: int) -> None:
        if capped is not None and i + 1 >= capped.max_steps + IN_FLIGHT:
            capped.stop()  # the trace keeps the first steps (trimmed to them once the run is over)
        if progress is not None:
            progress(i)

    device.add_observer(recorder)
    try:
        result = run_overlapped(backend, mode, steps=steps, policy=policy, device=device, batch_size=batch_size,
                                cfg=cfg, state=state, options=attrs.evolve(opts, timeline=timeline, progress=step_done),
                                lowering=lowering)
    finally:
        device.remove_observer(recorder)
    if capped is not None:
        capped.trim()
    add_waits(timeline, recorder)
    graphs = device.caps.graphs
    if isinstance(backend, StepShape):
        add_replays(timeline, graphed=[replayed(ph.backend, ph.mode) and graphs for ph in backend.phases],
                    phases=[ph.name for ph in backend.phases])
    else:
        add_replays(timeline, graphed=[replayed(backend, mode) and graphs])
    return TracedRun(result, timeline, policy.name)


#: Steps the host may issue ahead of the streams running them (a trace stops recording that
#: much after its last kept step, then trims to it).
IN_FLIGHT = 4
