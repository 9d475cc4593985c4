"""``--cases MODULE:ATTR``: the race cases a name points at, written outside readfence.

``ATTR`` (dotted, then any ``[KEY]`` subscripts, as ``--engine`` takes) is a :class:`Case`, a list,
tuple or mapping of them, or a function with no required argument returning any of these.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from readfence.engine.internal import load_attribute

from ._case import Case


def _cases(value: Any, where: str) -> list[Case]:
    if isinstance(value, Case):
        return [value]
    if isinstance(value, Mapping):
        return [c for k, v in value.items() for c in _cases(v, f"{where}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [c for i, v in enumerate(value) for c in _cases(v, f"{where}[{i}]")]
    if callable(value):
        try:
            inspect.signature(value).bind()
        except TypeError as e:
            raise ValueError(f"{where} is a function that takes arguments ({e}): name a readfence.races.Case, a list "
                             f"or mapping of them, or a function of no argument returning them") from e
        except ValueError:  # no signature to read (a builtin): calling it says
            pass
        try:
            made = value()
        except Exception as e:
            raise ValueError(f"{where}() raised {type(e).__name__}: {e}") from e
        if callable(made) and not isinstance(made, Case):
            raise ValueError(f"{where}() returned {made!r}, a function: return the cases themselves")
        return _cases(made, f"{where}()")
    raise ValueError(f"{where} is {value!r} ({type(value).__name__}): name a readfence.races.Case, a list or mapping of "
                     f"them, or a function of no argument returning them")


def load_cases(text: str) -> list[Case]:
    """The cases ``MODULE:ATTR`` names (see the module docstring); ``ValueError`` says what is wrong.

    >>> [c.name for c in load_cases("readfence.races:CASES")][-1]
    'vllm-one-input-buffer'
    >>> load_cases("readfence.races:score")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: readfence.races:score is a function that takes arguments (...): name a readfence.races.Case, ...
    """
    value, name = load_attribute(text, option="--cases", takes="MODULE:ATTR", example="mycases:CASES")
    found = _cases(value, name)
    if not found:
        raise ValueError(f"{name} holds no case: name a readfence.races.Case or a non-empty list of them")
    names = [c.name for c in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{name}: case names must differ, {', '.join(map(repr, twice))} is given twice")
    return found
