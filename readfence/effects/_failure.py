"""The ``returns`` results readfence gives back (``parse``, ``audit``, ``verify``...): a failure whose
``unwrap()`` says why, and neither one usable as a bool.

``returns``' own ``Failure(x).unwrap()`` raises an ``UnwrapFailedError`` with no message, so a
user who unwraps a failed parse sees neither the position nor the reason. :class:`Failure` is
that container with one difference: the error ``unwrap()`` raises carries ``str(x)``.

A ``returns`` container is always true, a failure too: ``if audit(backend, mode):`` would pass on
an unsound declaration. readfence's :class:`Success` and :class:`Failure` refuse to be used as a
bool instead, with a ``TypeError`` saying what to ask. Each equals (and hashes like) ``returns``'
own container of the same value, and is one (``match`` with ``case Success(x)`` works), so
nothing else changes.

>>> failed = Failure("position 4: expected a backend name")
>>> failed.unwrap()
Traceback (most recent call last):
...
readfence.effects._failure.UnwrapError: unwrap() of a failure: position 4: expected a backend name
>>> import returns.result
>>> failed == returns.result.Failure("position 4: expected a backend name"), failed.failure()
(True, 'position 4: expected a backend name')
>>> if failed:  # doctest: +ELLIPSIS
...     pass
Traceback (most recent call last):
...
TypeError: a Result is neither true nor false (a returns container always is true, a failure too): ask ...
"""

from __future__ import annotations

from typing import Any, NoReturn

from returns.primitives.exceptions import UnwrapFailedError
from returns.result import Failure as _Failure
from returns.result import Success as _Success

from ._errors import ReadfenceError


class UnwrapError(ReadfenceError, UnwrapFailedError):
    """``unwrap()`` of a failure: its message is the failure value's text (``halted_container``
    is the failure, as for ``returns``' own error)."""

    def __init__(self, container: Any) -> None:
        super().__init__(container)
        self.args = (f"unwrap() of a failure: {container.failure()}",)

    def __str__(self) -> str:
        return str(self.args[0])


#: What using a result as a bool raises.
NOT_A_BOOL = ("a Result is neither true nor false (a returns container always is true, a failure too): ask "
              "returns.pipeline.is_successful(result), unwrap() it (it raises, saying why, on a failure), map "
              "over it, or match it: case Success(value): ... case Failure(why): ...")


class Success(_Success):  # type: ignore[misc]  # final for type checkers only: the one way to refuse bool()
    """``returns.result.Success`` that refuses to be used as a bool (:data:`NOT_A_BOOL`).

    >>> from returns.pipeline import is_successful
    >>> is_successful(Success(3)), Success(3).unwrap(), Success(3) == __import__("returns").result.Success(3)
    (True, 3, True)
    """

    def __bool__(self) -> bool:
        raise TypeError(NOT_A_BOOL)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Success):
            return bool(self._inner_value == other._inner_value)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._inner_value)

    def __repr__(self) -> str:
        return f"<Success: {self._inner_value}>"


class Failure(_Failure):  # type: ignore[misc]  # final for type checkers only: the one way to give unwrap() a message
    """``returns.result.Failure`` whose ``unwrap()`` raises :class:`UnwrapError`, naming why."""

    def unwrap(self) -> NoReturn:
        if isinstance(self._inner_value, BaseException):
            raise UnwrapError(self) from self._inner_value
        raise UnwrapError(self)

    def __bool__(self) -> bool:
        raise TypeError(NOT_A_BOOL)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Failure):
            return bool(self._inner_value == other._inner_value)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._inner_value)

    def __repr__(self) -> str:
        return f"<Failure: {self._inner_value}>"


__all__ = ["NOT_A_BOOL", "Failure", "Success", "UnwrapError"]
