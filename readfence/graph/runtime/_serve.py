"""The serving loop: the overlapped loop as an engine runs it.

Requests arrive (a seeded Poisson process, :class:`Traffic`), are admitted up to the model's
limits, prefilled in chunks and decoded until their output length (:class:`ServeScheduler`),
so the batch size follows the traffic. As an engine's graph runner does, the loop lowers one
graph per batch size of a capture list and runs each decode step in the smallest that fits,
the batch padded; a prefill (EXTEND) step runs eagerly at its own batch size, its fence
resolved from the prefill backend's own declaration (``PRE_REPLAY`` where it snapshots its
reads, the coarse fence where it declares nothing). Step shapes (``eagle(...)``) run their
phases in each decode step and prefill with their target; a ``per_stream`` group runs every
batch size on the same forward streams.

The fence step ``i`` publishes comes from the graph step ``i`` replayed, and step ``i+1``'s
writes wait on it: before a wait is bound, the loop checks that each event it binds is
recorded by that graph alone (:class:`ForeignEventError` otherwise, naming both graphs). Each
graph keeps its own event ring.

:func:`run_serve_serial` is the reference: the same schedule, eager, one step after another,
each step at its exact batch size. Each request's outputs must be bit-identical to it.
"""

from __future__ import annotations

import collections
import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.backends import PerStream
from readfence.core import SHARED_BUFFERS, BackendLike, ForwardMode, ModelConfig
from readfence.core.internal import model_config, positive_int, request_ranges, tokens_per_request

from ..devices import Device, Event, Timeline
from ..devices.internal import check_device
from ..lowering import CheckState, LowerOptions, Policy, StepRun, make_state, torch_device
from ..lowering.internal import check_owned, device_of, for_a_loop, names_keywords, set_by
from ..steps import CaptureList, PhasedStep, StepShape, StreamGroup, capture_list, lower_capture_list
from ..steps.internal import (
    LoweredStep,
    StreamOrder,
    Target,
    check_run,
    eager_step,
    lower_step,
    members,
    recapture,
    scheduling_mode,
)
from ._arrivals import Traffic
from ._loop import DecodeLoop, fence_summary, sanitized, settled_on_error, synthetic_work
from ._options import ServeOptions, options_of, said_in
from ._result import same_logits
from ._sanitizer import Violation
from ._serve_scheduler import DECODE, PREFILL, ServeScheduler, ServeStep

#: The batch sizes captured by default, in the engines' style (a graph per size; a batch runs
#: in the smallest that fits, padded).
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)


def prefill_target(target: Target) -> BackendLike:
    """What runs a prefill (EXTEND) step of ``target``: a backend or a ``per_stream`` group
    itself; a step shape's target (the backend of its first ``TARGET_VERIFY`` phase).

    >>> from readfence.backends import paged, trtllm_mha
    >>> from readfence.graph import eagle
    >>> prefill_target(eagle(trtllm_mha(), paged())).name
    'trtllm_mha'
    """
    if isinstance(target, StepShape):
        return next((p.backend for p in target.phases if p.mode is ForwardMode.TARGET_VERIFY), target.phases[0].backend)
    return target


def _padded(kind: str, size: int, sizes: Sequence[int], members: int) -> int:
    need = max(size, members)
    if kind == PREFILL:
        return need
    return next(s for s in sizes if s >= need)


@attrs.frozen
class StepRecord:
    """What one step of the serving loop ran: its ``kind`` (``"prefill"``, ``"decode"``), the
    ``requests`` (ids, batch order), the size of the graph it ran in (``padded``), the
    ``graph`` (``"decode b8"``, ``"prefill b3"``), whether that is a captured graph
    replay (``graphed``) and, per forward stream, how many stage runs the step made there."""

    step: int
    kind: str
    requests: tuple[int, ...]
    padded: int
    graph: str
    graphed: bool
    tokens: int  # per request
    tracks: tuple[tuple[str, int], ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@attrs.frozen
class ServeResult:
    """Outputs and measurements of one run of the serving loop (or of its serial reference).

    ``logits[i]`` are step ``i``'s outputs for its real requests (padding dropped; a tuple per
    phase or stream for a composite step), ``records[i]`` what it ran.
    """

    policy: Policy | None
    records: tuple[StepRecord, ...]
    logits: list[Tensor | tuple[Tensor, ...]]
    seconds: float
    violations: tuple[Violation, ...] = ()
    slack: dict[str, float] = attrs.Factory(dict)
    ends: tuple[float, ...] = ()  # when each step ended (CpuDevice timestamps)
    host_seconds: tuple[float, ...] = ()  # host time per step: scheduling, writes, launches

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def prefill_steps(self) -> int:
        return sum(r.kind == PREFILL for r in self.records)

    @property
    def decode_steps(self) -> int:
        return sum(r.kind == DECODE for r in self.records)

    @property
    def batch_sizes(self) -> dict[int, int]:
        """How many decode steps ran in the graph of each padded batch size."""
        return dict(sorted(collections.Counter(r.padded for r in self.records if r.kind == DECODE).items()))

    @property
    def prefill_sizes(self) -> dict[int, int]:
        """How many prefill steps ran at each batch size."""
        return dict(sorted(collections.Counter(r.padded for r in self.records if r.kind == PREFILL).items()))

    @property
    def tokens(self) -> int:
        """Tokens of real requests the run processed (prompt chunks and decoded tokens)."""
        return sum(r.batch_size * r.tokens for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        """Steady-state tokens/s: the tokens of steps 1.. over the time from step 0's end to the
        last step's end where the device timestamps them (step 0 pays one-time costs), else
        every token over the wall time."""
        if len(self.ends) == self.steps > 1 and self.ends[-1] > self.ends[0]:
            return sum(r.batch_size * r.tokens for r in self.records[1:]) / (self.ends[-1] - self.ends[0])
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mean_slack(self) -> float | None:
        """Mean over buffers of the mean time from a buffer's last read to its release (s)."""
        return statistics.fmean(self.slack.values()) if self.slack else None

    @property
    def host_per_step(self) -> float | None:
        """Median host time per step (s)."""
        return statistics.median(self.host_seconds) if self.host_seconds else None

    def first_difference(self, reference: ServeResult) -> tuple[int, int | None] | None:
        """``(step, request id)`` of the first output that is not bit-identical to ``reference``'s
        (the request ``None`` when the steps themselves differ), or ``None``."""
        for i, (a, b) in enumerate(zip(self.records, reference.records)):
            if (a.kind, a.requests) != (b.kind, b.requests):
                return i, None
            mine, theirs = self.logits[i], reference.logits[i]
            if not same_logits(mine, theirs):
                return i, _first_request(a, mine, theirs)
        if self.steps != reference.steps:
            return min(self.steps, reference.steps), None
        return None

    def matches(self, reference: ServeResult) -> bool:
        """Every step's outputs bit-identical to ``reference``'s, request by request."""
        return self.first_difference(reference) is None


def _rows(out: Tensor | tuple[Tensor, ...]) -> list[Tensor]:
    return [out] if isinstance(out, Tensor) else [t for part in out for t in _rows(part)]


def _first_request(record: StepRecord, a: Tensor | tuple[Tensor, ...], b: Tensor | tuple[Tensor, ...]) -> int | None:
    # the first request whose rows differ in some part (each part is request-major)
    for x, y in zip(_rows(a), _rows(b)):
        if x.shape != y.shape or torch.equal(x, y):
            continue
        per = max(1, x.shape[0] // max(1, record.batch_size))
        bad = next(i for i in range(x.shape[0]) if not torch.equal(x[i], y[i]))
        return record.requests[min(bad // per, len(record.requests) - 1)]
    return None


def _unpad(out: Any, low: Any, real: int, padded: int, tokens: int) -> Tensor | tuple[Tensor, ...]:
    """The outputs of ``real`` requests of a step run in a graph of ``padded`` (padding dropped)."""
    if isinstance(low, (PhasedStep, StepShape)):
        shape = low.shape if isinstance(low, PhasedStep) else low
        return tuple(part.narrow(0, 0, real * tokens_per_request(ph.mode)) for part, ph in zip(out, shape.phases))
    if isinstance(low, StreamGroup):
        ranges = request_ranges(padded, len(low.lowered))
        return tuple(part.narrow(0, 0, max(0, min(hi, real) - lo) * tokens) for part, (lo, hi) in zip(out, ranges))
    return out.narrow(0, 0, real * tokens) if real != padded else out


def graph_labels(low: LoweredStep) -> tuple[str, ...]:
    """The labels of the lowered graphs one step of ``low`` replays (one, or one per phase
    graph or stream)."""
    if isinstance(low, PhasedStep):
        return tuple(g.label for g in low.graphs.values())
    if isinstance(low, StreamGroup):
        return tuple(g.label for g in low.lowered)
    return (low.label,)


def _tracks(low: LoweredStep) -> tuple[tuple[str, int], ...]:
    if isinstance(low, PhasedStep):
        return ((low.stream.name, len(low.shape.phases)),)
    if isinstance(low, StreamGroup):
        return tuple((g.stream.name, 1) for g in low.lowered)
    return ((low.stream.name, 1),)


def _parts(fence: Any) -> tuple[Any, ...]:
    return tuple(fence.fences) if hasattr(fence, "fences") else (fence,)


@attrs.define
class ServeLoop:
    """The lowered graphs of a target per batch size, and the scheduler that feeds them.

    Build with :func:`serve_loop`; :meth:`run` runs steps. ``decode[size]`` is the graph a
    decode step of up to ``size`` requests replays; ``prefill[size]`` the eager prefill step of
    ``size`` requests (lowered before a run, for every size the run's schedule holds).
    """

    target: Target
    mode: ForwardMode
    policy: Policy
    device: Device
    cfg: ModelConfig
    state: Mapping[str, dict[str, Tensor]]
    scheduler: ServeScheduler
    capture_sizes: tuple[int, ...]
    decode: dict[int, LoweredStep]
    prefill: dict[int, LoweredStep]
    lowering: LowerOptions  # what every graph is lowered with (the loop's check mode, timeline, ...)
    writers: dict[int, DecodeLoop]  # per lowered step (by id): its write order behind its fence
    written: Event
    write_work: Callable[[], object] | None
    timeline: Timeline | None
    check: CheckState | None = None
    members: int = 1
    order: StreamOrder = attrs.Factory(StreamOrder)  # the per_stream groups' latest fence per stream

    # -- graphs ----------------------------------------------------------------------------

    def _wired(self, low: LoweredStep) -> LoweredStep:
        # the scheduler's writes behind this graph's fence, in the order its fence releases them
        order = tuple(sorted(SHARED_BUFFERS, key=low.write_key))
        self.writers[id(low)] = DecodeLoop(low, self.scheduler, self.device, self.device.stream("schedule"),
                                           self.written, self.write_work, self.timeline, order, self.check)
        return low

    def _lower(self, target: BackendLike | Target, mode: ForwardMode, size: int) -> LoweredStep:
        low = lower_step(target, mode, device=self.device, policy=self.policy, batch_size=size, cfg=self.cfg,
                         state=self.state, lowering=self.lowering, order=self.order)
        return self._wired(low)

    def _lower_all(self, target: Target, mode: ForwardMode, sizes: Sequence[int]) -> CaptureList:
        graphs = lower_capture_list(target, mode, sizes, device=self.device, policy=self.policy, cfg=self.cfg,
                                    state=self.state, lowering=self.lowering, order=self.order)
        for low in graphs.graphs.values():
            self._wired(low)
        return graphs

    def graph_for(self, step: ServeStep) -> tuple[LoweredStep, int, str]:
        """The lowered step ``step`` runs in, its batch size and its name (``"decode b4"``)."""
        size = _padded(step.kind, step.batch_size, self.capture_sizes, self.members)
        if step.kind == DECODE:
            return self.decode[size], size, f"decode b{size}"
        low = self.prefill.get(size)
        if low is None:  # the schedule was not planned this far (see ``prepare``): lower it now
            low = self.prefill[size] = self._lower(prefill_target(self.target), ForwardMode.EXTEND, size)
            self.recapture()
        return low, size, f"prefill b{size}"

    def recapture(self) -> tuple[int, ...]:
        """Lower again each decode graph that captured a tensor the backend has replaced since
        (lowering a larger size, or a prefill step, regrew a buffer the backend keeps: see
        ``steps.recapture``); the sizes lowered again."""
        return recapture(self.decode, lambda size: self._lower(self.target, self.mode, size))

    def prepare(self, steps: int) -> dict[str, int]:
        """Lower the prefill steps the next ``steps`` steps need (a dry run of a copy of the
        scheduler), so that nothing is lowered mid-run; returns how many steps of each kind the
        dry run found."""
        plan = copy.deepcopy(self.scheduler)
        kinds: collections.Counter[str] = collections.Counter()
        for _ in range(steps):
            kind, reqs, *_ = plan.plan()
            kinds[kind] += 1
            if kind == PREFILL:
                size = _padded(kind, len(reqs), self.capture_sizes, self.members)
                if size not in self.prefill:
                    self.prefill[size] = self._lower(prefill_target(self.target), ForwardMode.EXTEND, size)
        self.recapture()  # a prefill lowered may have regrown what a decode graph captured
        return dict(kinds)

    def lowered_steps(self) -> list[LoweredStep]:
        """Every lowered step of the loop: the decode graphs by size, then the prefill steps."""
        return [*self.decode.values(), *self.prefill.values()]

    # -- fences ----------------------------------------------------------------------------
    def check_binding(self, run: StepRun, low: LoweredStep) -> None:
        """Refuse (:class:`~readfence.graph.lowering.ForeignEventError`) to bind the next step's writes to
        ``run``'s fence unless each event it binds is recorded by ``low`` (the graph the step
        replayed) and by no other graph."""
        labels = graph_labels(low)
        for part in _parts(run.fence):
            check_owned(part, labels, f"the writes after step {run.step}")

    # -- running ---------------------------------------------------------------------------
    def run(self, steps: int, *, progress: Callable[[int], None] | None = None,
            timeout: float | None = None) -> tuple[list[StepRun], list[StepRecord], list[Tensor | tuple[Tensor, ...]],
                                                   list[float], float]:
        """Run ``steps`` overlapped steps; returns the step runs, what each ran, its unpadded
        outputs, the host time of each step and the wall time (s)."""
        positive_int("steps", steps)
        self.prepare(steps)
        with settled_on_error(self.device, timeout):
            return self._run(steps, progress, timeout)

    def _run(self, steps: int, progress: Callable[[int], None] | None, timeout: float | None,
             ) -> tuple[list[StepRun], list[StepRecord], list[Tensor | tuple[Tensor, ...]], list[float], float]:
        stream = self.device.stream("schedule")
        t0 = time.perf_counter()
        nxt = self.scheduler.next_step()
        low, size, name = self.graph_for(nxt)
        self.writers[id(low)]._write_state(nxt, None)
        runs: list[StepRun] = []
        records: list[StepRecord] = []
        steps_done: list[tuple[ServeStep, Any, int]] = []
        host: list[float] = []
        for i in range(steps):
            h0 = time.perf_counter()
            run = low.run(self.scheduler.pad(nxt, size), step=nxt.step, after=[self.written])
            runs.append(run)
            steps_done.append((nxt, low, size))
            records.append(StepRecord(nxt.step, nxt.kind, nxt.requests, size, name,
                                      nxt.kind == DECODE and self.device.caps.graphs, nxt.tokens, _tracks(low)))
            if i + 1 < steps:
                after = self.scheduler.next_step()
                writer = self.writers[id(low)]
                if self.check is None:
                    self.check_binding(run, low)
                    writer._write_state(after, functools.partial(run.fence.wait, stream))
                else:  # the step restores what it poisoned at its very end: write after that
                    run.fence.wait_end(stream)
                    writer._write_state(after, None)
                nxt = after
                low, size, name = self.graph_for(nxt)
            host.append(time.perf_counter() - h0)
            if progress is not None:
                progress(i)
        outputs = []
        for run, (step, lowered, padded) in zip(runs, steps_done):
            outputs.append(_unpad(run.result(timeout), lowered, step.batch_size, padded, step.tokens))
        self.device.synchronize(timeout)
        return runs, records, outputs, host, time.perf_counter() - t0


def _scheduler(target: Target, mode: ForwardMode, cfg: ModelConfig, traffic: Traffic, sizes: Sequence[int],
               max_prefill: int | None) -> ServeScheduler:
    return ServeScheduler(cfg, tokens_per_request(scheduling_mode(target, mode)), traffic,
                          max_batch=min(max(sizes), cfg.max_reqs - 1), max_prefill=max_prefill)


def serve_scheduler(target: Target, traffic: Traffic, capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
                    cfg: ModelConfig | None = None, max_prefill: int | None = None) -> ServeScheduler:
    """The scheduler the serving loop of ``target`` runs ``traffic`` with (and its reference):
    ``ValueError`` when the capture sizes or the requests do not fit the model or the target.

    >>> from readfence.backends import paged
    >>> serve_scheduler(paged(), Traffic(), [1, 2, 4]).max_batch
    4
    """
    cfg = model_config(cfg)
    check_run(target, ForwardMode.DECODE)
    return _scheduler(target, ForwardMode.DECODE, cfg, traffic, capture_list(capture_sizes, cfg, target), max_prefill)


@names_keywords(options=ServeOptions)
def serve_loop(
    target: Target,
    *,
    policy: Policy,
    device: Device,
    traffic: Traffic | None = None,
    capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    options: ServeOptions | None = None,
    lowering: LowerOptions | None = None,
) -> ServeLoop:
    """Lower ``target`` (a backend, a ``per_stream`` group or a step shape) for every batch size
    of ``capture_sizes`` and wire it to a :class:`ServeScheduler` over ``traffic`` on ``device``.

    Decode steps run in ``DECODE`` (a step shape: its phases); prefill steps in ``EXTEND``
    with :func:`prefill_target`. ``options`` (a :class:`ServeOptions`) is the rest of the loop:
    the prefill cap, synthetic work on each page-table write, a timeline, the poison-on-release
    check mode, ``UNSAFE_skip_soundness_check`` (each as for ``decode_loop``); ``lowering`` (a
    :class:`LowerOptions`: ring size, event factory...) goes to every graph's lowering.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     loop = serve_loop(paged(), policy=Policy.EXACT, device=dev, capture_sizes=[1, 2, 4])
    ...     sorted(loop.decode), loop.decode[4].batch_size
    ([1, 2, 4], 4)
    """
    mode = ForwardMode.DECODE
    check_run(target, mode, "lower")
    check_device(device)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a readfence.graph.Policy, got {policy!r}")
    opts = options_of(options, ServeOptions, "serve_loop")
    cfg = model_config(cfg)
    traffic = Traffic() if traffic is None else traffic
    sizes = capture_list(capture_sizes, cfg, target)
    sched = _scheduler(target, mode, cfg, traffic, sizes, opts.max_prefill)
    state = make_state(cfg, device) if state is None else state
    check = opts.check
    checker = check if isinstance(check, CheckState) else CheckState(state["shared"], cfg) if check else None
    lowered = set_by(lowering, "serve_loop", keywords=said_in(ServeOptions), measure=True, publish=None,
                     timeline=opts.timeline, check=checker,
                     UNSAFE_skip_soundness_check=opts.UNSAFE_skip_soundness_check)
    work = synthetic_work(device, write_cost=opts.write_cost, write_wait_s=opts.write_wait_s)
    loop = ServeLoop(target, mode, policy, device, cfg, state, sched, sizes, {}, {}, lowered, {},
                     device.event("scheduler/written"), work, opts.timeline, checker, members(target))
    for size, low in loop._lower_all(target, mode, sizes).graphs.items():
        loop.decode[size] = low
    return loop


@names_keywords(options=ServeOptions)
def run_serve(
    target: Target,
    *,
    steps: int,
    policy: Policy,
    device: Device,
    traffic: Traffic | None = None,
    capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    options: ServeOptions | None = None,
    lowering: LowerOptions | None = None,
) -> ServeResult:
    """Run the serving loop for ``steps`` steps; outputs per request, what each step ran,
    sanitizer findings, fence slack, host time per step. The keywords besides ``steps`` are
    :func:`serve_loop`'s; ``options.sanitize`` (default ``True``) has the race sanitizer watch
    the run, ``options.progress(i)`` is called after step ``i``.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> traffic = Traffic(rate=1.0, prompt=(4, 8), output=(2, 6))
    >>> with CpuDevice() as dev:
    ...     res = run_serve(paged(), steps=12, policy=Policy.PER_BUFFER, device=dev, traffic=traffic,
    ...                     capture_sizes=[1, 2, 4])
    >>> ref = run_serve_serial(paged(), steps=12, traffic=traffic, capture_sizes=[1, 2, 4])
    >>> res.matches(ref), res.violations, res.prefill_steps > 0 < res.decode_steps
    (True, (), True)
    """
    positive_int("steps", steps)
    check_device(device)
    opts = options_of(options, ServeOptions, "run_serve")
    lowering = for_a_loop(lowering, "run_serve", said_in(ServeOptions))
    loop = serve_loop(target, policy=policy, device=device, traffic=traffic, capture_sizes=capture_sizes, cfg=cfg,
                      state=state, options=opts, lowering=lowering)
    (runs, records, outputs, host, seconds), violations = sanitized(
        device, opts.sanitize, lambda: loop.run(steps, progress=opts.progress))
    slack, ends = fence_summary(runs, loop.timeline)
    return ServeResult(policy, tuple(records), outputs, seconds, violations, slack,
                       () if None in ends else tuple(e for e in ends if e is not None), tuple(host))


class SerialServe:
    """The serving loop's reference, step by step: the same schedule, eager, each step at its
    exact batch size. :meth:`run` goes on from where the last call stopped (a long run can be
    compared chunk by chunk, keeping no more than a chunk of outputs). See :func:`run_serve_serial`.
    """

    def __init__(self, target: Target, *, traffic: Traffic | None = None,
                 capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES, cfg: ModelConfig | None = None,
                 state: Mapping[str, dict[str, Tensor]] | None = None, device: str | None = None,
                 options: ServeOptions | None = None, padded: bool = False) -> None:
        check_run(target, ForwardMode.DECODE)
        opts = options_of(options, ServeOptions, "SerialServe")
        self.target, self.cfg = target, model_config(cfg)
        traffic = Traffic() if traffic is None else traffic
        self.sizes = capture_list(capture_sizes, self.cfg, target)
        where = device if device is not None else ("cpu" if state is None else device_of(state["shared"]).type)
        self.where = torch_device(where)
        self.state = make_state(self.cfg, self.where) if state is None else state
        self.scheduler = _scheduler(target, ForwardMode.DECODE, self.cfg, traffic, self.sizes, opts.max_prefill)
        self.members, self.prefill = members(target), prefill_target(target)
        self.write_wait_s, self.progress = opts.write_wait_s, opts.progress
        if padded and isinstance(target, PerStream):
            raise ValueError("run_serve_serial(padded=True): a per_stream group's members already serve the "
                             "shares of the padded size; pad a backend or a step shape")
        self.pad = padded

    def run(self, steps: int, progress: Callable[[int], None] | None = None) -> ServeResult:
        """The next ``steps`` steps; ``progress(i)`` (default: the options') after step ``i``."""
        progress = self.progress if progress is None else progress
        positive_int("steps", steps)
        cfg, state, where, mode = self.cfg, self.state, self.where, ForwardMode.DECODE
        records, outputs, ends = [], [], []
        t0 = time.perf_counter()
        for i in range(steps):
            nxt = self.scheduler.next_step()
            if self.write_wait_s:
                time.sleep(self.write_wait_s)
            for b in SHARED_BUFFERS:
                state["shared"][b].copy_(nxt.shared[b])
            padded = _padded(nxt.kind, nxt.batch_size, self.sizes, self.members)
            pad = nxt.kind == DECODE and self.pad and padded > nxt.batch_size  # as the loop runs it
            batch = self.scheduler.pad(nxt, padded) if pad else nxt.batch
            batch = batch if where == "cpu" else {k: v.to(where) for k, v in batch.items()}
            if nxt.kind == DECODE:
                out = eager_step(self.target, mode, cfg, state, batch, padded)
                outputs.append(_unpad(out, self.target, nxt.batch_size, padded, nxt.tokens) if pad else out)
            else:
                outputs.append(eager_step(self.prefill, ForwardMode.EXTEND, cfg, state, batch, padded))
            records.append(StepRecord(nxt.step, nxt.kind, nxt.requests, padded, f"{nxt.kind} b{padded}", False,
                                      nxt.tokens))
            ends.append(time.perf_counter())
            if progress is not None:
                progress(i)
        if where == "cuda":
            torch.cuda.synchronize()
        return ServeResult(None, tuple(records), outputs, time.perf_counter() - t0,
                           ends=tuple(ends) if where == "cpu" else ())


@names_keywords(options=ServeOptions)
def run_serve_serial(
    target: Target,
    *,
    steps: int,
    traffic: Traffic | None = None,
    capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    device: str | None = None,
    options: ServeOptions | None = None,
    padded: bool = False,
) -> ServeResult:
    """The reference of the serving loop: the same schedule (same traffic, capture list and
    limits), eager, one step after another, each step at its exact batch size (a ``per_stream``
    group's members serve the requests of their shares of the padded size, as in the loop);
    with ``padded``, each decode step padded as the loop pads it to the captured size it runs in,
    the padding's outputs dropped (a backend whose requests' outputs depend on the padding rows,
    a reduction over the whole batch, matches the loop only then).
    ``device`` is the torch device kind it runs on (``"cpu"``, ``"cuda"``; default: where
    ``state`` lives, else the CPU). ``options`` is the loop's own :class:`ServeOptions`, of which
    it reads ``max_prefill``, ``progress`` and ``write_wait_s`` (it sleeps that long before each
    step's writes: the serial baseline of a loop given the same write work).

    >>> from readfence.backends import paged
    >>> ref = run_serve_serial(paged(), steps=6, traffic=Traffic(rate=1.0, prompt=(4, 8), output=(1, 3)))
    >>> [r.kind for r in ref.records]
    ['prefill', 'prefill', 'decode', 'prefill', 'decode', 'prefill']
    """
    positive_int("steps", steps)
    serial = SerialServe(target, traffic=traffic, capture_sizes=capture_sizes, cfg=cfg, state=state, device=device,
                         options=options_of(options, ServeOptions, "run_serve_serial"), padded=padded)
    return serial.run(steps)
