"""The three stages of a step (:class:`Stage`: where each runs and when its reads end) and the
dotted names a stage's keyword groups are flattened into.

>>> [s.name for s in STAGES]
['prepare_out_graph', 'prepare_in_graph', 'body']
"""


from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs
from torch.utils import _pytree as pytree

from readfence.effects import ReadEnd, ReadfenceError


@attrs.frozen
class Stage:
    """One stage of a step: its name, whether it runs inside the graph, and read ends.

    ``end`` is the read end of a read made in it. ``escape_end`` is what an escape costs it (a
    host read, a reference handed out, a branch on data: Python the trace could not see, so the
    step runs the stage's Python): the end until which every shared buffer counts as read, beyond
    what the stage is traced and seen to read. ``outputs`` is the group its outputs are named under.

    * In the graph it is ``POST_REPLAY``: on a path the trace did not take, ``prepare_in_graph``
      may hand the body a view of any buffer, read wherever the body consumes it; and a CUDA
      graph cannot capture the stage at all (``lower`` refuses it there).
    * Out of the graph it is ``NONE``: an escape counts for the buffers it reaches, no more.
      *When*: whatever the stage's Python reads, on any path, it reads before it returns, and
      what it returns crosses into the graph as copies, so each read ends at ``PRE_REPLAY``, its
      ``end``. *Which*: the value a host read hands over is computed from the escaping tensor,
      whose memory and whose ancestors in the traced graph are traced reads of the stage (a host
      read of a copy of ``seq_lens`` reads ``seq_lens``, not ``swa_map``); on the traced path the
      trace holds every read. On another path, taken where the Python branches on the value,
      the runs of its Python show what it reads: the read observer on the example steps, and on
      the varied states, whose values differ so that a branch on data goes another way
      (``core.internal.Ledger.observe_varied``, on every stage whose Python runs); the audit and ``lower`` count
      what they saw. A path none of them takes (a threshold no state crosses) is what ``verify``'s
      poison and the comparison with the serial run catch, as for any out-of-graph stage's Python
      that branches on what no trace sees (a counter it keeps).

    >>> PREPARE_IN_GRAPH.end, PREPARE_IN_GRAPH.escape_end, PREPARE_IN_GRAPH.in_graph
    (<ReadEnd.IN_REPLAY: 2>, <ReadEnd.POST_REPLAY: 3>, True)
    >>> PREPARE_OUT_GRAPH.escape_end
    <ReadEnd.NONE: 0>
    """

    name: str
    in_graph: bool
    end: ReadEnd
    escape_end: ReadEnd
    outputs: str

    def __str__(self) -> str:
        return self.name


#: Before the replay, host-launched; its outputs cross into the graph as copies, so nothing it
#: touched is read later: an escape counts for the buffers it reaches (see :class:`Stage`).
PREPARE_OUT_GRAPH = Stage("prepare_out_graph", in_graph=False, end=ReadEnd.PRE_REPLAY,
                          escape_end=ReadEnd.NONE, outputs="meta")
#: The graph's first nodes; its outputs are not copied: on a path the trace did not take they
#: may be views of any buffer, read wherever the body consumes them (POST_REPLAY).
PREPARE_IN_GRAPH = Stage("prepare_in_graph", in_graph=True, end=ReadEnd.IN_REPLAY,
                         escape_end=ReadEnd.POST_REPLAY, outputs="meta_in")
#: The model body, ``attend`` in every layer; its reads end with the replay.
BODY = Stage("body", in_graph=True, end=ReadEnd.POST_REPLAY, escape_end=ReadEnd.POST_REPLAY, outputs="logits")

#: The stages of one step, in execution order.
STAGES: tuple[Stage, ...] = (PREPARE_OUT_GRAPH, PREPARE_IN_GRAPH, BODY)
_BY_NAME = {s.name: s for s in STAGES}

#: Per stage name, the read end of a read in it: for what names a stage as text (the read
#: observer's labels); everything else holds the :class:`Stage` value and asks its ``end``.
STAGE_ENDS: dict[str, ReadEnd] = {s.name: s.end for s in STAGES}


def stage_named(name: str) -> Stage:
    """The :class:`Stage` called ``name``.

    >>> stage_named("body") is BODY
    True
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}; stages: {list(_BY_NAME)}") from None


class StageOutputError(ReadfenceError, ValueError):
    """A stage returned what a step cannot carry, or what the traced graph cannot reproduce.

    A stage returns a dict (``prepare_*``) or a tensor (``body``); a dict holds tensors, Python
    scalars (``bool``, ``int``, ``float``, ``str``), ``None``, and dicts, lists and tuples of
    them, under keys of any hashable type whose ``==`` is a Python bool (not a tensor). A traced
    graph bakes the Python values and tensor shapes of the one step it traced, so one that
    changes from step to step is refused too.
    The message names the backend, the stage, the key and the line that returned it; ``stage``
    is the stage's name (``None`` where no one stage is at fault).
    """

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


# -- names -----------------------------------------------------------------------------------
_PLAIN = re.compile(r"[A-Za-z_][^.\[\]]*")


def _segment(key: Any) -> str:
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.MappingKey):
        k = key.key
        if isinstance(k, str) and _PLAIN.fullmatch(k):
            return k
        return f"[{k!r}]"
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return f"[{key!r}]"  # pragma: no cover - other key kinds


def flatten_group(prefix: str, tree: object) -> list[tuple[str, Any]]:
    """``[(name, leaf)]`` for a pytree (dicts, lists, tuples) under ``prefix``.

    A name joins the key path with dots: a string key that starts with a letter or ``_`` and
    holds no ``.``, ``[`` or ``]`` as it is, a sequence index as digits, any other key as
    ``[repr(key)]``. So keys ``"a.b"`` and ``"a"`` / ``"b"`` nested, or ``1`` and ``"1"``, never
    share a name; two distinct keys whose reprs agree do, and are refused.

    >>> flatten_group("params", {"layers": [{"wq": 1}], "emb": 2})
    [('params.layers.0.wq', 1), ('params.emb', 2)]
    >>> [n for n, _ in flatten_group("meta", {"a.b": 1, "a": {"b": 2}, 1: 3, "1": 4})]
    ["meta.['a.b']", 'meta.a.b', 'meta.[1]', "meta.['1']"]
    """
    pairs, _ = pytree.tree_flatten_with_path(tree)
    out = [(".".join([prefix, *map(_segment, path)]), leaf) for path, leaf in pairs]
    _check_distinct(prefix, [n for n, _ in out], [p for p, _ in pairs])
    return out


def _check_distinct(prefix: str, names: Sequence[str], paths: Sequence[Any]) -> None:
    if len(set(names)) == len(names):
        return
    seen: dict[str, Any] = {}
    for name, path in zip(names, paths):
        if name in seen:
            raise StageOutputError(f"the keys {pytree.keystr(seen[name])} and {pytree.keystr(path)} of {prefix} "
                                   f"both flatten to {name!r} (distinct keys whose reprs agree): rename one")
        seen[name] = path
