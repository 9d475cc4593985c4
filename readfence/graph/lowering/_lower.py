"""Lowering: a traced step becomes device work with events placed from the joined effect.

``lower`` traces the backend's step (``readfence.core.trace``), refuses an unsound
declaration (unless the policy is COARSE), plans where each buffer's release is published
(``plan_fences``), and builds on a :class:`Device`:

* the out-of-graph stage, launched eagerly before every replay (PRE_REPLAY reads);
* one captured graph per event-ring slot holding ``prepare_in_graph`` and the model body,
  with event records inside it (IN_REPLAY, and EXACT records after the last-reading node);
* a post-forward launch that copies the logits out (the COARSE fence follows it).

Every lowered graph owns its events: nothing is shared across shapes, modes or streams.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.core import (
    SHARED_BUFFERS,
    BackendLike,
    CapturedStateError,
    ForwardMode,
    ModelConfig,
    StageThreadError,
    bind,
    example_step,
    init_params,
    make_pools,
    make_shared_state,
    observe_program,
)
from readfence.core import audit as audit_backend
from readfence.core import trace as trace_step
from readfence.core._checks import check_backend, check_buffers, check_forward_mode, positive_int
from readfence.core._memory import BufferMap
from readfence.core._program import Program, StageGraph, flatten_inputs
from readfence.effects import ReadEnd

from ..devices import Device, DeviceError, Event, Op, Stream, Timeline
from ..devices._open import check_device
from ._fence import Bound, Fence, RunClock, slot_head
from ._fx_compile import compile_graph
from ._fx_records import insert_records, stage_ops
from ._issue import StepRun, step_issuer
from ._plan import IN_GRAPH_STAGES, FencePlan, LastRead, Placement, plan_fences
from ._poison import CheckState, poison_points
from ._policy import Policy

_COUNTER = itertools.count()


class UnsoundLowering(ValueError):
    """Lowering refused: a buffer is declared to end earlier than the traced code reads it.

    ``failure`` is the audit's :class:`~readfence.core.Unsound` (buffer, ends, reader)."""

    failure: Any = None


class UncapturableStage(ValueError):
    """Lowering refused: a stage escapes the tracer where the device cannot run its Python.

    On CUDA an in-graph stage that escapes would be replayed on the one path the example took (a
    CUDA graph captures kernels, not Python); and a trace under fake tensors stops at any
    escape (they hold no values), leaving no stage graph to lower. The CPU device runs such a
    stage's Python in the step (see ``readfence.core._program``)."""


@attrs.define
class _Slot:
    """One event-ring slot: its events, its stage graphs with records, its captured graph."""

    events: dict[Placement, Any]
    probes: dict[str, Any]
    done: Any
    stages: dict[str, tuple[Any, tuple[Op, ...]]]
    graph: Any = None
    # stage-level events per end, indexed by ReadEnd.rank, in plan order (a tuple, not a dict
    # keyed by the enum: run() is on the host's hot path and enum hashing is slow)
    at_end: tuple[tuple[Any, ...], ...] = ()
    fence_events: tuple[Any, ...] = ()  # events in plan order, then done
    buffer_points: Mapping[str, int | None] = attrs.Factory(dict)  # buffer -> event index (None: no wait)
    out_fn: Any = None  # the prepare_out_graph launch (watched, timed as lowered) and its ops
    out_ops: tuple[Op, ...] = ()
    # check mode: the poison action of each stage-level release point, indexed by ReadEnd.rank
    act_at_end: tuple[Any, ...] = ()
    clock: Any = None  # RunClock of the slot's runs, set once its graph is captured
    fence_head: tuple[Any, ...] = ()  # what the fences of the slot's runs share (``slot_head``)


class Lowered:
    """A backend's step lowered onto a device for one (mode, batch size, policy, stream).

    Build with :func:`lower`. ``shared``, ``pools`` and ``params`` are the live tensors the
    step reads (share them with the scheduler and other lowered graphs); :meth:`run` enqueues
    one step and returns its logits and :class:`Fence`.
    """

    def __init__(
        self,
        *,
        backend: BackendLike,
        mode: ForwardMode,
        policy: Policy,
        device: Device,
        cfg: ModelConfig,
        batch_size: int,
        program: Program,
        plan: FencePlan,
        stream: Stream,
        ring_size: int,
        state: Mapping[str, dict[str, Tensor]],
        measure: bool,
        timeline: Timeline | None = None,
        new_event: Callable[[str], Event] | None = None,
        check: CheckState | None = None,
    ) -> None:
        self.backend, self.mode, self.policy, self.device = backend, mode, policy, device
        self.check = check
        # check mode: the buffers this graph's release points poison by default (all it releases)
        self.poisons = frozenset(b for bs in poison_points(plan.placements).values() for b in bs)
        self.cfg, self.batch_size, self.program, self.plan = cfg, batch_size, program, plan
        self.stream, self.ring_size, self.measure = stream, ring_size, measure
        self.timeline = timeline
        self._new_event = device.event if new_event is None else new_event
        self.shared, self.pools, self.params = state["shared"], state["pools"], state["params"]
        self.label = f"{backend.name}/{mode.name}/b{batch_size}/{policy.name}/{stream.name}#{next(_COUNTER)}"
        self.graphed = mode.uses_graph and device.caps.graphs
        self._runs = 0
        self._observed: dict[str, dict[str, frozenset[str]]] = {}
        dev = _device_of(self.shared)
        example = example_step(cfg, mode, batch_size, device=dev)
        self._batch = {k: torch.zeros_like(v, device=dev) for k, v in example.batch.items()}
        self._env: dict[str, Tensor] = flatten_inputs(
            shared=self.shared, batch=self._batch, pools=self.pools, params=self.params
        )
        self._meta = self._static_meta(example, dev)
        self._env.update(self._meta)
        self._logits = torch.zeros(example.num_tokens, cfg.vocab, device=dev)
        self._static_batch = tuple(self._batch.values())
        self._labels = {name: f"{self.label}/{name}" for name in
                        ("prepare_out_graph", "prepare_in_graph", "body", "load_batch", "outputs")}
        self._slots = [self._build_slot(r) for r in range(ring_size)]
        self._issuers = [step_issuer(self, slot, r) for r, slot in enumerate(self._slots)]  # one generated function per slot

    # -- construction -----------------------------------------------------------------------
    def _static_meta(self, example: Any, dev: torch.device) -> dict[str, Tensor]:
        # Rehearse the whole step once, eagerly, on a throwaway example and on the lowered
        # stream: it gives the shapes of the out-of-graph stage's outputs, and it runs every
        # kernel once before any capture, as torch.cuda.graph asks (lazy library and allocator
        # set-up must not happen inside a capture). The live state is not touched. It runs under
        # the runtime read observer: what each node really reads (the example's buffers, or the
        # live ones a stage keeps a reference to) is what the sanitizer is told, with the trace.
        env = flatten_inputs(shared=example.shared, batch=example.batch, pools=example.pools,
                             params=example.params)
        buffers = BufferMap.of(example.shared).union([BufferMap.of(self.shared)])

        def rehearse() -> None:
            self._observed = observe_program(self.program, env, buffers)

        self.stream.launch(rehearse, label=f"{self.label}/rehearse")
        try:
            self.stream.synchronize()
        except DeviceError as e:  # the backend's own error, not the device's: name it as such
            if isinstance(e.__cause__, StageThreadError):
                raise e.__cause__ from None
            raise
        return {k: torch.zeros_like(env[k], device=dev) for k in self.program.stage("prepare_out_graph").outputs}

    def _build_slot(self, r: int) -> _Slot:
        dev = self.device
        events = {p: self._new_event(f"{self.label}/{p.end.name}{'@' + p.after.node if p.after else ''}#{r}")
                  for p in self.plan.points()}
        probes = {}
        if self.measure:
            # Probes are in-launch records: skip those a captured graph could not record
            # (no in-graph events), instead of failing the capture of a measured run.
            can_probe = not self.graphed or dev.caps.in_graph_events
            probes = {b: dev.event(f"{self.label}/lastread:{b}#{r}") for b, last in last_reads(self.program).items()
                      if b in self.plan.placements and (can_probe or last.stage not in IN_GRAPH_STAGES)}
        after: dict[str, dict[str, list[Any]]] = {s.name: {} for s in self.program.stages}
        for b, last in last_reads(self.program).items():  # probes first: read, then release
            if b in probes:
                after[last.stage].setdefault(last.node, []).append(probes[b])
        for point, event in events.items():
            if point.after is not None:
                after[point.after.stage].setdefault(point.after.node, []).append(event)
        actions: dict[str, dict[str, list[Any]]] = {s.name: {} for s in self.program.stages}
        at_end: list[Any] = [None] * len(ReadEnd)
        if self.check is not None:
            for point, buffers in poison_points(self.plan.placements).items():
                act = self.check.poisoner(buffers)
                if point.after is not None:
                    actions[point.after.stage].setdefault(point.after.node, []).append(act)
                else:
                    at_end[point.end.rank] = act
        stages = {s.name: self._stage_fn(s, after[s.name], actions[s.name]) for s in self.program.stages}
        slot = _Slot(events, probes, self._new_event(f"{self.label}/done#{r}"), stages)
        slot.act_at_end = tuple(at_end)
        slot.at_end = tuple(tuple(e for p, e in events.items() if p.after is None and p.end is end) for end in ReadEnd)
        index = {p: i for i, p in enumerate(events)}
        slot.fence_events = (*events.values(), slot.done)
        slot.buffer_points = MappingProxyType({b: index.get(p) for b, p in self.plan.placements.items()})
        out_runner, env, copy_meta = stages["prepare_out_graph"][0], self._env, self._copy_meta
        slot.out_fn = lambda: copy_meta(out_runner.run(env))
        if self.check is not None and self.check.watcher is not None:
            watch, plain = self.check.watcher.stage, slot.out_fn

            def watched() -> None:
                with watch("prepare_out_graph"):  # the copy into the graph is this stage's read
                    plain()

            slot.out_fn = watched
        if self.timeline is not None:
            slot.out_fn = self.timeline.timed(self.stream.name, "prepare_out_graph", slot.out_fn, "stage")
        slot.out_ops = stages["prepare_out_graph"][1]
        if self.graphed:
            with dev.capture(self.stream, label=f"{self.label}/graph#{r}") as graph:
                self._in_graph_work(slot)
            slot.graph = graph
        slot.clock = RunClock(())
        self._set_base(slot, tuple(e.generation for e in slot.fence_events))
        return slot

    def _set_base(self, slot: _Slot, base: tuple[int, ...]) -> None:
        slot.clock.base = base
        slot.fence_head = slot_head(self.label, slot.buffer_points, slot.fence_events, base)

    def _reads(self, stage: StageGraph) -> dict[str, frozenset[str]]:
        # per node, the traced reads and what the rehearsal observed it really read
        seen = self._observed.get(stage.name, {})
        return {n: stage.reads.get(n, frozenset()) | seen.get(n, frozenset()) for n in {*stage.reads, *seen}}

    def _stage_fn(self, stage: StageGraph, after: dict[str, list[Any]],
                  actions: dict[str, list[Any]]) -> tuple[Any, tuple[Op, ...]]:
        if not stage.faithful:
            # The tracer could not see everything: run the Python stage; no node-level records.
            return stage, tuple(stage_ops(stage.gm, self._reads(stage), stage.name))
        gm = insert_records(stage.gm, after, self.device, actions) if after or actions else stage.gm
        reads = self._reads(stage)
        return CompiledStage(stage, compile_graph(gm, keep=reads)), stage_ops(gm, reads, stage.name)

    def _launch_stage(self, name: str, slot: _Slot, step: int | None, sink: Any) -> None:
        runner, ops = slot.stages[name]
        env = self._env
        watcher = None if self.check is None else self.check.watcher

        def run_stage() -> None:
            if watcher is None:
                sink(runner.run(env))
                return
            with watcher.stage(name):
                sink(runner.run(env))

        fn = run_stage if self.timeline is None else self.timeline.timed(self.stream.name, name, run_stage, "stage")
        self.stream.launch(fn, label=self._labels[name], ops=ops, step=step)

    def _record_points(self, slot: _Slot, end: ReadEnd) -> None:
        # as the step issuer emits for PRE_REPLAY and POST_REPLAY: the records, then check mode's poison
        for event in slot.at_end[end.rank]:
            self.stream.record(event)
        if slot.act_at_end[end.rank] is not None:
            self.stream.launch(slot.act_at_end[end.rank], label=f"{self.label}/poison@{end.name}")

    def _in_graph_work(self, slot: _Slot, step: int | None = None) -> None:
        # prepare_in_graph and the body: captured once per slot, or launched eagerly.
        self._launch_stage("prepare_in_graph", slot, step, self._env.update)
        self._record_points(slot, ReadEnd.IN_REPLAY)
        self._launch_stage("body", slot, step, lambda out: self._logits.copy_(out["logits"]))

    # -- running ----------------------------------------------------------------------------
    def run(self, batch: Mapping[str, Tensor], *, step: int | None = None, after: Sequence[Event] = (),
            poison: Iterable[str] | None = None, first: bool = True, last: bool = True) -> StepRun:
        """Enqueue one step on the lowered stream; returns its logits and fence.

        ``batch`` holds this step's inputs (copied into the graph's static buffers on the
        stream); ``after`` are events the step must wait for (e.g. the scheduler's writes).
        In check mode, ``poison`` are the buffers this replay's release points poison (default:
        every buffer it releases), ``first``/``last`` whether it starts/ends the step (a
        multi-phase step replays several graphs). A batch with a missing key (``KeyError``) or
        a tensor of another shape than the graph was captured for (``ValueError``) is refused
        before anything is enqueued. The step is issued by its ring slot's generated function
        (``graph.lowering._issue``).

        >>> from readfence.backends import paged
        >>> from readfence.graph import CpuDevice, Scheduler
        >>> with CpuDevice() as dev:
        ...     low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.EXACT)
        ...     run = low.run(Scheduler(low.cfg, ForwardMode.DECODE, 2).next_step().batch)
        ...     tuple(run.result(timeout=10).shape), run.fence.released("req_to_token")
        ((2, 64), True)
        """
        return self._issuers[self._runs % self.ring_size](batch, step, after, poison, first, last)

    def step_source(self, slot: int = 0) -> str:
        """The generated code that issues a step on event-ring slot ``slot`` (what :meth:`run`
        calls on that slot's turn; see ``graph.lowering._issue``).

        >>> from readfence.backends import paged
        >>> from readfence.graph import CpuDevice
        >>> with CpuDevice() as dev:
        ...     low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER)
        ...     "graph.replay(s, step=step)" in low.step_source()
        True
        """
        if not isinstance(slot, int) or not 0 <= slot < self.ring_size:
            raise ValueError(f"{self.label}: slot must be an int in range({self.ring_size}), got {slot!r}")
        return self._issuers[slot].source

    def _check_start(self, slot: _Slot, step: int, poison: frozenset[str], first: bool) -> None:
        # before anything of the step reads: pick the poison, arm this replay's release points,
        # and poison what the plan says is never read (its release point is the start)
        check, s = self.check, self.stream
        assert check is not None
        if first:
            s.launch(check.start, step, label=f"{self.label}/check", step=step)
        s.launch(check.arm, poison, label=f"{self.label}/arm", step=step)
        never = slot.act_at_end[ReadEnd.NONE.rank]
        if never is not None:
            s.launch(never, label=f"{self.label}/poison@NONE", step=step)

    def _copy_meta(self, out: Mapping[str, Tensor]) -> None:
        meta = self._meta
        for k, v in out.items():
            meta[k].copy_(v)

    def _measured_fence(self, slot: _Slot, step: int, ticket: int) -> Fence:
        # the CpuDevice generations kept: their timestamps give the slack
        events = slot.fence_events
        handles = tuple([getattr(e, "latest", None) for e in events])
        probes = {b: Bound.latest(e) for b, e in slot.probes.items()}
        return Fence.from_ticket(self.label, step, slot.buffer_points, events, slot.clock, ticket, handles, probes,
                                 handles[-1])

    def write_key(self, buffer: str) -> tuple[int, int, int]:
        """Where ``buffer`` is released in the step (the scheduler writes in this order)."""
        placement = self.plan.placements.get(buffer)
        return (9, 0, 0) if placement is None else placement.sort_key

    def describe(self) -> list[dict[str, str]]:
        """Per buffer: declared, observed, placement of its event."""
        declared, observed = self.backend.read_effect(self.mode), self.program.traced()
        return [
            {**row, "declared": declared[row["buffer"]].name, "observed": observed[row["buffer"]].name}
            for row in self.plan.describe()
        ]

    def __repr__(self) -> str:
        return f"<Lowered {self.label}: {len(self.plan.points())} fence point(s), ring {self.ring_size}>"


class CompiledStage:
    """A faithful stage's graph, compiled (``graph._fx_compile``), run like ``StageGraph.run``."""

    __slots__ = ("stage", "graph", "_fn", "_inputs", "_outputs")

    def __init__(self, stage: StageGraph, graph: Any) -> None:
        self.stage, self.graph = stage, graph
        self._fn, self._inputs, self._outputs = graph.fn, stage.inputs, stage.outputs

    def run(self, env: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Execute the stage on ``env`` (dotted name -> tensor); outputs by dotted name."""
        return dict(zip(self._outputs, self._fn(*map(env.__getitem__, self._inputs)), strict=True))


def last_reads(program: Program) -> dict[str, LastRead]:
    """Per shared buffer read by ``program``, the node after which its last read is done.

    Only nodes an event can follow: a stage that runs its Python function instead of its
    graph (unfaithful) has no nodes to follow, and a read by a stage's output (the copy of the
    out-of-graph stage's outputs into the graph) ends with the stage; those buffers get the
    stage-level point. EXACT places its events from these (``plan_fences(last_reads=...)``).

    >>> from readfence.backends import paged
    >>> from readfence.core import trace
    >>> last = last_reads(trace(paged(), ForwardMode.DECODE))["req_to_token"]
    >>> last.stage, last.node
    ('prepare_in_graph', 'index_select')
    """
    out = {}
    for b in SHARED_BUFFERS:
        last = program.last_reader(b)
        if last is None:
            continue
        stage, node = last
        graph = program.stage(stage)
        names = [n.name for n in graph.gm.graph.nodes]
        if not graph.faithful or node == names[-1]:
            continue
        out[b] = LastRead(stage, node, names.index(node))
    return out


def _device_of(shared: Mapping[str, Tensor]) -> torch.device:
    return next(iter(shared.values())).device


def torch_device(device: Device | str) -> str:
    """The torch device kind a readfence ``Device`` (or its name) runs on: ``cuda`` or ``cpu``."""
    name = device if isinstance(device, str) else device.name
    return "cuda" if name.startswith("cuda") else "cpu"


def make_state(cfg: ModelConfig, device: Device | str = "cpu") -> dict[str, dict[str, Tensor]]:
    """Fresh live tensors (shared buffers, pools, params) on ``device``'s torch device."""
    where = torch_device(device)
    return {
        "shared": make_shared_state(cfg, device=where),
        "pools": make_pools(cfg, device=where),
        "params": init_params(cfg, device=where),
    }


def lower(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    batch_size: int,
    device: Device,
    policy: Policy,
    cfg: ModelConfig | None = None,
    stream: Stream | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    ring_size: int | None = None,
    steps_in_flight: int = 1,
    publish: Sequence[str] | None = None,
    measure: bool = False,
    timeline: Timeline | None = None,
    new_event: Callable[[str], Event] | None = None,
    check: CheckState | None = None,
    UNSAFE_skip_soundness_check: bool = False,
) -> Lowered:
    """Lower ``backend``'s step in ``mode`` onto ``device`` with fences placed by ``policy``.

    ``backend`` is a backend value (parse a spec with ``readfence.backends.parse``), ``mode``
    any mode but ``IDLE`` (which runs no forward), ``device`` a device object
    (``CpuDevice()``, ``open_device(kind)``), ``batch_size`` an int in ``1..cfg.max_reqs``.

    Refuses (``UnsoundLowering``, with the audit's message) a declaration earlier than the
    traced reads unless ``policy`` is COARSE. ``UNSAFE_skip_soundness_check=True`` lowers it
    anyway: only for tests that show what an unsound fence does. ``check`` (a
    :class:`~readfence.graph.CheckState` over ``state["shared"]``) lowers the check mode:
    every release point poisons the buffers it releases (see ``graph.lowering._poison``).

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER)
    ...     [(r["buffer"], r["end"]) for r in low.describe()][:2]
    [('req_to_token', 'IN_REPLAY'), ('seq_lens', 'IN_REPLAY')]
    """
    check_backend(backend)
    check_forward_mode(mode, "lower")
    check_device(device)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a readfence.graph.Policy, got {policy!r}")
    positive_int("steps_in_flight", steps_in_flight)
    ring_size = steps_in_flight if ring_size is None else positive_int("ring_size", ring_size)
    if ring_size < steps_in_flight:
        raise ValueError(
            f"event ring of size {ring_size} is too small for {steps_in_flight} steps in flight: "
            f"the record of step i+{ring_size} would reuse an event that a wait of step i has not "
            f"bound yet; use ring_size >= {steps_in_flight}"
        )
    buffers = SHARED_BUFFERS if publish is None else check_buffers(publish, SHARED_BUFFERS, "publish")
    cfg = ModelConfig() if cfg is None else cfg
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    state = state if state is not None else make_state(cfg, device)
    graphed = mode.uses_graph and device.caps.graphs
    program = _checked_program(backend, mode, cfg, batch_size, device, state, graphed)
    declared = backend.read_effect(mode)
    observed = program.traced()
    if policy is not Policy.COARSE and not observed <= declared and not UNSAFE_skip_soundness_check:
        failure = audit_backend(backend, mode, cfg=cfg, batch_sizes=[batch_size], state=state).failure()
        error = UnsoundLowering(
            f"refusing to lower {backend.name} for {mode.name} with policy {policy.name}: "
            f"{failure.message}. Fix the declaration, or lower with Policy.COARSE."
        )
        error.failure = failure
        raise error
    plan = plan_fences(buffers=buffers, declared=declared, caps=device.caps, policy=policy,
                       last_reads=last_reads(program), observed=observed, graphed=graphed)
    return Lowered(
        backend=backend, mode=mode, policy=policy, device=device, cfg=cfg, batch_size=batch_size,
        program=program, plan=plan, stream=stream if stream is not None else device.stream("forward"),
        ring_size=ring_size, state=state, measure=measure, timeline=timeline, new_event=new_event,
        check=check,
    )


def _checked_program(backend: BackendLike, mode: ForwardMode, cfg: ModelConfig, batch_size: int, device: Device,
                     state: Mapping[str, Mapping[str, Tensor]], graphed: bool) -> Program:
    """The traced step bound to the live ``state``; refuses what no fence can make correct:
    captured trace-time state (stale whatever the policy) and, on a device whose graphs
    capture kernels rather than Python, an in-graph stage that escapes the tracer."""
    program = bind(trace_step(backend, mode, cfg=cfg, batch_size=batch_size, device=torch_device(device)), state)
    unusable = [c for c in program.captured() if not c.usable]
    if unusable:
        raise CapturedStateError(backend.name, mode, unusable)
    if torch_device(device) == "cuda" and program.aborted is not None:
        stage = program.aborted_stage
        what = ("a graph would replay only the path the example took; move host reads to prepare_out_graph"
                if graphed and stage in IN_GRAPH_STAGES else "the trace cannot follow it on fake tensors")
        raise UncapturableStage(
            f"cannot {'capture' if graphed else 'lower'} {backend.name} for {mode.name} on {device.name}: "
            f"{program.aborted}: {what} (the CPU device runs the stage's Python in the step)"
        )
    if graphed and torch_device(device) == "cuda":
        escapes = [e for e in program.unfaithful() if e[0] in IN_GRAPH_STAGES]
        if escapes:
            stage, node, why, source = escapes[0]
            raise UncapturableStage(
                f"cannot capture {backend.name} for {mode.name} on {device.name}: stage {stage} escapes "
                f"the tracer ({why.removeprefix('escape: ')} at {source}, node {node!r}), so a graph would "
                f"replay only the path the example took; move host reads to prepare_out_graph"
            )
    return program


__all__ = ["Lowered", "StepRun", "UncapturableStage", "UnsoundLowering", "last_reads", "lower", "make_state"]
