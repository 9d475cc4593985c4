"""Every bad option of every command is one ``Error:`` line naming it, exit status 2.

The options come from the click objects themselves, so a new option is covered as soon as it
exists (and a parameter type this file knows no bad values for fails the test until it does).
"""

from __future__ import annotations

import click
import pytest

from readfence.cli import COMMANDS, _engine_cmd, _params, main

# a valid SPEC for commands that require one, so that only the option under test is wrong
NEEDS_SPEC = {"plan": ["paged"], "verify": ["paged"], "serve": ["paged"]}


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
    if isinstance(kind, _params.Rate):
        return ["x", "0", "-1", str(kind.at_most * 2), "nan", "inf", ""]
    if isinstance(kind, _params.Sizes):
        return ["x", "0", "1,,2", "1,17", "-2", ""]
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
    if isinstance(param, click.Option) and param.metavar == "MODULE:ATTR":  # loaded by the command that takes it
        return ["no-colon", ":", "", "no_such_module_xyz:CASES"]
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


# -- the group, repeats, suggestions and how values are shown --------------------------------

def test_a_bare_readfence_prints_its_usage_and_one_error_line(script):
    run = script()
    assert run.returncode == 2
    assert run.stdout.startswith("Usage: readfence [OPTIONS] COMMAND [ARGS]...")
    assert "Commands:" in run.stdout and "demo" in run.stdout
    assert run.stderr.strip().splitlines() == [
        "Error: missing command; commands: demo, plan, audit, verify, serve, bench (`readfence COMMAND --help` says what "
        "each takes)"]


@pytest.mark.parametrize(("argv", "says"), [
    (["dmeo"], "Error: unknown command 'dmeo' (did you mean demo?); commands: demo, plan, audit, verify, serve, bench"),
    (["bench", "--layers", "3"], "Error: unknown option --layers; bench takes --quick, --device, --json, --cases; see `readfence bench --help`"),
    (["demo", "--stpes", "3"], "Error: unknown option --stpes (did you mean --steps"),
    (["demo", "--spec", "paged", "--spec", "linear"], "Error: --spec given twice ('paged', then 'linear'): give it once"),
    (["demo", "--steps=3", "--steps", "4"], "Error: --steps given twice ('3', then '4'): give it once"),
    (["demo", "--json", "--json"], "Error: --json given twice: give it once"),
    (["serve", "paged", "--verify", "--verify", "--verify"], "Error: --verify given 3 times: give it once"),
    (["demo", "--spec", "   "], "Error: invalid --spec '   ': position 3: empty spec"),
    (["demo", "--trace", ""], "Error: invalid --trace '': the file name must end in .json"),
    (["demo", "--plot", ".png"], "Error: invalid --plot '.png': the file name must end in .png"),
    (["plan", "pagd"], "Error: invalid SPEC 'pagd': position 0: unknown backend 'pagd' (did you mean 'paged'?)"),
    (["demo", "--spec", "eagel(paged, paged)"], "Error: invalid --spec 'eagel(paged, paged)': position 0: unknown "
                                                "backend 'eagel' (did you mean 'eagle'?)"),
    (["verify", "paged", "--mode", "foo"], "Error: invalid --mode 'foo': unknown forward mode; allowed: decode, "
                                           "target_verify, draft_extend, extend"),
    (["verify", "eagle(paged, trtllm_mha)", "--mode", "decode"],
     "Error: --mode does not apply to the step shape 'eagle(paged, trtllm_mha, draft_steps=2)': its phases fix their "
     "own modes (draft_decode[0]:DECODE"),
    (["plan", "ngram(paged)", "--mode", "extend"], "Error: --mode does not apply to the step shape 'ngram(paged)'"),
    (["audit", "join(" * 150 + "paged" + ")" * 150], "Error: invalid SPEC 'join(join("),
    (["plan", "eagle(" + "join(" * 150 + "paged" + ")" * 150 + ", paged)"], "Error: invalid SPEC 'eagle(join("),
])
def test_errors_say_what_was_given_and_what_was_meant(cli, argv, says):
    result = click.testing.CliRunner().invoke(main, argv, prog_name="readfence")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), lines
    if "join(" * 150 in "".join(argv):  # a tree deeper than the audit walks: the limit named, no traceback
        assert "is a tree more than 100 levels deep" in lines[0], lines


def test_verify_mode_lists_only_modes_it_takes_and_idle_is_refused_with_the_reason(cli):
    listed = click.testing.CliRunner().invoke(main, ["verify", "paged", "--mode", "foo"]).output
    assert "idle" not in listed
    refused = click.testing.CliRunner().invoke(main, ["verify", "paged", "--mode", "idle"]).output.strip()
    assert refused == ("Error: invalid --mode 'idle': its steps carry no tokens, there is nothing to verify; allowed: "
                       "decode, target_verify, draft_extend, extend")


def test_a_long_value_is_shown_cut_short_with_its_length():
    spec = "paged," * 2000
    result = click.testing.CliRunner().invoke(main, ["demo", "--spec", spec])
    assert result.exit_code == 2
    line = result.output.strip()
    assert len(line) < 300 and "... (12000 characters): position 5:" in line, line


def test_the_names_checked_before_torch_are_the_librarys():
    from readfence.core import ForwardMode, ModelConfig
    from readfence.graph import DEVICE_KINDS, Policy
    from readfence.parallel import tp_sizes

    cfg = ModelConfig()
    assert _params.MODE_NAMES == tuple(m.value for m in ForwardMode)
    assert _params.POLICY_NAMES == tuple(p.value for p in Policy)
    assert _params.DEVICE_KINDS == DEVICE_KINDS
    assert (_params.MAX_BATCH, _params.TINY_HEADS, _params.TINY_MLP) == (cfg.max_reqs, cfg.heads, cfg.mlp)
    assert list(_params.TP_SIZES) == tp_sizes(cfg)
    from readfence.backends import REFERENCE_LEAVES
    from readfence.backends._spec import _COMBINATORS
    from readfence.graph.steps._shapes import STEP_SHAPES

    assert _params.LEAF_NAMES == tuple(sorted(REFERENCE_LEAVES))
    assert _params.COMBINATOR_NAMES == tuple(sorted(_COMBINATORS))
    assert _params.STEP_SHAPE_NAMES == tuple(STEP_SHAPES)


@pytest.mark.parametrize("spec", ["pagd", "tbo(paged, lineer)", "eagle(pagd, linear)", "tbo(deepseek_v4(dspark=true), x)",
                                  "select(decode=dense, default=pagedd)"])
def test_a_misspelt_name_is_refused_before_torch_in_the_parsers_own_words(spec):
    from readfence.cli._params import check_spec_names, parse_spec

    with pytest.raises(ValueError) as early:
        check_spec_names(spec)
    with pytest.raises(ValueError) as parsed:
        parse_spec(spec)  # the grammar itself, with torch
    assert str(early.value) == str(parsed.value)


# every command's --help, and a bad option of each kind, answered without importing torch
NO_TORCH = [[name, "--help"] for name in COMMANDS] + [
    ["demo", "--steps", "0"], ["demo", "--batch-size", "99"], ["demo", "--policy", "fast"], ["demo", "--tp", "3"],
    ["demo", "--device", "tpu"], ["demo", "--write-wait-ms", "-1"], ["demo", "--trace", "x.txt"],
    ["demo", "--spec", "a", "--spec", "b"], ["demo", "--tp", "2", "--plot", "x.png"],
    ["verify", "paged", "--mode", "idle"], ["verify"], ["verify", "paged", "--engine", "m:f"],
    ["audit", "--batch-size", "0"], ["audit", "--engine", "no-colon"], ["plan"], ["plan", "x", "--mode", "sideways"],
    ["bench", "nosuch"], ["bench", "--steps", "3"], ["dmeo"], [], ["plan", "pagedd"], ["audit", "tbo(paged, lineer)"],
    ["verify", "paged", "--policy", "per-buffer"], ["demo", "--spec", "eagle(pagd, linear)"],
]


@pytest.mark.parametrize("argv", NO_TORCH, ids=[" ".join(a) or "(none)" for a in NO_TORCH])
def test_help_and_bad_options_import_no_torch(argv):
    import subprocess
    import sys

    probe = ("import sys; from click.testing import CliRunner; from readfence.cli import main; "
             f"r = CliRunner().invoke(main, {argv!r}); "
             "print(r.exit_code, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    code, imported = run.stdout.split()
    assert code == ("0" if "--help" in argv else "2") and imported == "False", (argv, run.stdout)
