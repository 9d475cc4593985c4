"""``readfence demo --trace``: one clock for every run, tracks in flow order, a capped size."""

from __future__ import annotations

import json

from readfence.graph.runtime import internal as _trace

FAST = ["--steps", "6", "--batch-size", "2"]


def _trace_of(cli, tmp_path, *args):
    path = tmp_path / "run.json"
    result = cli("demo", *FAST, "--trace", str(path), *args)
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text()), result.output


def test_runs_share_one_clock_so_coarse_which_ran_first_comes_first(cli, tmp_path):
    doc, _ = _trace_of(cli, tmp_path, "--policy", "exact")
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    spans = [e for e in doc["traceEvents"] if e["ph"] in ("X", "i")]
    first = {names[pid]: min(e["ts"] for e in spans if e["pid"] == pid) for pid in names}
    last = {names[pid]: max(e["ts"] for e in spans if e["pid"] == pid) for pid in names}
    assert min(first.values()) == 0.0
    assert last["COARSE"] < first["EXACT"]  # one after the other, as they ran


def test_tracks_are_ordered_host_schedule_forward_fences(cli, tmp_path):
    doc, _ = _trace_of(cli, tmp_path, "--policy", "per_buffer")
    for pid in {e["pid"] for e in doc["traceEvents"]}:
        named = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
                 if e["pid"] == pid and e["name"] == "thread_name"}
        order = sorted((e["args"]["sort_index"], named[e["tid"]]) for e in doc["traceEvents"]
                       if e["pid"] == pid and e["name"] == "thread_sort_index")
        assert [name for _, name in order] == ["host", "schedule", "forward", "fences"]


def test_the_trace_keeps_the_first_steps_only(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(_trace, "TRACE_STEPS", 3)
    doc, out = _trace_of(cli, tmp_path, "--policy", "exact")
    steps = {e["args"]["step"] for e in doc["traceEvents"] if "step" in e.get("args", {})}
    assert steps == {0, 1, 2}
    assert doc["otherData"]["traced_steps"] == 3
    assert "(the first 3 steps of each run)" in out
    bodies = [e for e in doc["traceEvents"] if e["name"] == "body" and e["pid"] == 0]
    assert len(bodies) == 3  # the forward of the steps kept, trimmed at the last one's end
