"""``readfence ARGS`` run for the tests, each distinct run once per test run.

The README's and the docs' commands, their samples and the commands other tests paste are run
by several test files, some alike (the same command in a bash block, in the prose and in a
test of what it prints). :func:`run_readfence` runs a command once per run of the suite and
hands every later caller, on any pytest-xdist worker, what it printed: the run is keyed by
everything its output depends on (its arguments, its folder, the environment variables its test
set), and a file lock makes a second worker wait for the first instead of running it again.

It runs the command in the worker's process (a ``--tp`` run's ranks too fork from there), and
the first worker's run serves every other: a test that patches readfence, or needs the run to
happen in its own process state, or sets the environment for a whole module, calls the command
itself (the ``cli`` fixture).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys

from filelock import FileLock

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The folder every worker of this test run shares, set by the session fixture in
#: ``tests/conftest.py``; ``None`` (run outside pytest): nothing is shared.
_shared: pathlib.Path | None = None

#: The environment as the running test started (set by the fixture in ``tests/conftest.py``).
_at_test_start: dict[str, str] | None = None

#: How long a worker waits for another to finish the same command (every wait of a run, a
#: device's, a collective's, a rank's, times out sooner): longer means the other worker hangs,
#: and the test fails saying so.
LOCK_TIMEOUT_S = 900.0


def share_runs_in(folder: pathlib.Path) -> None:
    """Keep each run's result in ``folder`` (one folder for every worker of a test run)."""
    global _shared
    folder.mkdir(parents=True, exist_ok=True)
    _shared = folder


def readfence_script() -> str:
    """The installed console script (next to this interpreter, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "readfence")
    found = here if os.path.exists(here) else shutil.which("readfence")
    assert found, "the readfence console script is not installed: pip install -e ."
    return found


def note_test_start() -> None:
    """Remember the environment as a test starts: a run's key holds what the test changed of it
    (what a library sets when a test first imports it, e.g. SGLang's cache folders, is the
    same for every command and must not tell two runs apart)."""
    global _at_test_start
    _at_test_start = dict(os.environ)


def run_key(argv: list[str], cwd: str) -> str:
    """What a run's output depends on, hashed: its arguments, its folder and the environment
    variables the running test set or removed (every variable outside a test; pytest's own,
    which name the worker and the test, left out).

    >>> run_key(["plan", "paged"], ".") == run_key(["plan", "paged"], "."), run_key(["plan"], ".") == run_key(["plan", "paged"], ".")
    (True, False)
    """
    start = _at_test_start if _at_test_start is not None else {}
    changed = {k: os.environ.get(k) for k in {*start, *os.environ} if os.environ.get(k) != start.get(k)}
    env = sorted((k, v) for k, v in changed.items() if not k.startswith("PYTEST_"))  # None: removed
    text = json.dumps([argv, str(pathlib.Path(cwd).resolve()), env])
    return hashlib.sha256(text.encode()).hexdigest()


def _run(argv: list[str], cwd: str) -> tuple[int, str, str]:
    """``readfence argv`` in ``cwd``, in-process: the traces this worker made are reused, and a
    ``--tp`` run's ranks fork from the server process this worker's first launch started (with
    this process's folder and environment as they are at the launch) instead of importing torch
    in a fresh script and server each time. What the installed script and its ranks do as
    processes is tested by the tests that run it (``tests/cli/test_script.py``,
    ``tests/cli/test_error_lines.py``, ``tests/cli/test_tp.py``)."""
    from click.testing import CliRunner

    from readfence.cli import main

    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(main, argv, catch_exceptions=False)
    finally:
        os.chdir(here)
    return result.exit_code, result.stdout, result.stderr


def run_readfence(argv: list[str], cwd: str) -> tuple[int, str, str]:
    """``readfence argv`` run in ``cwd``: (exit status, stdout, stderr), run once per test run
    (see the module's docstring); a command that writes a file runs in a folder of its own
    test's, so its run is that test's alone."""
    if _shared is None:
        return _run(argv, cwd)
    path = _shared / f"{run_key(argv, cwd)}.json"
    with FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S):
        if path.exists():
            code, out, err = json.loads(path.read_text())
            return code, out, err
        result = _run(argv, cwd)
        path.write_text(json.dumps(result))
    return result
