"""One error style for the command line: ``Error: <what was wrong>`` on one line, exit status 2
for bad input, 1 for what readfence found.

:class:`InputError` is that error for bad input; :class:`Refused` carries any other of
readfence's own errors (a refused backend, a device timeout) out of a command the same way. :class:`OneLineErrors` turns click's own usage errors (an
option given no value, an unknown option or command, a missing or extra argument, a value
click's types refuse) into it: no usage banner, the option named. Imports neither torch nor a
command module (the group uses it too).

>>> import click
>>> @click.command(cls=OneLineCommand)
... @click.option("--steps", type=int)
... @click.option("--json", "as_json", is_flag=True)
... def cmd(steps, as_json):
...     pass
>>> for args in (["--steps"], ["--stpes", "3"], ["--device", "3"], ["extra"], ["--steps", "1", "--steps", "2"],
...              ["--json", "--json"]):
...     try:
...         cmd.main(args, prog_name="demo", standalone_mode=False)
...     except InputError as e:
...         print(e.message)
--steps needs a value: an integer
unknown option --stpes (did you mean --steps?); see `demo --help`
unknown option --device; demo takes --steps, --json; see `demo --help`
unexpected extra argument 'extra'; see `demo --help`
--steps given twice ('1', then '2'): give it once
--json given twice: give it once

A command can check its options in two phases, so that bad input is found before anything heavy
is imported: the parameter types convert what they can check cheaply, and a type with a
``resolve(value, param, ctx)`` method finishes the conversion after every option has passed
(a spec is parsed, a module imported, a mode looked up); ``precheck(params)``, given as
``@click.command(cls=OneLineCommand, precheck=...)``, checks combinations of options in between.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import click

from readfence.effects import ReadfenceError
from readfence.effects.internal import one_line as one_line_text


class InputError(ReadfenceError, click.ClickException):
    """Bad input: one ``Error: ...`` line on stderr, exit status 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(one_line_text(message))


class Refused(ReadfenceError, click.ClickException):
    """One of readfence's own errors (a :class:`ReadfenceError` other than bad input) reaching a
    command: ``Error: <its class>: <its message>`` on one line, exit status 1, no traceback.

    >>> from readfence.effects import UnwrapError
    >>> from returns.result import Failure
    >>> e = Refused(UnwrapError(Failure("no backend")))
    >>> e.message, e.exit_code
    ('UnwrapError: unwrap() of a failure: no backend', 1)
    """

    exit_code = 1

    def __init__(self, error: ReadfenceError) -> None:
        super().__init__(one_line_text(f"{type(error).__name__}: {error}"))
        self.error = error


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
        # --help is close to anything short: it is no suggestion (the hint already points there)
        close = [p for p in error.possibilities or () if p not in ("--help", "-h")]
        if close:
            return InputError(f"unknown option {error.option_name} (did you mean {', '.join(close)}?){see}")
        options = _options(ctx)
        takes = f"; {ctx.info_name if ctx is not None else 'it'} takes {', '.join(options)}" if options else ""
        return InputError(f"unknown option {error.option_name}{takes}{see}")
    if isinstance(error, click.BadOptionUsage):
        # click's parser raises this for an option that takes a value and has too few tokens
        # left, and for ``--flag=value``: the option's kind tells which, not the message's words
        param = _find(ctx, error.option_name)
        if isinstance(param, click.Option) and not param.is_flag and not param.count:
            return InputError(f"{error.option_name} needs a value: {expects(param)}")
        return InputError(f"invalid {error.option_name}: {error.message[:1].lower()}{error.message[1:].rstrip('.')}")
    if isinstance(error, click.MissingParameter):
        return InputError(f"missing {param_name(error.param)}: {expects(error.param)}{see}")
    if isinstance(error, click.BadParameter):
        shown = param_name(error.param) if error.param is not None else (error.param_hint or "value")
        return InputError(f"invalid {shown}: {error.message.rstrip('.')}")
    message = error.message.rstrip(".")
    command = getattr(error, "command_name", None)  # click >= 8.2 raises NoSuchCommand
    if command:
        group = ctx.command if ctx is not None else None
        known = ", ".join(group.list_commands(ctx)) if isinstance(group, click.Group) and ctx is not None else ""
        names = difflib.get_close_matches(command, known.split(", "), n=2)
        hint = f" (did you mean {' or '.join(names)}?)" if names else ""
        return InputError(f"unknown command {command!r}{hint}; commands: {known}")
    return InputError(f"{message[:1].lower()}{message[1:]}{see}")


def _options(ctx: click.Context | None) -> list[str]:
    """The options a command takes, as the user writes them (``--help`` left out)."""
    params = ctx.command.params if ctx is not None else []
    return [max(p.opts, key=len) for p in params if isinstance(p, click.Option) and p.name != "help"]


class MissingCommand(InputError):
    """A group run without a command: its usage on stdout, then one ``Error:`` line."""

    def __init__(self, ctx: click.Context) -> None:
        group = ctx.command
        names = group.list_commands(ctx) if isinstance(group, click.Group) else []
        super().__init__(f"missing command; commands: {', '.join(names)} (`{ctx.command_path} COMMAND --help` "
                         "says what each takes)")
        self.ctx = ctx

    def show(self, file: Any = None) -> None:
        click.echo(self.ctx.get_help())
        super().show(file)


def _shown_twice(param: click.Parameter, values: list[str], uses: int) -> str:
    name = param_name(param)
    times = "twice" if uses == 2 else f"{uses} times"
    if getattr(param, "is_flag", False):  # a flag carries no value to show
        return f"{name} given {times}: give it once"
    shown = ", then ".join(repr(v) for v in values[:3]) + (", ..." if len(values) > 3 else "")
    return f"{name} given {times} ({shown}): give it once"


class OneLineErrors:
    """Mixin for click commands and groups: click's usage errors become one-line
    :class:`InputError` (parse errors of the command itself, and unknown sub-commands); an
    option that takes one value and is given several times is refused, not silently the last."""

    def __init__(self, *args: Any, precheck: Callable[[dict[str, Any]], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.precheck = precheck

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)  # type: ignore[misc]
        except click.exceptions.NoArgsIsHelpError as e:
            raise MissingCommand(e.ctx) from None
        except click.UsageError as e:  # the parser's errors carry no context: make one to name the command
            ctx = e.ctx or click.Context(self, info_name=info_name, parent=parent)  # type: ignore[arg-type]
            raise one_line(e, ctx) from None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given: dict[str, list[click.Parameter]] = {}
        argv = list(args)  # the parser consumes its list
        if not isinstance(self, click.Group):
            try:  # a dry run of the parser, for the order the options came in (repeats included)
                _, _, order = self.make_parser(ctx).parse_args(args=list(argv))  # type: ignore[attr-defined]
            except click.UsageError:
                order = []  # the real parse below reports it
            for param in order:
                if isinstance(param, click.Option) and not (param.multiple or param.count):
                    given.setdefault(param.name or "", []).append(param)
        # extra arguments are let through click's parse and refused here, from the list itself
        allowed, ctx.allow_extra_args = ctx.allow_extra_args, True
        try:
            rest: list[str] = super().parse_args(ctx, args)  # type: ignore[misc]
        finally:
            ctx.allow_extra_args = allowed
        for uses in given.values():
            if len(uses) > 1:
                raise InputError(_shown_twice(uses[0], _values(uses[0], argv), len(uses)))
        if rest and not allowed and not isinstance(self, click.Group) and not ctx.resilient_parsing:
            raise InputError(f"unexpected extra argument{'s' if len(rest) > 1 else ''} "
                             f"{', '.join(repr(a) for a in rest)}; see `{ctx.command_path} --help`")
        return rest

    def invoke(self, ctx: click.Context) -> Any:
        if self.precheck is not None:
            self.precheck(ctx.params)
        for param in ctx.command.params:
            resolve = getattr(param.type, "resolve", None)
            if resolve is not None and param.name in ctx.params and ctx.params[param.name] is not None:
                ctx.params[param.name] = resolve(ctx.params[param.name], param, ctx)
        return super().invoke(ctx)  # type: ignore[misc]

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)  # type: ignore[misc]
        except click.UsageError as e:
            raise one_line(e, ctx) from None


def _values(param: click.Parameter, args: list[str]) -> list[str]:
    """What ``args`` gives ``param`` each time it is used (``--x v`` and ``--x=v``)."""
    out, opts = [], set(getattr(param, "opts", ()))
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if arg in opts and i + 1 < len(args):
            out.append(args[i + 1])
        elif eq and name in opts:
            out.append(value)
    return out


class OneLineCommand(OneLineErrors, click.Command):
    """A click command whose every bad option is one ``Error:`` line (use with ``cls=``)."""


__all__ = ["InputError", "MissingCommand", "OneLineCommand", "OneLineErrors", "Refused", "expects", "one_line",
           "param_name"]
