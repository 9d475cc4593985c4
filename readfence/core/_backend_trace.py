"""A backend's step traced into a ``Program`` on readfence's example state, and cached.

:func:`trace` builds the example step of a model config (``_state``, ``_model``) and hands its
functions to the tracer (:func:`readfence.core.tracing.trace_step`); the program is kept per
backend code, mode, model, batch size, device and seed (:class:`TraceKey`) and rechecked on a
hit: each tensor its graphs captured must still be where the backend keeps it. It sits above
the tracer so that the tracer needs neither the model nor the state it runs on.
"""

from __future__ import annotations

from typing import Any

import attrs

from ._checks import check_backend, check_mode, positive_int
from ._model import step_functions
from ._modes import ForwardMode
from ._program import Program
from ._protocol import BackendLike
from ._state import ModelConfig, example_step
from .tracing import CACHES, CodeKey, KeptTensor, code_key, first_stale, kept_tensors, reach, trace_step


@attrs.frozen
class TraceKey:
    """What a traced program depends on: the backend's code and the values it can read
    (:class:`~readfence.core.tracing.CodeKey`), the mode, the model, the batch size, the
    device the trace's tensors are on and the example's seed."""

    code: CodeKey
    mode: ForwardMode
    cfg: Any
    batch_size: int
    device: str
    seed: int


def _nodes(program: Program) -> int:
    return sum(len(s.graph.gm.graph.nodes) for s in program.stages)


#: Traced programs, at most 1024 and a million graph nodes in all (a 64-layer model's program
#: is some 20,000 nodes, about 6 MB; lowering every size of a capture list traces three programs
#: per size for a combinator of two), the oldest forgotten first.
TRACES = CACHES.table("traces", TraceKey, "the traced program; rechecked: each tensor it captured still where the "
                      "backend keeps it, with its storage and shape", limit=1024, budget=1_000_000, weight=_nodes)


def forget_trace(backend: BackendLike, mode: ForwardMode, *, cfg: ModelConfig, batch_size: int, device: str,
                 seed: int = 0) -> None:
    """Forget the cached trace that :func:`trace` with these arguments returns (and, with it,
    everything computed from it): the next call traces again.

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig
    >>> first = trace(paged(), ForwardMode.DECODE)
    >>> forget_trace(paged(), ForwardMode.DECODE, cfg=ModelConfig(), batch_size=2, device="cpu")
    >>> trace(paged(), ForwardMode.DECODE) is first
    False
    """
    TRACES.forget(TraceKey(code_key(backend), mode, cfg, batch_size, str(device), seed))


def _still_kept(kept: tuple[KeptTensor, ...], backend: BackendLike) -> str | None:
    stale = first_stale(kept, backend)
    return None if stale is None else f"stage {stale[0].stage}'s tensor at {stale[0].where} {stale[1]}"


def _trace_uncached(backend: BackendLike, mode: ForwardMode, cfg: Any, batch_size: int, device: str, seed: int) -> Program:
    step = example_step(cfg, mode, batch_size, seed=seed, device="cpu")
    return trace_step(step_functions(backend, mode, cfg), mode, step.groups(), device=device)


def trace(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_size: int = 2,
    device: str = "cpu",
    seed: int = 0,
) -> Program:
    """Trace ``backend``'s step in ``mode`` into a ``Program`` (cached per arguments, and per
    the Python values the backend's code can read: see :class:`TraceKey`).

    Stages: ``prepare_out_graph`` (eager, before replay), ``prepare_in_graph`` (first nodes
    of the graph) and ``body`` (the model's forward, calling ``attend`` per layer). Inputs
    come from ``example_step(cfg, mode, batch_size, seed=seed)``; on a device other than
    CPU they are fake tensors, so no such device is needed. Raises ``StageWriteError`` if a
    stage writes a shared buffer.

    >>> from readfence.backends import paged
    >>> prog = trace(paged(), ForwardMode.DECODE)
    >>> prog.traced() <= paged().read_effect(ForwardMode.DECODE)
    True
    """
    check_backend(backend)
    check_mode(mode)
    if cfg is None:
        cfg = ModelConfig()
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    device = str(device)
    key = TraceKey(code_key(backend), mode, cfg, batch_size, device, seed)
    hit: Program | None = TRACES.get(key)
    if hit is not None:
        return hit
    program = _trace_uncached(backend, mode, cfg, batch_size, device, seed)
    if not program.captured():
        return TRACES.put(key, program)
    # where the backend keeps each tensor its graphs captured (after the trace: what it ran on)
    kept = kept_tensors(program.stages, reach(backend, "backend"))
    return TRACES.put(key, program, check=lambda: _still_kept(kept, backend))
