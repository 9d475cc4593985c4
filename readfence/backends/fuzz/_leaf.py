"""A generated leaf: a :class:`Placement` of a pattern in a stage, on a buffer, reached one way,
and a :class:`FuzzLeaf` that holds placements and a declaration.

>>> from readfence.backends.fuzz import VOCABULARY
>>> p = Placement(VOCABULARY["clone"], "attend", "seq_lens", via="closure")
>>> print(FuzzLeaf("f0", (p,), declared(POST_REPLAY=["seq_lens"])))
f0: metadata in prepare_in_graph; declares seq_lens=POST_REPLAY
  clone(seq_lens) via closure in attend
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from readfence.core import SHARED_BUFFERS
from readfence.effects import ReadEffect, ReadEnd

from ._axes import _STASH_VIAS, ATTEND, IN, OUT, RETURN_SHAPES, VIAS
from ._vocabulary import Pattern


@attrs.frozen(repr=False)
class Placement:
    """A pattern placed in a ``stage`` on a ``buffer``, reaching it ``via`` (see :data:`VIAS`);
    from a prepare stage, ``carry`` returns the pattern's result as metadata for the body to
    read (else the stage reduces it to its fingerprint)."""

    pattern: Pattern
    stage: str
    buffer: str
    via: str = "argument"
    carry: bool = False

    def __attrs_post_init__(self) -> None:
        if self.stage not in self.pattern.stages:
            raise ValueError(f"pattern {self.pattern.name!r} cannot be placed in {self.stage!r} "
                             f"(only {', '.join(self.pattern.stages)})")
        if self.buffer not in SHARED_BUFFERS:
            raise ValueError(f"unknown buffer {self.buffer!r}; shared buffers are {list(SHARED_BUFFERS)}")
        if self.via not in VIAS:
            raise ValueError(f"unknown via {self.via!r}; one of {list(VIAS)}")
        if self.via in _STASH_VIAS and self.stage == OUT:
            raise ValueError(f"via {self.via!r} reads what prepare_out_graph stashed: place it in a later stage")
        if self.carry and self.stage == ATTEND:
            raise ValueError("only a prepare stage can carry its result into the body")

    def __repr__(self) -> str:
        via = "" if self.via == "argument" else f" via {self.via}"
        carry = ", carried" if self.carry else ""
        return f"{self.pattern.name}({self.buffer}){via} in {self.stage}{carry}"


def declared(**ends: Sequence[str]) -> tuple[tuple[str, ReadEnd], ...]:
    """A declaration from ``END=[buffers]`` keywords (buffers not named: ``NONE``).

    >>> declared(IN_REPLAY=["seq_lens"])[:2]
    (('req_to_token', <ReadEnd.NONE: 0>), ('seq_lens', <ReadEnd.IN_REPLAY: 2>))
    """
    per = {b: ReadEnd[end] for end, buffers in ends.items() for b in buffers}
    return tuple((b, per.get(b, ReadEnd.NONE)) for b in SHARED_BUFFERS)


@attrs.frozen(repr=False)
class FuzzLeaf:
    """A paged leaf: attention over the page-table metadata built in ``meta_stage`` (``None``:
    from the batch alone, reading no shared buffer), its placements, and its declaration
    (per buffer, the end it declares: the same in every mode)."""

    name: str
    placements: tuple[Placement, ...]
    declared: tuple[tuple[str, ReadEnd], ...]
    meta_stage: str | None = IN
    returns: str = "flat"  # how its prepare stages return their metadata (see RETURN_SHAPES)

    def __attrs_post_init__(self) -> None:
        if self.returns not in RETURN_SHAPES:
            raise ValueError(f"unknown return shape {self.returns!r}; one of {list(RETURN_SHAPES)}")

    def effect(self) -> ReadEffect:
        return ReadEffect.of(dict(self.declared))

    def __repr__(self) -> str:
        meta = f"metadata in {self.meta_stage}" if self.meta_stage else "metadata from the batch"
        if self.returns != "flat":
            meta += f", returned {self.returns}"
        ends = ", ".join(f"{b}={e.name}" for b, e in self.declared if e is not ReadEnd.NONE) or "nothing"
        lines = [f"{self.name}: {meta}; declares {ends}"]
        lines += [f"  {p!r}" for p in self.placements]
        return "\n".join(lines)
