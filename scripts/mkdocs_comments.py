"""A griffe extension for the API reference: a module-level name documented by ``#:`` comments
right above its assignment (``#: The stages of one step, in execution order.``), as Sphinx reads
them, gets those comments as its docstring, so that the site shows the constant with its text."""

from __future__ import annotations

from typing import Any

import griffe


def comment_docstring(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment block that ends right above line ``lineno`` (1-based), as text.

    >>> comment_docstring(["x = 1", "#: The answer,", "#: to everything.", "ANSWER = 42"], 4)
    'The answer,\\nto everything.'
    >>> comment_docstring(["# a plain comment", "N = 3"], 2) is None
    True
    """
    found: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        found.append(lines[i].lstrip()[2:].strip())
        i -= 1
    return "\n".join(reversed(found)) or None


class CommentDocstrings(griffe.Extension):
    """Gives each module attribute without a docstring its ``#:`` comments (module docstring)."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None or not attr.parent or not attr.parent.is_module:
            return
        try:
            lines = attr.lines_collection[attr.filepath]  # type: ignore[index]
        except (KeyError, TypeError):
            return
        text = comment_docstring(list(lines), attr.lineno)
        if text is not None:
            attr.docstring = griffe.Docstring(text, lineno=attr.lineno, parent=attr)
