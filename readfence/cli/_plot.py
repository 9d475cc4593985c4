"""A PNG of the first few steps of each run's timeline (matplotlib, the ``plot`` extra).

One panel per policy, one row per track (host, schedule stream, forward stream): stage,
write, host and wait spans as bars, buffer releases as red ticks on the forward row.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

from readfence.graph import Span, Timeline

_COLORS = {
    "prepare_out_graph": "#4c72b0",
    "prepare_in_graph": "#55a868",
    "body": "#8172b2",
    "write": "#dd8452",
    "host": "#937860",
    "wait": "#dddddd",
}


def window(timeline: Timeline, steps: int, stream: str = "forward") -> tuple[float, float]:
    """From the first span to the end of the ``steps``-th ``body`` on ``stream`` (seconds).

    >>> tl = Timeline()
    >>> for i in range(3):
    ...     tl.span("forward", "body", i, i + 0.5, "stage")
    >>> window(tl, 2)
    (0, 1.5)
    """
    spans = [s for s in timeline.spans]
    if not spans:
        return (timeline.origin, timeline.origin)
    start = min(s.start for s in spans)
    bodies = sorted(s.end for s in spans if s.track == stream and s.name == "body")
    end = bodies[min(steps, len(bodies)) - 1] if bodies else max(s.end for s in spans)
    return start, end


def _color(span: Span) -> str:
    name, cat = span.name, span.category
    return _COLORS.get(name) or _COLORS.get(cat) or "#999999"


def plot_timelines(timelines: Mapping[str, Timeline], path: str | pathlib.Path, *, steps: int = 3,
                   title: str = "") -> pathlib.Path:
    """Draw the first ``steps`` steps of each timeline into one PNG at ``path``.

    >>> import tempfile, os
    >>> tl = Timeline()
    >>> tl.span("forward", "body", tl.origin, tl.origin + 0.002, "stage")
    >>> tl.instant("forward", "release seq_lens", tl.origin + 0.001, "fence")
    >>> out = plot_timelines({"EXACT": tl}, os.path.join(tempfile.mkdtemp(), "t.png"))
    >>> out.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = pathlib.Path(path)
    items = list(timelines.items())
    fig, axes = plt.subplots(max(1, len(items)), 1, figsize=(12, 1.6 + 1.4 * len(items)), squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], items):
        t0, t1 = window(tl, steps)
        spans = [s for s in tl.spans if s.start <= t1 and s.end >= t0]
        tracks = sorted({s.track for s in tl.spans}, key=lambda t: (t != "host", t != "schedule", t))
        row = {t: i for i, t in enumerate(tracks)}
        for s in spans:
            y = row[s.track]
            x = (s.start - t0) * 1e3
            if s.end > s.start and s.category != "replay":
                ax.broken_barh([(x, (s.end - s.start) * 1e3)], (y - 0.35, 0.7), facecolors=_color(s),
                               edgecolor="black" if s.category == "wait" else "none", linewidth=0.3)
            elif s.category == "replay":
                ax.broken_barh([(x, (s.end - s.start) * 1e3)], (y - 0.45, 0.9), facecolors="none",
                               edgecolor="black", linewidth=0.8)
            elif s.category == "fence":
                ax.plot([x, x], [y - 0.45, y + 0.45], color="red", linewidth=1)
        ax.set_yticks(range(len(tracks)), tracks)
        ax.set_ylim(-0.6, len(tracks) - 0.4)
        ax.invert_yaxis()
        ax.set_xlim(0, max((t1 - t0) * 1e3, 1e-3))
        ax.set_title(label, loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("ms")
    legend = [Patch(color=c, label=n) for n, c in _COLORS.items()]
    legend += [Patch(facecolor="none", edgecolor="black", label="graph replay"),
               Patch(color="red", label="buffer released (fence)")]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
