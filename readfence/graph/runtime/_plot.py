"""A PNG of the first few steps of each run's timeline (matplotlib, the ``plot`` extra).

One panel per policy, all on one time axis (the same milliseconds from the end of each run's
warm-up step), one row per track (host, schedule stream, each forward stream) and one per
shared buffer (``fence: <buffer>``): stage, write, host and wait spans as bars, graph replays as
boxes, a buffer's release as a red tick and its last read as a black one on its own row, each
step's end as a dotted line under its number. A span too short to see at the drawn scale (the
host's scheduling, a ``prepare_in_graph`` of a few microseconds) is drawn as a sliver of the
least visible width; labels that would run into each other or out of their box are left out.

Step 0 is left out: the first replay of a run pays one-time costs (the first run of a process
took 400-500 ms where later steps take a few), which would size the axis and make that policy
look ten times slower per step. Each panel says how long its step 0 took. Nor does one slow
step later on size the axis (a serving run's first prefill of a size, a write that stalled):
the axis covers each run's first steps, but no more than twice as long as that many of its
typical (median) steps take.
"""

from __future__ import annotations

import math
import pathlib
import statistics
from collections.abc import Mapping
from typing import Any

from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, SHARED_BUFFERS

from ..devices import Span, Timeline
from ._traces import TracedRun, _labelled_timelines, stage_tracks, track_order

_COLORS = {
    PREPARE_OUT_GRAPH.name: "#4c72b0",
    PREPARE_IN_GRAPH.name: "#55a868",
    BODY.name: "#8172b2",
    "write": "#dd8452",
    "host": "#937860",
    "wait": "#dddddd",
}
_RELEASE, _READ = "red", "black"
#: Least gap between two step labels, as a share of the axis (closer labels would overlap).
LABEL_GAP = 0.025
#: Least drawn width of a bar, as a share of the axis: a shorter span is drawn this wide.
MIN_BAR = 0.003
#: How much longer than its typical (median) steps a run's shown steps may take before the
#: axis stops growing with them (one outlier step does not size every panel).
OUTLIER = 2.0
#: The row a buffer's release and last read are drawn on.
FENCE_ROW = "fence: "


def step_ends(timeline: Timeline, phases: int = 1) -> list[float]:
    """When each step ended: its last ``body`` on every forward stream (a step runs ``phases``
    of them per stream), or its last fence instant if that came later (a COARSE release
    follows the step's outputs).

    >>> tl = Timeline()
    >>> for i in range(4):
    ...     tl.span("forward", "body", i, i + 0.5, "stage")
    >>> tl.instant("fences", "release seq_lens", 3.75, "fence", step=1)
    >>> step_ends(tl, phases=2)
    [1.5, 3.75]
    """
    ends: dict[int, float] = {}
    steps_named = [s for s in timeline.spans if s.category == "replay" and "graph" in s.args]
    for s in steps_named:  # a serving loop's steps say which graph they ran: each is one step
        k = int(s.args["step"])  # type: ignore[call-overload]
        ends[k] = max(ends.get(k, s.end), s.end)
    for track in [] if steps_named else stage_tracks(timeline):
        bodies = sorted(s.end for s in timeline.spans if s.track == track and s.name == BODY.name)
        for i, end in enumerate(bodies):
            ends[i // phases] = max(ends.get(i // phases, end), end)
    for s in timeline.spans:
        step = s.args.get("step")
        if s.category in ("fence", "read") and isinstance(step, int):
            ends[step] = max(ends.get(step, s.end), s.end)
    return [ends[k] for k in sorted(ends)]


#: Steps at a run's start the plot leaves out (they pay one-time costs: see the module docstring).
WARM_UP = 1


def window(timeline: Timeline, steps: int, phases: int = 1, skip: int = WARM_UP) -> tuple[float, float]:
    """From the end of step ``skip - 1`` (the first span when ``skip`` is 0, or when the run has
    no more steps than that) to the end of the ``steps``-th step after it (seconds); see
    :func:`step_ends`.

    >>> tl = Timeline()
    >>> for i in range(6):
    ...     tl.span("forward", "body", i, i + 0.5, "stage")
    >>> window(tl, 2, skip=0), window(tl, 2, phases=3, skip=0), window(tl, 2), window(tl, 9)
    ((0, 1.5), (0, 5.5), (0.5, 2.5), (0.5, 5.5))
    """
    if not timeline.spans:
        return (timeline.origin, timeline.origin)
    ends = step_ends(timeline, phases)
    if not ends:
        return min(s.start for s in timeline.spans), max(s.end for s in timeline.spans)
    if skip and len(ends) > skip:
        start, ends = ends[skip - 1], ends[skip:]
    else:
        start = min(s.start for s in timeline.spans)
    return start, ends[min(steps, len(ends)) - 1]


def shown_width(timeline: Timeline, steps: int, phases: int = 1) -> float:
    """How long (s) a panel needs for the first ``steps`` steps after the warm-up of ``timeline``
    (:func:`window`), but no more than :data:`OUTLIER` times that many of its median steps: a
    single slow step does not size the axis.

    >>> tl = Timeline()
    >>> ends = [0.0, 1.0, 2.0, 3.0, 20.0, 21.0, 22.0]   # step 4 took 17 s, every other one 1 s
    >>> for a, b in zip(ends, ends[1:]):
    ...     tl.span("forward", "body", a, b, "stage")
    >>> window(tl, 4), shown_width(tl, 4)
    ((1.0, 21.0), 8.0)
    """
    t0, t1 = window(timeline, steps, phases)
    ends = step_ends(timeline, phases)
    after = ends[WARM_UP - 1:] if WARM_UP and len(ends) > WARM_UP else ends
    gaps = [b - a for a, b in zip(after, after[1:]) if b > a]
    if not gaps:
        return t1 - t0
    return min(t1 - t0, OUTLIER * min(steps, len(gaps)) * statistics.median(gaps))


def _labelled(xs: list[float], min_gap: float) -> list[bool]:
    """Which of the sorted positions ``xs`` get a label: each at least ``min_gap`` from the last
    labelled one (labels closer than that run into each other).

    >>> _labelled([0.0, 1.0, 1.5, 2.0, 2.2, 5.0], 1.0)
    [True, True, False, True, False, True]
    """
    out, last = [], -math.inf
    for x in xs:
        keep = x - last >= min_gap
        out.append(keep)
        last = x if keep else last
    return out


def _color(span: Span) -> str:
    return _COLORS.get(span.name) or _COLORS.get(span.category) or "#999999"


def row_of(span: Span) -> str:
    """The row ``span`` is drawn on: its track, or for a release or a last read its buffer's
    :data:`FENCE_ROW`.

    >>> tl = Timeline()
    >>> tl.instant("fences", "last read seq_lens", 1.0, "read", step=0)
    >>> row_of(tl.spans[0])
    'fence: seq_lens'
    """
    if span.category in ("fence", "read"):
        return FENCE_ROW + span.name.removeprefix("release ").removeprefix("last read ")
    return span.track


def rows(timeline: Timeline) -> list[str]:
    """The rows of a panel, top to bottom: the host, the schedule stream, the forward streams,
    then one per buffer that is released or read (in the shared buffers' order).

    >>> tl = Timeline()
    >>> tl.span("forward", "body", 0, 1, "stage")
    >>> tl.instant("fences", "release state_slots", 1.0, "fence", step=0)
    >>> tl.instant("fences", "release req_to_token", 1.0, "fence", step=0)
    >>> rows(tl)
    ['forward', 'fence: req_to_token', 'fence: state_slots']
    """
    named = {row_of(s) for s in timeline.spans}
    tracks = sorted((r for r in named if not r.startswith(FENCE_ROW)), key=track_order)
    order = {b: i for i, b in enumerate(SHARED_BUFFERS)}
    fences = sorted((r for r in named if r.startswith(FENCE_ROW)),
                    key=lambda r: (order.get(r.removeprefix(FENCE_ROW), len(order)), r))
    return tracks + fences


def _declutter(fig: Any, labels: list[tuple[Any, Any, float | None]]) -> None:
    """Remove each label that runs into one kept before it on its panel, or (a graph's name)
    is wider than the box it names (``(text, axes, box width in pixels or None)``, drawn)."""
    renderer = fig.canvas.get_renderer()
    kept: dict[int, list[Any]] = {}
    for text, ax, room in sorted(labels, key=lambda item: item[0].get_position()[0]):
        box = text.get_window_extent(renderer)
        mine = kept.setdefault(id(ax), [])
        if (room is not None and box.width > room) or any(box.overlaps(other) for other in mine):
            text.remove()
        else:
            mine.append(box)


def timeline_figure(timelines: Mapping[str, Timeline], *, steps: int = 3, phases: int = 1, title: str = "") -> Any:
    """The matplotlib figure :func:`plot_timelines` saves: one panel per timeline, one shared
    time axis long enough for every run's first ``steps`` steps after its warm-up (``phases``
    bodies each), see :func:`shown_width`.

    >>> slow, fast = Timeline(), Timeline()
    >>> for i in range(4):  # a long warm-up step, then 4 ms (slow) and 2 ms (fast) steps
    ...     slow.span("forward", "body", 0.0 if i == 0 else 0.5 + 0.004 * i, 0.5 + 0.004 * (i + 1), "stage")
    ...     fast.span("forward", "body", 0.0 if i == 0 else 0.5 + 0.002 * i, 0.5 + 0.002 * (i + 1), "stage")
    >>> fig = timeline_figure({"COARSE": slow, "EXACT": fast})
    >>> [tuple(round(float(x), 3) for x in ax.get_xlim()) for ax in fig.axes]
    [(0.0, 12.0), (0.0, 12.0)]
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    items = list(timelines.items())
    starts = [window(tl, steps, phases)[0] for _, tl in items]
    width = max([shown_width(tl, steps, phases) for _, tl in items] + [1e-6])
    least = width * 1e3 * MIN_BAR  # ms
    # a row with nothing in the drawn window is left out (the host issues short runs' steps ahead of
    # the streams: its work for them is over before the window starts, and the panel says so)
    seen = [{row_of(s) for s in tl.spans if s.start <= t0 + width and s.end >= t0} for (_, tl), t0 in zip(items, starts)]
    panel_rows = [[r for r in rows(tl) if r in shown] for (_, tl), shown in zip(items, seen)]
    ahead = [any(s.track == "host" for s in tl.spans) and "host" not in shown for (_, tl), shown in zip(items, seen)]
    heights = [1.0 + 0.32 * len(r) for r in panel_rows]
    height = 1.0 + sum(heights)
    fig, axes = plt.subplots(max(1, len(items)), 1, figsize=(12, height), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": heights or [1.0]})
    labels: list[tuple[Any, Any, float | None]] = []
    boxes: list[tuple[Any, Any, float, float]] = []  # (text, axes, x0, x1 in ms): a graph's name and its box
    for ax, (label, tl), t0, names, early in zip(axes[:, 0], items, starts, panel_rows, ahead):
        t1 = t0 + width
        ends = step_ends(tl, phases)
        row = {t: i for i, t in enumerate(names)}
        for s in (s for s in tl.spans if s.start <= t1 and s.end >= t0):
            y, x, w = row[row_of(s)], (s.start - t0) * 1e3, (s.end - s.start) * 1e3
            if s.category == "replay":
                ax.broken_barh([(x, w)], (y - 0.45, 0.9), facecolors="none", edgecolor="black", linewidth=0.8)
                if "graph" in s.args:  # which graph the step ran (a serving loop's steps change graphs)
                    text = ax.text(x + w / 2, y + 0.42, str(s.args["graph"]), fontsize=6, ha="center", va="bottom",
                                   clip_on=True)
                    boxes.append((text, ax, x, x + w))
            elif s.category == "fence":
                ax.plot([x, x], [y - 0.4, y + 0.4], color=_RELEASE, linewidth=1.2)
            elif s.category == "read":
                ax.plot([x, x], [y - 0.4, y + 0.05], color=_READ, linewidth=1.2)
            elif s.end > s.start:
                ax.broken_barh([(x, max(w, least))], (y - 0.35, 0.7), facecolors=_color(s),
                               edgecolor="black" if s.category == "wait" else "none", linewidth=0.3)
        shown = [(k, (end - t0) * 1e3) for k, end in enumerate(ends) if t0 < end <= t1]
        for (k, x), label_it in zip(shown, _labelled([x for _, x in shown], width * 1e3 * LABEL_GAP)):
            ax.axvline(x, color="#777777", linestyle=":", linewidth=0.8)
            if label_it:
                labels.append((ax.text(x, -0.62, f"{k}", fontsize=7, color="#555555", va="center", ha="center",
                                       clip_on=True), ax, None))
        if WARM_UP and len(ends) > WARM_UP:
            warm = (ends[WARM_UP - 1] - min(s.start for s in tl.spans)) * 1e3
            note = "; the host issued these steps before (no host row)" if early else ""
            ax.set_title(f"step 0 (warm-up, {warm:.0f} ms) left out{note}", loc="right", fontsize=8, color="#555555")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(-0.85, len(names) - 0.4)  # the band above the first row holds the step numbers
        ax.invert_yaxis()
        ax.set_title(label, loc="left", fontsize=10)
    axes[0, 0].set_xlim(0, width * 1e3)
    axes[-1, 0].set_xlabel("ms since the end of the run's step 0 (its warm-up); the numbers at the top of each panel "
                           "are the steps ending at the dotted line under them")
    legend = [Patch(color=c, label=n) for n, c in _COLORS.items()]
    legend += [Patch(facecolor="none", edgecolor="black", label="graph replay"),
               Patch(color=_RELEASE, label="buffer released (fence)"),
               Patch(color=_READ, label="buffer's last read")]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1))  # the legend's two rows below
    for text, ax, x0, x1 in boxes:  # a graph's name fits its box or is left out
        (px0, _), (px1, _) = ax.transData.transform([(x0, 0), (x1, 0)])
        labels.append((text, ax, abs(px1 - px0)))
    _declutter(fig, labels)
    return fig


def plot_timelines(timelines: Mapping[str, Timeline | TracedRun] | Timeline | TracedRun, path: str | pathlib.Path, *,
                   steps: int = 3, phases: int = 1, title: str = "") -> pathlib.Path:
    """Draw the first ``steps`` steps after the warm-up of each run into one PNG at ``path``
    (what ``readfence demo --plot`` draws; needs matplotlib, the ``plot`` extra): a
    :class:`~readfence.graph.runtime.TracedRun` (:func:`~readfence.graph.run_traced`), a ``Timeline``,
    or a mapping from a label (a policy's name) to either, one panel each. ``phases``: forward
    bodies per step, more than one for a speculative step.

    >>> import tempfile, os
    >>> tl = Timeline()
    >>> tl.span("forward", "body", tl.origin, tl.origin + 0.002, "stage")
    >>> tl.instant("fences", "release seq_lens", tl.origin + 0.001, "fence", step=0)
    >>> out = plot_timelines({"EXACT": tl}, os.path.join(tempfile.mkdtemp(), "t.png"))
    >>> out.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    path = pathlib.Path(path)
    fig = timeline_figure(_labelled_timelines(timelines), steps=steps, phases=phases, title=title)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
