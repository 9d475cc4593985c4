"""What core needs of a backend: stage functions and a declared effect (structural typing).

The concrete ``Backend`` value and its combinators live in ``readfence.backends``; core only
depends on this protocol, so the layering effects <- core <- backends holds.

Stage functions are pure over named tensors:

* ``prepare_out_graph(mode, shared, batch) -> meta``: eager, host-launched before replay;
  its reads of ``shared`` end at ``PRE_REPLAY``. What it returns crosses into the graph as a
  *copy* (see :func:`readfence.core.cross_into_graph`).
* ``prepare_in_graph(mode, shared, batch, meta) -> meta``: the first nodes of the captured
  graph; reads end at ``IN_REPLAY``. ``meta`` holds what ``prepare_out_graph`` returned.
* ``attend(mode, layer, q, k, v, pools, shared, batch, meta) -> out``: per layer, inside the
  model body; reads of ``shared`` here end at ``POST_REPLAY``. ``pools`` (KV caches, linear
  state) are model-owned and may be written; ``shared`` must never be written by any stage.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import attrs
from torch import Tensor

from readfence.effects import ReadEffect, ReadEnd

from ._modes import ForwardMode

Tensors = Mapping[str, Tensor]

@runtime_checkable
class BackendLike(Protocol):
    """An attention backend as core sees it: a name, a declared effect, three stage functions.

    What every stage receives: ``mode`` (the step's :class:`ForwardMode`); ``shared``, the
    scheduler's shared buffers by name (``req_to_token``, ``seq_lens``, ``swa_map``,
    ``state_slots``: see :data:`SHARED_BUFFERS`) holding this step's state; ``batch``, this
    step's inputs (``input_ids``, ``positions``, ``req_pool_indices``, ``out_cache_loc``;
    ``tokens_per_request(mode)`` tokens per request, request-major). No stage may write a shared
    buffer, in place, through a view or with ``out=`` (``StageWriteError``): the scheduler owns
    them. A read of a shared buffer ends at the stage that makes it, which is what
    :meth:`read_effect` must declare (``readfence.core.audit`` checks it against the traced code).

    Optionally, ``runs_as(mode)`` names the backend whose stage functions the step in ``mode``
    runs unchanged (a wrapper handing the whole step to one child); see :func:`runs_as`; and
    ``child_runs(mode, batch_size)`` says which children a step runs and at which batch size
    (see :func:`child_runs`); and ``replayed(mode)`` whether the engine replays a step in ``mode``
    from a captured graph (see :func:`replayed`).
    """

    @property
    def name(self) -> str:
        """The name specs use for this backend (a leaf's, or the combinator's)."""
        ...

    def read_effect(self, mode: ForwardMode) -> ReadEffect:
        """Per shared buffer, the stage end by which every read of it in a ``mode`` step is done."""
        ...

    def read_end(self, mode: ForwardMode) -> ReadEnd:
        """``read_effect(mode).end``: the join over all buffers."""
        ...

    def children(self) -> tuple[tuple[str, BackendLike], ...]:
        """``(label, child)`` pairs, e.g. ``("children[0]", paged)``; ``()`` for a leaf."""
        ...

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        """Eager metadata work the host launches before the replay; its reads end at ``PRE_REPLAY``.

        May read ``shared`` and ``batch``, on the device or on the host (``.item()``,
        ``.tolist()`` and data-dependent branches are fine here on the CPU device: this stage is
        not captured, and a host read then holds what its value was computed from until
        ``PRE_REPLAY``, with what the stage's Python reads on the varied states; on CUDA the
        trace, on fake tensors, stops at a host read and lowering refuses the step).
        Returns metadata tensors by name; they cross into the graph as *copies* made when it
        returns (:func:`~readfence.core.cross_into_graph`), so a view of a shared buffer returned here is read
        by that copy, never inside the graph. Keep no reference to ``shared`` for later stages:
        a kernel that reads what an earlier stage stored is invisible to the static analysis.
        """
        ...

    def prepare_in_graph(
        self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors
    ) -> dict[str, Tensor]:
        """The first nodes of the captured graph; its reads end at ``IN_REPLAY``.

        Receives ``meta``: the copies of what ``prepare_out_graph`` returned. May read
        ``shared``, ``batch`` and ``meta`` with device ops only: a CUDA graph replays kernels, not
        Python, so a host read or a branch on tensor data here cannot be captured (CUDA lowering
        refuses it; the CPU device runs the stage's Python in the step, and the stage then holds
        every buffer until ``POST_REPLAY``). Returns more
        metadata, merged over ``meta`` for ``attend``; it is *not* copied: a view of a shared
        buffer returned here is read wherever ``attend`` uses it (``POST_REPLAY``); snapshot it
        (``.clone()``, ``index_select``) to end the read here.
        """
        ...

    def attend(
        self,
        mode: ForwardMode,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pools: dict[str, Tensor],
        shared: Tensors,
        batch: Tensors,
        meta: Tensors,
    ) -> Tensor:
        """Attention of one ``layer``, inside the model body; reads of ``shared`` here end at
        ``POST_REPLAY`` (after the replay: the fence waits for the whole graph).

        Receives the layer's ``q``, ``k``, ``v`` ``[T, H, D]`` for the step's ``T`` tokens;
        ``pools``, the model-owned caches (KV, linear state), which it may write (store this
        step's ``k``/``v`` at ``batch["out_cache_loc"]``); ``meta``, both prepare stages'
        outputs. Returns the attention output shaped like ``q``. It must not write ``shared``.
        """
        ...


def runs_as(backend: BackendLike, mode: ForwardMode) -> BackendLike:
    """The backend whose stage functions ``backend``'s step in ``mode`` runs: what its optional
    ``runs_as(mode)`` method says (a wrapper that hands the whole step to one child names it),
    else ``backend`` itself. Two backends that run as the same one trace and observe alike, so
    ``audit`` traces and observes that one once and reports it under each name.

    Only a class of readfence's own (its combinators, leaves and engine adapters, by the file it is
    defined in) is taken at its word: a user's class, or a user's subclass of one of readfence's,
    may add a read of its own to the step it says it hands on, so its own step is traced.

    >>> from readfence.backends import per_stream, paged, trtllm_mha
    >>> runs_as(per_stream(paged(), trtllm_mha()), ForwardMode.DECODE) == paged()
    True
    """
    method = getattr(backend, "runs_as", None)
    if method is None:
        return backend
    runner = method(mode)
    if not isinstance(runner, BackendLike):
        raise TypeError(f"{backend.name}.runs_as({mode}) must return a backend, got {runner!r} "
                        f"({type(runner).__name__})")
    return runner if _own_class(type(backend)) else backend


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _own_class(cls: type) -> bool:
    """Whether ``cls`` is defined in a file of readfence's package (where, not what it is named).

    >>> from readfence.backends import paged
    >>> _own_class(type(paged())), _own_class(dict)
    (True, False)
    """
    module = sys.modules.get(cls.__module__)
    where = getattr(module, "__file__", None)
    return where is not None and os.path.abspath(where).startswith(_PACKAGE)


def replayed(backend: BackendLike, mode: ForwardMode) -> bool:
    """Whether a step of ``backend`` in ``mode`` is replayed from a captured graph: what its optional
    ``replayed(mode)`` method says (an engine backend: whether its engine graph-replays it), else
    whether ``mode`` is one engines replay (:attr:`ForwardMode.uses_graph`) and every child is
    replayed in it (an engine turns graphs off for a step any of whose backends it does not
    replay). A step that is not replayed runs every stage as its Python, as an engine runs such a
    mode: nothing of it is captured, so nothing bakes its shapes or Python values.

    >>> from readfence.backends import paged
    >>> replayed(paged(), ForwardMode.DECODE), replayed(paged(), ForwardMode.EXTEND)
    (True, False)
    """
    method = getattr(backend, "replayed", None)
    if method is None:
        return mode.uses_graph and all(replayed(child, mode) for _, child in backend.children())
    answer = method(mode)
    if not isinstance(answer, bool):
        raise TypeError(f"{backend.name}.replayed({mode}) must return a bool, got {answer!r} "
                        f"({type(answer).__name__})")
    return answer


@attrs.frozen
class ChildRun:
    """One child a wrapper's step runs: its ``label`` and ``backend``, the ``batch_size`` it is
    handed (``0``: a micro-batch with no request), and whether a fence is ``placed`` from its own
    declaration (a ``per_stream`` member publishes its stream's fence) rather than from the
    wrapper's joined one.

    >>> from readfence.backends import paged
    >>> ChildRun("children[0]", paged(), 2).placed
    False
    """

    label: str
    backend: BackendLike
    batch_size: int
    placed: bool = False


def child_runs(backend: BackendLike, mode: ForwardMode, batch_size: int) -> tuple[ChildRun, ...]:
    """The children ``backend``'s step in ``mode`` at ``batch_size`` runs, each with the batch
    size it is handed: what the optional ``child_runs(mode, batch_size)`` method says (a
    ``select`` runs only its selected arm, a ``tbo`` hands each child its micro-batch), else
    every child at ``batch_size``. The audit judges each node only where it runs.

    >>> from readfence.backends import select, tbo, paged, dense
    >>> [(r.label, r.batch_size) for r in child_runs(tbo(paged(), dense(), paged()), ForwardMode.DECODE, 3)]
    [('primary', 3), ('children[0]', 2), ('children[1]', 1)]
    >>> [r.label for r in child_runs(select({ForwardMode.DECODE: paged()}, default=dense()), ForwardMode.EXTEND, 2)]
    ['default']
    """
    method = getattr(backend, "child_runs", None)
    if method is None:
        return tuple(ChildRun(label, child, batch_size) for label, child in backend.children())
    runs = tuple(method(mode, batch_size))
    bad = [r for r in runs if not isinstance(r, ChildRun)]
    if bad:
        raise TypeError(f"{backend.name}.child_runs({mode}, {batch_size}) must return ChildRun values, got "
                        f"{bad[0]!r} ({type(bad[0]).__name__})")
    return runs
