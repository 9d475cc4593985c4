"""The overlapped decode loop: the scheduler writes step i+1 behind step i's fence.

Each step the host scheduler computes the next shared state (request churn, new token slots,
slot maps) while the forward stream replays the current step; a schedule stream then waits,
buffer by buffer, on the step's :class:`Fence` and copies the new state into the live
buffers. The next forward waits for those writes. ``run_serial`` (``_serial``) is the
reference; the loop's options are one record, :class:`LoopOptions` (``_options``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor

from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.core.internal import model_config, positive_int

from ..devices import Device, DeviceTimeout, Event, Read, Stream, Timeline, Write
from ..devices.internal import check_device, copy_all_from_host
from ..lowering import CheckState, LowerOptions, Policy, StepRun, make_state, torch_device
from ..lowering.internal import for_a_loop, names_keywords, set_by
from ..steps.internal import LoweredStep, Target, check_run, lower_step, scheduling_mode
from ._options import LoopOptions, options_of, said_in
from ._result import LoopResult
from ._sanitizer import Sanitizer, Violation
from ._scheduler import Scheduler, StepSource, StepState
from ._staging import Holds, StagingRing, check_staging, host_write, staging_name

T = TypeVar("T")


def _carries_work(buffers: Sequence[str]) -> bool:
    """Whether a write of ``buffers`` includes the page table's, the one ``write_work`` goes with."""
    return "req_to_token" in buffers


def _run_all(fns: Sequence[Callable[[], Any]]) -> None:
    for fn in fns:
        fn()


def _write(dst: Tensor, src: Tensor, work: Callable[[], Any] | None, expected: Tensor | None = None) -> None:
    """One buffer's write (a traced run times each buffer on its own)."""
    _write_group([dst] if expected is None else [dst, expected], [src] if expected is None else [src, src], work)


def _write_group(dsts: Sequence[Tensor], srcs: Sequence[Tensor], work: Callable[[], Any] | None) -> None:
    if work is not None:  # synthetic scheduler work that must follow the fence (see decode_loop)
        work()
    copy_all_from_host(dsts, srcs)


@attrs.define
class DecodeLoop:
    """A lowered step plus the scheduler that feeds it, on one device.

    Build with :func:`decode_loop`; :meth:`run` runs ``steps`` overlapped steps.
    """

    lowered: LoweredStep
    scheduler: StepSource
    device: Device
    schedule_stream: Stream
    written: Event
    write_work: Callable[[], object] | None  # run on the schedule stream before the page-table write
    timeline: Timeline | None
    write_order: tuple[str, ...]
    check: CheckState | None = None  # check mode: poison on release (graph.lowering._poison)
    staging: StagingRing | None = None  # host buffers the scheduler stages each step's state in (_staging)
    _stager: _Stager | None = attrs.field(init=False, default=None)  # the staging ring at work, while it runs
    write_groups: tuple[tuple[str, ...], ...] = attrs.field(init=False)  # write_order by release point
    _plain_groups: tuple[tuple[str, ...], ...] = attrs.field(init=False)  # plain copies join the next group

    def __attrs_post_init__(self) -> None:
        # Buffers released at the same point are written by one launch after one wait: on the
        # demo model that is 5 schedule-stream items a step instead of 9, each a wake-up and a
        # GIL handoff between the stream threads (bench_overhead: about 20 us apiece).
        key = self.lowered.write_key
        self.write_groups = tuple(tuple(g) for _, g in itertools.groupby(self.write_order, key=key))
        plain: list[tuple[str, ...]] = []
        pending: tuple[str, ...] = ()
        for group in self.write_groups:
            pending += group
            if _carries_work(group):
                plain.append(pending)
                pending = ()
        self._plain_groups = (*plain, pending) if pending else tuple(plain)

    def _wait_groups(self) -> tuple[tuple[str, ...], ...]:
        """A step's writes in groups, each launched after one wait on its latest release point.

        Watched (a device observer, such as the sanitizer), each group waits at its own point:
        an early fence must race to be caught. Unwatched, a plain copy waits with the next
        group that carries work (``write_work``, on the page-table write) or with the last one:
        later is sound, and on the CPU device a wait costs a wake-up of the schedule stream and
        GIL handoffs that slow the forward, far more than the copy it would start early
        (default_nowait: EXACT at 0.92x serial with a wait per release point, 1.00x with one).
        """
        if getattr(self.device, "observers", None):
            return self.write_groups
        if self.write_work is None:
            return (self.write_order,)
        return self._plain_groups

    def _writer(self, group: Sequence[str], nxt: StepState) -> Callable[[], None]:
        """The launch that writes ``group``'s buffers (and, in check mode, what the forward must
        find there until it releases them); traced, one span per buffer."""
        shared, check = self.lowered.shared, self.check

        def work(buffers: Sequence[str]) -> Callable[[], Any] | None:
            return self.write_work if _carries_work(buffers) else None

        if self.timeline is None:
            dsts, srcs = [shared[b] for b in group], [nxt.shared[b] for b in group]
            if check is not None:
                dsts, srcs = dsts + [check.expected[b] for b in group], srcs + srcs
            return functools.partial(_write_group, dsts, srcs, work(group))
        timed = [self.timeline.timed(self.schedule_stream.name, f"write {b}",
                                     functools.partial(_write, shared[b], nxt.shared[b], work([b]),
                                                       None if check is None else check.expected[b]),
                                     "write", step=nxt.step)
                 for b in group]
        return timed[0] if len(timed) == 1 else functools.partial(_run_all, timed)

    def _write_state(self, nxt: StepState, fence_wait: Callable[[Sequence[str]], None] | None) -> None:
        s, step, stager = self.schedule_stream, nxt.step, self._stager
        reads: list[Read] = []
        with s.batch():
            if stager is not None:  # the copy reads the host buffer the step was staged in
                reads = [Read(staging_name(stager.ring.slot(step)), "scheduler/copy", step)]
                if stager.holds is not None:
                    s.wait(stager.holds.events[step])
            for group in self._wait_groups():
                if fence_wait is not None:
                    fence_wait(group)
                # named after its first buffer: a trace matches launches to spans by name
                s.launch(self._writer(group, nxt), label=f"scheduler/write:{group[0]}",
                         ops=[*reads, *(Write(b, step, "scheduler") for b in group)], step=step)
            s.record(self.written)

    def _next(self) -> StepState:
        if self.timeline is None:
            return self.scheduler.next_step()
        return self.timeline.timed("host", "schedule next step", self.scheduler.next_step, "host")()

    def run(self, steps: int, *, progress: Callable[[int], None] | None = None, timeout: float | None = None) -> tuple[list[StepRun], float]:
        """Run ``steps`` overlapped steps; returns the step runs and the wall time (s)."""
        positive_int("steps", steps)
        with settled_on_error(self.device, timeout):
            return self._run(steps, progress, timeout)

    def _run(self, steps: int, progress: Callable[[int], None] | None, timeout: float | None) -> tuple[list[StepRun], float]:
        t0 = time.perf_counter()
        stager = self._stager = None if self.staging is None else _Stager(self, steps, timeout)
        runs: list[StepRun] = []
        try:
            nxt = self._next() if stager is None else stager.fill(self._next())
            self._write_state(nxt, None)
            for i in range(steps):
                run = self.lowered.run(nxt.batch, step=i, after=[self.written])
                runs.append(run)
                if stager is not None:
                    stager.launched(run)
                if i + 1 < steps:
                    nxt = self._next() if stager is None else stager.fill(self._next())
                    if self.check is None:
                        self._write_state(nxt, functools.partial(run.fence.wait, self.schedule_stream))
                    else:  # the step restores what it poisoned at its very end: write after that
                        run.fence.wait_end(self.schedule_stream)
                        self._write_state(nxt, None)
                if progress is not None:
                    progress(i)
        finally:
            self._stager = None
            if stager is not None and stager.holds is not None:
                stager.holds.open_all()
        for run in runs:
            run.result(timeout)
        self.device.synchronize(timeout)
        return runs, time.perf_counter() - t0


    def time_forward(self, steps: int, timeout: float | None = None) -> float:
        """Seconds per step of the lowered forward alone: ``steps`` replays of one scheduled
        batch back to back, no scheduler work (one side of the overlap limit).

        A measurement: like :meth:`time_scheduler` it advances the scheduler and rewrites the
        live state and pools, so later outputs no longer follow ``run_serial``'s."""
        positive_int("steps", steps)
        nxt = self._next()
        self._write_state(nxt, None)
        self.device.synchronize(timeout)
        t0 = time.perf_counter()
        for i in range(steps):
            self.lowered.run(nxt.batch, step=i, after=[self.written])
        self.device.synchronize(timeout)
        return (time.perf_counter() - t0) / steps

    def time_scheduler(self, steps: int, timeout: float | None = None) -> float:
        """Seconds per step of the scheduler alone: next step plus its writes (synthetic work
        included), no forward and no fence (the other side of the overlap limit)."""
        positive_int("steps", steps)
        self.device.synchronize(timeout)
        t0 = time.perf_counter()
        for _ in range(steps):
            self._write_state(self._next(), None)
        self.device.synchronize(timeout)
        return (time.perf_counter() - t0) / steps

    def limit(self, steps: int, timeout: float | None = None) -> float:
        """Steps/s with perfect overlap: ``1 / max(forward alone, scheduler alone)``.

        >>> from readfence.backends import paged
        >>> from readfence.graph import CpuDevice
        >>> with CpuDevice() as dev:
        ...     loop = decode_loop(paged(), policy=Policy.PER_BUFFER, device=dev,
        ...                        options=LoopOptions(write_wait_s=0.01))
        ...     loop.limit(5) <= 100.0           # the scheduler alone takes >= 10 ms a step
        True
        """
        return 1.0 / max(self.time_forward(steps, timeout), self.time_scheduler(steps, timeout))


class _Stager:
    """A loop's staging ring at work: the host buffers, the host's waits before each refill (on a
    per-step end event, so that the wait is on that very step and the race sanitizer sees it),
    the refills (host writes), and the holds."""

    def __init__(self, loop: DecodeLoop, steps: int, timeout: float | None) -> None:
        assert loop.staging is not None
        self.loop, self.ring, self.timeout = loop, loop.staging, timeout
        self.buffers: dict[int, dict[str, Tensor]] = {}
        self.ends: list[Event] = []
        self.sync = loop.device.stream("staging/host-waits")
        self.holds = Holds(loop.device, steps, loop.device.timeout if timeout is None else timeout) \
            if self.ring.held else None

    def launched(self, run: StepRun) -> None:
        end = self.loop.device.event(f"staging/step-end/{run.step}")
        run.fence.wait_end(self.sync)
        self.sync.record(end)
        self.ends.append(end)

    def fill(self, nxt: StepState) -> StepState:
        step = nxt.step
        waited = self.ring.waited(step)
        if waited is not None and 0 <= waited < len(self.ends):
            if self.holds is not None:
                self.holds.open(waited)
            self.ends[waited].synchronize(self.timeout)
        slot = self.ring.slot(step)
        host_write(self.loop.device, staging_name(slot), step, "host/stage")
        staged = self.buffers.get(slot)
        if staged is None:
            staged = self.buffers[slot] = {b: t.clone() for b, t in nxt.shared.items()}
        else:
            for b, t in nxt.shared.items():
                staged[b].copy_(t)
        if self.ring.slots is None:  # a fresh buffer per step: nothing comes round again
            del self.buffers[slot]
        return attrs.evolve(nxt, shared=staged)


def synthetic_work(device: Device | str, *, write_cost: int = 0, write_wait_s: float = 0.0) -> Callable[[], object] | None:
    """The scheduler's synthetic page-table work for ``decode_loop``: a GIL-free
    ``write_cost x write_cost`` matmul on ``device``, or a ``write_wait_s`` stall of the
    schedule stream that uses no compute (a copy engine); ``None`` for neither.

    For a torch device kind (``"cpu"``, ``"cuda"``: the serial reference, which has no streams)
    the wait is a host sleep, after the device has finished what was queued: it overlaps nothing.

    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     synthetic_work(dev) is None, callable(synthetic_work(dev, write_wait_s=0.001))
    (True, True)
    """
    if write_cost and write_wait_s:
        raise ValueError("pass write_cost (a matmul) or write_wait_s (a wait), not both")
    if write_wait_s < 0 or write_cost < 0:
        raise ValueError(f"write_cost and write_wait_s must be >= 0, got {write_cost!r} and {write_wait_s!r}")
    if write_cost:
        w = torch.randn(write_cost, write_cost, device=torch_device(device))
        return functools.partial(torch.mm, w, w)
    if write_wait_s:
        if isinstance(device, str):
            return functools.partial(_host_wait, device, float(write_wait_s))
        return functools.partial(device.stall, float(write_wait_s))
    return None


def _host_wait(where: str, seconds: float) -> None:
    if where == "cuda":
        torch.cuda.synchronize()
    time.sleep(seconds)


@names_keywords(options=LoopOptions)
def decode_loop(
    backend: Target,
    mode: ForwardMode = ForwardMode.DECODE,
    *,
    policy: Policy,
    device: Device,
    batch_size: int = 4,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    options: LoopOptions | None = None,
    lowering: LowerOptions | None = None,
) -> DecodeLoop:
    """Lower ``backend`` (a backend, a ``per_stream`` group or a :class:`StepShape`) and
    wire it to a seeded scheduler on ``device``.

    ``state`` (``shared``, ``pools``, ``params`` on the device) is the live state the step
    runs on, fresh by default: pass the one a backend holds references to. ``options`` (a
    :class:`LoopOptions`) is the rest of the loop: the scheduler's seed, synthetic scheduler work
    on each page-table write, a host staging ring, a timeline, the poison-on-release check mode
    (``check=True`` or a :class:`CheckState` over ``state["shared"]``: every release point poisons
    what it releases, and the scheduler writes each step after the previous one ended).

    ``lowering`` (a :class:`LowerOptions`: ring size, event factory) goes to every graph's
    lowering; the loop measures its fences, and the timeline, the check mode and
    ``UNSAFE_skip_soundness_check`` come from ``options`` (a ``LowerOptions`` that sets one is
    refused, saying so). A staging ring that refills a buffer before its copy surely ran is
    refused (``StagingRingError``, see ``check_staging``) unless ``UNSAFE_skip_soundness_check``
    runs it anyway, to show it racing.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     loop = decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2, options=LoopOptions(seed=1))
    ...     runs, seconds = loop.run(3)
    >>> len(runs)
    3
    """
    check_run(backend, mode, "lower")
    check_device(device)
    opts = options_of(options, LoopOptions, "decode_loop")
    unsafe = opts.UNSAFE_skip_soundness_check
    if opts.staging is not None:
        found = check_staging(opts.staging)
        if found is not None and not unsafe:
            raise found
    cfg = model_config(cfg)
    state = make_state(cfg, device) if state is None else state
    check = opts.check
    checker = check if isinstance(check, CheckState) else CheckState(state["shared"], cfg) if check else None
    lowered = set_by(lowering, "decode_loop", keywords=said_in(LoopOptions), measure=True, publish=None,
                     timeline=opts.timeline, check=checker, UNSAFE_skip_soundness_check=unsafe)
    low = lower_step(backend, mode, batch_size=batch_size, device=device, policy=policy, cfg=cfg,
                     state=state, lowering=lowered)
    sched = Scheduler(cfg, scheduling_mode(backend, mode), batch_size, seed=opts.seed, finish_prob=opts.finish_prob)
    order = tuple(sorted(SHARED_BUFFERS, key=low.write_key))
    work = synthetic_work(device, write_cost=opts.write_cost, write_wait_s=opts.write_wait_s)
    return DecodeLoop(low, sched, device, device.stream("schedule"), device.event("scheduler/written"),
                      work, opts.timeline, order, checker, opts.staging)


@names_keywords(options=LoopOptions)
def run_overlapped(
    backend: Target,
    mode: ForwardMode = ForwardMode.DECODE,
    *,
    steps: int,
    policy: Policy,
    device: Device,
    batch_size: int = 4,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    options: LoopOptions | None = None,
    lowering: LowerOptions | None = None,
) -> LoopResult:
    """Run the overlapped decode loop for ``steps`` steps; logits, wall time, sanitizer findings,
    fence slack. The keywords besides ``steps`` are :func:`decode_loop`'s; ``options.sanitize``
    (default ``True``) has the race sanitizer watch the run, ``options.progress(i)`` is called
    after step ``i``.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, run_serial
    >>> with CpuDevice() as dev:
    ...     res = run_overlapped(paged(), steps=5, policy=Policy.PER_BUFFER, device=dev, batch_size=2)
    >>> res.matches(run_serial(paged(), steps=5, batch_size=2)), res.violations
    (True, ())
    """
    check_run(backend, mode)
    positive_int("steps", steps)
    check_device(device)
    opts = options_of(options, LoopOptions, "run_overlapped")
    lowering = for_a_loop(lowering, "run_overlapped", said_in(LoopOptions))
    loop = decode_loop(backend, mode, policy=policy, device=device, batch_size=batch_size, cfg=cfg, state=state,
                       options=opts, lowering=lowering)
    (runs, seconds), violations = sanitized(device, opts.sanitize, lambda: loop.run(steps, progress=opts.progress))
    slack, ends = fence_summary(runs, loop.timeline)
    done = [e for e in ends if e is not None]
    intervals = () if len(done) < len(ends) else tuple(b - a for a, b in zip(done, done[1:]))
    return LoopResult(policy, [r.logits for r in runs], seconds, violations, slack, intervals)


@contextlib.contextmanager
def settled_on_error(device: Device, timeout: float | None = None) -> Iterator[None]:
    """On an error in the block, wait for the device to run what it was given before the error
    goes on (``Device.settle``): a loop that fails part-way (a refused wait, a scheduler error)
    leaves no step of its own running on what it shares with its caller (the live buffers, an
    engine object), which the caller's next call would race. What settling met is added to the
    error as notes; the error raised is the block's own. A device that timed out is not waited for
    again (its stuck stream would hold the error back by as long once more), nor is an interrupt.

    >>> from readfence.graph import CpuDevice
    >>> done = []
    >>> with CpuDevice() as dev:
    ...     try:
    ...         with settled_on_error(dev):
    ...             dev.stream("forward").launch(lambda: (dev.stall(0.05), done.append(1)), label="step")
    ...             raise RuntimeError("the scheduler failed")
    ...     except RuntimeError:
    ...         print(done)
    [1]
    """
    try:
        yield
    except DeviceTimeout:
        raise
    except Exception as error:
        for met in device.settle(timeout):
            error.add_note(f"while the device settled after this error: {type(met).__name__}: {met}")
        raise


def sanitized(device: Device, sanitize: bool, run: Callable[[], T]) -> tuple[T, tuple[Violation, ...]]:
    """``run()``, watched by a :class:`Sanitizer` on ``device`` when ``sanitize``: its result
    and the sanitizer's findings (none when not watched)."""
    sanitizer = Sanitizer() if sanitize else None
    if sanitizer is not None:
        device.add_observer(sanitizer)
    try:
        result = run()
    finally:
        if sanitizer is not None:
            device.remove_observer(sanitizer)
    return result, tuple(sanitizer.violations) if sanitizer is not None else ()


def fence_summary(runs: Sequence[StepRun], timeline: Timeline | None) -> tuple[dict[str, float], list[float | None]]:
    """The mean fence slack per buffer over ``runs`` and each run's fence time (marking the
    releases and last reads on ``timeline`` when there is one)."""
    slack: dict[str, list[float]] = {}
    for run in runs:
        for b in SHARED_BUFFERS:
            s = run.fence.slack(b)
            if s is not None:
                slack.setdefault(b, []).append(s)
    if timeline is not None:
        _fence_instants(timeline, "fences", runs)
    return {b: statistics.fmean(v) for b, v in slack.items()}, [r.fence.done_time() for r in runs]


def _fence_instants(timeline: Timeline, stream: str, runs: Sequence[StepRun]) -> None:
    for run in runs:
        for b in SHARED_BUFFERS:
            t = run.fence.release_time(b)
            if t is not None:
                timeline.instant(stream, f"release {b}", t, "fence", step=run.step)
            t = run.fence.last_read_time(b)
            if t is not None:
                timeline.instant(stream, f"last read {b}", t, "read", step=run.step)
