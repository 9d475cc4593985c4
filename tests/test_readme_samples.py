"""The sample outputs the README and the docs' pages show are what the commands print.

A text block preceded by ``<!-- sample: readfence ARGS | FLAGS -->`` is compared with a real run
of that command, line by line, after squeezing runs of spaces (column widths follow the values).
FLAGS: ``numbers`` replaces every number with ``N`` (timings differ from run to run; the columns,
rows and words do not); ``shrink`` does that and runs the command as ``docs_pages.shrink``
makes it (as ``tests/cli/test_readme_commands.py`` runs a bash block's command); ``slow`` marks a run of a
minute or more as a slow test; ``stderr`` compares stderr too. A line ``...`` stands for any
lines, and ``...`` inside a line for any text.
"""

from __future__ import annotations

import re
import shlex

import pytest

from tests.command_runs import run_readfence
from tests.docs_pages import run_folder, samples, shrink

pytestmark = pytest.mark.slow  # end to end (the README, the scripts, worker processes): the full suite

SAMPLES = samples()


def normal(line: str, numbers: bool) -> str:
    """``line`` with runs of spaces squeezed (and every number ``N`` when ``numbers``).

    >>> normal("COARSE      52.7     1.00x", True)
    'COARSE N Nx'
    """
    line = " ".join(line.split())
    return re.sub(r"\d+(\.\d+)?", "N", line) if numbers else line


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` fits ``expected``, whose ``...`` lines stand for any lines and whose
    ``...`` inside a line stands for any text.

    >>> matches(["a", "...", "d ... f"], ["a", "b", "c", "d e f"]), matches(["a"], ["b"])
    (True, False)
    """
    def fits(pattern: str, line: str) -> bool:
        return re.fullmatch(".*".join(map(re.escape, pattern.split("..."))), line) is not None

    def go(i: int, j: int) -> bool:
        if i == len(expected):
            return j == len(actual)
        if expected[i] == "...":
            return any(go(i + 1, k) for k in range(j, len(actual) + 1))
        return j < len(actual) and fits(expected[i], actual[j]) and go(i + 1, j + 1)

    return go(0, 0)


def test_the_readme_marks_its_samples():
    assert len(SAMPLES) >= 5


def _case(page: str, command: str, flags: str, text: str) -> object:
    slow = "slow" in (flags or "")  # a minute or more: run with the slow tests
    return pytest.param(page, command, flags, text, id=command, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize(("page", "command", "flags", "text"), [_case(*s) for s in SAMPLES])
def test_a_readme_sample_is_what_the_command_prints(page, command, flags, text, tmp_path):
    flags = {f.strip() for f in (flags or "").split(",")}
    argv = (shrink if "shrink" in flags else list)(shlex.split(command))
    # where and as the bash blocks' commands run: a command in both runs once
    _, stdout, stderr = run_readfence(argv[1:], run_folder(argv, tmp_path))
    out = stdout + (stderr if "stderr" in flags else "")
    numbers = "numbers" in flags or "shrink" in flags
    expected = [normal(x, numbers) for x in text.strip("\n").splitlines()]
    actual = [normal(x, numbers) for x in out.strip("\n").splitlines()]
    assert matches(expected, actual), f"{command}\n--- {page}\n{text}\n--- printed\n{out}"
