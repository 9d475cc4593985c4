"""A PNG of the first few steps of each run's timeline (matplotlib, the ``plot`` extra).

One panel per policy, all on one time axis (the same milliseconds from the end of each run's
warm-up step), one row per track (host, schedule stream, each forward stream, fences): stage,
write, host and wait spans as bars, graph replays as boxes, buffer releases as red ticks and
last reads as black ticks on the fences row, each step's end as a dotted line under its number.

Step 0 is left out: the first replay of a run pays one-time costs (the first run of a process
took 400-500 ms where later steps take a few), which would size the axis and make that policy
look ten times slower per step. Each panel says how long its step 0 took.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from typing import Any

from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH

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


def timeline_figure(timelines: Mapping[str, Timeline], *, steps: int = 3, phases: int = 1, title: str = "") -> Any:
    """The matplotlib figure :func:`plot_timelines` saves: one panel per timeline, one shared
    time axis long enough for every run's first ``steps`` steps after its warm-up (``phases``
    bodies each).

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
    windows = [window(tl, steps, phases) for _, tl in items]
    width = max([t1 - t0 for t0, t1 in windows] + [1e-6])
    height = 1.8 + 1.5 * len(items)
    fig, axes = plt.subplots(max(1, len(items)), 1, figsize=(12, height), squeeze=False, sharex=True)
    for ax, (label, tl), (t0, _) in zip(axes[:, 0], items, windows):
        t1 = t0 + width
        ends = step_ends(tl, phases)
        tracks = sorted({s.track for s in tl.spans}, key=track_order)
        row = {t: i for i, t in enumerate(tracks)}
        for s in (s for s in tl.spans if s.start <= t1 and s.end >= t0):
            y, x, w = row[s.track], (s.start - t0) * 1e3, (s.end - s.start) * 1e3
            if s.category == "replay":
                ax.broken_barh([(x, w)], (y - 0.45, 0.9), facecolors="none", edgecolor="black", linewidth=0.8)
                if "graph" in s.args:  # which graph the step ran (a serving loop's steps change graphs)
                    ax.text(x + w / 2, y - 0.5, str(s.args["graph"]), fontsize=6, ha="center", va="bottom",
                            clip_on=True)
            elif s.category == "fence":
                ax.plot([x, x], [y - 0.45, y + 0.45], color=_RELEASE, linewidth=1)
            elif s.category == "read":
                ax.plot([x, x], [y - 0.45, y], color=_READ, linewidth=1)
            elif s.end > s.start:
                ax.broken_barh([(x, w)], (y - 0.35, 0.7), facecolors=_color(s),
                               edgecolor="black" if s.category == "wait" else "none", linewidth=0.3)
        shown = [(k, (end - t0) * 1e3) for k, end in enumerate(ends) if t0 < end <= t1]
        for (k, x), label_it in zip(shown, _labelled([x for _, x in shown], width * 1e3 * LABEL_GAP)):
            ax.axvline(x, color="#777777", linestyle=":", linewidth=0.8)
            if label_it:
                ax.text(x, -0.55, f"{k}", fontsize=7, color="#555555", va="bottom", ha="center")
        if WARM_UP and len(ends) > WARM_UP:
            warm = (ends[WARM_UP - 1] - min(s.start for s in tl.spans)) * 1e3
            ax.set_title(f"step 0 (warm-up, {warm:.0f} ms) left out", loc="right", fontsize=8, color="#555555")
        ax.set_yticks(range(len(tracks)), tracks)
        ax.set_ylim(-0.6, len(tracks) - 0.4)
        ax.invert_yaxis()
        ax.set_title(label, loc="left", fontsize=10)
    axes[0, 0].set_xlim(0, width * 1e3)
    axes[-1, 0].set_xlabel("ms since the end of the run's step 0 (its warm-up); the numbers above the dotted "
                           "lines are the steps ending there")
    legend = [Patch(color=c, label=n) for n, c in _COLORS.items()]
    legend += [Patch(facecolor="none", edgecolor="black", label="graph replay"),
               Patch(color=_RELEASE, label="buffer released (fence)"),
               Patch(color=_READ, label="buffer's last read")]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1))  # the legend's two rows below
    return fig


def plot_timelines(timelines: Mapping[str, Timeline | TracedRun] | Timeline | TracedRun, path: str | pathlib.Path, *,
                   steps: int = 3, phases: int = 1, title: str = "") -> pathlib.Path:
    """Draw the first ``steps`` steps after the warm-up of each run into one PNG at ``path``
    (what ``readfence demo --plot`` draws; needs matplotlib, the ``plot`` extra): a
    :class:`~readfence.graph.TracedRun` (:func:`~readfence.graph.run_traced`), a ``Timeline``,
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
