"""``readfence demo --plot``: every panel on one time axis, each showing its run's first steps."""

from __future__ import annotations

import collections

import pytest

from readfence.cli import _plot

STEPS = 3  # what the demo's plot draws


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
        result = cli("demo", "--steps", "4", "--batch-size", "2", "--write-wait-ms", "2", *args,
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
        t0 = min(s.start for s in tl.spans)
        releases = [s for s in tl.spans if s.category == "fence"]
        # every release of the first steps is inside the axis and drawn as a red tick there
        first = [s for s in releases if s.args["step"] < STEPS]
        assert {s.args["step"] for s in first} == set(range(STEPS)), policy
        drawn = _ticks(ax, "red")
        for s in first:
            x = (s.start - t0) * 1e3
            assert x <= hi and any(abs(x - d) < 1e-6 for d in drawn), (policy, s.name, s.args)
        # each forward stream's graph replays of those steps are drawn too
        for track in {s.track for s in tl.spans if s.category == "replay"}:
            replays = sorted((s for s in tl.spans if s.track == track and s.category == "replay"),
                             key=lambda s: s.start)
            assert len(replays) >= STEPS * bodies_per_step
            assert (replays[STEPS * bodies_per_step - 1].end - t0) * 1e3 <= hi + 1e-6, (policy, track)
    # the axis is no longer than the slowest run's first steps need
    ends = [max(s.end for s in tl.spans if s.category == "fence" and s.args["step"] == STEPS - 1)
            - min(s.start for s in tl.spans) for tl in timelines.values()]
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
        assert collections.Counter(s.args["step"] for s in replays) == {k: 4 for k in range(4)}
        assert [s.args["phase"] for s in replays[:4]] == phases


def test_per_stream_panels_draw_every_forward_stream(drawn):
    timelines, fig = drawn("--spec", "per_stream(paged, trtllm_mha)", "--policy", "exact")
    _check_panels(timelines, fig, bodies_per_step=1)
    for ax in fig.axes:
        assert {"forward[0]", "forward[1]", "fences"} <= {t.get_text() for t in ax.get_yticklabels()}
