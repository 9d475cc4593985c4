"""Helpers for driving the ``readfence`` command: click's runner and the installed script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from readfence.cli import main


@pytest.fixture
def cli():
    """``cli(*args)`` runs ``readfence args`` in-process; stdout and stderr kept apart."""
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, list(args), catch_exceptions=False)

    return invoke


def readfence_script() -> str:
    """The installed console script (next to this interpreter, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "readfence")
    found = here if os.path.exists(here) else shutil.which("readfence")
    assert found, "the readfence console script is not installed: pip install -e ."
    return found


def run_readfence(argv: list[str], cwd: str) -> tuple[int, str, str]:
    """``readfence argv`` run in ``cwd``: (exit status, stdout, stderr). In-process (the traces
    the suite already made are reused), except a ``--tp`` run, which launches worker processes
    and runs as the installed script, as a user runs it."""
    if "--tp" in argv:
        run = subprocess.run([readfence_script(), *argv], capture_output=True, text=True, cwd=cwd,
                             timeout=600, check=False)
        return run.returncode, run.stdout, run.stderr
    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(main, argv, catch_exceptions=False)
    finally:
        os.chdir(here)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def script():
    """``script(*args)`` runs the installed ``readfence`` script in a subprocess."""

    def run(*args: str, cwd: str | None = None, timeout: float = 300):
        return subprocess.run([readfence_script(), *args], capture_output=True, text=True,
                              cwd=cwd, timeout=timeout, check=False)

    return run
