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


def _ticks(ax, color: str) -> list[float]:
    """x (ms) of the vertical ticks of ``color`` on the panel's fences row."""
    rows = [t.get_text() for t in ax.get_yticklabels()]
    y = rows.index("fences")
    return [line.get_xdata()[0] for line in ax.lines
            if line.get_color() == color and abs(sum(line.get_ydata()) / 2 - y) < 0.5]


def _check_panels(timelines, fig, bodies_per_step: int) -> None:
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(timelines)
    limits = {ax.get_xlim() for ax in fig.axes}
    assert len(limits) == 1, f"panels do not share a time axis: {limits}"
    (lo, hi), = limits
    assert lo == 0
    for ax, (policy, tl) in zip(fig.axes, timelines.items()):
        t0 = internal.step_ends(tl, bodies_per_step)[0]  # the warm-up step's end
        assert ax.get_title(loc="right").startswith("step 0 (warm-up, ")
        releases = [s for s in tl.spans if s.category == "fence"]
        # every release of the first steps after the warm-up is inside the axis, drawn as a red tick there
        first = [s for s in releases if 1 <= s.args["step"] <= STEPS]
        assert {s.args["step"] for s in first} == set(range(1, STEPS + 1)), policy
        drawn = _ticks(ax, "red")
        for s in first:
            x = (s.start - t0) * 1e3
            assert x <= hi and any(abs(x - d) < 1e-6 for d in drawn), (policy, s.name, s.args)
        # each forward stream's graph replays of those steps are drawn too
        for track in {s.track for s in tl.spans if s.category == "replay"}:
            replays = sorted((s for s in tl.spans if s.track == track and s.category == "replay"),
                             key=lambda s: s.start)
            assert len(replays) >= (STEPS + 1) * bodies_per_step
            assert (replays[(STEPS + 1) * bodies_per_step - 1].end - t0) * 1e3 <= hi + 1e-6, (policy, track)
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
        assert {"forward[0]", "forward[1]", "fences"} <= {t.get_text() for t in ax.get_yticklabels()}


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
