"""Generated user backends for differential fuzzing of the analysis: an op vocabulary, programs
built from it, and hypothesis strategies that draw them.

A *pattern* is a small named building block that reads (or writes) one shared buffer: a view
or list view, a real or a no-op copy, a host read, a conditional read, a custom op, a write,
a read handed to another thread; or uses only its metadata (``zeros_like``, ``new_zeros``,
``size``...), which reads nothing.
A :class:`Placement` puts a pattern in a stage of a leaf, on a buffer, reaching the buffer
*via* the stage's argument or a reference the leaf keeps (closure, attribute, global, DLPack,
a stash made in ``prepare_out_graph``); from a prepare stage its result is either reduced
there or *carried* into the body as metadata (what crosses into the graph). A
:class:`FuzzLeaf` is a paged leaf with placements and a random declaration, a
:class:`FuzzTree` a combinator (``join``, ``tbo``, ``hybrid_linear``, ``select``) over
them, and a :class:`FuzzProgram` a tree and the mode it runs in. Every value a pattern reads
goes into the leaf's attention output through a fingerprint, so a race changes the logits;
indices stay in range whatever the buffers hold (in-range poison included).

Programs are data: they print, compare and shrink; :meth:`FuzzProgram.build` makes the
backend against the live state the checks run on (patterns that keep a reference to a buffer
need it). ``readfence.graph.fuzz.check_program`` holds the analysis to the dynamic checks on
one program.

Fuzz your own op vocabulary: add patterns to a copy of :data:`VOCABULARY` and draw programs
from ``programs(vocabulary=...)`` (hypothesis: shrinks a failing program to a small one) or
``random_programs(n, seed, vocabulary=...)`` (uniform: long runs cover it evenly).

>>> from hypothesis import given, settings
>>> @settings(max_examples=20, database=None)
... @given(programs())
... def check(program):
...     assert 1 <= program.layers <= 3 and program.leaves()
>>> check()
>>> from readfence.core import ForwardMode
>>> chunk = VOCABULARY["chunk"]
>>> mine = FuzzLeaf("mine", (Placement(chunk, "prepare_in_graph", "seq_lens", carry=True),),
...                 declared(POST_REPLAY=["seq_lens"]))
>>> print(FuzzProgram(mine, ForwardMode.DECODE))
mine in DECODE
  mine: metadata in prepare_in_graph; declares seq_lens=POST_REPLAY
    chunk(seq_lens) in prepare_in_graph, carried
"""

from __future__ import annotations

from ._axes import COMBINATORS, FUZZ_MODES, RETURN_SHAPES, STAGE_END, STAGE_NAMES, VIAS
from ._generator import CLASS_WEIGHTS
from ._leaf import FuzzLeaf, Placement, declared
from ._ops import _KEPT as _KEPT  # the planned buffers, which a test may plant by hand
from ._ops import copy_pieces, gather_rows, gather_rows_unknown, keep, planned_gather
from ._program import FuzzProgram, FuzzTree
from ._strategies import declarations, leaves, placements, programs, random_programs
from ._vocabulary import VOCABULARY, Pattern, Site, fingerprint

__all__ = [
    "CLASS_WEIGHTS",
    "COMBINATORS",
    "FUZZ_MODES",
    "RETURN_SHAPES",
    "STAGE_NAMES",
    "STAGE_END",
    "VIAS",
    "VOCABULARY",
    "FuzzLeaf",
    "FuzzProgram",
    "FuzzTree",
    "Pattern",
    "Placement",
    "Site",
    "declarations",
    "declared",
    "copy_pieces",
    "fingerprint",
    "gather_rows",
    "gather_rows_unknown",
    "keep",
    "leaves",
    "placements",
    "planned_gather",
    "programs",
    "random_programs",
]
