"""Every command's ``--mode`` help names exactly the modes the command takes, and a mode a command
refuses is refused with the reason and the modes it takes instead."""

from __future__ import annotations

import re

import click
import pytest

from readfence.cli._params import MODE_NAMES

COMMANDS = ["audit", "plan", "verify"]


def _mode_option(name: str) -> click.Option:
    import importlib

    module = importlib.import_module(f"readfence.cli._{name}_cmd")
    command = next(v for v in vars(module).values() if isinstance(v, click.Command) and v.name == name)
    return next(p for p in command.params if isinstance(p, click.Option) and "--mode" in p.opts)


def _accepted(option: click.Option) -> set[str]:
    taken = set()
    for mode in MODE_NAMES:
        try:
            option.type.convert(mode, option, None)
        except click.ClickException:  # (the one-line InputError among them)
            continue
        taken.add(mode)
    return taken


@pytest.mark.parametrize("name", COMMANDS)
def test_the_help_names_the_modes_the_command_takes(name: str) -> None:
    option = _mode_option(name)
    help_text = option.help or ""
    named = {m for m in MODE_NAMES if re.search(rf"\b{m}\b", help_text)}
    assert named == _accepted(option), (name, help_text)


def test_verify_refuses_idle_saying_why_and_what_it_takes(cli) -> None:
    result = cli("verify", "paged", "--mode", "idle")
    assert result.exit_code == 2
    assert "its steps carry no tokens" in result.output and "allowed: decode, target_verify, draft_extend, extend" in result.output


def test_an_engine_audit_refuses_idle_as_its_help_says(cli) -> None:
    assert "--engine takes the other four" in (_mode_option("audit").help or "")
    result = cli("audit", "--engine", "tests.engine.cli_engines:triton", "--mode", "idle")
    assert result.exit_code == 2, result.output
    assert "its steps carry no tokens" in result.output and "allowed: decode, target_verify, draft_extend, extend" in result.output
