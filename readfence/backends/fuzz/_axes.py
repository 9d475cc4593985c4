"""The axes a generated program varies along: the stages a pattern is placed in, the ways a stage
reaches its buffer, the modes programs run in, the combinators trees are built with, and the
shapes a leaf returns its metadata in.

>>> STAGE_NAMES, STAGE_END["attend"]
(('prepare_out_graph', 'prepare_in_graph', 'attend'), <ReadEnd.POST_REPLAY: 3>)
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from readfence.core import PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, ForwardMode
from readfence.effects import ReadEnd

Tensors = Mapping[str, Tensor]
State = Mapping[str, Mapping[str, Tensor]]
M = ForwardMode
OUT, IN, ATTEND = PREPARE_OUT_GRAPH.name, PREPARE_IN_GRAPH.name, "attend"

#: The stages a pattern can be placed in, in execution order.
STAGE_NAMES: tuple[str, ...] = (OUT, IN, ATTEND)

#: The read end of a read made in each stage (``attend`` runs in the model body).
STAGE_END: dict[str, ReadEnd] = {OUT: ReadEnd.PRE_REPLAY, IN: ReadEnd.IN_REPLAY, ATTEND: ReadEnd.POST_REPLAY}

#: How a stage reaches its buffer: the stage's ``shared`` argument, or a reference the leaf
#: keeps to the live buffer (``closure``, ``attribute``, ``global``, ``dlpack``), or a
#: tensor ``prepare_out_graph`` stashed on the leaf (``stash_clone``, ``stash_dlpack``:
#: trace-time state, only for the later stages).
VIAS: tuple[str, ...] = ("argument", "closure", "attribute", "global", "dlpack", "stash_clone", "stash_dlpack")
_LIVE_VIAS = frozenset({"closure", "attribute", "global", "dlpack"})
_STASH_VIAS = frozenset({"stash_clone", "stash_dlpack"})

#: The modes programs run in: both replay a captured graph.
FUZZ_MODES: tuple[ForwardMode, ...] = (M.DECODE, M.TARGET_VERIFY)

#: The combinators trees are built with.
COMBINATORS: tuple[str, ...] = ("join", "tbo", "hybrid_linear", "select")

#: How a leaf's prepare stages return their metadata (what the step carries, see
#: ``readfence.core.internal.check_stage_output``): a flat dict; nested in a dict per stage; as a list
#: of (key, value) tuples; under tuple and int keys; with Python scalars and ``None`` beside
#: the tensors; and, from ``prepare_in_graph``, a refinement of an out-of-graph tensor under
#: its own key.
RETURN_SHAPES: tuple[str, ...] = ("flat", "nested", "sequences", "odd_keys", "python_values", "same_key")
_LAYER_SPLITTING = frozenset({"join", "hybrid_linear"})  # children attend different layers
