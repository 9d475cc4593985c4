"""The spec grammar's tokens, and what it says of a name it does not know: the part of the grammar
that needs no backend, so that the command line checks a spec's names before torch is imported.

The grammar and its parser are ``readfence.backends._spec``'s; it tokenizes with
:func:`tokenize` and words an unknown name with :func:`unknown_name`, as the command line does.

>>> [(t.kind, t.text) for t in tokenize("tbo(paged, x=1)")][:4]
[('name', 'tbo'), ('(', '('), ('name', 'paged'), (',', ',')]
>>> [(t.text, depth) for t, depth in called_names(tokenize('tbo(paged, select(decode=dense), pattern="x")'))]
[('tbo', 0), ('paged', 1), ('select', 1), ('dense', 2)]
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs


class _Fail(Exception):
    """A spec that does not parse, at ``position``: control flow inside the grammar, which turns it
    into its ``SpecError``."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(message)
        self.position, self.message = position, message


@attrs.frozen
class Token:
    """One token of a spec: its kind, its text, where it starts, and a literal's value."""

    kind: str  # name, int, float, string, "(", ")", ",", "=", end
    text: str
    pos: int
    value: Any = None

    def show(self) -> str:
        return "end of spec" if self.kind == "end" else repr(self.text)


def tokenize(spec: str) -> list[Token]:
    """The tokens of ``spec``, the last one ``end``; a character the grammar has no token for is an
    error at its position."""
    tokens: list[Token] = []
    i, n = 0, len(spec)
    while i < n:
        c = spec[i]
        if c.isspace():
            i += 1
        elif c in "(),=":
            tokens.append(Token(c, c, i))
            i += 1
        elif c.isalpha() or c == "_":
            j = i + 1
            while j < n and (spec[j].isalnum() or spec[j] == "_"):
                j += 1
            tokens.append(Token("name", spec[i:j], i))
            i = j
        elif c.isdigit() or (c in "-+." and i + 1 < n and (spec[i + 1].isdigit() or spec[i + 1] == ".")):
            j = i + 1
            while j < n and (spec[j].isdigit() or spec[j] in ".eE_" or
                             (spec[j] in "+-" and spec[j - 1] in "eE")):
                j += 1
            text = spec[i:j]
            try:
                tokens.append(Token("int", text, i, int(text)))
            except ValueError:
                try:
                    tokens.append(Token("float", text, i, float(text)))
                except ValueError:
                    raise _Fail(i, f"bad number {text!r}") from None
            i = j
        elif c == '"':
            j = spec.find('"', i + 1)
            if j < 0:
                raise _Fail(i, "unterminated string: expected a closing '\"'")
            tokens.append(Token("string", spec[i:j + 1], i, spec[i + 1:j]))
            i = j + 1
        else:
            raise _Fail(i, f"unexpected character {c!r}; expected a name, a literal or one of ( ) , =")
    tokens.append(Token("end", "", n))
    return tokens


def called_names(tokens: Sequence[Token]) -> Iterator[tuple[Token, int]]:
    """Each name ``tokens`` call (a backend, a combinator, a step shape), with its nesting depth: not a
    keyword (``x=``) nor a literal (``true``, ``false``)."""
    depth = 0
    for i, tok in enumerate(tokens):
        if tok.kind == "(":
            depth += 1
        elif tok.kind == ")":
            depth = max(0, depth - 1)
        elif tok.kind == "name" and tok.text not in ("true", "false") and tokens[i + 1].kind != "=":
            yield tok, depth


def unknown_name(name: str, *, depth: int, leaves: Sequence[str], combinators: Sequence[str],
                 outer: Sequence[str] = (), what: str = "") -> str:
    """What the grammar says of a backend name it does not know, at nesting ``depth``: the closest
    name, then the leaves and combinators it knows, and at the top the ``outer`` forms (``what``s:
    the step shapes) too.

    >>> print(unknown_name("pagd", depth=1, leaves=["paged"], combinators=["tbo"]))
    unknown backend 'pagd' (did you mean 'paged'?); known leaves: paged; combinators: tbo
    """
    names = [*leaves, *combinators, *(outer if depth == 0 else ())]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    shapes = f"; {what}s: {', '.join(outer)}" if outer and depth == 0 else ""
    return (f"unknown backend {name!r}{hint}; known leaves: {', '.join(sorted(leaves))}; "
            f"combinators: {', '.join(sorted(combinators))}{shapes}")


__all__ = ["Token", "called_names", "tokenize", "unknown_name"]
