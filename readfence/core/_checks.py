"""Argument checks shared by every public entry point: bad input fails up front, by name.

Each check returns the value it accepts, or raises an error whose message names the
argument, shows the bad value and its type, and says what is allowed (and, where a likely
fix exists, what to write instead). The command line reports the same faults in the same
words (``readfence.cli._params``).

>>> positive_int("steps", 3)
3
>>> positive_int("steps", 2.5)
Traceback (most recent call last):
...
ValueError: steps must be a positive int, got 2.5 (float)
>>> positive_int("batch_size", 17, at_most=16, limit="cfg.max_reqs")
Traceback (most recent call last):
...
ValueError: batch_size must be an int in 1..16, got 17 (int); 16 is cfg.max_reqs
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from ._modes import ForwardMode
from ._protocol import BackendLike

_T = TypeVar("_T")


def _shown(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices`` to ``value``, else ``""``.

    >>> did_you_mean("req_to_tokn", ["req_to_token", "seq_lens"])
    "; did you mean 'req_to_token'?"
    >>> did_you_mean("kv", ["req_to_token", "seq_lens"])
    ''
    """
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_buffers(buffers: Iterable[str], known: Iterable[str], where: str) -> tuple[str, ...]:
    """``buffers`` as a tuple if each is one of the shared buffers ``known``; else a
    ``ValueError`` naming the first unknown one, ``where`` it was found, the shared buffers and
    the closest of them (a misspelt name would otherwise say nothing about the buffer it meant).

    >>> check_buffers(["req_to_tokn"], ["req_to_token", "seq_lens"], "publish")
    Traceback (most recent call last):
    ...
    ValueError: publish names unknown buffer 'req_to_tokn'; shared buffers are req_to_token, seq_lens; did you mean 'req_to_token'?
    """
    names, known = tuple(buffers), tuple(known)
    for name in names:
        if name not in known:
            raise ValueError(f"{where} names unknown buffer {name!r}; shared buffers are {', '.join(known)}"
                             f"{did_you_mean(name, known)}")
    return names


def positive_int(name: str, value: object, *, at_most: int | None = None, limit: str = "") -> int:
    """``value`` if it is an int ``>= 1`` (and ``<= at_most``); bools and floats are refused.

    ``limit`` names where ``at_most`` comes from (``cfg.max_reqs``) in the message.
    """
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value and (at_most is None or value <= at_most):
        return value
    if at_most is None:
        raise ValueError(f"{name} must be a positive int, got {_shown(value)}")
    where = f"; {at_most} is {limit}" if limit else ""
    raise ValueError(f"{name} must be an int in 1..{at_most}, got {_shown(value)}{where}")


def positive_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number of seconds ``> 0``.

    >>> positive_seconds("timeout", 5)
    5.0
    >>> positive_seconds("timeout", 0)
    Traceback (most recent call last):
    ...
    ValueError: timeout must be a finite number of seconds > 0, got 0 (int)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{name} must be a finite number of seconds > 0, got {_shown(value)}")


def check_mode(mode: object, where: str = "mode") -> ForwardMode:
    """``mode`` itself, or a ``TypeError`` naming the bad value.

    >>> check_mode(ForwardMode.DECODE)
    <ForwardMode.DECODE: 'decode'>
    >>> check_mode("decode")
    Traceback (most recent call last):
    ...
    TypeError: mode must be a ForwardMode, got 'decode' (str); did you mean ForwardMode.DECODE?
    """
    if isinstance(mode, ForwardMode):
        return mode
    hint = ""
    if isinstance(mode, str) and mode.strip().upper() in ForwardMode.__members__:
        hint = f"; did you mean ForwardMode.{mode.strip().upper()}?"
    raise TypeError(f"{where} must be a ForwardMode, got {_shown(mode)}{hint}")


def check_forward_mode(mode: object, action: str, where: str = "mode") -> ForwardMode:
    """Like :func:`check_mode`, and refuses ``IDLE``: an idle step runs no forward, so there is
    nothing to ``action`` (lower, verify, schedule).

    >>> check_forward_mode(ForwardMode.IDLE, "lower")
    Traceback (most recent call last):
    ...
    ValueError: mode IDLE runs no forward (its steps carry no tokens): there is nothing to lower; allowed: DECODE, TARGET_VERIFY, DRAFT_EXTEND, EXTEND
    """
    mode = check_mode(mode, where)
    if mode is ForwardMode.IDLE:
        allowed = ", ".join(m.name for m in ForwardMode if m is not ForwardMode.IDLE)
        raise ValueError(f"{where} IDLE runs no forward (its steps carry no tokens): there is nothing to "
                         f"{action}; allowed: {allowed}")
    return mode


def check_backend(
    value: Any,
    name: str = "backend",
    *,
    accept: tuple[type[_T], ...] = (),
    allowed: str = "a backend (e.g. readfence.backends.paged())",
    parse_hint: Callable[[str], str] | None = None,
) -> BackendLike | _T:
    """``value`` if it is a backend (:class:`BackendLike`) or one of ``accept``; else a
    ``TypeError`` naming ``name`` and ``allowed``. A spec string gets the call that parses it
    (``parse_hint(text)``, by default ``readfence.backends.parse``). A tree deeper than
    :data:`MAX_TREE_DEPTH` levels is a ``ValueError`` saying so.

    >>> check_backend("paged")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: backend must be a backend (e.g. readfence.backends.paged()), got 'paged' (str); to use
    a spec string, parse it first: readfence.backends.parse('paged').unwrap()
    """
    if isinstance(value, accept):
        return value
    if isinstance(value, BackendLike):
        return check_tree_depth(value, name)
    hint = ""
    if isinstance(value, str):
        call = parse_hint(value) if parse_hint is not None else f"readfence.backends.parse({value!r}).unwrap()"
        hint = f"; to use a spec string, parse it first: {call}"
    elif isinstance(value, type) or (callable(value) and isinstance(getattr(value, "__name__", None), str)):
        hint = f"; did you forget to call it ({value.__name__}())?"
    raise TypeError(f"{name} must be {allowed}, got {_shown(value)}{hint}")


#: The deepest backend tree the audit, the observer and ``lower`` take: their walks of a tree recurse
#: once per level, and Python's stack holds some three hundred levels of them (a backend value
#: itself, its effects, equality and printing, is built for any depth).
MAX_TREE_DEPTH = 100


def tree_depth(backend: BackendLike) -> int:
    """The levels of ``backend``'s tree (a leaf is one), walked without recursion; counting stops
    past :data:`MAX_TREE_DEPTH`.

    >>> from readfence.backends import join, paged
    >>> tree_depth(paged()), tree_depth(join(join(paged(), paged()), paged()))
    (1, 3)
    """
    deepest, stack = 0, [(backend, 1)]
    while stack and deepest <= MAX_TREE_DEPTH:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for _, child in node.children())
    return deepest


def check_tree_depth(backend: BackendLike, name: str = "backend") -> BackendLike:
    """``backend``, if its tree is at most :data:`MAX_TREE_DEPTH` levels deep; else a ``ValueError``
    naming ``name`` and the limit.

    >>> from readfence.backends import paged
    >>> check_tree_depth(paged()).name
    'paged'
    """
    if tree_depth(backend) > MAX_TREE_DEPTH:
        raise ValueError(f"{name} {backend.name!r} is a tree more than {MAX_TREE_DEPTH} levels deep: readfence audits, "
                         f"observes and lowers trees up to {MAX_TREE_DEPTH} levels deep (MAX_TREE_DEPTH)")
    return backend


#: The groups of a state's tensors (``make_state`` makes all three).
STATE_PARTS = ("shared", "pools", "params")


def check_state(state: object, *, required: tuple[str, ...] = ("shared",)) -> None:
    """``state`` is ``None`` or the live tensors: a mapping of :data:`STATE_PARTS` (those in
    ``required`` present), each a mapping of name -> tensor; else an error naming what is wrong.
    ``audit`` takes ``shared`` alone; ``lower`` runs the step on all three.

    >>> check_state("x")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: state must be None or a mapping {'shared': ..., 'pools': ..., 'params': ...} of the live
    tensors (readfence.graph.make_state(cfg) makes one), got 'x' (str)
    >>> check_state({"shared": {}}, required=STATE_PARTS)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: state has no 'pools', 'params': it must be a mapping {'shared': ..., 'pools': ..., 'params': ...}
    of the live tensors (readfence.graph.make_state(cfg) makes one)
    """
    if state is None:
        return
    how = ("a mapping {'shared': ..., 'pools': ..., 'params': ...} of the live tensors "
           "(readfence.graph.make_state(cfg) makes one)")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be None or {how}, got {_shown(state)}")
    unknown = [k for k in state if k not in STATE_PARTS]
    missing = [k for k in required if k not in state]
    if unknown or missing:
        what = (f"has unknown key(s) {', '.join(map(repr, unknown))}" if unknown
                else f"has no {', '.join(map(repr, missing))}")
        raise ValueError(f"state {what}: it must be {how}")
    for part in STATE_PARTS:
        if part in state and not isinstance(state[part], Mapping):
            raise TypeError(f"state[{part!r}] must be a mapping of name -> tensor, got {_shown(state[part])}")


__all__ = ["STATE_PARTS", "check_backend", "check_forward_mode", "check_mode", "check_buffers", "check_state",
           "did_you_mean", "positive_int",
           "positive_seconds"]
