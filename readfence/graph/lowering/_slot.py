"""Lowering passes per event-ring slot: insert records, compile, capture.

A lowered step owns one :class:`Slot` per event-ring slot: its events, its stage graphs with
those events' records inserted after their nodes (``insert_records``) and compiled
(``compile_graph``), and, on a device with graphs, the captured graph of its in-graph stages.
The stages are compiled once per lowering (:func:`compile_stages`), with a hook after every node
an event may follow (:func:`record_sites`), which every slot binds to its own events and check
actions (:class:`StageCode`): every slot runs the one code the lowering validated. The code is
kept under all it is compiled from (:class:`CompileKey`): lowering the same step under another
policy, or again, on the same state reuses it (its hooks are bound per slot, so nothing of a
lowering's own is in it).
:func:`build_slot` is the pass; :class:`StepLauncher` is how a step's stages are launched on
the lowered stream, in a capture or eagerly, in the order of ``core.STAGES``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import attrs
from torch import Tensor, fx

from readfence.core import BODY, PREPARE_OUT_GRAPH, STAGES, Program, Stage, StageGraph, StageOutputError
from readfence.core.internal import CACHES, BufferMap, Ledger, NodeReadsIn, as_words
from readfence.effects import ReadEnd

from ..devices import Device, Event, Graph, Op, Record, Stream, Timeline
from ._fence import RunClock, SlotHead, claim_events, slot_head
from ._fx_aliases import insert_alias_checks
from ._fx_compile import CompiledGraph, compile_graph
from ._fx_memory import UNKNOWN, InputMemory, storage_token
from ._fx_records import AfterNode, hooks_for, insert_hooks, stage_ops
from ._plan import IN_GRAPH_STAGES, FencePlan, LastRead, Placement
from ._poison import CheckState, Watcher, poison_points

Action = Callable[[], None]


class StageRunner(Protocol):
    """What runs one stage of a lowered step on the step's environment."""

    def run(self, env: Mapping[str, Tensor]) -> dict[str, Tensor]: ...


class CompiledStage:
    """A faithful stage's graph, compiled (``graph._fx_compile``), run like ``StageGraph.run``;
    ``fn`` is the compiled code bound to its hooks (default: the graph's own)."""

    __slots__ = ("stage", "graph", "_fn", "_inputs", "_outputs")

    def __init__(self, stage: StageGraph, graph: CompiledGraph, fn: Callable[..., Any] | None = None) -> None:
        self.stage, self.graph = stage, graph
        self._fn = graph.fn if fn is None else fn
        self._inputs, self._outputs = stage.graph.inputs, stage.graph.outputs

    def run(self, env: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Execute the stage on ``env`` (name -> tensor); outputs by name."""
        return dict(zip(self._outputs, self._fn(*map(env.__getitem__, self._inputs)), strict=True))


class LaunchedStage(NamedTuple):
    """One stage as a slot launches it: what runs it, and the ops the device is told."""

    runner: StageRunner
    ops: tuple[Op, ...]


@attrs.define(eq=False)
class Slot:
    """One event-ring slot of a lowered step: its events, its stages, its captured graph.

    ``at_end[end.rank]`` are the stage-level events released at ``end`` (plan order) and
    ``act_at_end[end.rank]`` check mode's poison of what they release; ``fence_events`` are the
    events in plan order, then ``done``; ``buffer_points`` maps each published buffer to the
    index of its event there (``None``: never read, no wait). ``out_fn`` launches the
    out-of-graph stage (watched and timed as lowered); ``clock`` counts the slot's runs and
    ``head`` is what their fences share.
    """

    index: int
    events: dict[Placement, Event]
    probes: dict[str, Event]
    done: Event
    stages: dict[Stage, LaunchedStage]
    at_end: tuple[tuple[Event, ...], ...]
    act_at_end: tuple[Action | None, ...]
    fence_events: tuple[Event, ...]
    buffer_points: Mapping[str, int | None]
    out_fn: Action
    out_ops: tuple[Op, ...]
    clock: RunClock
    head: SlotHead
    graph: Graph | None = None

    def rebase(self, owner: str, base: tuple[int, ...]) -> None:
        """Start the slot's fences from event generations ``base`` (after a capture, or when a
        step stopped midway recorded some events)."""
        self.clock.base = base
        self.head = slot_head(owner, self.buffer_points, self.fence_events, base)


@attrs.define(eq=False)
class StepLauncher:
    """How a lowered step's stages are launched on its stream: each stage's runner over the
    step's environment ``env`` (its static batch, the live state, the static metadata copies
    ``meta``), the in-graph stages' outputs into ``env``, the body's into ``logits``; each
    watched in check mode (a run of the step's ``ledger``) and timed when there is a timeline. In
    a step that is not ``replayed`` the out-of-graph stage's outputs go into ``env`` as they are:
    every stage runs its Python, as the engine runs it, and its metadata may change shape every
    step."""

    stream: Stream
    env: dict[str, Tensor]
    meta: dict[str, Tensor]
    logits: Tensor
    label: str
    labels: Mapping[str, str]
    timeline: Timeline | None = None
    watcher: Watcher | None = None
    replayed: bool = True
    ledger: Ledger | None = None  # the step's: what check mode's watcher sees is recorded there

    def copy_meta(self, out: Mapping[str, Tensor]) -> None:
        """The out-of-graph stage's outputs into the graph's static buffers (of the traced
        shapes: a copy would broadcast a smaller tensor without a word); into the environment
        itself in a step that is not replayed."""
        if not self.replayed:
            self.env.update(out)
            return
        meta = self.meta
        for k, v in out.items():
            static = meta[k]
            if static.shape != v.shape:
                raise StageOutputError(
                    f"{self.label}: stage {PREPARE_OUT_GRAPH.name} returned {k!r} of shape {tuple(v.shape)}, "
                    f"the graph was lowered for shape {tuple(static.shape)}: a graph reads metadata of one "
                    f"shape per batch size; pad it to a fixed shape, as engines' graph runners do",
                    stage=PREPARE_OUT_GRAPH.name)
            if static.dtype == v.dtype:  # (as words: a dtype torch cannot copy, copied bit for bit)
                as_words(static).copy_(as_words(v))
            else:
                static.copy_(v)

    def launch_stage(self, slot: Slot, stage: Stage, step: int | None, sink: Callable[[dict[str, Tensor]], object]) -> None:
        runner, ops = slot.stages[stage]
        env, watcher = self.env, self.watcher

        def run_stage() -> None:
            if watcher is None:
                sink(runner.run(env))
                return
            with watcher.stage(stage.name, self.ledger):
                sink(runner.run(env))

        fn = run_stage if self.timeline is None else self.timeline.timed(self.stream.name, stage.name, run_stage, "stage")
        self.stream.launch(fn, label=self.labels[stage.name], ops=ops, step=step)

    def record_points(self, slot: Slot, end: ReadEnd) -> None:
        """The records of the stage-level points at ``end``, then check mode's poison (as the
        step issuer emits them for the points outside the graph)."""
        for event in slot.at_end[end.rank]:
            self.stream.record(event)
        act = slot.act_at_end[end.rank]
        if act is not None:
            self.stream.launch(act, label=f"{self.label}/poison@{end.name}")

    def in_graph_work(self, slot: Slot, step: int | None = None) -> None:
        """The in-graph stages in order, each followed by its stage-level points (the last
        stage's are the issuer's, after the replay): captured once per slot, or launched
        eagerly every step."""
        stages = [s for s in STAGES if s.in_graph]
        for stage in stages[:-1]:
            self.launch_stage(slot, stage, step, self.env.update)
            self.record_points(slot, stage.end)
        logits = self.logits
        self.launch_stage(slot, stages[-1], step, lambda out: logits.copy_(out[BODY.outputs]))


def last_reads(program: Program, observed: NodeReadsIn | None = None,
               ) -> dict[str, LastRead]:
    """Per shared buffer read by ``program``, the node after which its last read is done: the
    latest of the trace's last reader and every node ``observed`` (per stage, per node, the
    buffers a run was seen to read: the rehearsal's) saw reading it.

    Only nodes an event can follow: a stage that runs its Python function instead of its
    graph has no nodes to follow, and a read by a stage's output node ends with the stage;
    those buffers get the stage-level point. EXACT places its events from these
    (``plan_fences(last_reads=...)``).

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> program = trace(paged(), ForwardMode.DECODE)
    >>> last = last_reads(program)["req_to_token"]
    >>> str(last.stage), last.node
    ('prepare_in_graph', 'index_select')
    >>> from readfence.core import BODY
    >>> str(last_reads(program, {BODY: {"mul": frozenset({"req_to_token"})}})["req_to_token"].stage)
    'body'
    """
    out = {}
    positions = node_positions(program)
    for b in program.buffers:
        last = last_reader(program, b, observed, positions)
        if last is None:
            continue
        stage, node = last
        index, nodes = positions[stage].get(node), positions[stage]
        if program.stage(stage).runs_python or index is None or index == len(nodes) - 1:
            continue
        out[b] = LastRead(stage, node, index)
    return out


def node_positions(program: Program) -> dict[Stage, dict[str, int]]:
    """Per stage, in execution order, each node's position in its graph.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> [str(s) for s in node_positions(trace(paged(), ForwardMode.DECODE))]
    ['prepare_out_graph', 'prepare_in_graph', 'body']
    """
    return {s.stage: s.graph.node_order() for s in program.stages}


def last_reader(program: Program, buffer: str, observed: NodeReadsIn | None = None,
                positions: Mapping[Stage, Mapping[str, int]] | None = None) -> tuple[Stage, str] | None:
    """``(stage, node)`` of the last read of ``buffer``: the latest of the trace's last reader
    (``Program.last_reader``) and the nodes ``observed`` saw reading it; a node the stage's
    graph does not hold (a read seen in a stage's Python) counts as the stage's end.
    ``positions`` is :func:`node_positions` of ``program``, when the caller has it.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> from readfence.core import BODY
    >>> last_reader(trace(paged(), ForwardMode.DECODE), "seq_lens", {BODY: {"mul": frozenset({"seq_lens"})}}) == (BODY, "mul")
    True
    """
    positions = node_positions(program) if positions is None else positions
    order = {name: i for i, name in enumerate(positions)}
    readers = [r for r in [program.last_reader(buffer)] if r is not None]
    readers += [(stage, node) for stage, nodes in (observed or {}).items() for node, bufs in nodes.items()
                if buffer in bufs and stage in order]
    if not readers:
        return None

    def position(reader: tuple[Stage, str]) -> tuple[int, int]:
        nodes = positions[reader[0]]
        return order[reader[0]], nodes.get(reader[1], len(nodes))

    return max(readers, key=position)


def node_reads(stage: StageGraph, observed: NodeReadsIn) -> dict[str, frozenset[str]]:
    """Per node of ``stage``, the buffers its trace reads and those ``observed`` saw it read."""
    seen, traced = observed.get(stage.stage, {}), stage.analysis.reads
    return {n: traced.get(n, frozenset()) | seen.get(n, frozenset()) for n in {*traced, *seen}}


def _ignore(*_: object) -> None:
    """What a hook calls while the code is validated: no event, no poison, no check."""


@attrs.frozen(eq=False)
class StageCode:
    """One stage of a lowered step as every ring slot runs it: ``gm``, its graph with a hook
    after each node of ``sites`` (and an alias check after each opaque op), and ``compiled``, its
    compiled code (``None``: the stage runs its Python). A slot binds the hooks to its own events
    and check actions (:meth:`launched`); the lowering validates the code with the hooks bound to
    nothing (:meth:`validating`). ``keep`` are the nodes the passes left where they are."""

    stage: StageGraph
    gm: fx.GraphModule
    compiled: CompiledGraph | None
    sites: frozenset[str] = frozenset()
    keep: frozenset[str] = frozenset()
    writes: bool = False

    def launched(self, reads: Mapping[str, frozenset[str]],
                 hooks: Mapping[Hashable, Callable[..., object]] | None = None) -> LaunchedStage:
        """The stage as a slot launches it, its hooks calling ``hooks`` (``hooks_for`` that
        slot's events and actions; the others, as compiled); ``reads`` per node for its ops."""
        name = self.stage.stage.name
        if self.compiled is None:
            return LaunchedStage(self.stage, stage_ops(self.gm, reads, name))
        # a site this slot places nothing after calls nothing; the alias checks run as compiled
        targets = {key: _ignore if isinstance(own, AfterNode) else own for key, own in self.compiled.hooks}
        targets.update(hooks or {})
        runner = CompiledStage(self.stage, self.compiled, self.compiled.bind(targets))
        return LaunchedStage(runner, stage_ops(self.gm, reads, name, targets))

    def validating(self) -> CompiledStage:
        """The compiled code with every hook bound to nothing: what the lowering's translation
        validation replays (its records, poison and checks are no part of what it computes)."""
        assert self.compiled is not None
        return CompiledStage(self.stage, self.compiled, self.compiled.bind(
            {key: _ignore for key, _ in self.compiled.hooks}))

    def serves(self, after: Mapping[str, object], actions: Mapping[str, object], keep: frozenset[str]) -> bool:
        """Whether this code can run a slot placing records ``after`` and check ``actions`` after
        its nodes, with the passes keeping ``keep``: a hook after each of those nodes, a poison
        hook known to write, the same nodes kept."""
        if self.compiled is None:
            return True
        placed = {n for n, v in after.items() if v} | {n for n, v in actions.items() if v}
        return placed <= self.sites and (self.writes or not any(actions.values())) and keep == self.keep


def record_sites(program: Program, observed: NodeReadsIn) -> dict[Stage, frozenset[str]]:
    """Per stage, the nodes an event or a check's poison may be placed after: every node the
    trace or ``observed`` saw read a shared buffer but the stage's last (where the stage ends).

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, PREPARE_IN_GRAPH, trace
    >>> sorted(record_sites(trace(paged(), ForwardMode.DECODE), {})[PREPARE_IN_GRAPH])
    ['index_select', 'index_select_1']
    """
    out = {}
    for s in program.stages:
        last = next(n.name for n in reversed(s.graph.gm.graph.nodes))
        out[s.stage] = frozenset(n for n in node_reads(s, observed) if n != last)
    return out


def compile_stage(stage: StageGraph, sites: frozenset[str], observed: NodeReadsIn, *, writes: bool = False,
                  live: BufferMap | None = None, backend: str = "?", inputs: tuple[InputMemory, ...] | None = None,
                  optimize: bool = True) -> StageCode:
    """``stage`` with a hook after each node of ``sites`` (``writes``: a check's poison may run
    there) and, given the ``live`` shared buffers, an alias check after each opaque op
    (``insert_alias_checks``), compiled (``optimize``: through the compile passes, keeping the
    nodes that read a shared buffer where they are, ``inputs`` saying what its inputs hold;
    else every node as traced, through its op's handle); a stage that runs its Python runs as
    it is, with no node-level records."""
    if stage.runs_python:
        return StageCode(stage, stage.graph.gm, None)
    keep = frozenset(node_reads(stage, observed))
    gm = insert_hooks(stage.graph.gm, sorted(sites), writes=writes) if sites else stage.graph.gm
    if live is not None:
        gm = insert_alias_checks(gm, live, backend=backend, stage=stage.stage.name)
    compiled = compile_graph(gm, keep=keep, inputs=inputs, simplify=optimize, bindings=optimize)
    return StageCode(stage, gm, compiled, frozenset(sites), keep, writes)


@attrs.frozen
class CompileKey:
    """All a program's compiled stages (:func:`compile_stages`) are computed from: the ``program``
    (by identity: another trace, or one bound to another state, is another program), per stage the
    hook ``sites`` and the nodes kept where they are (``keep``: those the trace or a run saw read a
    shared buffer), whether a hook may write (``writes``), the ``live`` buffers the alias checks
    compare against, ``optimize``, and what each stage input the caller gives holds (``inputs``:
    its storage, by :func:`~readfence.graph.lowering._fx_memory.storage_token`, the only thing of a
    tensor the passes read; an input the caller does not give is a static buffer of its own)."""

    program: Program
    sites: tuple[tuple[Stage, frozenset[str]], ...]
    keep: tuple[tuple[Stage, frozenset[str]], ...]
    inputs: tuple[tuple[str, Hashable], ...]
    writes: bool
    live: BufferMap | None
    optimize: bool


#: Compiled stages, shared by the lowerings of one program on one state (every policy, every size
#: of a capture list lowered again): the very code a fresh compilation gives.
_COMPILED = CACHES.table("compiled_stages", CompileKey, "the program's stages with hooks inserted, compiled by "
                         "the passes", limit=128)


def compile_stages(program: Program, sites: Mapping[Stage, frozenset[str]], env: Mapping[str, Tensor],
                   observed: NodeReadsIn, *, writes: bool = False, live: BufferMap | None = None,
                   optimize: bool = True) -> Mapping[Stage, StageCode]:
    """Every stage of ``program`` compiled once for every slot (:func:`compile_stage`). What each
    compiled stage's inputs hold is told to its passes: the step's tensors in ``env`` (live
    state; an input ``env`` does not hold yet is a static buffer the lowering allocates, memory
    of its own), or, for an earlier in-graph stage's outputs, the memory that stage's analysis
    says they may be (a stage that runs its Python may return any memory). Computed once per
    :class:`CompileKey` (the code is read-only: each slot binds its own hooks)."""
    given = {n for s in program.stages for n in s.graph.inputs if n in env}
    key = CompileKey(program, tuple((s.stage, frozenset(sites.get(s.stage, frozenset()))) for s in program.stages),
                     tuple((s.stage, frozenset(node_reads(s, observed))) for s in program.stages),
                     tuple(sorted((n, storage_token(env[n])) for n in given)), writes, live, optimize)
    return _COMPILED.compute(key, lambda: MappingProxyType(_compile_stages(program, sites, env, observed, writes=writes,
                                                                           live=live, optimize=optimize)))


def _compile_stages(program: Program, sites: Mapping[Stage, frozenset[str]], env: Mapping[str, Tensor],
                    observed: NodeReadsIn, *, writes: bool, live: BufferMap | None,
                    optimize: bool) -> dict[Stage, StageCode]:
    produced: dict[str, InputMemory] = {}
    code: dict[Stage, StageCode] = {}
    for s in program.stages:
        inputs = tuple(produced[n] if n in produced else env.get(n, frozenset({("static", n)})) for n in s.graph.inputs)
        code[s.stage] = c = compile_stage(s, sites.get(s.stage, frozenset()), observed, writes=writes, live=live,
                                          backend=program.backend, inputs=inputs, optimize=optimize)
        if s.stage.in_graph:  # its outputs join the environment as they are, every step
            memory = None if c.compiled is None else c.compiled.memory
            outs = memory.outputs() if memory is not None else tuple(frozenset({UNKNOWN}) for _ in s.graph.outputs)
            produced.update(zip(s.graph.outputs, outs))
    return code


@attrs.frozen
class SlotSpec:
    """What every slot of one lowered step is built from."""

    label: str
    program: Program
    plan: FencePlan
    device: Device
    observed: NodeReadsIn
    graphed: bool
    measure: bool
    new_event: Callable[[str], Event]
    check: CheckState | None = None
    timeline: Timeline | None = None
    # the last reads the plan was made from (``last_reads(program, observed)``)
    reads: Mapping[str, LastRead] = attrs.Factory(dict)
    # the live shared buffers an opaque op's outputs are checked against at every replay, where a
    # replay runs Python (the CPU device); ``None``: no such check
    live: BufferMap | None = None
    # what every step checks once its out-of-graph stage ran, before the graph replays: that each
    # tensor the graph captured is still the one the backend keeps (raises); ``None``: nothing captured
    kept_check: Callable[[], None] | None = None


@attrs.frozen(eq=False)
class SlotParts:
    """What event-ring slot ``index`` is built from: its events (per placement, the probes of
    the last reads, in the graph and in the out-of-graph stage's Python), and per stage the
    records (``after``) and check actions (``actions``) inserted after each node, and the
    actions at each stage-level end (``at_end``)."""

    index: int
    events: dict[Placement, Event]
    probes: dict[str, Event]
    out_probes: dict[str, Event]
    after: dict[Stage, dict[str, list[Event]]]
    actions: dict[Stage, dict[str, list[Action]]]
    at_end: tuple[Action | None, ...]


def slot_parts(spec: SlotSpec, r: int) -> SlotParts:
    """Event-ring slot ``r``'s events, and where their records and the check's actions go."""
    label, program, plan, dev = spec.label, spec.program, spec.plan, spec.device
    events = {p: spec.new_event(f"{label}/{p.end.name}{'@' + p.after.node if p.after else ''}#{r}")
              for p in plan.points()}
    reads = spec.reads
    probes = {}
    if spec.measure:
        # Probes are in-launch records: skip those a captured graph could not record
        # (no in-graph events), instead of failing the capture of a measured run.
        can_probe = not spec.graphed or dev.caps.in_graph_events
        probes = {b: dev.event(f"{label}/lastread:{b}#{r}") for b, last in reads.items()
                  if b in plan.placements and (can_probe or last.stage not in IN_GRAPH_STAGES)}
    # a last read in the out-of-graph stage's Python: probed as that stage returns
    positions = node_positions(program) if spec.measure else {}
    out_probes = {b: dev.event(f"{label}/lastread:{b}#{r}") for b in plan.placements
                  if spec.measure and b not in probes and b in program.buffers
                  and (last_reader(program, b, spec.observed, positions) or (None,))[0] == PREPARE_OUT_GRAPH}
    after: dict[Stage, dict[str, list[Event]]] = {s.stage: {} for s in program.stages}
    for b, last in reads.items():  # probes first: read, then release
        if b in probes:
            after[last.stage].setdefault(last.node, []).append(probes[b])
    for point, event in events.items():
        if point.after is not None:
            after[point.after.stage].setdefault(point.after.node, []).append(event)
    actions: dict[Stage, dict[str, list[Action]]] = {s.stage: {} for s in program.stages}
    at_end: list[Action | None] = [None] * len(ReadEnd)
    if spec.check is not None:
        for point, buffers in poison_points(plan.placements).items():
            act = spec.check.poisoner(buffers)
            if point.after is not None:
                actions[point.after.stage].setdefault(point.after.node, []).append(act)
            else:
                at_end[point.end.rank] = act
    return SlotParts(r, events, probes, out_probes, after, actions, tuple(at_end))


def build_slot(spec: SlotSpec, launcher: StepLauncher, parts: SlotParts, code: Mapping[Stage, StageCode]) -> Slot:
    """Event-ring slot ``parts.index``: its stages, ``code`` bound to its events and check
    actions, and, when ``spec.graphed``, its in-graph stages captured on the launcher's stream."""
    label, plan, dev = spec.label, spec.plan, spec.device
    events, probes, out_probes = parts.events, parts.probes, parts.out_probes
    stages = {}
    for s in spec.program.stages:
        c = code[s.stage]
        if not c.serves(parts.after[s.stage], parts.actions[s.stage], c.keep):
            raise AssertionError(f"{label}: stage {s.stage} was compiled without a hook its slot {parts.index} binds")
        stages[s.stage] = c.launched(node_reads(s, spec.observed), hooks_for(parts.after[s.stage], dev,
                                                                                parts.actions[s.stage]))
    index = {p: i for i, p in enumerate(events)}
    done = spec.new_event(f"{label}/done#{parts.index}")
    fence_events = (*events.values(), done)
    claim_events(label, [*events.values(), *probes.values(), *out_probes.values(), done])
    slot = Slot(
        index=parts.index, events=events, probes={**probes, **out_probes}, done=done, stages=stages,
        at_end=tuple(tuple(e for p, e in events.items() if p.after is None and p.end is end) for end in ReadEnd),
        act_at_end=parts.at_end, fence_events=fence_events,
        buffer_points=MappingProxyType({b: index.get(p) for b, p in plan.placements.items()}),
        out_fn=_out_launch(spec, launcher, stages[PREPARE_OUT_GRAPH].runner, tuple(out_probes.values())),
        out_ops=(*stages[PREPARE_OUT_GRAPH].ops, *(Record(e) for e in out_probes.values())),
        clock=RunClock(()), head=slot_head(label, {}, (), ()),
    )
    if spec.graphed:
        with dev.capture(launcher.stream, label=f"{label}/graph#{parts.index}") as graph:
            launcher.in_graph_work(slot)
        slot.graph = graph
    slot.rebase(label, tuple(e.generation for e in fence_events))
    return slot


def _out_launch(spec: SlotSpec, launcher: StepLauncher, runner: StageRunner, probes: tuple[Event, ...] = ()) -> Action:
    # the out-of-graph stage and its copies into the graph's static buffers, one launch; then
    # the probes of the last reads made in its Python
    env, copy_meta, dev, kept_check = launcher.env, launcher.copy_meta, spec.device, spec.kept_check

    def plain() -> None:
        copy_meta(runner.run(env))
        if kept_check is not None:  # its Python may have replaced a buffer the graph captured
            kept_check()
        for probe in probes:
            dev.record_here(probe)

    fn = plain
    watcher = launcher.watcher
    if watcher is not None:
        def watched() -> None:
            # the copy into the graph is this stage's read; what it reads is a run of the step's ledger
            with watcher.stage(PREPARE_OUT_GRAPH.name, launcher.ledger):
                plain()

        fn = watched
    if spec.timeline is not None:
        fn = spec.timeline.timed(launcher.stream.name, PREPARE_OUT_GRAPH.name, fn, "stage")
    return fn


__all__ = ["CompileKey", "CompiledStage", "LaunchedStage", "Slot", "SlotParts", "SlotSpec", "StageCode", "StepLauncher", "build_slot",
           "compile_stage", "compile_stages", "last_reader", "last_reads", "node_positions", "node_reads", "record_sites",
           "slot_parts"]
