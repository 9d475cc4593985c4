"""``readfence demo``: the table, JSON, trace, plot, and the exit status."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from readfence.backends import paged, redeclare
from readfence.cli import _demo_run, _params
from readfence.core import ForwardMode
from readfence.effects import ReadEffect, ReadEnd

FAST = ["--steps", "4", "--batch-size", "2"]  # small runs keep the tests fast


def test_table_has_one_row_per_policy_and_names_the_device(cli):
    result = cli("demo", *FAST)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "device: cpu" in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    for column in ("steps/s", "speedup vs COARSE", "mean fence slack (ms)", "matches serial",
                   "sanitizer findings"):
        assert column in header
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["COARSE"], ["JOINED"],
                                                                              ["PER_BUFFER"], ["EXACT"])]
    assert [r[0] for r in rows] == ["COARSE", "JOINED", "PER_BUFFER", "EXACT"]
    assert all(r[-2:] == ["yes", "none"] for r in rows), out
    assert rows[0][2] == "1.00x"


def test_table_and_json_carry_the_serial_baseline(cli):
    out = cli("demo", *FAST, "--write-wait-ms", "0").output
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    serial = next(line for line in out.splitlines() if line.startswith("serial (no overlap)")).split()
    assert "vs serial" in header and float(serial[3]) > 0 and serial[5] == "1.00x"  # its steps/s, then 1.00x
    rows = json.loads(cli("demo", *FAST, "--policy", "exact", "--json").output)
    for row in rows:
        assert row["serial_steps_per_s"] == rows[0]["serial_steps_per_s"] > 0  # one reference run
        assert row["speedup_vs_serial"] == pytest.approx(row["steps_per_s"] / row["serial_steps_per_s"])


def test_default_spec_has_buffers_ending_at_different_stages():
    from readfence.cli._params import parse_spec

    effect = parse_spec(_demo_run.DEFAULT_SPEC).read_effect(ForwardMode.DECODE)
    assert len({effect[b] for b in effect.buffers}) >= 2


def test_json_rows_have_the_documented_keys(cli):
    result = cli("demo", *FAST, "--policy", "exact", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["policy"] for r in rows] == ["COARSE", "EXACT"]  # COARSE always runs: the baseline
    for row in rows:
        assert {"policy", "steps_per_s", "speedup_vs_coarse", "matches_serial", "violations",
                "mean_slack_ms"} <= set(row)
        assert row["matches_serial"] is True and row["violations"] == 0
        assert row["steps_per_s"] > 0 and row["mean_slack_ms"] >= 0
    assert rows[0]["speedup_vs_coarse"] == 1.0


def test_write_cost_alone_runs_with_free_waits(cli):
    rows = json.loads(cli("demo", *FAST, "--policy", "exact", "--write-cost", "8", "--json").output)
    assert [(r["write_cost"], r["write_wait_ms"], r["matches_serial"]) for r in rows] == [(8, 0.0, True)] * 2


def test_trace_is_chrome_json_with_tracks_stages_writes_waits_and_releases(cli, tmp_path):
    path = tmp_path / "run.json"
    result = cli("demo", *FAST, "--policy", "per_buffer", "--trace", str(path))
    assert result.exit_code == 0, result.output
    assert f"trace written to {path}" in result.output
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"COARSE", "PER_BUFFER"}
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"host", "forward", "schedule"} <= tracks
    spans = {e["name"] for e in events if e["ph"] == "X"}
    assert {"prepare_out_graph", "prepare_in_graph", "body", "graph replay", "schedule next step",
            "write req_to_token", "write state_slots"} <= spans
    assert any(name.startswith("wait ") for name in spans)
    instants = {e["name"] for e in events if e["ph"] == "i"}
    assert {"release req_to_token", "release state_slots", "last read req_to_token"} <= instants
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_plot_is_a_real_png(cli, tmp_path):
    path = tmp_path / "run.png"
    result = cli("demo", *FAST, "--policy", "joined", "--plot", str(path))
    assert result.exit_code == 0, result.output
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_plot_without_matplotlib_exits_2_with_a_hint(cli, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = cli("demo", *FAST, "--plot", str(tmp_path / "x.png"))
    assert result.exit_code == 2
    assert "pip install 'readfence[plot]'" in result.output
    assert not (tmp_path / "x.png").exists()


def _early_paged():
    # Declares the page table released before replay; paged reads it inside the graph.
    return redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                       "seq_lens": ReadEnd.IN_REPLAY}))


def test_an_unsound_declaration_is_refused_and_exits_1(cli, monkeypatch):
    monkeypatch.setattr(_params, "parse_spec", lambda text: _early_paged())
    result = cli("demo", *FAST, "--policy", "per_buffer")
    assert result.exit_code == 1
    assert "refused" in result.output
    assert "PER_BUFFER: refusing to lower" in result.output


def test_races_show_in_the_findings_column_and_exit_1(cli, monkeypatch):
    real = _demo_run.run_overlapped

    def unsafe(*args, options, **kwargs):
        return real(*args, options=attrs.evolve(options, UNSAFE_skip_soundness_check=True), **kwargs)

    monkeypatch.setattr(_params, "parse_spec", lambda text: _early_paged())
    monkeypatch.setattr(_demo_run, "run_overlapped", unsafe)
    result = cli("demo", *FAST, "--policy", "per_buffer", "--json")
    assert result.exit_code == 1
    rows = {r["policy"]: r for r in json.loads(result.output)}
    assert rows["COARSE"]["violations"] == 0
    assert rows["PER_BUFFER"]["violations"] > 0
    assert "req_to_token" in rows["PER_BUFFER"]["findings"][0]


def test_a_mismatch_with_serial_exits_1(cli, monkeypatch):
    real = _demo_run.run_overlapped

    def corrupt(*args, **kwargs):
        res = real(*args, **kwargs)
        res.logits[-1].add_(torch.ones_like(res.logits[-1]))
        return res

    monkeypatch.setattr(_demo_run, "run_overlapped", corrupt)
    result = cli("demo", *FAST, "--policy", "exact")
    assert result.exit_code == 1
    assert "outputs differ from the serial run" in result.output
    assert "every policy matched" not in result.output


@pytest.mark.parametrize("args, expected", [
    (["--spec", "tbo("], "invalid --spec 'tbo(': position 4: expected a backend name"),
    (["--spec", "nosuch"], "unknown backend 'nosuch'; known leaves: deepseek_v4"),
    (["--policy", "fastest"], "invalid --policy 'fastest': unknown policy 'fastest'; allowed: coarse, joined, "
                              "per_buffer, exact, all"),
    (["--policy", "exact,fast"], "invalid --policy 'exact,fast': unknown policy 'fast'"),
    (["--steps", "0"], "invalid --steps '0': must be a positive integer"),
    (["--steps", "many"], "invalid --steps 'many': must be a positive integer"),
    (["--steps", "2.5"], "invalid --steps '2.5': must be a positive integer"),
    (["--device", "tpu"], "invalid --device 'tpu': unknown device; allowed: auto, cpu, cuda"),
    (["--batch-size", "1000"], "invalid --batch-size '1000': must be at most 16 (the tiny model serves at most 16 requests)"),
    (["--trace", "no/such/dir/t.json"], "invalid --trace 'no/such/dir/t.json': directory 'no/such/dir' does not exist"),
    (["--write-cost", "5", "--write-wait-ms", "2"], "give --write-cost (scheduler work on the CPU) or --write-wait-ms"),
    (["--spec", "per_stream(paged, linear)", "--batch-size", "1"], "runs 2 forward streams, each on a share of the "
                                                                   "batch: --batch-size must be at least 2, got 1"),
])
def test_bad_input_exits_2_with_one_line(cli, args, expected):
    result = cli("demo", *args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert expected in lines[0]
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_when_absent_exits_2(cli):
    result = cli("demo", "--device", "cuda")
    assert result.exit_code == 2
    assert "CUDA is not available here" in result.output and "allowed: auto, cpu" in result.output


def test_policies_take_a_comma_list_or_repeats(cli):
    both = json.loads(cli("demo", *FAST, "--policy", "exact,joined", "--json").output)
    repeated = json.loads(cli("demo", *FAST, "--policy", "exact", "--policy", "joined", "--json").output)
    for rows in (both, repeated):
        assert [r["policy"] for r in rows] == ["COARSE", "JOINED", "EXACT"]


@pytest.mark.parametrize("args, expected", [
    (["--trace", "/proc/x.json"], "invalid --trace '/proc/x.json': cannot write there"),
    (["--trace", "/dev/full"], "invalid --trace '/dev/full': the file name must end in .json"),
    (["--plot", "x.txt"], "invalid --plot 'x.txt': the file name must end in .png"),
    (["--trace", "run.png"], "invalid --trace 'run.png': the file name must end in .json"),
])
def test_output_paths_are_checked_before_anything_runs(cli, args, expected):
    result = cli("demo", *FAST, *args)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_directory_and_a_file_in_the_way_are_named_as_what_they_are(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs.json").mkdir()
    (tmp_path / "notes.txt").write_text("")
    for args, expected in ((["--trace", "runs.json"], "'runs.json' is a directory; give a file name ending in .json"),
                           (["--plot", "notes.txt/run.png"], "'notes.txt' is not a directory (it is a file)")):
        result = cli("demo", *FAST, *args)
        assert result.exit_code == 2, result.output
        assert result.output.strip() == f"Error: invalid {args[0]} {args[1]!r}: {expected}"


def test_a_pipe_is_not_an_output_file_and_a_checked_path_leaves_nothing_behind(cli, tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.json")  # opening it to write would block: refused before
    result = cli("demo", *FAST, "--trace", str(tmp_path / "pipe.json"))
    assert result.exit_code == 2 and "not a regular file" in result.output, result.output
    result = cli("demo", *FAST, "--batch-size", "1000", "--trace", str(tmp_path / "t.json"))  # refused after the check
    assert result.exit_code == 2 and "--batch-size" in result.output and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("args, expected", [
    (["--steps", "99999999999999999999999"], "invalid --steps '99999999999999999999999': must be at most 100000"),
    (["--spec", "eagle(paged, trtllm_mha, draft_steps=2000)"],
     "position 37: eagle(draft_steps=...) expects an int in 1..64, got 2000"),
])
def test_what_cannot_be_useful_is_bounded(cli, args, expected):
    result = cli("demo", *args)
    assert result.exit_code == 2 and expected in result.output, result.output


def test_progress_counts_the_serial_reference_too():
    from readfence.graph import Policy

    calls: list[tuple[str, int]] = []
    phase = ["-"]
    _demo_run.run_demo(paged(), policies=(Policy.EXACT,), device="cpu", steps=3, batch_size=2,
                       progress=lambda i: calls.append((phase[0], i)), on_policy=lambda name: phase.__setitem__(0, name))
    assert calls == [(name, i) for name in ("serial reference", "COARSE", "EXACT") for i in range(3)]
