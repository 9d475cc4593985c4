"""The one base of every error readfence raises on purpose.

Each of readfence's errors also keeps the built-in class its callers have always caught
(``ValueError`` for a refused declaration, ``TimeoutError`` for a device wait, ...), so catching
``ReadfenceError`` is a way to tell readfence's verdicts from a bug anywhere else:

>>> from readfence.effects import ReadfenceError
>>> from readfence.graph import UnsoundLowering
>>> issubclass(UnsoundLowering, ReadfenceError), issubclass(UnsoundLowering, ValueError)
(True, True)
>>> issubclass(KeyError, ReadfenceError)
False
"""

from __future__ import annotations


class ReadfenceError(Exception):
    """An error readfence raises on purpose: a refused program, a bad input, a device timeout.

    Its message names what was wrong (backend, mode, buffer, stage, spec position).
    """


__all__ = ["ReadfenceError"]
