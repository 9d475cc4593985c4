"""Every bad option of every command is one ``Error:`` line naming it, exit status 2.

The options come from the click objects themselves, so a new option is covered as soon as it
exists (and a parameter type this file knows no bad values for fails the test until it does).
"""

from __future__ import annotations

import click
import pytest

from readfence.cli import COMMANDS, _engine_cmd, _params, main

# a valid SPEC for commands that require one, so that only the option under test is wrong
NEEDS_SPEC = {"plan": ["paged"], "verify": ["paged"]}


def _command(name: str) -> click.Command:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    return command


def _bad_values(param: click.Parameter) -> list[str]:
    """Wrong type, out of range, unknown choice: values the parameter must refuse."""
    kind = param.type
    if isinstance(kind, _params.Positive):
        return ["many", "2.5", "0", "-3"] + ([str(kind.at_most + 1)] if kind.at_most else [])
    if isinstance(kind, _params.Integer):
        return ["x", "1.5", ""]
    if isinstance(kind, _params.Amount):
        return ["x", "-1", str(kind.at_most * 2), "nan", "inf"] + (["2.5"] if kind.integer else [])
    if isinstance(kind, _params.Policies):
        return ["fastest", "exact,fast", ""]
    if isinstance(kind, _params.Mode):
        return ["sideways", ""]
    if isinstance(kind, _params.OneOf):
        return ["no-such-" + kind.what, kind.choices[0] + "x", ""]
    if isinstance(kind, _params.DeviceName):
        return ["tpu", ""]
    if isinstance(kind, _params.Spec):
        return ["tbo(", "nope", "eagle(paged)", ""]
    if isinstance(kind, _params.OutputFile):
        return ["x.txt", f"no/such/dir/x{kind.suffix}", f"/proc/x{kind.suffix}", "/tmp"]
    if isinstance(kind, _engine_cmd.Engine):
        return ["no_such_module_xyz:factory", "readfence.engine.reference:no_such_factory", "no-colon", ":", ""]
    if isinstance(kind, click.Choice):
        return ["no-such-choice", ""]
    if isinstance(param, click.Option) and param.is_flag:
        return []  # a flag takes no value: see the "=" case below
    pytest.fail(f"no bad values known for {param.name} of type {kind!r}: add them to _bad_values")


def _cases() -> list[tuple[str, list[str], str]]:
    """(command, argv, what the error must name) for every bad use of every parameter."""
    cases = []
    for name in COMMANDS:
        command = _command(name)
        spec = NEEDS_SPEC.get(name, [])
        for param in command.params:
            if isinstance(param, click.Option) and param.name == "help":
                continue
            if isinstance(param, click.Argument):
                what = param.human_readable_name
                cases += [(name, [value], what) for value in _bad_values(param)]
                if param.required:
                    cases.append((name, [], what))  # missing
                continue
            flag = max(param.opts, key=len)
            if param.is_flag:
                cases.append((name, [*spec, f"{flag}=1"], flag))  # a value given to a flag
                continue
            cases += [(name, [*spec, flag, value], flag) for value in _bad_values(param)]
            cases.append((name, [*spec, flag], flag))  # missing value
        cases.append((name, [*spec, "--no-such-option"], "--no-such-option"))
        cases.append((name, [*spec, "extra", "arguments"], "extra"))
    cases += [("", ["--version=3"], "--version"), ("", ["--no-such-option"], "--no-such-option"),
              ("", ["no-such-command"], "no-such-command")]
    return cases


CASES = _cases()


def test_every_command_and_option_is_covered():
    covered = {(c, what) for c, _, what in CASES}
    for name in COMMANDS:
        for param in _command(name).params:
            if param.name != "help":
                what = param.human_readable_name if isinstance(param, click.Argument) else max(param.opts, key=len)
                assert (name, what) in covered, (name, what)
    assert len(CASES) > 80


@pytest.mark.parametrize(("command", "argv", "named"), CASES,
                         ids=[" ".join([c, *a]) or "(none)" for c, a, _ in CASES])
def test_a_bad_option_is_one_error_line_naming_it(command, argv, named):
    result = click.testing.CliRunner().invoke(main, [command, *argv] if command else argv)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and named in lines[0], lines[0]
    assert "Usage:" not in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
