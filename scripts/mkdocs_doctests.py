"""A griffe extension for the API reference: fences each docstring's doctest examples as ``pycon``
code, so that ``>>> x[0][1]`` is shown as code, not read as markdown (a link, emphasis), and
expands ``__all__`` lists built from other modules' ``__all__``."""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with every doctest block (``>>>`` lines, their ``...`` continuations and their
    output up to a blank line) put in a fenced ``pycon`` block at the block's indentation.

    >>> print(fence_doctests("Adds.\\n\\n>>> 1 + 1\\n2\\n\\nDone."))
    Adds.
    <BLANKLINE>
    ```pycon
    >>> 1 + 1
    2
    ```
    <BLANKLINE>
    Done.
    """
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctests of every docstring griffe loads, and expands an ``__all__`` built from
    subpackages' (``readfence.graph``'s) so that its names are the package's public API."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        def walk(module: griffe.Module) -> None:
            for sub in module.modules.values():
                if not sub.is_alias:
                    walk(sub)
            loader.expand_exports(module)

        walk(pkg)

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
