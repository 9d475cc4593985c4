"""Per-buffer read effects: the map lattice ``buffer -> ReadEnd`` with a default."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import attrs

from ._read_end import ReadEnd


def _normalise(items: Iterable[tuple[str, ReadEnd]]) -> tuple[tuple[str, ReadEnd], ...]:
    pairs = tuple(items)
    # Sort by name only (mixed key types are rejected later with a clear message).
    return tuple(sorted(pairs, key=lambda kv: repr(kv[0])))


@attrs.frozen(repr=False)
class ReadEffect:
    """Per shared buffer, the end of its last read; unnamed buffers have ``default``.

    Immutable and hashable. Entries equal to the default are dropped on construction, so
    equality is semantic: ``{a: NONE}`` with default ``NONE`` is the empty effect. The names
    given stay readable as :attr:`named` (not part of the value), so a check of buffer names
    sees a misspelt one whatever end it was given.

    >>> e = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY})
    >>> (e | ReadEffect.of({"swa_map": ReadEnd.PRE_REPLAY})).end
    <ReadEnd.IN_REPLAY: 2>
    >>> e["seq_lens"], e <= ReadEffect.unknown()
    (<ReadEnd.NONE: 0>, True)
    """

    _items: tuple[tuple[str, ReadEnd], ...] = attrs.field(alias="items", converter=_normalise)
    default: ReadEnd = ReadEnd.NONE
    # Names given with the default end: dropped from the value, kept for name checks.
    _silent: tuple[str, ...] = attrs.field(init=False, default=(), eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.default, ReadEnd):
            raise TypeError(f"ReadEffect default must be a ReadEnd, got {self.default!r}")
        for key, value in self._items:
            if not isinstance(key, str):
                raise TypeError(
                    f"ReadEffect buffer names must be str: key {key!r} "
                    f"({type(key).__name__}) with value {value!r}"
                )
            if not isinstance(value, ReadEnd):
                raise TypeError(
                    f"ReadEffect values must be ReadEnd: buffer {key!r} has value {value!r} "
                    f"({type(value).__name__})"
                )
        # Semantic equality: an entry equal to the default says nothing.
        kept = tuple((k, v) for k, v in self._items if v is not self.default)
        if len(kept) != len(self._items):
            object.__setattr__(self, "_silent", tuple(k for k, v in self._items if v is self.default))
        object.__setattr__(self, "_items", kept)

    @classmethod
    def of(cls, ends: Mapping[str, ReadEnd], default: ReadEnd = ReadEnd.NONE) -> ReadEffect:
        """Build an effect from ``{buffer: end}``; ``TypeError`` names a bad key or value."""
        if not isinstance(ends, Mapping):
            raise TypeError(f"ReadEffect.of expects a mapping buffer -> ReadEnd, got {ends!r}")
        return cls(items=ends.items(), default=default)

    @classmethod
    def none(cls) -> ReadEffect:
        """Bottom: no buffer is read."""
        return cls(items=(), default=ReadEnd.NONE)

    @classmethod
    def unknown(cls) -> ReadEffect:
        """Top: every buffer may be read at any time (the coarse fence)."""
        return cls(items=(), default=ReadEnd.UNKNOWN)

    @classmethod
    def uniform(cls, buffers: tuple[str, ...] | list[str], end: ReadEnd) -> ReadEffect:
        """Every buffer in ``buffers`` ends at ``end``; all others at ``NONE``.

        >>> ReadEffect.uniform(["seq_lens"], ReadEnd.IN_REPLAY)["seq_lens"]
        <ReadEnd.IN_REPLAY: 2>
        """
        return cls.of(dict.fromkeys(buffers, end))

    # -- lookup ------------------------------------------------------------------------------
    def __getitem__(self, buffer: str) -> ReadEnd:
        if not isinstance(buffer, str):
            raise TypeError(f"buffer names are str, got {buffer!r}")
        for key, end in self._items:
            if key == buffer:
                return end
        return self.default

    @property
    def buffers(self) -> tuple[str, ...]:
        """The buffers named explicitly (those whose end differs from the default)."""
        return tuple(k for k, _ in self._items)

    @property
    def named(self) -> tuple[str, ...]:
        """Every buffer name this effect was built with, those given the default end included.

        Not part of the value (equal effects may differ here, and joins keep only
        :attr:`buffers`): it is what a declaration *names*, for checking the names against a
        schema before the entries equal to the default are forgotten.

        >>> e = ReadEffect.of({"req_to_tokn": ReadEnd.NONE, "seq_lens": ReadEnd.IN_REPLAY})
        >>> e.buffers, e.named, e == ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY})
        (('seq_lens',), ('seq_lens', 'req_to_tokn'), True)
        """
        return self.buffers + self._silent

    def items(self) -> Iterator[tuple[str, ReadEnd]]:
        return iter(self._items)

    def as_dict(self) -> dict[str, ReadEnd]:
        return dict(self._items)

    @property
    def end(self) -> ReadEnd:
        """Join over all buffers, unnamed ones (the default) included."""
        return ReadEnd.join_all([self.default, *(e for _, e in self._items)])

    # -- lattice -----------------------------------------------------------------------------
    def map(self, f: Callable[[ReadEnd], ReadEnd]) -> ReadEffect:
        """Apply ``f`` to every buffer's end, the default included."""
        return ReadEffect(items=((k, f(v)) for k, v in self._items), default=f(self.default))

    def zip_with(self, other: ReadEffect, f: Callable[[ReadEnd, ReadEnd], ReadEnd]) -> ReadEffect:
        """Pointwise combination over the union of both effects' buffers."""
        keys = set(self.buffers) | set(other.buffers)
        return ReadEffect(
            items=((k, f(self[k], other[k])) for k in keys), default=f(self.default, other.default)
        )

    def __or__(self, other: ReadEffect) -> ReadEffect:
        if not isinstance(other, ReadEffect):
            return NotImplemented
        return self.zip_with(other, ReadEnd.join)

    def __le__(self, other: ReadEffect) -> bool:
        if not isinstance(other, ReadEffect):
            return NotImplemented
        keys = set(self.buffers) | set(other.buffers)
        return self.default <= other.default and all(self[k] <= other[k] for k in keys)

    def __ge__(self, other: ReadEffect) -> bool:
        if not isinstance(other, ReadEffect):
            return NotImplemented
        return other <= self

    def __lt__(self, other: ReadEffect) -> bool:
        if not isinstance(other, ReadEffect):
            return NotImplemented
        return self <= other and self != other

    def __gt__(self, other: ReadEffect) -> bool:
        if not isinstance(other, ReadEffect):
            return NotImplemented
        return other < self

    @staticmethod
    def join_all(effects: Iterable[ReadEffect]) -> ReadEffect:
        """Join of any number of effects; the empty join is ``ReadEffect.none()``."""
        out = ReadEffect.none()
        for effect in effects:
            out = out | effect
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v.name}" for k, v in self._items)
        return f"ReadEffect({{{body}}}, default={self.default.name})"
