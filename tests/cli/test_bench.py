"""``readfence bench``: finds the benchmarks, runs them, prints their ratios."""

from __future__ import annotations

import pytest

from readfence.cli import _bench_cmd

OVERLAP = '''
def main(quick=False):
    return {"per_buffer_vs_coarse": 1.5 if quick else 2.0, "exact_vs_coarse": 1.75}
'''
OVERHEAD = '''
import sys
def main(argv):
    print("argv", argv)
    return {"lowered_vs_eager": 0.5}
'''


def test_calls_main_and_prints_ratios(cli, monkeypatch, tmp_path):
    (tmp_path / "bench_overlap.py").write_text(OVERLAP)
    (tmp_path / "bench_overhead.py").write_text(OVERHEAD)
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: tmp_path)
    result = cli("bench", "--quick")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines == ["== bench_overlap (quick)", "per_buffer_vs_coarse: 1.50", "exact_vs_coarse: 1.75",
                     "== bench_overhead (quick)", "argv ['--quick']", "lowered_vs_eager: 0.50"]


def test_without_a_checkout_says_where_the_benchmarks_are(cli, monkeypatch):
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: None)
    result = cli("bench")
    assert result.exit_code == 1
    assert "the benchmarks live in the source repository" in result.output
    assert "Traceback" not in result.output


def test_an_empty_benchmarks_dir_is_reported(cli, monkeypatch, tmp_path):
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: tmp_path)
    result = cli("bench")
    assert result.exit_code == 1 and "no benchmark found" in result.output


def _present() -> list:
    where = _bench_cmd.benchmarks_dir()
    return [] if where is None else [where / b for b in _bench_cmd.BENCHMARKS if (where / b).is_file()]


def test_the_repository_benchmarks_have_a_main_that_returns_ratios():
    import importlib.util
    import inspect

    found = _present()
    if not found:
        pytest.skip("no benchmarks/bench_overlap.py or bench_overhead.py in this checkout")
    for path in found:
        spec = importlib.util.spec_from_file_location(f"check_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert "quick" in inspect.signature(module.main).parameters, path


@pytest.mark.slow
def test_the_repository_benchmarks_run_quick(script):
    if not _present():
        pytest.skip("no benchmarks/bench_overlap.py or bench_overhead.py in this checkout")
    run = script("bench", "--quick", timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== bench_overlap" in run.stdout
    assert "_vs_coarse: " in run.stdout


DEVICE_AWARE = '''
def main(quick=False, device="cpu"):
    return {"device_" + device: 1.0}
'''


def test_device_is_passed_to_mains_that_take_it(cli, monkeypatch, tmp_path):
    (tmp_path / "bench_overlap.py").write_text(DEVICE_AWARE)
    (tmp_path / "bench_overhead.py").write_text(OVERLAP)  # takes no device: runs as it is
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: tmp_path)
    result = cli("bench", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "device_cpu: 1.00" in result.output and "per_buffer_vs_coarse: 2.00" in result.output


def test_unknown_device_is_refused_clearly(cli, monkeypatch, tmp_path):
    monkeypatch.setattr(_bench_cmd, "benchmarks_dir", lambda: tmp_path)
    result = cli("bench", "--device", "tpu")
    assert result.exit_code == 2
    assert "unknown device" in result.output and "Traceback" not in result.output
