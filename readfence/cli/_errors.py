"""One error style for the command line: ``Error: <what was wrong>`` on one line, exit status 2.

:class:`InputError` is that error. :class:`OneLineErrors` turns click's own usage errors (an
option given no value, an unknown option or command, a missing or extra argument, a value
click's types refuse) into it: no usage banner, the option named. Imports neither torch nor a
command module (the group uses it too).

>>> import click
>>> @click.command(cls=OneLineCommand)
... @click.option("--steps", type=int)
... def cmd(steps):
...     pass
>>> for args in (["--steps"], ["--stpes", "3"], ["extra"]):
...     try:
...         cmd.main(args, prog_name="demo", standalone_mode=False)
...     except InputError as e:
...         print(e.message)
--steps needs a value: an integer
unknown option --stpes (did you mean --steps?); see `demo --help`
unexpected extra argument 'extra'; see `demo --help`
"""

from __future__ import annotations

from typing import Any

import click


class InputError(click.ClickException):
    """Bad input: one ``Error: ...`` line on stderr, exit status 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the message held


def expects(param: click.Parameter | None) -> str:
    """What ``param`` takes, in words: its type's ``expects``, else click's type name.

    >>> expects(click.Option(["--seed"], type=int)), expects(click.Option(["--x"], type=click.Choice(["a", "b"])))
    ('an integer', 'one of a, b')
    """
    kind = getattr(param, "type", None)
    text = getattr(kind, "expects", None)
    if text:
        return text
    if isinstance(kind, click.Choice):
        return "one of " + ", ".join(map(str, kind.choices))
    name = getattr(kind, "name", "value")
    return {"integer": "an integer", "float": "a number", "text": "a text", "boolean": "true or false"}.get(name, name)


def param_name(param: click.Parameter | None) -> str:
    """How the user writes ``param``: its longest option name, or the argument's metavar."""
    if param is None:
        return "value"
    if isinstance(param, click.Argument):
        return param.human_readable_name
    return max(param.opts, key=len)


def _find(ctx: click.Context | None, name: str | None) -> click.Parameter | None:
    params = ctx.command.params if ctx is not None else []
    return next((p for p in params if name in getattr(p, "opts", ()) or p.name == name), None)


def one_line(error: click.UsageError, ctx: click.Context | None = None) -> InputError:
    """The :class:`InputError` saying what ``error`` (one of click's) says, in this style."""
    ctx = error.ctx or ctx
    where = ctx.command_path if ctx is not None else "readfence"
    see = f"; see `{where} --help`"
    if isinstance(error, click.NoSuchOption):
        hint = f" (did you mean {', '.join(error.possibilities)}?)" if error.possibilities else ""
        return InputError(f"unknown option {error.option_name}{hint}{see}")
    if isinstance(error, click.BadOptionUsage):
        param = _find(ctx, error.option_name)
        if "requires" in error.message and "argument" in error.message:
            return InputError(f"{error.option_name} needs a value: {expects(param)}")
        return InputError(f"invalid {error.option_name}: {error.message[:1].lower()}{error.message[1:].rstrip('.')}")
    if isinstance(error, click.MissingParameter):
        return InputError(f"missing {param_name(error.param)}: {expects(error.param)}{see}")
    if isinstance(error, click.BadParameter):
        shown = param_name(error.param) if error.param is not None else (error.param_hint or "value")
        return InputError(f"invalid {shown}: {error.message.rstrip('.')}")
    message = error.message.rstrip(".")
    if message.startswith("Got unexpected extra argument"):
        extra = message.partition("(")[2].rstrip(")")
        return InputError(f"unexpected extra argument{'s' if ' ' in extra else ''} "
                          f"{', '.join(repr(a) for a in extra.split())}{see}")
    command = getattr(error, "command_name", None)  # click >= 8.2 raises NoSuchCommand
    if command:
        group = ctx.command if ctx is not None else None
        known = ", ".join(group.list_commands(ctx)) if isinstance(group, click.Group) and ctx is not None else ""
        names = getattr(error, "possibilities", None)
        hint = f" (did you mean {', '.join(names)}?)" if names else ""
        return InputError(f"unknown command {command!r}{hint}; commands: {known}")
    return InputError(f"{message[:1].lower()}{message[1:]}{see}")


class OneLineErrors:
    """Mixin for click commands and groups: click's usage errors become one-line
    :class:`InputError` (parse errors of the command itself, and unknown sub-commands)."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)  # type: ignore[misc]
        except click.UsageError as e:  # the parser's errors carry no context: make one to name the command
            ctx = e.ctx or click.Context(self, info_name=info_name, parent=parent)  # type: ignore[arg-type]
            raise one_line(e, ctx) from None

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)  # type: ignore[misc]
        except click.UsageError as e:
            raise one_line(e, ctx) from None


class OneLineCommand(OneLineErrors, click.Command):
    """A click command whose every bad option is one ``Error:`` line (use with ``cls=``)."""


__all__ = ["InputError", "OneLineCommand", "OneLineErrors", "expects", "one_line", "param_name"]
