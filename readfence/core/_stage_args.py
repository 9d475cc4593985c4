"""A stage's arguments, read-only: the step's groups and the metadata it is handed.

The serial step hands one step's dicts to every stage (``shared``, ``batch`` and the metadata the
out-of-graph stage returned), while a lowered step hands each stage its own, and an engine's
scheduler owns the ``shared`` dict itself. A stage that assigns a key of one of them (rebinds
``shared["swa_map"]`` to another tensor, replaces ``meta["kv_lens"]`` for the body, appends to a
list the metadata holds) would change what the next stage sees in one run and not in the other,
or change the live state outside any fence. So every stage gets its arguments as read-only
containers (:func:`read_only`): reading them is reading a dict or a list, changing them raises
:class:`StageArgumentError` naming the backend, the stage, the key and the line. What a stage
returns is made plain again (:func:`plain`): a stage may return the metadata it was handed.
Each container is the stage's own copy, as in a lowered step: a change made around the refusal
(``dict.__setitem__`` on one) reaches no other stage and not the caller's state; nor does a change
to an ``OrderedDict``, a ``defaultdict`` or a ``deque`` a stage returned, each handed on as a copy
of its own type (not refused: their own methods stay theirs). In the body, the last stage, ``meta``
is a dict of its own to change.

>>> meta = read_only({"n": [1, 2]}, "prepare_in_graph", "meta", backend="mine")
>>> meta["n"][1], dict(meta) == {"n": [1, 2]}, plain({"m": meta}) == {"m": {"n": [1, 2]}}
(2, True, True)
>>> meta["n"].append(3)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
readfence.core._stage_args.StageArgumentError: backend 'mine' stage prepare_in_graph changed meta['n'] (append, at ...): ...
"""

from __future__ import annotations

import collections
import copy
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from torch.utils import _pytree as pytree

from readfence.effects import ReadfenceError


class StageArgumentError(ReadfenceError, TypeError):
    """A stage changed one of its arguments (assigned or deleted a key of ``shared``, ``batch``,
    ``meta``..., changed a list it was handed): the message names the backend, the stage, what it
    changed and the line; ``stage`` is the stage's name."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


def _caller() -> str:
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:  # the first frame not this module's
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Where:
    __slots__ = ("backend", "stage", "path")

    def __init__(self, backend: str, stage: str, path: str) -> None:
        self.backend, self.stage, self.path = backend, stage, path

    def refuse(self, how: str) -> NoReturn:
        shared = self.path.startswith("shared")
        why = ("the scheduler owns the shared state: rebinding one of its buffers changes the live state outside "
               "any fence" if shared else
               "the serial step hands these to the stages after it and a lowered step hands each stage its own, so "
               "the change would reach the next stage in one and not in the other")
        raise StageArgumentError(
            f"backend {self.backend!r} stage {self.stage} changed {self.path} ({how}, at {_caller()}): a stage's "
            f"arguments are read-only ({why}); return the new value under a key of the stage's output instead",
            stage=self.stage)


def _guarded(base: type, name: str, keyed: bool) -> Any:
    """``base``'s method ``name``, refused on a container handed to a stage (``keyed``: its first
    argument is the key it changes), run as it is on one the stage built itself."""
    method = getattr(base, name)

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = self._where
        if where is None:
            return method(self, *args, **kwargs)
        at = f"{where.path}[{args[0]!r}]" if keyed and args else where.path
        _Where(where.backend, where.stage, at).refuse(_HOW.get(name, name))

    guarded.__name__ = name
    return guarded


#: How the error words a change made by a dunder method (others by their name: ``append``).
_HOW = {"__setitem__": "assigned", "__delitem__": "deleted", "__ior__": "|=", "__iadd__": "+=", "__imul__": "*="}


class _ReadOnlyDict(dict[Any, Any]):
    """A dict a stage may read and not change (one it builds as ``type(meta)(...)`` is its own)."""

    _where: _Where | None = None

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in self:
            return self[key]
        return _SETDEFAULT(self, key, default)

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


_SETDEFAULT = _guarded(dict, "setdefault", True)  # (a key it already holds is only read)
for _name, _keyed in (("__setitem__", True), ("__delitem__", True), ("__ior__", False), ("pop", True),
                      ("popitem", False), ("clear", False), ("update", False)):
    setattr(_ReadOnlyDict, _name, _guarded(dict, _name, _keyed))


class _ReadOnlyList(list[Any]):
    """A list a stage may read and not change (one it builds as ``type(rows)(...)`` is its own)."""

    _where: _Where | None = None

    def __reduce__(self) -> Any:
        return (list, (list(self),))


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "remove", "pop",
              "clear", "sort", "reverse"):
    setattr(_ReadOnlyList, _name, _guarded(list, _name, False))


def read_only(value: Any, stage: str, path: str, *, backend: str = "?") -> Any:
    """``value`` with every dict and list in it (``value`` itself included) read-only, as the
    stage ``stage`` of ``backend`` is handed it at ``path`` (an argument's name); the other
    containers a stage may return copies of their own; tensors and other values as they are."""
    if type(value) not in _CONTAINERS:  # (most of what a stage is handed: each tensor of its groups)
        return value
    where = _Where(backend, stage, path)

    def handed(kind: type) -> Callable[[Iterable[Any]], Any]:  # a read-only container, refusing at ``path``
        def make(items: Iterable[Any]) -> Any:
            out = kind(items)
            out._where = where
            return out
        return make

    def child(key: Any, v: Any) -> Any:  # (a child's path made only for a container: most are tensors)
        return v if type(v) not in _CONTAINERS else read_only(v, stage, f"{path}[{key!r}]", backend=backend)

    return _each(value, child, as_dict=handed(_ReadOnlyDict), as_list=handed(_ReadOnlyList))


def plain(value: Any) -> Any:
    """``value`` with every read-only dict and list in it made a plain one again (what a stage
    returns: it may return what it was handed)."""
    return _each(value, lambda _, v: plain(v)) if _holds_read_only(value) else value


#: Dicts of other types a stage may return (torch's tree utilities walk them), each handed on as a copy.
_OTHER_DICTS = (collections.OrderedDict, collections.defaultdict)
#: Every container :func:`_each` walks.
_CONTAINERS = frozenset({dict, list, tuple, collections.deque, _ReadOnlyDict, _ReadOnlyList, *_OTHER_DICTS})


def _each(value: Any, fn: Callable[[Any, Any], Any], *, as_dict: Callable[[Iterable[Any]], Any] = dict,
          as_list: Callable[[Iterable[Any]], Any] = list) -> Any:
    """A container of ``value``'s kind holding ``fn(key, child)`` for each of its children (a dict's
    by key, a sequence's by index), a plain dict or list made by ``as_dict`` or ``as_list``; a
    value that is no container as it is."""
    kind = type(value)
    if kind is dict or kind is _ReadOnlyDict:
        return as_dict((k, fn(k, v)) for k, v in value.items())
    if kind is list or kind is _ReadOnlyList:
        return as_list(fn(i, v) for i, v in enumerate(value))
    if kind is tuple:
        return tuple(fn(i, v) for i, v in enumerate(value))
    if kind in _OTHER_DICTS:  # a copy of its own type (an OrderedDict's order, a defaultdict's factory)
        own = copy.copy(value)
        for k, v in value.items():
            dict.__setitem__(own, k, fn(k, v))
        return own
    if kind is collections.deque:
        return collections.deque((fn(i, v) for i, v in enumerate(value)), maxlen=value.maxlen)
    return value


def _holds_read_only(value: Any) -> bool:
    kind = type(value)
    if kind is _ReadOnlyDict or kind is _ReadOnlyList:
        return True
    if kind is dict or kind in _OTHER_DICTS:
        return any(_holds_read_only(v) for v in value.values())
    if kind is list or kind is tuple or kind is collections.deque:
        return any(_holds_read_only(v) for v in value)
    return False


# torch's tree utilities (and code a stage calls that uses them) walk them as the dict and the list they are
pytree.register_pytree_node(_ReadOnlyDict, lambda d: pytree._dict_flatten(d), lambda values, keys: dict(zip(keys, values)),
                            flatten_with_keys_fn=lambda d: pytree._dict_flatten_with_keys(d))
pytree.register_pytree_node(_ReadOnlyList, lambda s: pytree._list_flatten(s), lambda values, _: list(values),
                            flatten_with_keys_fn=lambda s: pytree._list_flatten_with_keys(s))

__all__ = ["StageArgumentError", "plain", "read_only"]
