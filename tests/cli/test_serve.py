"""``readfence serve``: the serving loop per policy on the command line."""

from __future__ import annotations

import json
import re

import click.testing

from readfence.cli import main

#: One repetition: what these tests check holds for each (the tests of ``SHORT`` below check the repetitions).
#: 12 steps of this traffic are 7 prefill steps and 5 decode steps in the graphs of 1 and 4 requests: every
#: kind of step, eager steps and graph replays, and more than one graph are in each run.
ARGS = ["serve", "paged", "--steps", "12", "--capture-sizes", "1,2,4", "--rate", "0.8", "--device", "cpu",
        "--write-wait-ms", "0", "--repeat", "1"]
KEYS = {"schema_version", "spec", "policy", "steps", "prefill_steps", "decode_steps", "batch_sizes", "tokens_per_s",
        "speedup_vs_serial", "speedup_vs_coarse", "mean_slack_ms", "matches_serial", "violations"}


def _run(*extra: str) -> click.testing.Result:
    return click.testing.CliRunner().invoke(main, [*ARGS, *extra], prog_name="readfence")


def test_json_has_one_object_per_policy_with_the_run_counts():
    result = _run("--policy", "exact", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["policy"] for r in rows] == ["COARSE", "EXACT"]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["matches_serial"] is True and r["violations"] == 0 and r["steps"] == 12
        assert r["prefill_steps"] + r["decode_steps"] == 12 and r["prefill_steps"] > 0 and r["decode_steps"] > 0
        assert sum(r["batch_sizes"].values()) == r["decode_steps"] and set(r["batch_sizes"]) <= {"1", "2", "4"}
    assert rows[0]["speedup_vs_coarse"] == 1.0


def test_verify_and_trace_name_the_graph_of_each_step(tmp_path):
    trace = tmp_path / "serve.json"
    result = _run("--policy", "per_buffer", "--verify", "--trace", str(trace))
    assert result.exit_code == 0, result.output
    assert "verified paged" in result.output and "serving" in result.output
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("cat") == "replay"]
    graphs = {e["args"]["graph"] for e in steps}
    assert any(g.startswith("decode b") for g in graphs) and any(g.startswith("prefill b") for g in graphs)
    assert any(e["name"].endswith("(graph replay)") for e in steps) and any(e["name"].endswith("(eager)") for e in steps)


def test_traffic_that_does_not_fit_is_one_error_line():
    result = click.testing.CliRunner().invoke(main, ["serve", "per_stream(paged, paged)", "--capture-sizes", "1"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: a per_stream group of 2 members needs a capture size >= 2, got [1]"]


SHORT = ["serve", "paged", "--steps", "6", "--capture-sizes", "1,2", "--rate", "0.8", "--device", "cpu",
         "--write-wait-ms", "0", "--policy", "exact"]


def test_throughput_is_the_median_of_three_repetitions_by_default_with_each_run_kept():
    import statistics

    result = click.testing.CliRunner().invoke(main, [*SHORT, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    for r in rows:
        assert r["repeats"] == 3 and len(r["tokens_per_s_runs"]) == 3 == len(r["speedup_vs_coarse_runs"])
        assert r["tokens_per_s"] == statistics.median(r["tokens_per_s_runs"])
        assert r["speedup_vs_coarse"] == statistics.median(r["speedup_vs_coarse_runs"])
        assert r["matches_serial"] is True and r["violations"] == 0
    assert rows[0]["speedup_vs_coarse_runs"] == [1.0, 1.0, 1.0]


def test_the_text_says_what_the_throughput_is_worth():
    result = click.testing.CliRunner().invoke(main, [*SHORT, "--repeat", "2"])
    assert result.exit_code == 0, result.output
    (note,) = [line for line in result.output.splitlines() if line.startswith("tokens/s and speedups:")]
    assert re.fullmatch(r"tokens/s and speedups: medians of 2 repetitions, the policies in a rotated order; across "
                        r"them, speedup vs COARSE ranged EXACT \d+\.\d\d-\d+\.\d\dx: a difference within a range "
                        r"is noise", note), note
    one = click.testing.CliRunner().invoke(main, [*SHORT, "--repeat", "1"])
    assert one.exit_code == 0, one.output
    assert ("tokens/s and speedups: one run per policy, which on a shared machine can differ by 2x from one run to "
            "the next: noise; --repeat N takes medians over N repetitions") in one.output
    bad = click.testing.CliRunner().invoke(main, [*SHORT, "--repeat", "0"])
    assert bad.exit_code == 2 and bad.output.startswith("Error: invalid --repeat '0': must be a positive integer")
