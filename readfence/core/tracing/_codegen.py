"""Defining a generated function so that a traceback through it shows its lines.

``exec`` of a compiled string leaves a traceback with the file name and line number but no
text; registering the source with :mod:`linecache` (as ``torch.fx`` does for its generated
``forward``) makes a failure inside a generated step issuer or batch gatherer read like one
in a source file.

>>> import traceback
>>> fail = define("fail", "def fail(x):\\n    return 1 / x\\n", {}, "<example: fail>")
>>> try:
...     fail(0)
... except ZeroDivisionError as e:
...     "return 1 / x" in "".join(traceback.format_exception(e))
True
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any


def define(name: str, source: str, scope: dict[str, Any], filename: str) -> Callable[..., Any]:
    """Execute ``source`` (which defines ``name``) in ``scope`` and return ``scope[name]``.

    ``filename`` names it in tracebacks and must be unique among generated sources (a later
    one of the same name would show in place of this one's lines).
    """
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), scope)
    fn: Callable[..., Any] = scope[name]
    return fn
