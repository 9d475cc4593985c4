"""Lowering: a traced step becomes device work with events placed from the joined effect.

``lower`` is a chain of passes, each a function from its input to its output:

1. trace and bind to the live state (``core.trace``, ``core.bind``), refusing what no fence
   makes correct (trace-time state, a stage a CUDA graph cannot capture); the step's ledger
   (``core.internal.Ledger``) is where every run of its code below records what it read;
2. compile the captured stages once for every event-ring slot (``_slot.compile_stages``): a
   hook after every node a record or check mode's poison may follow (``_fx_records``), an
   alias check after each opaque op (``_fx_aliases``), then constant folding, shared
   subexpressions and Python bindings (``_fx_compile``);
3. validate that code against the stages' Python (``core.validate_replay``): each captured
   stage, its hooks bound to nothing, must compute what its Python computes on the generated
   states, whatever the policy; the Python of the stages that run it in the step records what
   it read there into the ledger (a step that is not replayed, ``core.internal.replayed``, is
   observed on those states instead). Code that differs only through the compile passes (the
   same stages compiled without them pass) is readfence's miscompile: the plain code, validated
   as well, is what runs (``Lowered.optimized`` is then False). A capture validated before is
   checked again on those states and one more, and traced again (1-3) if its Python changed since
   through a value no cache key holds (``core.internal.StaleTrace``: no miscompile), the new trace
   validated on the state where the old one differed too;
4. unless the policy is COARSE, refuse an unsound declaration: the audit's verdict, made from the
   step's ledger, which the validation and the audit's own runs recorded into: a read any of
   them saw is a read;
5. rehearse the step once, eagerly (``_rehearse``: shapes, observed reads, warm-up), into the
   same ledger: the last run of the step's Python before the loop's; and ask the verdict again;
6. plan the fences (``plan_fences``: where each buffer's release is published, EXACT from the
   same ledger: the bound trace joined with every read a run saw);
7. per event-ring slot, bind the validated code's hooks to the slot's events and poison, and
   capture (``_slot.build_slot``): every slot runs the very code validated (a record after a
   node only a run saw reading compiles the code again, validated again unless it computes
   alike).

and :class:`Lowered` is built from their results. On a :class:`Device` a step is:

* the out-of-graph stage, its Python run before every replay as engines run it (PRE_REPLAY
  reads; its host reads and side effects happen every step);
* one captured graph per event-ring slot holding ``prepare_in_graph`` and the model body,
  with event records inside it (IN_REPLAY, and EXACT records after the last-reading node); in a
  step that is not replayed (EXTEND) both run their Python instead, as engines run that mode,
  each followed by its stage-level points;
* a post-forward launch that copies the logits out (the COARSE fence follows it).

Every lowered graph owns its events: nothing is shared across shapes, modes or streams. Every
lowered graph knows where its backend keeps each tensor it captured (``Lowered.stale``): a replay
refuses a graph whose captured buffer the backend has replaced, resized or moved since.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from readfence.core import (
    SHARED_BUFFERS,
    STAGES,
    BackendLike,
    CapturedStateError,
    ForwardMode,
    ModelConfig,
    NotGraphSafe,
    Program,
    Stage,
    StageGraph,
    Unsound,
    bind,
    step_functions,
)
from readfence.core import trace as trace_step
from readfence.core.internal import (
    BufferMap,
    KeptTensor,
    Ledger,
    NodeReadsIn,
    StaleCaptureError,
    StaleTrace,
    check_backend,
    check_forward_mode,
    collection_paused,
    differs_on,
    example_step,
    flatten_inputs,
    forget_trace,
    ledger_of,
    model_config,
    positive_int,
    random_kept,
    refuse_writes,
    replayed,
    validate_replay,
    varied_states,
)
from readfence.effects import ReadEffect, ReadEnd, ReadfenceError

from ..devices import CudaDevice, Device, Event, Stream, Timeline
from ..devices.internal import check_device
from ._fence import Bound, Fence
from ._issue import IssueSeam, StepRun, step_issuer
from ._kept import captured_kept, kept_check, stale_capture
from ._keywords import names_keywords
from ._live_state import check_live_state, device_of, make_state, torch_device
from ._options import MAX_RING, LowerOptions, lowering_options
from ._pass_clock import PassClock
from ._plan import IN_GRAPH_STAGES, FencePlan, plan_fences
from ._poison import CheckState, poison_points
from ._policy import Policy
from ._rehearse import Rehearsal, rehearse
from ._slot import (
    Slot,
    SlotSpec,
    StageCode,
    StepLauncher,
    build_slot,
    compile_stages,
    last_reads,
    node_reads,
    record_sites,
    slot_parts,
)
from ._verdict import audit_verdict

if TYPE_CHECKING:
    from readfence.core import Unsound

_COUNTER = itertools.count()


class UnsoundLowering(ReadfenceError, ValueError):
    """Lowering refused: a buffer is declared to end earlier than the traced code reads it.

    ``failure`` is the audit's :class:`~readfence.core.Unsound` (buffer, ends, reader)."""

    failure: Unsound | None = None


class UncapturableStage(ReadfenceError, ValueError):
    """Lowering refused: a stage escapes the tracer where the device cannot run its Python.

    On CUDA an in-graph stage that escapes would be replayed on the one path the example took (a
    CUDA graph captures kernels, not Python); and a trace under fake tensors stops at any
    escape (they hold no values), leaving no stage graph to lower. The CPU device runs such a
    stage's Python in the step (see ``readfence.core._program``)."""


class Lowered:
    """A backend's step lowered onto a device for one (mode, batch size, policy, stream).

    Build with :func:`lower`, which runs the lowering's passes and hands their results here.
    ``shared``, ``pools`` and ``params`` are the live tensors the step reads (share them with
    the scheduler and other lowered graphs); ``observed`` is the effect EXACT placed from (the
    bound trace joined with every read a run of the step saw: its ledger's); ``ledger`` is the
    step's :class:`~readfence.core.internal.Ledger`; :meth:`run` enqueues one step and returns its
    logits and :class:`Fence`. ``pass_seconds`` is where the lowering's time went: wall seconds
    per pass, in the order ``lower`` runs them (a pass run twice, summed).

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.EXACT)
    >>> list(low.pass_seconds)
    ['trace', 'compile', 'validate', 'verdict', 'rehearse', 'plan', 'capture']
    """

    def __init__(self, *, backend: BackendLike, mode: ForwardMode, policy: Policy, device: Device, cfg: ModelConfig,
                 batch_size: int, program: Program, plan: FencePlan, launcher: StepLauncher, batch: dict[str, Tensor],
                 state: Mapping[str, dict[str, Tensor]], graphed: bool, measure: bool,
                 slots: Sequence[Slot], observed: ReadEffect, ledger: Ledger, check: CheckState | None = None,
                 optimized: bool = True, kept: tuple[KeptTensor, ...] = (),
                 pass_seconds: Mapping[str, float] | None = None) -> None:
        self.backend, self.mode, self.policy, self.device = backend, mode, policy, device
        # whether the captured stages run through the compile passes (folding, sharing, bindings)
        self.optimized = optimized
        self.observed = observed  # what EXACT placed from: the ledger's effect (the trace and every run's reads)
        self.ledger = ledger
        # wall seconds of each of lower's passes (``graph.lowering._pass_clock.PASSES``), in order
        self.pass_seconds: Mapping[str, float] = pass_seconds if pass_seconds is not None else {}
        self.cfg, self.batch_size, self.program, self.plan = cfg, batch_size, program, plan
        self.check, self.measure, self.graphed = check, measure, graphed
        self.kept = kept  # the tensors its compiled stages captured, where the backend keeps them
        self.launcher, self.stream, self.label = launcher, launcher.stream, launcher.label
        # check mode: the buffers this graph's release points poison by default (all it releases)
        self.poisons = frozenset(b for bs in poison_points(plan.placements).values() for b in bs)
        self.shared, self.pools, self.params = state["shared"], state["pools"], state["params"]
        self._batch = batch
        self._env, self._meta, self._logits = launcher.env, launcher.meta, launcher.logits
        self._slots, self.ring_size = list(slots), len(slots)
        self._seam = IssueSeam(
            label=self.label, batch_size=batch_size, stream=self.stream, batch=batch, logits=launcher.logits,
            labels=launcher.labels, check=check, poisons=self.poisons, graphed=graphed, measure=measure,
            in_graph_work=launcher.in_graph_work, check_start=self._check_start, measured_fence=self._measured_fence)
        self._issuers = [step_issuer(self._seam, slot, r) for r, slot in enumerate(self._slots)]  # one per slot
        self._start_poison: tuple[str, ...] = ()  # check mode: released before anything of a step runs
        self._start_poisoner: Callable[[], None] | None = None

    def poison_at_start(self, buffers: Iterable[str]) -> None:
        """Check mode: poison ``buffers`` as each step that this graph starts (``first=True``)
        begins, whatever its own plan says: buffers a multi-phase step releases before any of
        its phases (no phase reads them, or the phase publishing them waits for none of their
        reads) are released there, so that is where a late read must meet the poison."""
        if self.check is None:
            raise ValueError(f"{self.label}: poison_at_start needs a lowering in check mode (check=...)")
        self._start_poison = tuple(dict.fromkeys(buffers))
        self._start_poisoner = self.check.poisoner(self._start_poison) if self._start_poison else None

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
        return self._issuers[self._seam.runs % self.ring_size](batch, step, after, poison, first, last)

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

    # -- what the step issuer calls (through its seam) ----------------------------------------
    def _check_start(self, slot: Slot, step: int, poison: frozenset[str], first: bool) -> None:
        # before anything of the step reads: pick the poison, arm this replay's release points,
        # and poison what the plan says is never read (its release point is the start)
        check, s = self.check, self.stream
        assert check is not None
        if first:
            s.launch(check.start, step, label=f"{self.label}/check", step=step)
            if self._start_poisoner is not None:
                s.launch(check.arm, self._start_poison, label=f"{self.label}/arm", step=step)
                s.launch(self._start_poisoner, label=f"{self.label}/poison@start", step=step)
        s.launch(check.arm, poison, label=f"{self.label}/arm", step=step)
        never = slot.act_at_end[ReadEnd.NONE.rank]
        if never is not None:
            s.launch(never, label=f"{self.label}/poison@NONE", step=step)

    def _measured_fence(self, slot: Slot, step: int, ticket: int) -> Fence:
        # the CpuDevice generations kept: their timestamps give the slack
        events = slot.fence_events
        handles = tuple([getattr(e, "latest", None) for e in events])
        probes = {b: Bound.latest(e) for b, e in slot.probes.items()}
        return Fence.from_ticket(self.label, step, slot.buffer_points, events, slot.clock, ticket, handles, probes,
                                 handles[-1])

    def stale(self) -> StaleCaptureError | None:
        """Why this step's graphs no longer read what the backend keeps (a tensor they captured
        that the backend has replaced, resized or moved since: see ``core.internal.KeptTensor``),
        or ``None``. Every replay checks it after the out-of-graph stage's Python ran, and refuses
        to replay a stale graph; a capture list lowers its stale sizes again.

        >>> from readfence.backends import paged
        >>> from readfence.graph import CpuDevice
        >>> with CpuDevice() as dev:
        ...     print(lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.EXACT).stale())
        None
        """
        return stale_capture(self.kept, self.backend, self.label)

    def write_key(self, buffer: str) -> tuple[int, int, int]:
        """Where ``buffer`` is released in the step (the scheduler writes in this order)."""
        placement = self.plan.placements.get(buffer)
        return (9, 0, 0) if placement is None else placement.sort_key

    def describe(self) -> list[dict[str, str]]:
        """Per buffer: declared, observed, placement of its event."""
        declared, traced = self.backend.read_effect(self.mode), self.observed
        return [
            {**row, "declared": declared[row["buffer"]].name, "observed": traced[row["buffer"]].name}
            for row in self.plan.describe()
        ]

    def __repr__(self) -> str:
        return f"<Lowered {self.label}: {len(self.plan.points())} fence point(s), ring {self.ring_size}>"


@names_keywords
@random_kept()  # (the step's runs here draw nothing the loop's steps would draw)
@collection_paused()  # (its traces and runs keep what they make: a collection in between walks it all for nothing)
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
    lowering: LowerOptions | None = None,
    steps_in_flight: int = 1,
) -> Lowered:
    """Lower ``backend``'s step in ``mode`` onto ``device`` with fences placed by ``policy``.

    ``backend`` is a backend value (parse a spec with ``readfence.backends.parse``), ``mode``
    any mode but ``IDLE`` (which runs no forward), ``device`` a device object
    (``CpuDevice()``, ``open_device(kind)``), ``batch_size`` an int in ``1..cfg.max_reqs``.

    ``stream`` is where the step runs (default: the device's ``"forward"`` stream), ``state``
    the live tensors it reads (fresh by default: pass the ones a backend holds references to);
    ``steps_in_flight`` is how many steps the caller replays the graph in before its events are
    waited on (a step shape that replays one runner's graph in several phases says so: it is how
    the graph is run, not an option handed on), the least ``ring_size`` it takes.

    ``lowering`` (a :class:`LowerOptions`) is the rest: the event ring's size, measured fences,
    a timeline, the check mode, the compile passes, the buffers published. Refuses
    (``UnsoundLowering``, with the audit's message) a declaration earlier than the traced reads
    unless ``policy`` is COARSE; ``LowerOptions(UNSAFE_skip_soundness_check=True)`` lowers it
    anyway: only for tests that show what an unsound fence does. ``check`` (a
    :class:`~readfence.graph.CheckState` over ``state["shared"]``) lowers the check mode: every
    release point poisons the buffers it releases (see ``graph.lowering._poison``).
    ``optimize=False`` runs every node of the captured stages as traced, through its op's handle
    (no constant folding, no shared subexpressions, no Python bindings): what ``verify`` reruns
    to tell readfence's own miscompile from a backend's. Either way the code every ring slot
    runs is the code validated against the stages' Python (``Lowered.optimized`` says which).
    An option given as a keyword is refused, naming the record it goes in.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER)
    ...     [(r["buffer"], r["end"]) for r in low.describe()][:2]
    ...     lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.EXACT,
    ...           lowering=LowerOptions(ring_size=3)).ring_size
    [('req_to_token', 'IN_REPLAY'), ('seq_lens', 'IN_REPLAY')]
    3
    >>> lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, ring_size=3)
    Traceback (most recent call last):
    ...
    TypeError: lower() got an unexpected keyword argument 'ring_size'; it is a lowering option: pass lowering=LowerOptions(ring_size=...)
    """
    check_backend(backend)
    check_forward_mode(mode, "lower")
    check_device(device)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a readfence.graph.Policy, got {policy!r}")
    options = lowering_options(lowering, "lower")
    measure, timeline, new_event, check = options.measure, options.timeline, options.new_event, options.check
    positive_int("steps_in_flight", steps_in_flight, at_most=MAX_RING, limit="the most events a ring holds")
    ring_size = steps_in_flight if options.ring_size is None else options.ring_size
    if ring_size < steps_in_flight:
        raise ValueError(
            f"{backend.name} in {mode.name} at batch size {batch_size}: "
            f"event ring of size {ring_size} is too small for {steps_in_flight} steps in flight: "
            f"the record of step i+{ring_size} would reuse an event that a wait of step i has not "
            f"bound yet; use ring_size >= {steps_in_flight}"
        )
    buffers = SHARED_BUFFERS if options.publish is None else options.publish
    cfg = model_config(cfg)
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    state = state if state is not None else make_state(cfg, device)
    check_live_state(state, cfg)
    graphed = replayed(backend, mode) and device.caps.graphs
    stream = stream if stream is not None else device.stream("forward")
    label = f"{backend.name}/{mode.name}/b{batch_size}/{policy.name}/{stream.name}#{next(_COUNTER)}"
    # the passes (see the module docstring): trace and bind; compile once for every ring slot and
    # validate; refuse an unsound declaration; rehearse; plan the fences; bind and capture per slot
    clock = PassClock()
    with clock.timing("trace"):
        program = _checked_program(backend, mode, cfg, batch_size, device, state, graphed)
        ledger = ledger_of(program, cfg, batch_size, state)
    # the stages compiled as every slot will run them, a hook after each node a record or a check's
    # poison may follow (only EXACT places poison inside a graph), validated before the rehearsal
    # runs the step's Python once more
    live = None if isinstance(device, CudaDevice) else BufferMap.of(state["shared"])
    writes = check is not None and policy is Policy.EXACT
    known = flatten_inputs(shared=state["shared"], pools=state["pools"], params=state["params"])

    def compiled(program: Program, sites: Mapping[Stage, frozenset[str]], env: Mapping[str, Tensor],
                 seen: NodeReadsIn, poison: bool) -> Callable[[bool], Mapping[Stage, StageCode]]:
        return lambda passes: compile_stages(program, sites, env, seen, writes=poison, live=live, optimize=passes)

    def validated(program: Program, ledger: Ledger) -> tuple[Mapping[Stage, StageCode], bool]:
        return _validated(program, ledger, backend, mode, device,
                          compiled(program, record_sites(program, {}), known, {}, writes), options.optimize, clock)

    try:
        code, optimized = validated(program, ledger)
    except StaleTrace as stale:  # its Python changed since, through a value no key holds: trace it again
        forget_trace(backend, mode, cfg=cfg, batch_size=batch_size, device=torch_device(device))
        with clock.timing("trace"):
            program = _checked_program(backend, mode, cfg, batch_size, device, state, graphed)
            ledger = ledger_of(program, cfg, batch_size, state)
        if stale.seed is not None:  # validated also where the stale one differed: wrong there whatever changed, refused
            differs_on(program, stale.seed)
        code, optimized = validated(program, ledger)
    declared = backend.read_effect(mode)

    def refuse_unsound() -> None:
        # the audit's own verdict, at the batch size lowered, on the live state, from the step's
        # ledger: whatever it refuses (a declaration below the trace, below a read any run of the
        # step saw: the audit's observer, the rehearsal, the Python of the stages that run it on
        # the generated states) no fence placed from the declaration may accept; a write of a
        # shared buffer any run saw is refused under every policy, as the trace's own are (the
        # unsafe flag lowers it anyway, for the run-time guard to show)
        if options.UNSAFE_skip_soundness_check:
            return
        refuse_writes(backend.name, ledger.writes())
        if policy is Policy.COARSE:
            return
        with clock.timing("verdict"):
            failure = audit_verdict(backend, mode, cfg=cfg, batch_size=batch_size, device=torch_device(device),
                                    state=state, ledger=ledger)
        if failure is not None:
            error = UnsoundLowering(
                f"refusing to lower {backend.name} for {mode.name} with policy {policy.name}: {failure.message}"
            )
            error.failure = failure
            raise error

    refuse_unsound()
    # the rehearsal is the last run of the step's code before it is captured (whatever a backend
    # keeps from a run, it keeps from this one under every policy); what it saw joins the verdict
    # (asked again: made again only if the rehearsal changed what the ledger says)
    with clock.timing("rehearse"):
        rehearsal = rehearse(program, ledger=ledger, mode=mode, stream=stream, label=label)
    refuse_unsound()
    with clock.timing("plan"):
        # EXACT places from the bound trace joined with every read a run of the step saw, never below one
        seen = ledger.node_reads()
        observed = ledger.effect()
        reads = last_reads(program, seen)
        plan = plan_fences(buffers=buffers, declared=declared, caps=device.caps, policy=policy, last_reads=reads,
                           observed=observed, graphed=graphed)
        launcher, batch = _launcher(cfg, mode, batch_size, state, rehearsal, stream, label, timeline, check,
                                    program.replayed, ledger)
    # where a replay runs Python (the CPU device), opaque ops' outputs are checked at every replay
    kept = captured_kept(backend, program)
    spec = SlotSpec(label, program, plan, device, seen, graphed, measure,
                    device.event if new_event is None else new_event, check, timeline, reads, live,
                    kept_check(kept, backend, label))
    parts = [slot_parts(spec, r) for r in range(ring_size)]
    if not all(c.serves(parts[0].after[stage], parts[0].actions[stage], frozenset(node_reads(program.stage(stage), seen)))
               for stage, c in code.items()):
        # a record after a node only a run saw reading (the rehearsal's), or a node kept for that read: the
        # code again, with those; the validation is not repeated where it computes alike
        sites = {s: frozenset(parts[0].after[s]) | frozenset(parts[0].actions[s]) | record_sites(program, seen)[s]
                 for s in code}
        poison = writes or any(a for acts in parts[0].actions.values() for a in acts.values())
        code, optimized = _validated(program, ledger, backend, mode, device,
                                     compiled(program, sites, launcher.env, seen, poison), optimized, clock)
    with clock.timing("capture"):
        slots = [build_slot(spec, launcher, p, code) for p in parts]
    return Lowered(
        backend=backend, mode=mode, policy=policy, device=device, cfg=cfg, batch_size=batch_size, program=program,
        plan=plan, launcher=launcher, batch=batch, state=state, graphed=graphed, measure=measure, slots=slots,
        check=check, observed=observed, ledger=ledger, optimized=optimized, kept=kept, pass_seconds=clock.seconds(),
    )


def _launcher(cfg: ModelConfig, mode: ForwardMode, batch_size: int, state: Mapping[str, dict[str, Tensor]],
              rehearsal: Rehearsal, stream: Stream, label: str, timeline: Timeline | None,
              check: CheckState | None, replayed: bool, ledger: Ledger) -> tuple[StepLauncher, dict[str, Tensor]]:
    # the step's static buffers: its batch, the metadata copies, the logits; over the live state
    dev = device_of(state["shared"])
    example = example_step(cfg, mode, batch_size, device=dev, parts=("shared", "batch"))
    batch = {k: torch.zeros_like(v, device=dev) for k, v in example.batch.items()}
    env: dict[str, Tensor] = flatten_inputs(shared=state["shared"], batch=batch, pools=state["pools"],
                                            params=state["params"])
    env.update(rehearsal.meta)
    logits = torch.zeros(example.num_tokens, cfg.vocab, device=dev)
    labels = {name: f"{label}/{name}" for name in (*(s.name for s in STAGES), "load_batch", "outputs")}
    watcher = None if check is None else check.watcher
    return StepLauncher(stream, env, rehearsal.meta, logits, label, labels, timeline, watcher, replayed,
                        ledger), batch


def _validated(program: Program, ledger: Ledger, backend: BackendLike, mode: ForwardMode, device: Device,
               compiled: Callable[[bool], Mapping[Stage, StageCode]], optimize: bool, clock: PassClock,
               ) -> tuple[Mapping[Stage, StageCode], bool]:
    """The step's stages as every ring slot runs them (``compiled(passes)``: hooks for records and
    checks inserted, compiled through the passes or not), validated: each captured stage's compiled
    code, its hooks bound to nothing, must compute what its Python computes on the generated states
    (``core.validate_replay``), whatever the policy, or the step is refused (``NotGraphSafe``):
    a graph that bakes a value of the traced step is wrong with any fence. What the Python of the
    stages that run it in the step reads there is recorded in ``ledger``. A step that is not
    replayed has no capture: its Python runs on the same states under the read observer instead
    (``Ledger.observe_varied``). The states are ``core.internal.varied_states``, written into the
    live buffers for a backend that keeps references to them, after the device has run what was
    enqueued on them.

    Code compiled through the passes that differs where the same stages compiled without them
    (every node as traced) do not is readfence's own miscompile, not the backend's: the step then
    runs that plain code, validated as well. Returns the code and whether it went through the
    passes (each compile and each validation timed on ``clock``)."""
    with clock.timing("compile"):
        code = compiled(optimize)
    if not program.replayed or program.aborted is not None:
        with clock.timing("validate"):
            ledger.observe_varied(settle=device.synchronize)
        return code, optimize
    try:
        with clock.timing("validate"):
            _validate_code(program, ledger, backend, mode, device, code)
        return code, optimize
    except NotGraphSafe as e:
        if not optimize or isinstance(e, StaleTrace):  # (a stale trace is traced again, not a miscompile)
            raise
    with clock.timing("compile"):
        plain = compiled(False)
    with clock.timing("validate"):
        _validate_code(program, ledger, backend, mode, device, plain)  # the backend's own refusal
    return plain, False


def _validate_code(program: Program, ledger: Ledger, backend: BackendLike, mode: ForwardMode, device: Device,
                   code: Mapping[Stage, StageCode]) -> None:
    # each captured stage replayed as the slots run it: the very code, no event fired
    runners = {stage: c.validating() for stage, c in code.items() if c.compiled is not None}

    def replay(stage: StageGraph, env: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return runners[stage.stage].run(env)

    key = tuple((str(stage), r.graph.computation) for stage, r in runners.items())
    cfg, state = ledger.cfg, ledger.state
    with varied_states(program, cfg, ledger.batch_size, state, settle=device.synchronize) as example:
        validate_replay(program, step_functions(backend, mode, cfg), example, ledger=ledger, replay=replay, key=key)
    # a capture validated before, on another state, ran nothing here: its Python is observed instead
    ledger.observe_varied(settle=device.synchronize)


def _checked_program(backend: BackendLike, mode: ForwardMode, cfg: ModelConfig, batch_size: int, device: Device,
                     state: Mapping[str, Mapping[str, Tensor]], graphed: bool) -> Program:
    """The traced step bound to the live ``state``; refuses what no fence can make correct:
    trace-time state a replayed graph captured (stale whatever the policy: a stage that runs its
    Python reads what its code reaches now), another state's buffer any stage reads (the fences
    guard the state given), and, on a device whose graphs capture kernels rather than Python, an
    in-graph stage that escapes the tracer."""
    program = bind(trace_step(backend, mode, cfg=cfg, batch_size=batch_size, device=torch_device(device)), state)
    unusable = [c for c in program.captured() if not c.usable
                and (not program.stage(c.stage).runs_python or c.of_another_state)]
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


__all__ = ["Lowered", "StepRun", "UncapturableStage", "UnsoundLowering", "last_reads", "lower", "stale_capture"]
