"""The ``readfence`` command: ``demo``, ``plan``, ``audit``, ``verify``, ``serve`` and ``bench``.

Each command's module (and torch with it) is imported only when that command runs, so
``readfence --help`` and ``--version`` answer at once.

>>> from click.testing import CliRunner
>>> result = CliRunner().invoke(main, ["--version"])
>>> result.output.startswith("readfence, version ")
True
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from readfence import __version__
from readfence.effects import ReadfenceError

from ._errors import OneLineErrors, Refused

#: The exit status of a command interrupted by Ctrl-C (SIGINT): 128 + 2, as Python's own.
INTERRUPTED = 130

# name -> (module, attribute, the line ``readfence --help`` shows; a test keeps it equal to
# the command's own docstring)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("._demo_cmd", "demo", "Run the tiny model's overlapped decode loop under each fence policy."),
    "plan": ("._plan_cmd", "plan", "Show how SPEC's read effect in MODE is derived and where each policy fences it."),
    "audit": ("._audit_cmd", "audit",
              "Trace SPEC (default: every reference backend) and check its declared read ends."),
    "verify": ("._verify_cmd", "verify_cmd",
               "Audit SPEC, then check each policy's fences at run time, against the serial run."),
    "serve": ("._serve_cmd", "serve", "Run SPEC's serving loop: arrivals, changing batches, prefill between decodes."),
    "bench": ("._bench_cmd", "bench", "Run the benchmarks (from the source checkout) and print their ratios."),
}


class _LazyGroup(OneLineErrors, click.Group):
    """A group whose commands are imported when one is asked for, not when the group is (and
    whose bad options and unknown commands are one ``Error:`` line, as the commands' are)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute, _ = COMMANDS[cmd_name]
        command: Any = getattr(importlib.import_module(module, __name__), attribute)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ReadfenceError as e:
            if isinstance(e, click.ClickException):  # bad input: already one line, exit status 2
                raise
            raise Refused(e) from None  # a refusal, a timeout, a failed rank: one line, exit status 1
        except KeyboardInterrupt:
            # Ctrl-C: the status of a process SIGINT ended (128 + 2), as Python's own; not 1 (a finding)
            click.echo("\nInterrupted", err=True)
            sys.exit(INTERRUPTED)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, _, short) in COMMANDS.items()])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="readfence")
def main() -> None:
    """readfence: exact, sound fences for shared buffers read during graph replay.

    \b
    Start with `readfence demo`; `readfence plan SPEC` shows where fences go and why,
    `readfence audit` checks declarations against traced code, `readfence verify SPEC`
    checks the fences at run time (poison on release, a write guard, a read observer),
    `readfence serve SPEC` runs them as an engine does (arrivals, a graph per batch size).
    """


__all__ = ["main"]
