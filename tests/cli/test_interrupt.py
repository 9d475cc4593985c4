"""Ctrl-C ends a command with exit status 130 (128 + SIGINT), as Python's own, not 1 (a finding)
nor 2 (bad input), and without a traceback."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
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


def _read_until(fd: int, pattern: re.Pattern[bytes], timeout: float) -> bytes:
    """What ``fd`` gives until ``pattern`` matches it (or the writer closes it, or ``timeout`` passes)."""
    seen, deadline = b"", time.monotonic() + timeout
    while not pattern.search(seen) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal's other end is closed: the process ended
                chunk = b""
            if not chunk:
                break
            seen += chunk
    return seen


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT and a pseudo-terminal")
def test_ctrl_c_during_a_run_exits_130(tmp_path):
    # stderr is a terminal, so the progress bar shows: its first step done says the run is under
    # way (torch imported, the loop running), however long a loaded machine takes to get there
    terminal, stderr = pty.openpty()
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a size: tqdm draws no bar 0 wide
    # as from a terminal: SIGINT at its default, whatever this process inherited (a job started in the
    # background of a shell ignores it, and so would the command, which then never sees the Ctrl-C)
    as_from_a_terminal = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                          "os.execv(sys.argv[1], sys.argv[1:])")
    run = subprocess.Popen([sys.executable, "-c", as_from_a_terminal, readfence_script(), "demo", "--steps", "100000",
                            "--policy", "exact"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr)
    os.close(stderr)
    try:
        err = _read_until(terminal, re.compile(rb" [1-9][0-9]*/[0-9]+ \["), timeout=300)
        assert run.poll() is None, (run.communicate(), err)
        run.send_signal(signal.SIGINT)
        # read the terminal to its end meanwhile: a full terminal would block the bar's writes and the
        # command's last line
        err += _read_until(terminal, re.compile(rb"(?!)"), timeout=300)
        run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        os.close(terminal)
    text = err.decode(errors="replace")
    assert run.returncode == 130, text
    assert "Traceback" not in text and text.strip().endswith("Interrupted"), text
