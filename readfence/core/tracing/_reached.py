"""What a walk of a backend's values finds: where each value was reached (:class:`Path`), the
values some code can read (:class:`Settings`, a cache key) and the tensors reached (:class:`Reach`).

>>> str(Path("backend").then("attr", "kernel").then("global", "SCALE"))
"backend.kernel.__globals__['SCALE']"
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import attrs
import torch


class Path(tuple):
    """Where a value was reached from the root: ``root`` (its name) and ``steps``, each an
    ``(kind, key)`` pair. ``str`` is the Python expression that reads it
    (``backend.kernel.attend_fn.__globals__['SCALE']``). A tuple, so that a walk of thousands of
    values makes its paths at the cost of tuples.

    >>> path = Path("backend", (("attr", "kernel"), ("global", "SCALE")))
    >>> str(path), path == Path("backend").then("attr", "kernel").then("global", "SCALE")
    ("backend.kernel.__globals__['SCALE']", True)
    """

    __slots__ = ()

    def __new__(cls, root: str, steps: tuple[tuple[str, Hashable], ...] = ()) -> Path:
        return tuple.__new__(cls, (root, steps))

    @property
    def root(self) -> str:
        return self[0]

    @property
    def steps(self) -> tuple[tuple[str, Hashable], ...]:
        return self[1]

    def then(self, kind: str, key: Hashable) -> Path:
        """This path, one step further."""
        return _tuple_new(Path, (self[0], (*self[1], (kind, key))))

    def __getnewargs__(self) -> tuple[str, tuple[tuple[str, Hashable], ...]]:
        return self[0], self[1]

    def __repr__(self) -> str:
        return f"Path({self[0]!r}, {self[1]!r})"

    def resolve(self, root: object) -> object:
        """The value this path reaches from ``root`` now (:data:`GONE` when a step fails)."""
        value = root
        for kind, key in self.steps:
            try:
                value = _STEPS[kind](value, key)
            except (AttributeError, LookupError, TypeError, ValueError):
                return GONE
        return value

    def names(self, kind: str) -> Iterator[Hashable]:
        return (key for k, key in self.steps if k == kind)

    def __str__(self) -> str:
        out = [self.root]
        for kind, key in self.steps:
            out.append(_SHOWN[kind](key))
        return "".join(out)


_tuple_new = tuple.__new__


class _Gone:
    def __repr__(self) -> str:
        return "GONE"


#: What :meth:`Path.resolve` gives where the value is no longer there.
GONE: Any = _Gone()

_STEPS: dict[str, Any] = {
    "attr": lambda v, k: getattr(v, k),
    "entry": lambda v, k: vars(v)[k],
    "global": lambda v, k: v.__globals__[k],
    "cell": lambda v, k: v.__closure__[k[0]].cell_contents,
    "default": lambda v, k: v.__defaults__[k],
    "kwdefault": lambda v, k: v.__kwdefaults__[k],
    "item": lambda v, k: v[k],
}
_SHOWN: dict[str, Any] = {
    "attr": lambda k: f".{k}",
    "entry": lambda k: f".{k}",
    "global": lambda k: f".__globals__[{k!r}]",
    "cell": lambda k: f".__closure__[{k[0]}].cell_contents",
    "default": lambda k: f".__defaults__[{k}]",
    "kwdefault": lambda k: f".__kwdefaults__[{k!r}]",
    "item": lambda k: f"[{k!r}]",
}



def tensor_layout(t: torch.Tensor) -> tuple[Any, ...]:
    """What a graph that captured ``t`` relies on: its identity, the memory it spans, its shape,
    strides and dtype (a CUDA graph holds its address; a replay reads it with this layout).

    >>> t = torch.zeros(4)
    >>> tensor_layout(t) == tensor_layout(t), tensor_layout(t) == tensor_layout(t.resize_(8))
    (True, False)
    """
    try:
        where = t.untyped_storage().data_ptr() if t.device.type not in ("meta",) else None
    except (RuntimeError, NotImplementedError):  # fake or functional tensors hold no memory
        where = None
    return (id(t), where, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device))


@attrs.frozen(cache_hash=True)
class Settings:
    """The Python values some reached code can read, each with the path it was found at, in
    the order of the walk (frozen: a cache key). Two walks of unchanged objects give equal
    settings; ``complete`` is False where the walk stopped at :data:`LIMIT` or :data:`DEPTH`.
    The objects taken by identity are held, so that no identity is reused while a key lives."""

    entries: tuple[tuple[Path, Hashable], ...]
    complete: bool = True
    held: tuple[Any, ...] = attrs.field(default=(), eq=False, hash=False, repr=False)

    def changed_from(self, other: Settings) -> Path | None:
        """The first path whose value differs between ``other`` and these settings (or which only
        one of them reaches); ``None`` when they are equal.

        >>> Settings(((Path("x"), 1),)).changed_from(Settings(((Path("x"), 2),)))
        Path('x', ())
        """
        mine, theirs = dict(self.entries), dict(other.entries)
        for path, _ in (*self.entries, *other.entries):
            if mine.get(path, GONE) != theirs.get(path, GONE):
                return path
        return None

    def __len__(self) -> int:
        return len(self.entries)


@attrs.frozen(eq=False)
class Reach:
    """What :func:`reach` found: the :class:`Settings`, and every tensor reached, with the first
    path it was found at (assigned attributes included: where the backend keeps its buffers)."""

    settings: Settings
    tensors: tuple[tuple[Path, torch.Tensor], ...]

    def homes(self, t: torch.Tensor) -> tuple[tuple[Path, bool], ...]:
        """Every path that holds ``t`` itself (``True``) or a tensor over its memory (``False``:
        a view kept beside it), those holding ``t`` first."""
        memory = _memory(t)
        itself = tuple((path, True) for path, held in self.tensors if held is t)
        views = tuple((path, False) for path, held in self.tensors
                      if held is not t and memory is not None and _memory(held) == memory)
        return itself + views


def _memory(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes()) if st.data_ptr() else None
    except (RuntimeError, NotImplementedError):
        return None
