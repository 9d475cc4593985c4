"""``readfence bench``: finds every benchmark, runs the chosen ones, prints their figures."""

from __future__ import annotations

import re

import pytest

from readfence.cli import _bench_cmd

FAKE = '''
def main(quick=False):
    return {"per_buffer_vs_coarse": 1.5 if quick else 2.0, "n": {"steps": 3}}
'''
DEVICE_AWARE = '''
def main(quick=False, device="cpu"):
    return {"device_" + device: 1.0}
'''
BROKEN = '''
def main(quick=False):
    raise RuntimeError("calibration diverged")
'''


@pytest.fixture
def fake_dir(monkeypatch, tmp_path):
    """A benchmarks/ folder whose every benchmark is ``FAKE`` unless a test writes another."""
    for name in _bench_cmd.BENCHMARKS:
        (tmp_path / f"bench_{name}.py").write_text(FAKE)
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: tmp_path)
    return tmp_path


def _headers(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("== ")]


def test_every_benchmark_file_is_run_by_default():
    where = _bench_cmd.benchmarks_dir()
    assert where is not None, "run the tests from the source checkout"
    files = {p.stem.removeprefix("bench_") for p in where.glob("bench_*.py")}
    assert files == set(_bench_cmd.BENCHMARKS)


def test_runs_all_in_order_and_prints_the_figures(cli, fake_dir):
    result = cli("bench", "--quick")
    assert result.exit_code == 0, result.output
    assert _headers(result.output) == [f"== {n} (quick)" for n in _bench_cmd.BENCHMARKS]
    block = result.output.split("== effects (quick)\n")[1].split("==")[0].splitlines()
    assert block[:2] == ["per_buffer_vs_coarse: 1.50", "n.steps: 3"]
    assert re.fullmatch(r"\(effects took \d+\.\d s\)", block[2])


def test_names_pick_some(cli, fake_dir):
    result = cli("bench", "overlap", "effects")
    assert result.exit_code == 0, result.output
    assert _headers(result.output) == ["== effects", "== overlap"]  # in the fixed order
    assert "per_buffer_vs_coarse: 2.00" in result.output


def test_an_unknown_name_is_one_line_naming_the_choices(cli, fake_dir):
    result = cli("bench", "overlay")
    assert result.exit_code == 2
    assert result.output.strip() == ("Error: invalid NAMES 'overlay': unknown benchmark; allowed: "
                                     "effects, audit, scale, check, overhead, overlap, serve, fuzz, tp, triton, races")


def test_a_failing_benchmark_is_reported_and_the_others_still_run(cli, fake_dir):
    (fake_dir / "bench_check.py").write_text(BROKEN)
    result = cli("bench", "--quick")
    assert result.exit_code == 1
    assert "check FAILED: RuntimeError: calibration diverged" in result.stdout
    assert "Traceback" in result.stderr  # the details, apart from the report
    assert len(_headers(result.stdout)) == len(_bench_cmd.BENCHMARKS)
    assert result.stdout.splitlines()[-1] == "failed: check"


def test_a_module_without_main_is_a_failure(cli, fake_dir):
    (fake_dir / "bench_fuzz.py").write_text("x = 1\n")
    result = cli("bench", "fuzz")
    assert result.exit_code == 1 and "has no main(quick=...)" in result.output


def test_device_is_passed_to_mains_that_take_it(cli, fake_dir):
    (fake_dir / "bench_overlap.py").write_text(DEVICE_AWARE)
    result = cli("bench", "overlap", "effects", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "device_cpu: 1.00" in result.output and "per_buffer_vs_coarse: 2.00" in result.output


def test_without_a_checkout_says_where_the_benchmarks_are(cli, monkeypatch):
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: None)
    result = cli("bench")
    assert result.exit_code == 1
    assert "the benchmarks live in the source repository" in result.output
    assert "Traceback" not in result.output


def test_a_missing_benchmark_file_is_named(cli, monkeypatch, tmp_path):
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: tmp_path)
    result = cli("bench", "audit")
    assert result.exit_code == 1 and "no benchmark file for audit" in result.output


#: what each benchmark's figures must hold (a key of each part it measures)
FIGURES = {
    "effects": ["wide.build_ms", "deep.parse_ms", "balanced.query_us"],
    "audit": ["cpu.cold_s", "cpu.traces", "cuda.warm_ms", "cpu.unsound"],
    "check": ["poison_vs_plain", "observer_vs_plain"],
    "overhead": ["per_buffer_lowered_vs_hand", "exact_lowered_vs_hand"],
    "overlap": [f"{run}.{p}_vs_coarse" for run in ("mixed_matmul", "mixed_wait", "late_join_wait", "mid_join_wait")
                for p in ("joined", "per_buffer", "exact")],
    "serve": ["deepseek_v4.serial_tokens_per_s", "deepseek_v4.exact_tokens_per_s", "deepseek_v4.exact_vs_coarse",
              "deepseek_v4.exact_mean_slack_ms", "deepseek_v4.exact_host_ms_per_step", "deepseek_v4.mix.prefill_steps"],
    "fuzz": ["programs", "p1_violations", "p2_violations"],
    "scale": ["ratios.trace_2_over_1", "ratios.audit_2_over_1", "ratios.lower_2_over_1", "capture.per_extra_size_s",
              "memory.first_size_mb", "memory.per_extra_size_mb", "audit_all_s", "fuzz_programs_per_s",
              "dispatch.first_lower_fresh_process_s", "floor.2.audit_floor_s", "floor.audit_2_over_1_at_least",
              "floor.lower_2_over_1_at_least", "replay_check.2.lower_over_unchecked", "replay_check.2.check_over_audit"],
    "tp": [f"rank{r}.{p}_vs_{base}" for r in (0, 1) for p in ("joined", "per_buffer", "exact") for base in ("coarse", "limit")],
    "triton": ["total_before", "total_after", "median_s_before", "median_s_after", "after_vs_before"],
}


@pytest.mark.slow  # runs the benchmarks: the full suite
@pytest.mark.parametrize("name", _bench_cmd.BENCHMARKS)
def test_each_repository_benchmark_runs_quick(cli, name):
    result = cli("bench", name, "--quick")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "quick: each benchmark's smoke run; its figures show that it runs, they measure nothing"
    figures = dict(line.split(": ", 1) for line in lines[2:-1])
    if name == "triton" and "skipped" in figures:
        pytest.skip(figures["skipped"])  # SGLang or triton is not installed
    for key in FIGURES[name]:
        value = figures[key]
        assert re.fullmatch(r"-?\d+(\.\d+)?", value), (key, value)
    if name == "serve":
        assert figures["deepseek_v4.matches_serial"] == "True"
    if name == "audit":
        assert figures["cpu.unsound"] == "0" and int(figures["cpu.traces"]) > 0
    if name == "triton":  # every run the audit dropped added no evidence: the reports are the same (checked inside)
        assert int(figures["total_after"]) < int(figures["total_before"]), figures
    if name == "fuzz":
        assert figures["p1_violations"] == "0" and figures["p2_violations"] == "0"
        # two programs give no rate: none is printed as if it were one
        assert int(figures["refused_runnable"]) < 20 and figures["false_alarm_rate"] == "n/a (too few samples)"


@pytest.mark.slow  # runs the benchmarks: the full suite
def test_the_script_runs_a_benchmark(script):
    run = script("bench", "effects", "--quick", timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[1] == "== effects (quick)" and "wide.build_ms: " in run.stdout
