"""Every command turns each of readfence's own errors into one ``Error:`` line and exit status 1
or 2, never a traceback: a backend (and an engine backend) raises each error class from its
out-of-graph stage (``tests/cli/raising_backends.py``), and each command runs it.

The quick tier runs each command once and each error class once; the full suite runs every pair.
"""

from __future__ import annotations

import pytest

from readfence.cli import _bench_cmd
from readfence.effects.internal import one_line

from .raising_backends import ERRORS, RAISES

MARK = "raised on purpose by the backend under test"  # the raising backend's message, on one line

SPEC = "tests.cli.raising_backends:backend"
ENGINE = "tests.cli.raising_backends:engine"

#: Each command, run on the raising backend with the smallest options that reach its stages.
COMMANDS: dict[str, tuple[str, ...]] = {
    "plan": ("plan", SPEC),
    "audit": ("audit", SPEC, "--mode", "decode", "--batch-size", "1", "--jobs", "1"),
    "verify": ("verify", SPEC, "--steps", "1", "--batch-size", "1", "--policy", "exact", "--device", "cpu"),
    "demo": ("demo", "--spec", SPEC, "--steps", "1", "--batch-size", "1", "--policy", "exact", "--device", "cpu"),
    "serve": ("serve", SPEC, "--steps", "2", "--policy", "exact", "--capture-sizes", "1,2", "--repeat", "1",
              "--device", "cpu"),
    "engine audit": ("audit", "--engine", ENGINE, "--mode", "decode", "--batch-size", "1"),
    "engine verify": ("verify", "--engine", ENGINE, "--steps", "1", "--batch-size", "1", "--policy", "exact",
                      "--device", "cpu"),
}

#: Where a command reports the error as a finding of its own (exit status 1, its report naming it,
#: on one line) rather than as an ``Error:`` line: verify reports a stage that writes or hands work
#: to a thread (its audit refuses it), and an engine's verify a method that raised, per fence.
FINDINGS = {("verify", "StageWriteError"), ("verify", "StageThreadError"), ("engine verify", "EngineError"),
            ("engine verify", "StageWriteError")}

#: What an engine command makes of its engine breaking the contract or its code raising: the engine's
#: fault, named with its method and line, as bad input (exit status 2).
ENGINE_INPUT = {"ContractError", "EngineError"}


def _pairs() -> list:
    """(command, error) pairs: in the quick tier every error on ``plan`` and one per other command."""
    out = []
    names = sorted(ERRORS)
    for i, command in enumerate(COMMANDS):
        for j, name in enumerate(names):
            quick = command == "plan" or j == (7 * i) % len(names)
            out.append(pytest.param(command, name, id=f"{command}-{name}", marks=[] if quick else [pytest.mark.slow]))
    return out


def _error_lines(result) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize(("command", "name"), _pairs())
def test_each_command_turns_each_readfence_error_into_one_error_line(cli, monkeypatch, command, name):
    monkeypatch.setenv(RAISES, name)
    result = cli(*COMMANDS[command])
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    if (command, name) in FINDINGS:  # the report says the error's own message, on one line
        assert result.exit_code == 1 and _error_lines(result) == [], output
        assert any(one_line(str(ERRORS[name]())) in line for line in output.splitlines()), output
        return
    # the backend's own words, on one line (the errors that word their message themselves: their name)
    said = MARK if MARK in one_line(str(ERRORS[name]())) else name
    lines = _error_lines(result)
    assert len(lines) == 1 and said in lines[0], output
    if command.startswith("engine") and name in ENGINE_INPUT:
        assert result.exit_code == 2, output
    else:
        assert result.exit_code == 1 and lines[0].startswith(f"Error: {name}: "), output


@pytest.mark.parametrize("command", [c if c in ("plan", "audit") else pytest.param(c, marks=pytest.mark.slow)
                                     for c in COMMANDS])
def test_the_same_commands_on_the_same_backends_succeed_when_nothing_raises(cli, monkeypatch, command):
    # the errors above come from the backend, not from the options: without one, each command is clean
    monkeypatch.delenv(RAISES, raising=False)
    result = cli(*COMMANDS[command])
    assert result.exit_code == 0 and _error_lines(result) == [], result.stdout + result.stderr


@pytest.mark.slow
def test_a_tensor_parallel_run_whose_ranks_raise_is_one_error_line(script, monkeypatch):
    monkeypatch.setenv(RAISES, "DeviceTimeout")  # the ranks inherit it
    run = script("demo", "--spec", SPEC, "--steps", "1", "--batch-size", "1", "--policy", "exact", "--tp", "2",
                 "--device", "cpu")
    output = run.stdout + run.stderr
    lines = [line for line in output.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in output and run.returncode == 1, output
    assert len(lines) == 1 and lines[0].startswith("Error: tensor-parallel run of 2 ranks failed"), output
    assert "DeviceTimeout: timed out after 0.5 s waiting for event 'done'" in lines[0], output


def test_a_benchmark_raising_a_readfence_error_is_one_error_line_and_the_others_run(cli, monkeypatch):
    ran = []

    def run(path, quick, device):
        ran.append(path.stem)
        if path.stem == "bench_effects":
            raise ERRORS["DeviceTimeout"]()
        return {}

    monkeypatch.setattr(_bench_cmd, "run_benchmark", run)
    result = cli("bench", "effects", "audit", "--quick")
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert _error_lines(result) == [
        "Error: benchmark effects: DeviceTimeout: timed out after 0.5 s waiting for event 'done' (recorded on stream "
        "'forward'); raised on purpose by the backend under test"], output
    assert result.exit_code == 1 and ran == ["bench_effects", "bench_audit"], output
