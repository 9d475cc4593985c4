"""The numeric option types: positive and any integers, amounts, rates and batch-size lists, each
turning a bad value into one clean error line.

>>> BATCH_SIZE.convert("4", None, None), Sizes().convert("8,1", None, None)
(4, (1, 8))
"""

from __future__ import annotations

import math
import re
from typing import Any

import click

from ._param_base import MAX_BATCH, _fail


class Positive(click.ParamType):
    """A positive integer, at most ``at_most`` (what can still be useful: a step count past it
    would run for hours, not show more); ``bound`` says where the bound comes from.

    >>> Positive(at_most=10).convert("11", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '11': must be at most 10
    >>> BATCH_SIZE.convert("17", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '17': must be at most 16 (the tiny model serves at most 16 requests)
    """

    name = "N"

    def __init__(self, at_most: int | None = None, bound: str = "") -> None:
        self.at_most, self.bound = at_most, bound
        self.expects = "a positive integer" + ("" if at_most is None else f" up to {at_most}")

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip()
        if not (isinstance(value, int) and not isinstance(value, bool)) and not re.fullmatch(r"\+?[0-9]+", text):
            raise _fail(param, value, "must be a positive integer (1, 2, 3, ...)")
        number = int(text)
        if number <= 0:
            raise _fail(param, value, "must be a positive integer (1, 2, 3, ...)")
        if self.at_most is not None and number > self.at_most:
            raise _fail(param, value, f"must be at most {self.at_most}" + (f" ({self.bound})" if self.bound else ""))
        return number


MAX_STEPS = 100_000  # steps per run of a command: minutes on a CPU device, more shows nothing new


#: The type of ``--batch-size``: requests per step, at most what the tiny model serves.
BATCH_SIZE = Positive(at_most=MAX_BATCH, bound=f"the tiny model serves at most {MAX_BATCH} requests")


class Integer(click.ParamType):
    """Any integer (a seed).

    >>> Integer().convert(" -3 ", None, None)
    -3
    """

    name = "INTEGER"
    expects = "an integer"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip()
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise _fail(param, value, "must be an integer (..., -1, 0, 1, ...)")
        return int(text)


class Amount(click.ParamType):
    """A finite number in ``0..at_most`` (an ``int`` when ``integer``): a cost or a duration.

    >>> Amount(100.0).convert("2.5", None, None)
    2.5
    >>> Amount(100.0).convert("nan", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value 'nan': must be a number from 0 to 100
    """

    def __init__(self, at_most: float, *, integer: bool = False, unit: str = "") -> None:
        self.at_most, self.integer, self.unit = at_most, integer, unit
        self.name = "N" if integer else "X"
        self.expects = f"{'an integer' if integer else 'a number'} from 0 to {at_most:g}{unit}"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float | int:
        text = str(value).strip()
        try:
            number: float | int = int(text) if self.integer and re.fullmatch(r"[+-]?[0-9]+", text) else float(text)
        except ValueError:
            number = math.nan
        if self.integer and not isinstance(number, int):
            raise _fail(param, value, f"must be {self.expects}")
        if not (math.isfinite(number) and 0 <= number <= self.at_most):
            raise _fail(param, value, f"must be {self.expects}")
        return number


class Rate(click.ParamType):
    """A positive finite number up to ``at_most`` (requests per step of a serving loop).

    >>> Rate(16.0).convert("0.5", None, None)
    0.5
    >>> Rate(16.0).convert("0", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '0': must be a number above 0 and at most 16 (requests per step)
    """

    name = "R"

    def __init__(self, at_most: float) -> None:
        self.at_most = at_most
        self.expects = f"a number above 0 and at most {at_most:g} (requests per step)"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            number = float(str(value).strip())
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and 0 < number <= self.at_most):
            raise _fail(param, value, f"must be {self.expects}")
        return number


class Sizes(click.ParamType):
    """A comma list of batch sizes, each in ``1..MAX_BATCH``; converts to a sorted tuple.

    >>> Sizes().convert("8, 1,2,4", None, None)
    (1, 2, 4, 8)
    >>> Sizes().convert("1,x", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '1,x': 'x' is not a batch size: give a comma list of integers from 1 to 16, e.g. 1,2,4,8,16
    """

    name = "SIZES"
    expects = f"a comma list of batch sizes from 1 to {MAX_BATCH}, e.g. 1,2,4,8,16"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        sizes = set()
        for part in str(value).split(","):
            text = part.strip()
            if not re.fullmatch(r"\+?[0-9]+", text) or not 1 <= int(text) <= MAX_BATCH:
                raise _fail(param, value, f"{text!r} is not a batch size: give a comma list of integers from 1 to "
                                          f"{MAX_BATCH}, e.g. 1,2,4,8,16")
            sizes.add(int(text))
        return tuple(sorted(sizes))
