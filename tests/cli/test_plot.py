"""``readfence demo --plot``: every panel on one time axis, each showing its run's first steps after
its warm-up step (step 0, left out and its duration named), with step labels that do not overlap."""

from __future__ import annotations

import collections

import pytest

import readfence.graph as _plot
from readfence.graph.runtime import internal

STEPS = 3  # what the demo's plot draws, after step 0 (the warm-up)


@pytest.fixture
def drawn(cli, monkeypatch, tmp_path):
    """``drawn(*demo_args)`` runs the demo with ``--plot`` and returns (timelines, figure)."""
    from matplotlib.figure import Figure

    seen: dict = {}
    plot, save = _plot.plot_timelines, Figure.savefig

    def plot_spy(timelines, *args, **kwargs):
        seen["timelines"] = timelines
        return plot(timelines, *args, **kwargs)

    def save_spy(fig, *args, **kwargs):
        seen["figure"] = fig
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(_plot, "plot_timelines", plot_spy)
    monkeypatch.setattr(Figure, "savefig", save_spy)

    def run(*args: str):
        result = cli("demo", "--steps", "5", "--batch-size", "2", "--write-wait-ms", "2", *args,
                     "--plot", str(tmp_path / "run.png"))
        assert result.exit_code == 0, result.output
        return seen["timelines"], seen["figure"]

    return run


def _ticks(ax, color: str, buffer: str | None = None) -> list[float]:
    """x (ms) of the vertical ticks of ``color`` on the panel's fence rows (``buffer``'s alone if given)."""
    rows = [t.get_text() for t in ax.get_yticklabels()]
    ys = [y for y, name in enumerate(rows) if name.startswith("fence: ") and buffer in (None, name[7:])]
    return [line.get_xdata()[0] for line in ax.lines
            if line.get_color() == color and any(abs(sum(line.get_ydata()) / 2 - y) < 0.5 for y in ys)]


def _check_panels(timelines, fig, bodies_per_step: int) -> None:
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(timelines)
    limits = {ax.get_xlim() for ax in fig.axes}
    assert len(limits) == 1, f"panels do not share a time axis: {limits}"
    (lo, hi), = limits
    assert lo == 0
    for ax, (policy, tl) in zip(fig.axes, timelines.items()):
        ends = internal.step_ends(tl, bodies_per_step)
        t0 = ends[0]  # the warm-up step's end
        assert ax.get_title(loc="right").startswith("step 0 (warm-up, ")
        # the first steps after the warm-up are inside the axis, unless one of them took more than
        # OUTLIER times the run's typical step (then the axis stops short of it: see shown_width)
        shown = [k for k in range(1, STEPS + 1) if (ends[k] - t0) * 1e3 <= hi + 1e-6]
        assert 1 in shown, (policy, hi, [(e - t0) * 1e3 for e in ends])
        releases = [s for s in tl.spans if s.category == "fence" and s.args["step"] in shown]
        assert {s.args["step"] for s in releases} == set(shown), policy
        for s in releases:  # a red tick on its buffer's own row
            x = (s.start - t0) * 1e3
            drawn = _ticks(ax, "red", s.name.removeprefix("release "))
            assert x <= hi and any(abs(x - d) < 1e-6 for d in drawn), (policy, s.name, s.args)
        # each forward stream's graph replays of those steps are drawn too
        for track in {s.track for s in tl.spans if s.category == "replay"}:
            replays = sorted((s for s in tl.spans if s.track == track and s.category == "replay"),
                             key=lambda s: s.start)
            last = (max(shown) + 1) * bodies_per_step - 1
            assert len(replays) > last and (replays[last].end - t0) * 1e3 <= hi + 1e-6, (policy, track)
    # the axis is no longer than the slowest run's steps after the warm-up need: the warm-up sizes nothing
    ends = [max(s.end for s in tl.spans if s.category == "fence" and s.args["step"] == STEPS)
            - internal.step_ends(tl, bodies_per_step)[0] for tl in timelines.values()]
    assert hi <= max(ends) * 1e3 * 1.5


def test_plain_spec_panels_share_one_time_axis(drawn):
    timelines, fig = drawn()
    assert list(timelines) == ["COARSE", "JOINED", "PER_BUFFER", "EXACT"]
    _check_panels(timelines, fig, bodies_per_step=1)


def test_speculative_step_shows_its_fences_and_steps(drawn):
    timelines, fig = drawn("--spec", "eagle(paged, trtllm_mha)", "--policy", "per_buffer")
    _check_panels(timelines, fig, bodies_per_step=4)
    phases = ["draft_decode[0]", "draft_decode[1]", "target_verify", "draft_extend"]
    for tl in timelines.values():
        replays = sorted((s for s in tl.spans if s.category == "replay"), key=lambda s: s.start)
        assert collections.Counter(s.args["step"] for s in replays) == {k: 4 for k in range(5)}
        assert [s.args["phase"] for s in replays[:4]] == phases


def test_per_stream_panels_draw_every_forward_stream(drawn):
    timelines, fig = drawn("--spec", "per_stream(paged, trtllm_mha)", "--policy", "exact")
    _check_panels(timelines, fig, bodies_per_step=1)
    for ax in fig.axes:
        assert {"forward[0]", "forward[1]", "fence: req_to_token"} <= {t.get_text() for t in ax.get_yticklabels()}


def test_a_slow_warm_up_sizes_nothing_and_labels_do_not_overlap():
    from readfence.graph import Timeline

    slow_start, steady = Timeline(), Timeline()
    for tl, first in ((slow_start, 0.45), (steady, 0.004)):  # a 450 ms first replay, then 4 ms steps
        t = 0.0
        for step in range(40):
            end = t + (first if step == 0 else 0.004)
            tl.span("forward", "body", t, end, "stage")
            tl.instant("fences", "release seq_lens", end, "fence", step=step)
            t = end
    fig = internal.timeline_figure({"COARSE": slow_start, "EXACT": steady}, steps=30)
    (lo, hi), = {ax.get_xlim() for ax in fig.axes}
    assert hi == pytest.approx(30 * 4.0)  # 30 steady steps, not 450 ms of warm-up
    assert fig.axes[0].get_title(loc="right") == "step 0 (warm-up, 450 ms) left out"
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = sorted((t for t in ax.texts), key=lambda t: t.get_position()[0])
        assert labels, "no step label drawn"
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), "step labels overlap"


def _steady(first: float, step: float, outlier_at: int | None = None, outlier: float = 0.0, steps: int = 12):
    """A timeline of ``steps`` steps: a ``first`` (warm-up) one, then ``step`` s each (one of them
    ``outlier`` s), each with a 2 us prepare_in_graph before its body and a 20 us host span."""
    from readfence.graph import Timeline

    tl, t = Timeline(), 0.0
    for k in range(steps):
        took = first if k == 0 else outlier if k == outlier_at else step
        tl.span("host", "schedule next step", t, t + 20e-6, "host")
        tl.span("forward", "prepare_in_graph", t, t + 2e-6, "stage")
        tl.span("forward", "body", t + 2e-6, t + took, "stage")
        tl.instant("fences", "release req_to_token", t + took / 2, "fence", step=k)
        tl.instant("fences", "last read seq_lens", t + took, "read", step=k)
        tl.instant("fences", "release seq_lens", t + took, "fence", step=k)
        t += took
    return tl


def test_one_slow_step_does_not_size_every_panel():
    steady, stalled = _steady(0.1, 0.004), _steady(0.1, 0.004, outlier_at=2, outlier=0.2)
    fig = internal.timeline_figure({"COARSE": steady, "EXACT": stalled}, steps=8)
    (lo, hi), = {ax.get_xlim() for ax in fig.axes}
    # at most OUTLIER times eight typical steps: the 200 ms one would have made it 228 ms
    assert hi == pytest.approx(internal.OUTLIER * 8 * 4.0)
    fig = internal.timeline_figure({"COARSE": steady}, steps=8)
    assert fig.axes[0].get_xlim()[1] == pytest.approx(8 * 4.0)


def test_each_buffer_has_its_row_and_short_spans_stay_visible():
    tl = _steady(0.1, 0.004)
    fig = internal.timeline_figure({"EXACT": tl}, steps=8)
    ax, = fig.axes
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["host", "forward", "fence: req_to_token", "fence: seq_lens"]
    assert len(_ticks(ax, "red", "req_to_token")) >= 8 and len(_ticks(ax, "black", "seq_lens")) >= 8
    assert _ticks(ax, "black", "req_to_token") == []  # a tick names its buffer by its row
    width = ax.get_xlim()[1]
    for name, y in (("host", 0), ("forward", 1)):  # 20 us and 2 us spans: a sliver, not nothing
        bars = [p for c in ax.collections for p in c.get_paths() if abs(p.get_extents().y0 + 0.35 - y) < 1e-6]
        assert bars and min(p.get_extents().width for p in bars) >= width * internal.MIN_BAR - 1e-9, name


def test_graph_names_that_do_not_fit_their_box_are_left_out():
    from readfence.graph import Timeline

    tl, t = Timeline(), 0.0
    for k in range(10):
        took = 0.004 if k % 2 else 0.0002  # every other step too narrow for its name
        tl.span("forward", "body", t, t + took, "stage")
        tl.span("forward", f"decode b{k}", t, t + took, "replay", step=k, graph=f"decode b{k}", kind="decode")
        t += took
    fig = internal.timeline_figure({"EXACT": tl}, steps=8)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax, = fig.axes
    names = [x for x in ax.texts if x.get_text().startswith("decode")]
    assert names and all(int(x.get_text()[-1]) % 2 for x in names), [x.get_text() for x in names]
    boxes = sorted((x.get_window_extent(renderer) for x in ax.texts), key=lambda b: b.x0)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
