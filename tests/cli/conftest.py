"""Helpers for driving the ``readfence`` command: click's runner and the installed script
(``tests.command_runs`` runs a command once for every test that runs it)."""

from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from readfence.cli import main
from tests.command_runs import readfence_script


@pytest.fixture
def cli():
    """``cli(*args)`` runs ``readfence args`` in-process; stdout and stderr kept apart."""
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, list(args), catch_exceptions=False)

    return invoke


@pytest.fixture
def script():
    """``script(*args)`` runs the installed ``readfence`` script in a subprocess."""

    def run(*args: str, cwd: str | None = None, timeout: float = 300):
        return subprocess.run([readfence_script(), *args], capture_output=True, text=True,
                              cwd=cwd, timeout=timeout, check=False)

    return run
