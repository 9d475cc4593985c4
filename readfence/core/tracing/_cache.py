"""readfence's caches: one object (:data:`CACHES`) of named tables, each entry under a frozen key
record that says what it depends on.

Every answer readfence caches about a backend's code (its traces, their bindings to a live state,
their validations, observations, verdicts) is valid only for what it was computed from. Each
table keys its entries by all of that, in a frozen key record a reader can print (``TraceKey``,
``BoundKey``...), or rechecks an entry when it is used; :meth:`Caches.describe` lists them:

* a backend's code is keyed by :class:`CodeKey`: the code itself and the :class:`Settings` its
  Python can read (``_guards``: globals, closure cells, attributes, config fields); a changed flag
  is another key, so another trace, and everything keyed by that trace is computed afresh;
* a trace whose graphs captured tensors is rechecked at use: each tensor must still be where the
  backend keeps it, with the same storage and shape (``_guards.KeptTensor``);
* an entry computed from other entries (:meth:`Table.compute`: the audit's verdict from traces)
  is current only while each entry it read is: a trace recomputed is a verdict recomputed.

Every table is bounded (a forgotten entry only costs computing it again); ``clear_trace_cache``
forgets every table but those marked ``kept`` (memos of pure functions of their key's values).

>>> describe = CACHES.describe()
>>> "traces" in describe and "TraceKey(code, mode, cfg, batch_size, device, seed)" in describe
True
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import attrs

from .._protocol import BackendLike
from ._guards import Settings, reach

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@attrs.define(eq=False)
class _Entry(Generic[V]):
    value: V
    check: Callable[[], str | None] | None  # rechecked at every use: why it no longer holds, or None
    depends: tuple[tuple[Table[Any, Any], Hashable, _Entry[Any]], ...]  # the entries it was computed from
    weight: int

    def stale(self) -> str | None:
        """Why this entry no longer holds (its check, or an entry it was computed from), or None."""
        if self.check is not None:
            why = self.check()
            if why is not None:
                return why
        for table, key, entry in self.depends:
            if table._entries.get(key) is not entry:
                return f"the {table.name} entry it was computed from was replaced or forgotten"
            why = entry.stale()
            if why is not None:
                return f"the {table.name} entry it was computed from no longer holds: {why}"
        return None


_ABSENT: Any = object()

#: While :meth:`Table.compute` computes an entry: the entries read meanwhile.
_READING: contextvars.ContextVar[list[tuple[Table[Any, Any], Hashable, _Entry[Any]]] | None] = (
    contextvars.ContextVar("readfence_cache_reads", default=None))


@attrs.define
class Stats:
    """What a table answered: ``hits``, ``misses`` (computed), ``stale`` (an entry found that no
    longer held, so computed again) and why the last stale entry did not hold."""

    hits: int = 0
    misses: int = 0
    stale: int = 0
    last_stale: str = ""


class Table(Generic[K, V]):
    """One named table of :class:`Caches`: values under ``key`` records (a frozen attrs class),
    at most ``limit`` of them (and ``budget`` in all of ``weight(value)``), the oldest forgotten
    first. ``what`` says what an entry is; ``kept`` tables (memos of pure functions of the key's
    values) survive ``Caches.clear``. An entry made by :meth:`compute` depends on every entry it
    read, but those of ``kept`` tables and of tables whose users recheck each entry themselves
    (``depended_on=False``).

    >>> @attrs.frozen
    ... class Square:
    ...     n: int
    >>> table = Table("squares", Square, "n * n", limit=2)
    >>> [table.compute(Square(n), lambda: n * n) for n in (1, 2, 3)], len(table), table.get(Square(1))
    ([1, 4, 9], 2, None)
    """

    def __init__(self, name: str, key: type, what: str, *, limit: int, budget: int | None = None,
                 weight: Callable[[V], int] | None = None, kept: bool = False, depended_on: bool = True) -> None:
        self.name, self.key, self.what, self.limit, self.kept = name, key, what, limit, kept
        self.depended_on = depended_on and not kept
        self.budget, self.weight = budget, weight
        self._entries: dict[K, _Entry[V]] = {}
        self._total = 0
        self.stats = Stats()

    def get(self, key: K, default: Any = None) -> Any:
        """The value under ``key``, rechecked (``default`` when absent, or when it no longer holds:
        then it is forgotten). Raises ``TypeError`` for a key that does not hash."""
        entry = self._entries.get(key)
        if entry is None:
            return default
        if entry.check is not None or entry.depends:
            why = entry.stale()
            if why is not None:
                self._forget(key)
                self.stats.stale += 1
                self.stats.last_stale = why
                return default
        self.stats.hits += 1
        if self.depended_on:
            reading = _READING.get()
            if reading is not None:
                reading.append((self, key, entry))
        return entry.value

    def put(self, key: K, value: V, *, check: Callable[[], str | None] | None = None,
            depends: tuple[tuple[Table[Any, Any], Hashable, _Entry[Any]], ...] = ()) -> V:
        """Keep ``value`` under ``key`` (``check()``: why it no longer holds, asked at every use;
        ``depends``: the entries it was computed from); returns ``value``."""
        if key in self._entries:
            self._forget(key)
        weight = self.weight(value) if self.weight is not None else 1
        while self._entries and (len(self._entries) >= self.limit or
                                 (self.budget is not None and self._total + weight > self.budget)):
            self._forget(next(iter(self._entries)))
        entry = _Entry(value, check, depends, weight)
        self._entries[key] = entry
        self._total += weight
        self.stats.misses += 1
        if self.depended_on:
            reading = _READING.get()
            if reading is not None:
                reading.append((self, key, entry))
        return value

    def compute(self, key: K, make: Callable[[], V], *, check: Callable[[], str | None] | None = None) -> V:
        """The value under ``key``, or ``make()``'s, kept: current only while every entry of any
        table that ``make`` read stays current (an answer computed from a trace is computed
        again once that trace is)."""
        hit = self.get(key, _ABSENT)
        if hit is not _ABSENT:
            return hit
        token = _READING.set([])
        try:
            value = make()
        finally:
            read = _READING.get() or []
            _READING.reset(token)
        return self.put(key, value, check=check, depends=tuple(read))

    def forget(self, key: K) -> None:
        """Forget the entry under ``key``, if any."""
        if key in self._entries:
            self._forget(key)

    def _forget(self, key: K) -> None:
        entry = self._entries.pop(key)
        self._total -= entry.weight

    def __contains__(self, key: object) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
        self._total = 0

    def describe(self) -> dict[str, Any]:
        """The table's name, key record, size, bounds, counts and what an entry is."""
        names = ([f.name for f in attrs.fields(self.key)] if attrs.has(self.key) else
                 list(getattr(self.key, "_fields", ())))
        fields = ", ".join(names)
        return {"table": self.name, "key": f"{self.key.__name__}({fields})", "entries": len(self),
                "limit": self.limit, "hits": self.stats.hits, "misses": self.stats.misses, "stale": self.stats.stale,
                "kept": self.kept, "what": self.what}


class Caches:
    """Every cache of readfence, by name (:data:`CACHES`): a module makes its table with
    :meth:`table`; :meth:`clear` forgets them (``clear_trace_cache``); :meth:`describe` lists
    them with their key records and sizes."""

    def __init__(self) -> None:
        self.tables: dict[str, Table[Any, Any]] = {}

    def table(self, name: str, key: type, what: str, *, limit: int, budget: int | None = None,
              weight: Callable[[Any], int] | None = None, kept: bool = False,
              depended_on: bool = True) -> Table[Any, Any]:
        """A new table named ``name`` (see :class:`Table`); a name is made once."""
        if name in self.tables:
            raise ValueError(f"a cache table named {name!r} exists already ({self.tables[name].what})")
        made: Table[Any, Any] = Table(name, key, what, limit=limit, budget=budget, weight=weight, kept=kept,
                                      depended_on=depended_on)
        self.tables[name] = made
        return made

    def __getitem__(self, name: str) -> Table[Any, Any]:
        return self.tables[name]

    def clear(self, *, kept: bool = False) -> None:
        """Forget every table's entries (the ``kept`` ones too, when ``kept``)."""
        for table in self.tables.values():
            if kept or not table.kept:
                table.clear()

    def rows(self) -> list[dict[str, Any]]:
        """One :meth:`Table.describe` per table, by name."""
        return [self.tables[name].describe() for name in sorted(self.tables)]

    def describe(self) -> str:
        """A table of the tables: name, key record, entries of limit, hits, misses, stale, what."""
        lines = []
        for row in self.rows():
            kept = " (kept)" if row["kept"] else ""
            lines.append(f"{row['table']:18} {row['entries']:5}/{row['limit']:<5} hits {row['hits']:<6} misses "
                         f"{row['misses']:<5} stale {row['stale']:<3} {row['key']}{kept}: {row['what']}")
        return "\n".join(lines)


#: readfence's caches.
CACHES = Caches()


# -- what a backend's code is --------------------------------------------------------------------
@attrs.frozen
class CodeKey:
    """What a trace or an observation of a backend depends on: its ``code`` (a leaf's kernel and
    options, so that ``redeclare``d copies share one; anything else, the backend itself) and the
    Python values that code can read (``settings``, see ``_guards``)."""

    code: Hashable
    settings: Settings


def _code_identity(backend: BackendLike) -> Any:
    """The code of ``backend``, not its declaration: a leaf that carries a ``kernel`` (the
    backends layer's ``Leaf``) by its type, name, kernel and options; anything else by itself."""
    kernel = getattr(backend, "kernel", None)
    if kernel is not None and not backend.children():
        try:
            key = (type(backend), backend.name, kernel, tuple(getattr(backend, "options", ())))
            hash(key)
            return key
        except TypeError:
            pass
    return backend


def code_key(backend: BackendLike) -> CodeKey:
    """What a trace or an observation of ``backend`` depends on (:class:`CodeKey`): its code and
    the values that code can read now.

    >>> from readfence.backends import paged, redeclare
    >>> from readfence.effects import ReadEffect
    >>> code_key(paged()) == code_key(redeclare(paged(), lambda m: ReadEffect.unknown()))
    True
    """
    return CodeKey(_code_identity(backend), reach(backend, "backend").settings)


def clear_trace_cache() -> None:
    """Forget every cached trace, binding, validation, observation and verdict (every table of
    :data:`CACHES` but the kept memos); the next call computes them again.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> clear_trace_cache(); _ = trace(paged(), ForwardMode.DECODE); trace_cache_size()
    1
    """
    CACHES.clear()


def trace_cache_size() -> int:
    """How many traced programs are cached (at most 1024 programs and a million graph nodes in
    all: the oldest is forgotten first)."""
    return len(CACHES["traces"])


__all__ = ["CACHES", "Caches", "CodeKey", "Stats", "Table", "clear_trace_cache", "code_key", "trace_cache_size"]
