"""Effect tables: one :class:`ReadEffect` per :class:`ForwardMode`, interned, with their joins.

A backend's table is computed once (:func:`make_table` from a declaration, :func:`join2` of two
children's effects), and equal effects and tables are one shared object, so that building a
tree of backends is linear in its size and comparing tables is mostly by identity.

>>> from readfence.effects import ReadEffect, ReadEnd
>>> a = intern(ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY}))
>>> intern(ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY})) is a, join2(a, a) is a
(True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from torch import Tensor

from readfence.core import SHARED_BUFFERS, ForwardMode, internal
from readfence.core.internal import check_mode
from readfence.effects import ReadEffect, ReadEnd

#: The modes, in the order of every effect table.
MODES: tuple[ForwardMode, ...] = tuple(ForwardMode)
_INDEX: dict[ForwardMode, int] = {m: i for i, m in enumerate(MODES)}

Table = tuple[ReadEffect, ...]
Tensors = Mapping[str, Tensor]

# The caches below are bounded: a program declares few distinct effects, but a long-lived
# process that builds many backends (a fuzzer drawing random declarations) must not grow
# without end. Each evicts its oldest entry when full; an evicted entry only costs sharing:
# an effect interned again is a new object, a join or table is computed again. They are
# memos of pure functions of the effects they hold (``kept`` by ``clear_trace_cache``).
_CACHE_LIMIT = 4096


class EffectPair(NamedTuple):
    """The key of a memoized join: the identities of two interned effects (held by the entry)."""

    left: int
    right: int


class EffectIds(NamedTuple):
    """The key of a shared table: the identities of its interned effects (held by the table)."""

    ids: tuple[int, ...]


@functools.lru_cache(maxsize=_CACHE_LIMIT)
def intern(effect: ReadEffect) -> ReadEffect:
    """One shared object per distinct effect, so joins can deduplicate by identity."""
    return effect


_BOTTOM = intern(ReadEffect.none())
# -> (a, b, a | b). Holding a and b keeps their ids from being reused.
_JOINS = internal.CACHES.table("effect_joins", EffectPair, "a | b of two interned effects (held with it)",
                               limit=_CACHE_LIMIT, kept=True)


def join2(a: ReadEffect, b: ReadEffect) -> ReadEffect:
    """``a | b``, interned and memoized by identity (tables hold few distinct effects)."""
    if a is b:
        return a
    key = EffectPair(id(a), id(b))
    hit = _JOINS.get(key)
    if hit is None:
        hit = _JOINS.put(key, (a, b, intern(a | b)))
    return hit[2]


def join_effects(effects: Iterable[ReadEffect]) -> ReadEffect:
    """Join of ``effects`` (bottom for none); memoized pairwise joins make it a few lookups.

    >>> a = ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY})
    >>> join_effects([a, a, ReadEffect.of({"swa_map": ReadEnd.PRE_REPLAY})]).end
    <ReadEnd.IN_REPLAY: 2>
    """
    out = _BOTTOM
    for effect in effects:
        out = join2(out, effect)
    return out


def default_declaration(mode: ForwardMode, reads: Iterable[str] | None = None) -> ReadEffect:
    """The default declaration of a leaf: what an engine assumes of a backend that declares nothing.

    ``IN_REPLAY`` for DECODE and TARGET_VERIFY over ``reads`` (every buffer when ``None``),
    ``UNKNOWN`` for every other mode.

    >>> default_declaration(ForwardMode.DECODE, ["seq_lens"])
    ReadEffect({'seq_lens': IN_REPLAY}, default=NONE)
    >>> default_declaration(ForwardMode.EXTEND).end
    <ReadEnd.UNKNOWN: 4>
    """
    mode = check_mode(mode)
    if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        if reads is None:
            return ReadEffect.of({}, default=ReadEnd.IN_REPLAY)
        return ReadEffect.uniform(tuple(reads), ReadEnd.IN_REPLAY)
    return ReadEffect.unknown()


# -> the table; the table holds its effects, so their ids stay theirs
_TABLES = internal.CACHES.table("effect_tables", EffectIds, "one shared tuple per distinct table of interned "
                                "effects", limit=_CACHE_LIMIT, kept=True)


def intern_table(table: Iterable[ReadEffect]) -> Table:
    """One shared tuple per distinct table of interned effects (children often share one)."""
    return table_of(tuple(intern(e) for e in table))


def table_of(effects: Table) -> Table:
    """The shared tuple for a table of already-interned effects (cheap: keyed by ids)."""
    key = EffectIds(tuple(map(id, effects)))
    hit: Table | None = _TABLES.get(key)
    return hit if hit is not None else _TABLES.put(key, effects)


def check_buffers(buffers: Iterable[str], where: str) -> tuple[str, ...]:
    """``buffers`` if each is one of :data:`~readfence.core.SHARED_BUFFERS` (see
    :func:`readfence.core.internal.check_buffers`).

    >>> check_buffers(["req_to_tokn"], "declaration of mine for DECODE")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: declaration of mine for DECODE names unknown buffer 'req_to_tokn'; shared buffers are
    req_to_token, seq_lens, swa_map, state_slots; did you mean 'req_to_token'?
    """
    return internal.check_buffers(buffers, SHARED_BUFFERS, where)


def make_table(declare: Callable[[ForwardMode], ReadEffect], who: str) -> Table:
    """Evaluate ``declare`` for every mode; ``TypeError`` names a mode that gave no effect,
    ``ValueError`` a buffer that is not a shared buffer (a misspelt name would otherwise
    declare nothing about the buffer it meant)."""
    table = []
    for mode in MODES:
        effect = declare(mode)
        if not isinstance(effect, ReadEffect):
            raise TypeError(
                f"declaration of {who} for {mode} must be a ReadEffect, got {effect!r} "
                f"({type(effect).__name__})"
            )
        check_buffers(effect.named, f"declaration of {who} for {mode}")
        table.append(intern(effect))
    return tuple(table)
