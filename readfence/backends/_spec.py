"""The spec grammar: ``tbo(deepseek_v4(dspark=false), paged)`` -> ``Backend``, and the calls
other layers build on it (the speculative step shapes: ``eagle(paged, trtllm_mha, draft_steps=2)``).

Grammar (whitespace is free; a call without arguments may drop the ``()``; a trailing comma
is allowed)::

    spec    := call END
    call    := NAME [ "(" [ arg ("," arg)* [","] ] ")" ]
    arg     := call | NAME "=" value
    value   := call | INT | FLOAT | "true" | "false" | STRING

What a name accepts is its :class:`CallForm`: how many positional backends, which keywords
of which type (or int range). The leaves and combinators are the backend forms; ``parse_call``
takes more forms for the outermost call only (the step shapes register theirs), so there is
one grammar, one parser and one error type for every spec.

A hand-written tokenizer and an explicit-stack parser: no ``eval``, no recursion, linear time;
nesting deeper than ``max_depth`` is an error. Every failure is a :class:`SpecError` naming the
position and what was expected (or which names / keywords exist).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from returns.result import Result

from readfence.core import ForwardMode
from readfence.core.internal import did_you_mean
from readfence.effects import Failure, Success  # unwrap() says why; neither is a bool
from readfence.effects.internal import Token, _Fail, tokenize, unknown_name

from ._backend import Backend
from ._combinators import hybrid, hybrid_linear, join, minimax, per_stream, select, tbo
from ._leaves import REFERENCE_LEAVES

#: Deepest nesting ``parse`` accepts by default.
MAX_DEPTH = 1000


@attrs.frozen
class SpecError:
    """Why a spec did not parse: ``position`` (0-based character offset), ``message``, ``spec``.

    >>> err = parse("tbo(").failure()
    >>> err.position, err.message
    (4, 'expected a backend name, found end of spec')
    >>> print(err)
    position 4: expected a backend name, found end of spec
      tbo(
          ^
    """

    position: int
    message: str
    spec: str

    def __str__(self) -> str:
        start = max(0, self.position - 60)
        excerpt = self.spec[start:self.position + 60]
        lead = "..." if start else ""
        return (f"position {self.position}: {self.message}\n  {lead}{excerpt}\n"
                f"  {' ' * (len(lead) + self.position - start)}^")


# -- forms: what each name accepts -----------------------------------------------------------

_LITERAL_TYPES: dict[type, str] = {bool: "true or false", int: "an int", float: "a number", str: "a string"}

#: What a keyword takes: ``Backend``, a literal type (``bool``, ``int``, ``float``, ``str``), or
#: a ``range`` of ints (``range(1, 65)``: an int in 1..64).
Keyword = type | range


@attrs.frozen
class CallForm:
    """How a spec writes one call, ``name(backend, ..., key=value, ...)``, and what it builds.

    ``build(*backends, **keywords)`` makes the value once the parser has checked the call:
    between ``min_args`` and ``max_args`` (``None``: no limit) positional backends, only the
    ``keywords`` listed, each of its :data:`Keyword` type, and every ``required`` one. ``usage``
    is shown when the call is wrong. Calling the form calls ``build``.

    >>> form = CallForm(lambda *backends, steps=1: (len(backends), steps), 1, None,
    ...                 {"steps": range(1, 9)}, usage="repeat(backend, ..., steps=N)")
    >>> parse_call("repeat(paged, linear, steps=3)", {"repeat": form}, what="repeat").unwrap()
    (2, 3)
    >>> print(parse_call("repeat(paged, steps=0)", {"repeat": form}, what="repeat").failure())
    position 20: repeat(steps=...) expects an int in 1..8, got 0
      repeat(paged, steps=0)
                          ^
    """

    build: Callable[..., Any]
    min_args: int = 0
    max_args: int | None = 0
    keywords: Mapping[str, Keyword] = attrs.field(factory=dict)
    required: tuple[str, ...] = ()
    usage: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.build(*args, **kwargs)


def _leaf_form(name: str, ctor: Callable[..., Backend]) -> CallForm:
    keywords: dict[str, Keyword] = {}
    try:
        params = list(inspect.signature(ctor).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty:
            keywords[p.name] = type(p.default)
    return CallForm(ctor, keywords=keywords, usage=name)


def _select(**kw: Backend) -> Backend:
    default = kw.pop("default", None)
    return select({ForwardMode(k): v for k, v in kw.items()}, default=default)


_COMBINATORS: dict[str, CallForm] = {
    "select": CallForm(_select, keywords={**{m.value: Backend for m in ForwardMode}, "default": Backend},
                       usage="select(decode=..., extend=..., default=...)"),
    "hybrid": CallForm(hybrid, keywords=dict.fromkeys(("decode", "prefill", "verify", "draft_extend"), Backend),
                       required=("decode", "prefill"), usage="hybrid(decode=..., prefill=...)"),
    "join": CallForm(join, 1, None, usage="join(backend, ...)"),
    "tbo": CallForm(tbo, 1, None, usage="tbo(primary, *children)"),
    "per_stream": CallForm(per_stream, 1, None, usage="per_stream(backend, ...)"),
    "hybrid_linear": CallForm(hybrid_linear, 1, None, {"pattern": str}, usage='hybrid_linear(backend, ..., pattern="0111")'),
    "minimax": CallForm(minimax, 2, 2, usage="minimax(sparse, dense)"),
}


def _describe(expected: Keyword) -> str:
    if isinstance(expected, range):
        return f"an int in {expected.start}..{expected[-1]}" if len(expected) else "an int in an empty range"
    return _LITERAL_TYPES.get(expected, expected.__name__)


def _check_value(name: str, key: str, expected: Keyword, value: Any, pos: int) -> Any:
    if expected is Backend:
        if not isinstance(value, Backend):
            raise _Fail(pos, f"{name}({key}=...) expects a backend, got {_show_literal(value)}")
        return value
    if isinstance(value, Backend):
        raise _Fail(pos, f"{name}({key}=...) expects {_describe(expected)}, got the backend {value}")
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(expected, range):
        ok = is_int and value in expected
    else:
        ok = (isinstance(value, expected) and not (expected is int and isinstance(value, bool))) or (
            expected is float and is_int)
    if not ok:
        raise _Fail(pos, f"{name}({key}=...) expects {_describe(expected)}, got {_show_literal(value)}")
    return float(value) if expected is float else value


def _show_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


@attrs.define
class _Frame:
    name: str
    pos: int
    form: CallForm
    args: list[tuple[Backend, int]] = attrs.field(factory=list)
    kwargs: dict[str, tuple[Any, int]] = attrs.field(factory=dict)
    key: str | None = None
    key_pos: int = 0


def _close(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``names``, else ``""``."""
    hint = did_you_mean(name, names)
    return f" ({hint.removeprefix('; ')})" if hint else ""


class _Parser:
    """One parse of ``spec``: the backend forms (combinators and ``leaves``), and the ``outer``
    forms the outermost call may be (a ``what``, e.g. a step shape), or a backend as well when
    ``or_backend``."""

    def __init__(self, spec: str, leaves: Mapping[str, Callable[..., Backend]], max_depth: int,
                 outer: Mapping[str, CallForm], what: str, or_backend: bool) -> None:
        self.spec, self.max_depth = spec, max_depth
        self.forms: dict[str, CallForm] = dict(_COMBINATORS)
        for name, ctor in leaves.items():
            if name in _COMBINATORS:
                raise ValueError(f"leaf name {name!r} is a combinator")
            if name in outer:
                raise ValueError(f"leaf name {name!r} is a {what}")
            self.forms[name] = _leaf_form(name, ctor)
        self.leaf_names = sorted(leaves)
        self.outer, self.what, self.or_backend = outer, what, or_backend or not outer

    def form(self, tok: Token, depth: int) -> CallForm:
        name = tok.text
        if name in self.outer:
            if depth:
                raise _Fail(tok.pos, f"{name} is a {self.what}: it can only be the whole spec, not an argument "
                                     "(its arguments are backends)")
            return self.outer[name]
        form = self.forms.get(name)
        if form is not None and (depth or self.or_backend):
            return form
        outer = ", ".join(self.outer)
        if depth == 0 and not self.or_backend:
            if form is None:
                raise _Fail(tok.pos, f"unknown {self.what} {name!r}{_close(name, self.outer)}; "
                                     f"{self.what}s: {outer}")
            raise _Fail(tok.pos, f"expected a {self.what} ({outer}), found the backend {name!r}")
        raise _Fail(tok.pos, unknown_name(name, depth=depth, leaves=self.leaf_names, combinators=list(_COMBINATORS),
                                          outer=list(self.outer), what=self.what))

    def build(self, frame: _Frame) -> Any:
        form, name = frame.form, frame.name
        args = [b for b, _ in frame.args]
        if len(args) < form.min_args or (form.max_args is not None and len(args) > form.max_args):
            if form.max_args == 0:
                raise _Fail(frame.args[0][1], f"{name} takes no positional arguments; usage: {form.usage}"
                            + self._allowed(form))
            want = (f"exactly {form.min_args}" if form.min_args == form.max_args
                    else f"at least {form.min_args}" if form.max_args is None
                    else f"{form.min_args} to {form.max_args}")
            raise _Fail(frame.pos, f"{name} needs {want} backend argument(s), got {len(args)}; "
                                   f"usage: {form.usage}")
        kwargs = {}
        for key, (value, pos) in frame.kwargs.items():
            kwargs[key] = _check_value(name, key, form.keywords[key], value, pos)
        missing = [k for k in form.required if k not in kwargs]
        if missing:
            raise _Fail(frame.pos, f"{name} needs {', '.join(k + '=' for k in missing)}; usage: {form.usage}")
        try:
            return form.build(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise _Fail(frame.pos, f"bad arguments for {name}: {exc}") from None

    @staticmethod
    def _allowed(form: CallForm) -> str:
        return f"; allowed keywords: {', '.join(sorted(form.keywords)) or '(none)'}"

    def parse(self) -> Any:
        tokens = tokenize(self.spec)
        stack: list[_Frame] = []
        i = 0
        state = "value"
        value: Any = None
        value_pos = 0
        while True:
            tok = tokens[i]
            if state == "arg":
                frame = stack[-1]
                if tok.kind == "name" and tokens[i + 1].kind == "=":
                    if tok.text not in frame.form.keywords:
                        raise _Fail(tok.pos, f"{frame.name} has no keyword {tok.text!r}"
                                    + self._allowed(frame.form))
                    if tok.text in frame.kwargs:
                        raise _Fail(tok.pos, f"{frame.name}: keyword {tok.text!r} given twice")
                    frame.key, frame.key_pos = tok.text, tok.pos
                    i += 2
                elif frame.kwargs:
                    raise _Fail(tok.pos, f"{frame.name}: positional argument after keyword arguments")
                state = "value"
                continue
            if state == "value":
                in_keyword = bool(stack) and stack[-1].key is not None
                value_pos = tok.pos
                if tok.kind == "name" and tok.text not in ("true", "false"):
                    form = self.form(tok, len(stack))
                    if tokens[i + 1].kind == "(":
                        if len(stack) >= self.max_depth:
                            raise _Fail(tok.pos, f"nesting deeper than {self.max_depth} levels")
                        stack.append(_Frame(tok.text, tok.pos, form))
                        i += 2
                        if tokens[i].kind == ")":
                            i += 1
                            value = self.build(stack.pop())
                            state = "after"
                        else:
                            state = "arg"
                        continue
                    value = self.build(_Frame(tok.text, tok.pos, form))
                    i += 1
                elif in_keyword and tok.kind in ("int", "float", "string"):
                    value = tok.value
                    i += 1
                elif in_keyword and tok.kind == "name":
                    value = tok.text == "true"
                    i += 1
                else:
                    what = "a backend name or a literal" if in_keyword else "a backend name"
                    raise _Fail(tok.pos, f"expected {what}, found {tok.show()}")
                state = "after"
                continue
            # state == "after": a complete value is in hand
            if not stack:
                if tok.kind != "end":
                    raise _Fail(tok.pos, f"expected end of spec, found {tok.show()}")
                return value
            frame = stack[-1]
            if frame.key is not None:
                frame.kwargs[frame.key] = (value, value_pos)
                frame.key = None
            else:
                frame.args.append((value, value_pos))
            if tok.kind == ",":
                i += 1
                if tokens[i].kind != ")":
                    state = "arg"
                    continue
                tok = tokens[i]
            if tok.kind == ")":
                i += 1
                value_pos = frame.pos
                value = self.build(stack.pop())
                continue
            raise _Fail(tok.pos, f"expected ',' or ')' in {frame.name}(...), found {tok.show()}")


def parse(
    spec: str,
    *,
    leaves: Mapping[str, Callable[..., Backend]] | None = None,
    max_depth: int = MAX_DEPTH,
) -> Result[Backend, SpecError]:
    """Parse a backend spec; ``Success(backend)`` or ``Failure(SpecError)``, never an exception.

    ``leaves`` adds (or replaces) leaf constructors by name, e.g. your own ``leaf``; the
    reference leaves are always known.

    >>> parse("tbo(deepseek_v4(dspark=false), paged)").unwrap()
    <Backend tbo(deepseek_v4, paged)>
    >>> print(parse("paged(x=1)").failure().message)
    paged has no keyword 'x'; allowed keywords: (none)
    >>> parse("nosuch").failure().message.startswith("unknown backend 'nosuch'; known leaves: deepseek_v4, dense")
    True
    """
    return _parse(spec, leaves, max_depth, {}, "", or_backend=True)


def parse_call(
    spec: str,
    forms: Mapping[str, CallForm],
    *,
    what: str,
    or_backend: bool = False,
    leaves: Mapping[str, Callable[..., Backend]] | None = None,
    max_depth: int = MAX_DEPTH,
) -> Result[Any, SpecError]:
    """Parse a spec whose outermost call is one of ``forms`` (each a ``what``, e.g. a step
    shape), its arguments backend specs; with ``or_backend``, a backend spec is accepted too.

    The grammar, the checks and the errors are those of :func:`parse`: ``Success(value)`` or
    ``Failure(SpecError)``. A form of ``forms`` nested inside another call is an error.

    >>> form = CallForm(lambda backend: ("wrapped", str(backend)), 1, 1, usage="wrap(backend)")
    >>> parse_call("wrap(tbo(paged, linear))", {"wrap": form}, what="wrapper").unwrap()
    ('wrapped', 'tbo(paged, linear)')
    >>> parse_call("paged", {"wrap": form}, what="wrapper").failure().message
    "expected a wrapper (wrap), found the backend 'paged'"
    >>> parse_call("paged", {"wrap": form}, what="wrapper", or_backend=True).unwrap()
    <Backend paged>
    """
    return _parse(spec, leaves, max_depth, forms, what, or_backend=or_backend)


def _parse(spec: str, leaves: Mapping[str, Callable[..., Backend]] | None, max_depth: int,
           outer: Mapping[str, CallForm], what: str, *, or_backend: bool) -> Result[Any, SpecError]:
    if not isinstance(spec, str):
        return Failure(SpecError(0, f"a spec is a str, got {spec!r} ({type(spec).__name__})", repr(spec)))
    known: dict[str, Callable[..., Backend]] = dict(REFERENCE_LEAVES)
    known.update(leaves or {})
    try:
        parser = _Parser(spec, known, max_depth, outer, what, or_backend)
    except ValueError as exc:
        return Failure(SpecError(0, str(exc), spec))
    try:
        if not spec.strip():
            expected = f"a {what} name" if outer and not or_backend else "a backend name"
            raise _Fail(len(spec), f"empty spec: expected {expected}")
        return Success(parser.parse())
    except _Fail as exc:
        return Failure(SpecError(exc.position, exc.message, spec))
