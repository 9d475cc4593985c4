"""A ``returns`` failure whose ``unwrap()`` says why: what ``parse``, ``audit`` and ``verify`` return.

``returns``' own ``Failure(x).unwrap()`` raises an ``UnwrapFailedError`` with no message, so a
user who unwraps a failed parse sees neither the position nor the reason. :class:`Failure` is
that container with one difference: the error ``unwrap()`` raises carries ``str(x)``. It equals
(and hashes like) ``returns.result.Failure`` of the same value, so nothing else changes.

>>> failed = Failure("position 4: expected a backend name")
>>> failed.unwrap()
Traceback (most recent call last):
...
readfence.effects._failure.UnwrapError: unwrap() of a failure: position 4: expected a backend name
>>> import returns.result
>>> failed == returns.result.Failure("position 4: expected a backend name"), failed.failure()
(True, 'position 4: expected a backend name')
"""

from __future__ import annotations

from typing import Any, NoReturn

from returns.primitives.exceptions import UnwrapFailedError
from returns.result import Failure as _Failure

from ._errors import ReadfenceError


class UnwrapError(ReadfenceError, UnwrapFailedError):
    """``unwrap()`` of a failure: its message is the failure value's text (``halted_container``
    is the failure, as for ``returns``' own error)."""

    def __init__(self, container: Any) -> None:
        super().__init__(container)
        self.args = (f"unwrap() of a failure: {container.failure()}",)

    def __str__(self) -> str:
        return str(self.args[0])


class Failure(_Failure):  # type: ignore[misc]  # final for type checkers only: the one way to give unwrap() a message
    """``returns.result.Failure`` whose ``unwrap()`` raises :class:`UnwrapError`, naming why."""

    def unwrap(self) -> NoReturn:
        if isinstance(self._inner_value, BaseException):
            raise UnwrapError(self) from self._inner_value
        raise UnwrapError(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Failure):
            return bool(self._inner_value == other._inner_value)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._inner_value)

    def __repr__(self) -> str:
        return f"<Failure: {self._inner_value}>"


__all__ = ["Failure", "UnwrapError"]
