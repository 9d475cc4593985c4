"""Plain fixed-width tables for terminal output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def table(rows: Sequence[Mapping[str, object]], columns: Sequence[str] | Mapping[str, str]) -> str:
    """Render ``rows`` as left-aligned columns; ``columns`` are keys (or ``{key: header}``).

    >>> print(table([{"policy": "COARSE", "x": 1.5}, {"policy": "EXACT", "x": 12}],
    ...             {"policy": "policy", "x": "steps/s"}))
    policy  steps/s
    COARSE  1.5
    EXACT   12
    """
    headers = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
    cells = [[str(row.get(key, "")) for key in headers] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers.values())]
    lines = [list(headers.values())] + cells
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
