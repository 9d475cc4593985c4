"""``tests.command_runs``: a command runs once per test run, and only a run of the same arguments,
folder and environment is handed what another printed."""

from __future__ import annotations

import threading

import pytest

from tests import command_runs


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The runs that really happen, in a folder of this test's own (not the run's shared one)."""
    ran: list[tuple[list[str], str]] = []

    def run(argv, cwd):
        ran.append((list(argv), cwd))
        return 0, f"ran {' '.join(argv)} #{len(ran)}\n", ""

    monkeypatch.setattr(command_runs, "_run", run)
    monkeypatch.setattr(command_runs, "_shared", None)
    command_runs.share_runs_in(tmp_path / "runs")
    return ran


def test_the_same_command_runs_once_and_each_caller_gets_its_output(counted, tmp_path):
    first = command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    again = command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    assert first == again == (0, "ran plan paged #1\n", "") and len(counted) == 1


def test_arguments_folder_and_environment_each_make_another_run(counted, tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    command_runs.run_readfence(["plan", "paged", "--json"], str(tmp_path))
    command_runs.run_readfence(["plan", "paged"], str(other))
    monkeypatch.setenv("READFENCE_TEST_VARIABLE", "1")
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    assert len(counted) == 4
    monkeypatch.delenv("PATH")
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    assert len(counted) == 5
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")  # pytest's own: names the worker, not the run
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    assert len(counted) == 5


def test_what_an_import_set_before_a_test_started_does_not_make_another_run(counted, tmp_path, monkeypatch):
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    monkeypatch.setenv("READFENCE_TEST_CACHE_DIR", "/tmp/cache")  # as SGLang sets its cache folders on import
    command_runs.note_test_start()  # the next test starts with it set
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    assert len(counted) == 1


def test_callers_at_once_wait_for_one_run(counted, tmp_path):
    results: list[tuple[int, str, str]] = []
    callers = [threading.Thread(target=lambda: results.append(command_runs.run_readfence(["demo"], str(tmp_path))))
               for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=60)
    assert len(results) == 4 and len(set(results)) == 1 and len(counted) == 1


def test_without_a_shared_folder_every_call_runs(counted, monkeypatch, tmp_path):
    monkeypatch.setattr(command_runs, "_shared", None)
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    command_runs.run_readfence(["plan", "paged"], str(tmp_path))
    assert len(counted) == 2
