"""Plain fixed-width tables: the one renderer of every table readfence prints, and the one rule
that puts a message on one line (here, in the layer that imports no torch, so that the command
line's help and its bad-option errors stay light)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence


def table(rows: Sequence[Mapping[str, object]] | Sequence[Sequence[object]],
          columns: Sequence[str] | Mapping[str, str]) -> str:
    """``rows`` as left-aligned columns under a header line.

    ``columns`` are the headers (``{key: header}`` to show a row key under another name); a
    row is a mapping read by those keys (a missing key is an empty cell) or a sequence of
    cells in column order. Trailing spaces are cut.

    >>> print(table([{"policy": "COARSE", "x": 1.5}, {"policy": "EXACT", "x": 12}],
    ...             {"policy": "policy", "x": "steps/s"}))
    policy  steps/s
    COARSE  1.5
    EXACT   12
    >>> print(table([["paged", "exact"]], ["backend", "verdict"]))
    backend  verdict
    paged    exact
    """
    headers = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
    cells = [[str(row.get(key, "")) for key in headers] if isinstance(row, Mapping) else [str(c) for c in row]
             for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"table: row {i} has {len(row)} cells for {len(headers)} columns {list(headers.values())}")
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers.values())]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in [list(headers.values()), *cells])


__all__ = ["table"]


def one_line(text: str) -> str:
    """``text`` on one line: each line break, with the spaces around it, becomes one space (runs
    of spaces inside a line, as in a value a message shows, are kept).

    >>> one_line("refused:\\n  stage body\\n"), one_line("a  b")
    ('refused: stage body', 'a  b')
    """
    return re.sub(r"\s*[\r\n]+\s*", " ", text).strip()
