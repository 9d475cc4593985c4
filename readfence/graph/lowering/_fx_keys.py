"""When two FX nodes' Python arguments are the same: the one rule the compile passes compare by.

The sharing pass merges two calls whose arguments are the same, and the layer pass puts two runs
of a layer into one class when theirs are: both ask :func:`arg_key`. A value stands for itself
with its type (``1`` is not ``True``, nor ``1.0``), a float by its bits (``-0.0`` is not ``0.0``:
a division tells them apart), a container by its items; any other object only as itself (two
objects equal by ``==`` may still act apart); a node as its caller says (itself, or its place in a
run).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import fx

#: Argument types that stand for themselves (with their type) in a key.
_PLAIN = frozenset({bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _itself(value: int) -> Hashable:
    return (int, value)


def arg_key(value: Any, node: Callable[[fx.Node], Hashable],
            integer: Callable[[int], Hashable] = _itself) -> Hashable:
    """A hashable stand-in for ``value`` (an FX argument: see the module docstring): each node in
    it as ``node(n)``, each integer as ``integer(i)`` (default: the integer, with its type).
    Raises ``TypeError`` for an object that cannot be hashed (nothing can say it is the same).

    >>> arg_key((0.0, 1, True), node=lambda n: n) == arg_key((-0.0, 1, True), node=lambda n: n)
    False
    >>> nan = float("nan")
    >>> arg_key(nan, node=lambda n: n) == arg_key(-nan, node=lambda n: n)
    False
    >>> arg_key([2, 3], node=lambda n: n, integer=lambda i: "int")
    (<class 'list'>, ('int', 'int'))
    """
    kind = type(value)
    if kind is fx.Node:
        return node(value)
    if kind is int:
        return integer(value)
    if kind in _PLAIN:
        return (kind, value)
    if kind is float:
        # by its bits: a NaN's sign and payload, an infinity's sign are the value's too (signbit,
        # copysign and a bit view read them)
        return ("float", value.hex() if math.isfinite(value) else struct.pack("<d", value))
    if isinstance(value, (list, tuple)):
        return (kind, tuple([arg_key(v, node, integer) for v in value]))
    if isinstance(value, dict):
        return ("dict", tuple((k, arg_key(v, node, integer)) for k, v in value.items()))
    hash(value)  # TypeError: not comparable
    return (kind, id(value))  # (an object is the same argument only as itself)


__all__ = ["arg_key"]
