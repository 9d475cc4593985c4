"""Ctrl-C ends a command with exit status 130 (128 + SIGINT), as Python's own, not 1 (a finding)
nor 2 (bad input), and without a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from readfence.cli import INTERRUPTED

from .conftest import readfence_script


def test_an_interrupted_command_exits_130(cli, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("readfence.cli._plan_data.plan_report", interrupted)
    result = cli("plan", "paged")
    assert INTERRUPTED == 130
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == "Interrupted"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT")
def test_ctrl_c_during_a_run_exits_130(tmp_path):
    run = subprocess.Popen([readfence_script(), "demo", "--steps", "100000", "--policy", "exact"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(6)  # torch imported, the run under way
        assert run.poll() is None, run.communicate()
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("Interrupted"), err
