"""The installed ``readfence`` console script, run in a subprocess as a user would."""

from __future__ import annotations

import json

import pytest

from readfence import __version__


def test_version_and_help(script):
    version = script("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"readfence, version {__version__}"
    helped = script("--help")
    assert helped.returncode == 0
    for command in ("demo", "plan", "audit", "verify", "bench"):
        assert command in helped.stdout


def test_help_and_version_import_no_command_and_no_torch() -> None:
    import subprocess
    import sys

    probe = ("import sys; from click.testing import CliRunner; from readfence.cli import main; "
             "assert CliRunner().invoke(main, ['--help']).exit_code == 0; "
             "assert CliRunner().invoke(main, ['--version']).exit_code == 0; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('readfence.cli._') "
             "and m != 'readfence.cli._errors'))")  # the group's error style: click only
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_help_listing_says_what_each_command_says_of_itself() -> None:
    from readfence.cli import COMMANDS, main

    for name, (_, _, short) in COMMANDS.items():
        command = main.get_command(None, name)
        assert command is not None and command.name == name
        assert command.get_short_help_str(limit=200) == short


def test_demo_json(script):
    run = script("demo", "--steps", "3", "--batch-size", "2", "--policy", "exact", "--json")
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [r["policy"] for r in rows] == ["COARSE", "EXACT"]
    assert all(r["matches_serial"] and r["violations"] == 0 for r in rows)
    assert run.stderr == ""  # no progress bar when stderr is not a terminal


@pytest.mark.slow
def test_plan_and_audit(script, cli):
    # the script's run of a command that traces: one of it (each run imports torch again); the
    # plan reaches the same entry point, run here
    plan = cli("plan", "tbo(deepseek_v4, paged)", "--mode", "decode", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert json.loads(plan.stdout)["effect"]["req_to_token"] == "IN_REPLAY"
    audit = script("audit", "linear", "--mode", "decode")
    assert audit.returncode == 0, audit.stderr
    row = next(line for line in audit.stdout.splitlines() if "state_slots" in line)
    assert row.split() == ["linear", "DECODE", "state_slots", "IN_REPLAY", "IN_REPLAY", "exact"]


def test_bad_input_is_one_line_without_traceback(script, cli):
    # the script's exit status and streams on bad input: one run of it; the other kinds of bad
    # input reach the same error path, run here (click's runner keeps stdout and stderr apart too)
    for i, (args, expected) in enumerate([
        (["demo", "--spec", "tbo(paged"], "invalid --spec 'tbo(paged': position 9: expected ',' or ')'"),
        (["demo", "--steps", "-3"], "invalid --steps '-3': must be a positive integer"),
        (["plan", "paged", "--mode", "prefill"], "invalid --mode 'prefill': unknown forward mode"),
    ]):
        if i == 0:
            run = script(*args)
            code, stdout, stderr = run.returncode, run.stdout, run.stderr
        else:
            result = cli(*args)
            code, stdout, stderr = result.exit_code, result.stdout, result.stderr
        assert code == 2, (args, stderr)
        assert stdout == ""
        assert stderr.strip().splitlines() == [f"Error: {stderr.strip()[7:]}"]
        assert expected in stderr and "Traceback" not in stderr
