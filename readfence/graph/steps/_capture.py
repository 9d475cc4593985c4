"""A capture list: one lowered graph per batch size, as an engine's graph runner keeps them.

An engine captures a graph for each size of its capture list and replays the smallest that
fits a batch, padding the rest. :func:`lower_capture_list` lowers a target for every size on
one live state (each graph with its own event ring: a fence is never bound to another size's
event) and says what each size cost: the first pays for warming the tracer up, the others
for their own trace, audit and code (each size is traced on its own shapes: a backend's reads
may depend on the batch size). What a size keeps is its own graphs: no traced program holds its
example's tensors, and the trace cache forgets its oldest programs past a bound.

A backend may regrow a buffer it keeps (its metadata, sized for the largest batch it has seen)
while a larger size is lowered: the graphs of the smaller sizes captured the old tensor and would
replay reading it. Once every size is lowered, :func:`recapture` lowers again each size whose
graphs captured a tensor the backend has replaced, resized or moved since (``Lowered.stale``),
until none has; a replay checks it too, and refuses a stale graph rather than read the old buffer.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping

import attrs
from torch import Tensor

from readfence.backends import PerStream
from readfence.core import ForwardMode, ModelConfig
from readfence.core.internal import StaleCaptureError, model_config, positive_int
from readfence.graph.devices import Device
from readfence.graph.lowering import LowerOptions, Policy, make_state

from ._composite import PhasedStep, StreamGroup, StreamOrder
from ._shapes import StepShape
from ._target import LoweredStep, Target, lower_step


def members(target: Target) -> int:
    """How many forward streams share a step of ``target`` (a ``per_stream`` group's members; a step
    shape's most, over its phases: a batch must give each of them a request).

    >>> from readfence.backends import paged, per_stream
    >>> from readfence.graph import eagle
    >>> members(per_stream(paged(), paged())), members(eagle(per_stream(paged(), paged()), paged()))
    (2, 2)
    """
    if isinstance(target, PerStream):
        return len(target.members)
    if isinstance(target, StepShape):
        return max((members(p.backend) for p in target.phases), default=1)
    return 1


def capture_list(sizes: Iterable[int], cfg: ModelConfig, target: Target | None = None) -> tuple[int, ...]:
    """The batch sizes to capture, sorted: each in ``1..cfg.max_reqs``; for a ``per_stream``
    group of ``m`` members only sizes ``>= m`` (every member serves a share).

    >>> from readfence.backends import paged, per_stream
    >>> capture_list([8, 1, 4, 2], ModelConfig()), capture_list([1, 2, 4], ModelConfig(), per_stream(paged(), paged()))
    ((1, 2, 4, 8), (2, 4))
    """
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"capture_sizes must be a collection of batch sizes, got {sizes!r}")
    chosen = sorted({positive_int("capture size", s, at_most=cfg.max_reqs, limit="cfg.max_reqs") for s in sizes})
    if not chosen:
        raise ValueError("capture_sizes must name at least one batch size")
    m = 1 if target is None else members(target)
    kept = tuple(s for s in chosen if s >= m)
    if not kept:
        raise ValueError(f"a per_stream group of {m} members needs a capture size >= {m}, got {chosen}")
    return kept


@attrs.frozen
class CaptureList:
    """Lowered graphs of one target and mode by batch size (``sizes``, ascending), on one live
    ``state``, and the seconds each took to lower.

    ``for_batch(n)`` is the graph a batch of ``n`` requests replays: the smallest captured size
    that holds it.
    """

    sizes: tuple[int, ...]
    graphs: Mapping[int, LoweredStep]
    seconds: Mapping[int, float]
    state: Mapping[str, dict[str, Tensor]]

    def __getitem__(self, size: int) -> LoweredStep:
        return self.graphs[size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def for_batch(self, n: int) -> tuple[int, LoweredStep]:
        """``(size, graph)``: the smallest captured size ``>= n`` and its graph.

        Raises ``ValueError`` naming ``n`` and the sizes when none holds it."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TypeError(f"a batch size is a positive int, got {n!r} ({type(n).__name__})")
        k = bisect.bisect_left(self.sizes, n)
        if k == len(self.sizes):
            raise ValueError(f"no captured graph holds a batch of {n} requests: the capture list is "
                             f"{list(self.sizes)}; capture a size >= {n} or split the batch")
        return self.sizes[k], self.graphs[self.sizes[k]]


def lower_capture_list(
    target: Target,
    mode: ForwardMode,
    batch_sizes: Iterable[int],
    *,
    device: Device,
    policy: Policy,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    lowering: LowerOptions | None = None,
    order: StreamOrder | None = None,
) -> CaptureList:
    """Lower ``target`` (a backend, a ``per_stream`` group or a step shape) in ``mode`` for every
    size of ``batch_sizes`` on one live ``state`` (made for ``cfg`` on ``device`` when omitted).

    Every graph is lowered with ``lowering`` (its ring size, check mode...); ``order`` is the
    stream order of a loop's ``per_stream`` groups (as :func:`lower_step`). A size is an int in
    ``1..cfg.max_reqs``; duplicates are lowered once.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     graphs = lower_capture_list(paged(), ForwardMode.DECODE, [4, 1, 2], device=dev, policy=Policy.EXACT)
    ...     graphs.sizes, graphs.for_batch(3)[0]
    ((1, 2, 4), 4)
    """
    cfg = model_config(cfg)
    sizes = capture_list(batch_sizes, cfg, target)
    state = make_state(cfg, device) if state is None else state
    graphs: dict[int, LoweredStep] = {}
    seconds: dict[int, float] = {}

    def lowered(size: int) -> LoweredStep:
        start = time.perf_counter()
        graphs[size] = lower_step(target, mode, device=device, policy=policy, batch_size=size, cfg=cfg, state=state,
                                  lowering=lowering, order=order)
        seconds[size] = seconds.get(size, 0.0) + time.perf_counter() - start
        return graphs[size]

    for size in sizes:
        lowered(size)
    recapture(graphs, lowered)
    return CaptureList(sizes, graphs, seconds, state)


def step_stale(low: object) -> StaleCaptureError | None:
    """Why a lowered step (a ``Lowered``, a phased step or a stream group: any of their graphs)
    no longer reads what its backend keeps (``Lowered.stale``), or ``None``."""
    parts = (low.graphs.values() if isinstance(low, PhasedStep) else low.lowered if isinstance(low, StreamGroup)
             else (low,))
    for part in parts:
        stale = getattr(part, "stale", None)
        error = stale() if callable(stale) else None
        if error is not None:
            return error
    return None


def recapture(graphs: MutableMapping[int, LoweredStep], lower: Callable[[int], LoweredStep]) -> tuple[int, ...]:
    """Lower again (``lower(size)``) each size of ``graphs`` that is stale (:func:`step_stale`: a
    tensor its graphs captured was replaced since, e.g. a buffer the backend regrew while a larger
    size was lowered), until none is; the sizes lowered again, in order. A backend that replaces a
    captured buffer at every lowering never settles: its :class:`StaleCaptureError` is raised.

    >>> recapture({1: object(), 2: object()}, lambda size: object())
    ()
    """
    again: list[int] = []
    for _ in range(len(graphs) + 1):
        stale = [size for size, low in graphs.items() if step_stale(low) is not None]
        if not stale:
            return tuple(again)
        for size in stale:
            graphs[size] = lower(size)
            again.append(size)
    error = next(e for low in graphs.values() if (e := step_stale(low)) is not None)
    raise StaleCaptureError(error.backend, f"lowered again {len(again)} times, still stale", error.stage, error.kept,
                            "was replaced again by the next lowering")
