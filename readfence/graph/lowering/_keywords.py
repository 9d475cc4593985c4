"""The message a function that takes its options as records gives for a keyword it does not
take: the closest keyword it takes, or the record that keyword goes in (``lower`` and every
function that lowers for you, the loops and ``verify``: one rule, one place)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar, overload

import attrs

from readfence.core.internal import did_you_mean

from ._options import LowerOptions

T = TypeVar("T")
P = ParamSpec("P")


def unexpected_keyword(caller: str, name: str, taken: Sequence[str], record: type | None = None) -> str:
    """What ``caller`` says of a keyword ``name`` it does not take (it takes ``taken``, and its
    options are a ``record``, an attrs class whose ``option_kind`` says what its fields are): the
    closest one it takes; for a field of its record or of :class:`LowerOptions`, the record it
    goes in; for a ``_ms`` one, the unit (in Python durations are seconds, on the command line
    milliseconds).

    >>> from readfence.graph import LoopOptions
    >>> print(unexpected_keyword("run_overlapped", "write_wait_ms", ["steps", "options"], LoopOptions))  # doctest: +NORMALIZE_WHITESPACE
    run_overlapped() got an unexpected keyword argument 'write_wait_ms'; it is a loop option in seconds:
    pass options=LoopOptions(write_wait_s=0.005) for the command line's --write-wait-ms 5
    >>> print(unexpected_keyword("run_overlapped", "seed", ["steps", "options"], LoopOptions))
    run_overlapped() got an unexpected keyword argument 'seed'; it is a loop option: pass options=LoopOptions(seed=...)
    >>> print(unexpected_keyword("lower", "ring_size", ["policy", "lowering"]))
    lower() got an unexpected keyword argument 'ring_size'; it is a lowering option: pass lowering=LowerOptions(ring_size=...)
    """
    fields = () if record is None else tuple(attrs.fields_dict(record))
    kind = getattr(record, "option_kind", "an option")
    hint = did_you_mean(name, sorted(taken))
    seconds = f"{name[:-3]}_s"
    if name.endswith("_ms") and seconds in taken:
        hint = (f"; did you mean {seconds!r}? (seconds in Python: {seconds}=0.005 is the command line's "
                f"--{name.replace('_', '-')} 5)")
    elif name.endswith("_ms") and seconds in fields and record is not None:
        hint = (f"; it is {kind} in seconds: pass options={record.__name__}({seconds}=0.005) for the command "
                f"line's --{name.replace('_', '-')} 5")
    elif name in fields and record is not None:
        hint = f"; it is {kind}: pass options={record.__name__}({name}=...)"
    elif name in attrs.fields_dict(LowerOptions) and "lowering" in taken:
        hint = f"; it is a lowering option: pass lowering=LowerOptions({name}=...)"
    return f"{caller}() got an unexpected keyword argument {name!r}{hint}"


@overload
def names_keywords(fn: Callable[P, T], *, options: type | None = None) -> Callable[P, T]: ...
@overload
def names_keywords(fn: None = None, *, options: type | None = None) -> Callable[[Callable[P, T]], Callable[P, T]]: ...


def names_keywords(fn: Callable[P, T] | None = None, *,
                   options: type | None = None) -> Callable[P, T] | Callable[[Callable[P, T]], Callable[P, T]]:
    """``fn``, refusing a keyword it does not take with :func:`unexpected_keyword`'s message
    (Python's own names neither the closest keyword, nor the record it belongs in, nor the
    unit) before it runs. ``options`` is the record ``fn`` takes as ``options=``:
    ``@names_keywords(options=LoopOptions)``."""
    if fn is None:
        return functools.partial(names_keywords, options=options)
    taken = tuple(inspect.signature(fn).parameters)
    inner = fn

    @functools.wraps(inner)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        for name in kwargs:
            if name not in taken:
                raise TypeError(unexpected_keyword(inner.__name__, name, taken, options))
        return inner(*args, **kwargs)

    return checked
