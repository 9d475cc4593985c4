"""The ledger of a bound program: what every run of its user code was seen to read.

readfence runs a backend's code many times before and while it trusts a fence: the audit's
observer on example steps, the Python of the stages that run it on the generated states
(:func:`~readfence.core.varied_step`), a capture's validation replays, the lowering's rehearsal
(a serving loop's warm-up of each captured size), check mode. Each run goes through one entry,
:meth:`Ledger.watch`, which runs it under a :class:`~readfence.core.ReadObserver` of the state the
run was given *and* the live shared buffers the program is bound to (a kernel reading a buffer it
keeps by reference reads the live one), and records what it saw, per stage and node, into the one
ledger of that bound program (:func:`ledger_of`). Nothing runs a step's code under observation
any other way, so a new kind of run cannot forget to record.

The verdict is a function of the ledger: the trace's reads (the program's analysis, its first
entry) joined with every run's (:meth:`Ledger.effect`, :meth:`Ledger.node_reads`,
:meth:`Ledger.last_reader`). A read seen by any run is a read: the audit's verdict, ``lower``'s
refusal, EXACT's placement, a step shape's ranking of its phases and ``verify``'s attribution all
read it here.

A read a run saw in a stage's Python has no node of the stage's graph; where that graph is what
runs (an in-graph stage of a replayed step) and its trace or a run of the graph (the rehearsal,
node by node) saw a node of it read the buffer, the read is the last such node's (the graph that
runs reads it there); anywhere else it is the stage's end (:data:`PYTHON`).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.effects import ReadEffect, ReadEnd

from ._node_labels import NodeLabels
from ._observe import Access, Disagreement, Observation, ReadObserver, Watched, cross_check
from ._program import NodeReads, Program, StageGraph, flatten_inputs
from ._state import TRAFFIC_STATES, ModelConfig, example_step, varied_step
from ._state_values import preserved
from ._step import STAGE_ENDS, STAGES, Stage, StepFunctions, eval_step, stage_named
from ._threads import watch_threads
from .tracing import CACHES, BufferMap, state_key

#: The node of a read a run saw in a stage's Python that no node of its graph accounts for: the
#: read ends with the stage.
PYTHON = "(python)"

#: The live tensors a step runs on: ``shared``, ``pools``, ``params``, each name -> tensor.
State = Mapping[str, Mapping[str, Tensor]]

#: The seeds of the generated states a capture is validated on and a step's Python is observed on:
#: the budget, one state of each kind traffic has (``core.varied_step``: every request at its first
#: tokens, every request at the longest context, a mixed batch with stale and padding rows). The
#: trace's example is another, so that the values computed from the step's data differ from the
#: traced ones.
REPLAY_SEEDS: tuple[int, ...] = tuple(range(1, len(TRAFFIC_STATES) + 1))


class RunKind(enum.StrEnum):
    """Which of readfence's runs of a step's code a :class:`Run` was.

    >>> RunKind.VARIED.on_generated_state, RunKind.OBSERVER.on_generated_state
    (True, False)
    """

    # (in the order a witness of a read is looked for: the audit's and lower's messages agree)
    OBSERVER = "observer"  # the audit's observer: the stages' Python on example steps (held to the trace)
    REHEARSAL = "rehearsal"  # lower's rehearsal, a loop's warm-up: the bound program on an example
    VARIED = "varied"  # the Python of the stages that run it, on a generated state
    VALIDATION = "validation"  # beside a capture's validation replay: the same Python on a generated state
    CHECK = "check"  # check mode: the lowered step on the live state

    @property
    def on_generated_state(self) -> bool:
        """Whether the run was on a generated state (``core.varied_step``): a path the trace's
        example did not take is seen there."""
        return self in (RunKind.VARIED, RunKind.VALIDATION)


@attrs.frozen
class Run:
    """One run of a step's code, as the ledger recorded it: what it was, on which state, and every
    access of a shared buffer it made (each labelled ``stage`` or ``stage:node``)."""

    kind: RunKind
    label: str
    accesses: tuple[Access, ...]

    @property
    def name(self) -> str:
        """What it was, for a message: ``observer run 'example 0'``."""
        return f"{self.kind.value} run '{self.label}'"

    def reads(self) -> Iterator[Access]:
        """Its reads and escapes (a write is not a read)."""
        return (a for a in self.accesses if a.kind != "write")


@attrs.frozen
class Witness:
    """Where the ledger last saw a buffer read: ``stage`` and ``node`` (:data:`PYTHON` for a
    stage's Python, an op's name for the audit's observer), the run, its end, and the user's
    ``file:line in function`` that made the read (``""``: unknown)."""

    stage: Stage
    node: str
    run: Run | None  # None: the trace's own read
    end: ReadEnd
    source: str = ""


class Ledger:
    """The evidence of one bound program: the trace and every run of its code (see the module
    docstring). Make one with :func:`ledger_of`; every run goes through :meth:`watch`.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> cfg = ModelConfig()
    >>> ledger = ledger_of(trace(paged(), ForwardMode.EXTEND, cfg=cfg), cfg, 2)
    >>> ledger.observe_varied()
    >>> [r.label for r in ledger.runs()]
    ['first_tokens', 'longest_context', 'mixed_batch']
    >>> ledger.effect()["req_to_token"], ledger.last_reader("req_to_token").stage.name
    (<ReadEnd.IN_REPLAY: 2>, 'prepare_in_graph')
    """

    def __init__(self, program: Program, cfg: ModelConfig, batch_size: int, state: State | None = None) -> None:
        self.program, self.cfg, self.batch_size = program, cfg, batch_size
        # the live state, held weakly (a cached ledger must not keep a model's caches alive)
        self._state = None if state is None else {g: {k: weakref.ref(t) for k, t in d.items()} for g, d in state.items()}
        self.live = BufferMap.of(state["shared"]) if state is not None else BufferMap.of({})
        self._runs: dict[tuple[RunKind, str], Run] = {}
        self._lock = threading.Lock()
        self._changes = itertools.count(1)
        self.version = 0  # bumped by every run that shows a read, escape or write not seen before
        self._seen: set[tuple[str, str, str]] = set()  # (kind, buffer, stage label) of every access
        self._memo: dict[tuple[Any, ...], Any] = {}  # what the queries computed, at a version

    # -- the one entry -------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, kind: RunKind, label: str, shared: Mapping[str, Tensor], *,
              observer: ReadObserver | None = None) -> Iterator[ReadObserver]:
        """A :class:`ReadObserver` of ``shared`` (the state the run is given) and the live shared
        buffers, for the block to run the program's code under (entered around the code it watches:
        all of a step, or the stages whose Python runs in it); what it saw is recorded as run
        ``label`` of ``kind`` when the block ends, also when the code raised (what it read before
        counts). ``observer`` is one the caller runs already (check mode's, watching the live
        buffers over a whole step): what it sees during the block is recorded."""
        if observer is None:
            live = self.state
            held = [*shared.values(), *(live["shared"].values() if live is not None else ())]
            observer = ReadObserver(BufferMap.of(shared).union([self.live]), held=held)
        start = len(observer.accesses)
        try:
            yield observer
        finally:
            self.record(Run(kind, label, tuple(observer.accesses[start:])))

    def record(self, run: Run) -> None:
        """Add ``run`` (to an earlier run of the same kind and label, if it saw more than that one);
        the ledger's version changes if it saw what no run saw before, and the evidence epoch
        (:func:`evidence_epoch`) if that changed what the ledger says the step reads."""
        global _EPOCH
        new = {(a.kind, a.buffer, a.stage) for a in run.accesses}
        with self._lock:
            key = (run.kind, run.label)
            old = self._runs.get(key)
            if old is None:
                self._runs[key] = run
            elif not new <= {(a.kind, a.buffer, a.stage) for a in old.accesses}:
                self._runs[key] = attrs.evolve(old, accesses=old.accesses + run.accesses)
            if new <= self._seen:
                return
            before = self._memo.get(("effect", (), True))
            wrote = any(k == "write" for k, _, _ in new - self._seen)
            self._seen |= new
            self.version = next(self._changes)
        if wrote or before is None or before[1] != self.effect():  # what a verdict is made of changed
            with _EPOCH_LOCK:
                _EPOCH += 1

    @property
    def state(self) -> State | None:
        """The live state the program is bound to (``None``: none, or no longer alive)."""
        if self._state is None:
            return None
        out = {g: {k: ref() for k, ref in d.items()} for g, d in self._state.items()}
        if any(t is None for d in out.values() for t in d.values()):
            return None
        return out  # type: ignore[return-value]

    @property
    def gone(self) -> bool:
        """Whether the live state it was made for is no longer alive (its memory may be another's)."""
        return self._state is not None and self.state is None

    def has(self, kind: RunKind, label: str) -> bool:
        """Whether a run of ``kind`` named ``label`` is recorded (a run is made once per ledger)."""
        return (kind, label) in self._runs

    def runs(self, *kinds: RunKind) -> tuple[Run, ...]:
        """The runs recorded (of ``kinds``, when given), in the order they were first made."""
        with self._lock:
            runs = tuple(self._runs.values())
        return tuple(r for r in runs if not kinds or r.kind in kinds)

    # -- the runs readfence makes ----------------------------------------------------------------
    def observe_step(self, kind: RunKind, label: str, fns: StepFunctions, inputs: Mapping[str, Any]) -> None:
        """Run one step of ``fns`` (the stages' Python, as written) on ``inputs`` (groups), each
        stage labelled (``core.internal.Watched``): the audit's observer."""
        with self.watch(kind, label, inputs.get("shared", {})) as observer, observer:
            eval_step(Watched(observer), fns, inputs)

    def observe_program(self, kind: RunKind, label: str, env: dict[str, Tensor], shared: Mapping[str, Tensor], *,
                        until: Stage | None = None) -> None:
        """Run the program on ``env`` (names -> tensors; updated with every output) as a step runs
        it: a stage that runs its graph node by node, each node labelled (a read inside a custom
        op's kernel is its node's), a stage that runs its Python as written; with ``until``, no
        stage after that one. ``shared`` is the state the run is given."""
        program = self.program
        with self.watch(kind, label, shared) as observer, observer:
            def run(s: StageGraph, env: Mapping[str, Tensor]) -> dict[str, Tensor]:
                if not s.runs_python:
                    return s.run(env, call=NodeLabels(s.graph.gm, observer, s.stage.name).run)
                with observer.stage(s.stage.name), watch_threads(program.backend, s.stage.name, "the read observer"):
                    return s.run(env)

            stages = program.stages if until is None else program.stages[: _index(program, until) + 1]
            for s in stages:
                env.update(run(s, env))

    def observe_examples(self, fns: StepFunctions, steps: int = 1, seed: int = 0) -> None:
        """The audit's observer: ``steps`` example steps (``example_step`` with seeds ``seed``,
        ``seed + 1``...; the first is the trace's own), each run once per ledger, watching the
        live buffers too (the live state is not written: a loop may be running on it)."""
        for i in range(steps):
            label = f"example {seed + i}"
            if not self.has(RunKind.OBSERVER, label):
                step = example_step(self.cfg, self.program.mode, self.batch_size, seed=seed + i, device=self._device())
                with torch.no_grad():
                    self.observe_step(RunKind.OBSERVER, label, fns, step.groups())

    def observe_varied(self, *, seeds: tuple[int, ...] | None = None,
                       settle: Callable[[], None] | None = None) -> None:
        """The Python of the stages the step runs as Python (an out-of-graph stage always; every
        stage of a step that is not replayed; an in-graph stage that escapes the tracer), on the
        generated states (``core.varied_step``, ``seeds``: default ``REPLAY_SEEDS``), up to the
        last such stage: the paths its Python takes on the states traffic has. A state already run
        (here, or by a capture's validation, which runs every stage's Python) is not run again.
        ``settle`` lets what was enqueued on the live buffers finish first."""
        program = self.program
        python = [s.stage for s in program.stages if s.runs_python]
        if program.aborted is not None or not python:
            return
        todo = [seed for seed in (REPLAY_SEEDS if seeds is None else seeds)
                if not self.has(RunKind.VARIED, state_label(seed)) and not self.has(RunKind.VALIDATION, state_label(seed))]
        if not todo:
            return
        with varied_states(program, self.cfg, self.batch_size, self.state, settle=settle,
                           parts=None if python[-1].in_graph else ("shared", "batch")) as example:
            for seed in todo:
                groups = example(seed)
                with torch.no_grad():
                    self.observe_program(RunKind.VARIED, state_label(seed), flatten_inputs(**groups), groups["shared"],
                                         until=python[-1])

    # -- what the ledger says --------------------------------------------------------------------
    def node_reads(self, *kinds: RunKind) -> NodeReads:
        """Per stage and node, the buffers the runs (of ``kinds``, when given) saw read: the
        fences' evidence beside the trace (see the module docstring for a read in a stage's Python).

        >>> from readfence.backends import paged
        >>> from readfence.core import ForwardMode, PREPARE_IN_GRAPH, step_functions, trace
        >>> cfg = ModelConfig()
        >>> ledger = ledger_of(trace(paged(), ForwardMode.DECODE, cfg=cfg), cfg, 2)
        >>> ledger.observe_examples(step_functions(paged(), ForwardMode.DECODE, cfg))
        >>> sorted(ledger.node_reads()[PREPARE_IN_GRAPH].items())
        [('index_select', frozenset({'req_to_token'})), ('index_select_1', frozenset({'seq_lens'}))]
        """
        memo = self._memo.get(("node_reads", kinds))
        if memo is not None and memo[0] == self.version:
            return {stage: dict(nodes) for stage, nodes in memo[1].items()}
        out: NodeReads = {}
        in_graph = self._graph_readers()
        for run in self.runs(*kinds):
            for a in run.reads():
                placed = self._placed(a, in_graph)
                if placed is not None:
                    stage, node = placed
                    nodes = out.setdefault(stage, {})
                    nodes[node] = nodes.get(node, frozenset()) | {a.buffer}
        self._memo[("node_reads", kinds)] = (self.version, out)
        return {stage: dict(nodes) for stage, nodes in out.items()}

    def effect(self, *kinds: RunKind, traced: bool = True) -> ReadEffect:
        """Per buffer, the end of its last read: the trace's (unless ``traced`` is false) joined
        with every read the runs (of ``kinds``, when given) saw, ``UNKNOWN`` where its memory
        escaped the dispatcher."""
        memo = self._memo.get(("effect", kinds, traced))
        if memo is not None and memo[0] == self.version:
            return memo[1]
        ends: dict[str, ReadEnd] = {}
        for run in self.runs(*kinds):
            for a in run.reads():
                ends[a.buffer] = ends.get(a.buffer, ReadEnd.NONE) | a.end
        seen = ReadEffect.of(ends)
        effect = self.program.traced() | seen if traced else seen
        self._memo[("effect", kinds, traced)] = (self.version, effect)
        return effect

    def last_reader(self, buffer: str, *kinds: RunKind) -> Witness | None:
        """Where ``buffer``'s last read is: the trace's last reader when it reads it until its
        end (:meth:`effect`), else the run that saw it read that late (in :class:`RunKind`'s order:
        the audit's observer, the rehearsal, then those on generated states, then check mode),
        its stage and node (an op's name for the audit's observer); ``None`` if nothing reads it.
        With ``kinds``, only the runs of those kinds, and not the trace, are looked at."""
        end = self.effect(*kinds, traced=not kinds)[buffer]
        if end is ReadEnd.NONE:
            return None
        if not kinds and self.program.traced()[buffer] is end:
            traced = self.program.last_reader(buffer)
            return None if traced is None else Witness(traced[0], traced[1], None, end, self._source(*traced))
        order = {s.name: i for i, s in enumerate(STAGES)}
        for run in sorted(self.runs(*kinds), key=lambda r: list(RunKind).index(r.kind)):
            reads = [a for a in run.reads() if a.buffer == buffer and a.end is end]
            if reads:
                last = max(reads, key=lambda a: (order.get(a.stage.partition(":")[0], len(order)), a.seq))
                stage = _stage_of(last) or _last_stage(self.program)
                node = a_node(last) if run.kind is not RunKind.OBSERVER else last.op
                return Witness(stage, node or PYTHON, run, end, last.source or self._source(stage, node or PYTHON))
        return None

    def writes(self) -> tuple[tuple[str, Access], ...]:
        """Every write of a shared buffer a run saw (by the op's schema, on the memory it was
        handed, or inside a kernel the observer runs under itself), first seen first, with the run
        that saw it (:attr:`Run.name`): a stage may only read shared state, and a write any run saw
        is a write, whatever the trace says (``core.internal.refuse_writes``)."""
        return tuple((run.name, a) for run in self.runs() for a in run.accesses if a.kind == "write")

    def observation(self) -> Observation:
        """The audit's observer's runs as an :class:`Observation` (what :func:`cross_check` holds
        the trace to)."""
        runs = self.runs(RunKind.OBSERVER)
        accesses = tuple(attrs.evolve(a, step=i) for i, run in enumerate(runs) for a in run.accesses)
        program = self.program
        return Observation(program.backend, program.mode, program.buffers, accesses, max(len(runs), 1),
                           (self.batch_size,))

    def disagreements(self) -> tuple[Disagreement, ...]:
        """What the audit's observer saw that the trace of a faithful stage does not cover: bugs in
        readfence's static analysis (:func:`cross_check`)."""
        if not self.runs(RunKind.OBSERVER):
            return ()
        return cross_check(self.program, self.observation())

    # -- helpers ----------------------------------------------------------------------------------
    def _placed(self, a: Access, in_graph: Mapping[tuple[Stage, str], str]) -> tuple[Stage, str] | None:
        stage = _stage_of(a)
        if stage is None:
            return None
        node = a_node(a)
        if node is None:  # a read in the stage's Python: the graph that runs reads it where its runs saw it
            node = PYTHON if self.program.stage(stage).runs_python else in_graph.get((stage, a.buffer), PYTHON)
        return stage, node

    def _graph_readers(self) -> dict[tuple[Stage, str], str]:
        """Per (stage whose graph runs, buffer), the last node of the graph that reads it, by its
        trace or by a run of the graph node by node (the rehearsal)."""
        found: dict[tuple[Stage, str], tuple[int, str]] = {}
        graphs = {s.stage: s for s in self.program.stages if not s.runs_python}
        order = {stage: g.graph.node_order() for stage, g in graphs.items()}

        def saw(stage: Stage, node: str, buffer: str) -> None:
            at = order[stage].get(node)
            if at is not None and at >= found.get((stage, buffer), (-1, ""))[0]:
                found[(stage, buffer)] = (at, node)

        for stage, g in graphs.items():
            for node, bufs in g.analysis.reads.items():
                for b in bufs:
                    saw(stage, node, b)
        for run in self.runs():
            for a in run.reads():
                where, label = _stage_of(a), a_node(a)
                if where in graphs and label is not None:
                    saw(where, label, a.buffer)
        return {key: node for key, (_, node) in found.items()}

    def _source(self, stage: Stage, node: str) -> str:
        """The user's line that made ``node`` of ``stage``'s graph (``""``: unknown)."""
        if not any(s.stage == stage for s in self.program.stages):
            return ""
        source = self.program.stage(stage).graph.source(node)
        return "" if source == "?" else source

    def _device(self) -> torch.device | str:
        if self.state is not None:
            return next(iter(self.state["shared"].values())).device
        return self.program.device

    def __repr__(self) -> str:
        return (f"<Ledger {self.program.backend} {self.program.mode.name} b{self.batch_size}: "
                f"{len(self._runs)} run(s), version {self.version}>")


def a_node(a: Access) -> str | None:
    """The graph node an access was labelled with (``stage:node``), or ``None`` (the stage's Python)."""
    stage, sep, node = a.stage.partition(":")
    return node if sep else None


def _stage_of(a: Access) -> Stage | None:
    name = a.stage.partition(":")[0]
    return stage_named(name) if name in STAGE_ENDS else None


def _last_stage(program: Program) -> Stage:
    return program.stages[-1].stage if program.stages else STAGES[-1]


def _index(program: Program, stage: Stage) -> int:
    return next(i for i, s in enumerate(program.stages) if s.stage == stage)


def state_label(seed: int) -> str:
    """The name of the generated state of ``seed`` (``core.varied_step``), as runs are labelled.

    >>> state_label(1), state_label(7)
    ('first_tokens', 'seed 7')
    """
    return TRAFFIC_STATES[seed - 1] if 1 <= seed <= len(TRAFFIC_STATES) else f"seed {seed}"


@contextlib.contextmanager
def on_live_state(program: Program, state: State | None, make: Callable[[int], dict[str, Any]], *,
                  settle: Callable[[], None] | None = None) -> Iterator[Callable[[int], dict[str, Any]]]:
    """``example(seed)``: ``make(seed)``'s input groups, for a check to run ``program``'s step on.
    A backend that keeps references to the live ``state`` (an engine object holding its runner's
    page table: the program captured tensors) reads that state, not an example: the example is
    written into the live buffers (after ``settle()``, which lets what was enqueued on them
    finish), which hold their values again when the block ends (as they do after the Python writes
    memory it keeps a reference to)."""
    keeps = state is not None and bool(program.captured())
    if keeps and settle is not None:  # nothing enqueued may run on the live buffers while they hold the example
        settle()

    def example(seed: int) -> dict[str, Any]:
        groups = make(seed)
        if not keeps or state is None:
            return groups
        for name in ("shared", "pools", "params"):
            if name not in groups:
                continue
            live, varied = state.get(name, {}), groups[name]
            for buffer, t in live.items():
                if buffer in varied and varied[buffer].shape == t.shape and varied[buffer].dtype == t.dtype:
                    t.copy_(varied[buffer])
            groups[name] = {**varied, **live}
        return groups

    with preserved(state) if keeps and state is not None else contextlib.nullcontext():
        yield example


def varied_states(program: Program, cfg: ModelConfig, batch_size: int, state: State | None, *,
                  settle: Callable[[], None] | None = None,
                  parts: tuple[str, ...] | None = None) -> contextlib.AbstractContextManager[Callable[[int], dict[str, Any]]]:
    """``example(seed)``: the input groups of ``core.varied_step``'s generated state for ``seed``, at
    ``batch_size``, on the live ``state``'s device (``None``: no live state, the program's device),
    written into the live buffers for a backend that keeps references to them
    (:func:`on_live_state`); ``parts`` (default: every group) the groups a run needs (an
    out-of-graph stage's Python takes ``shared`` and ``batch`` only)."""
    where = program.device if state is None else next(iter(state["shared"].values())).device

    def make(seed: int) -> dict[str, Any]:
        groups: dict[str, Any] = varied_step(cfg, program.mode, batch_size, seed=seed, device=where,
                                             parts=parts).groups()
        if state is not None:  # laid out as the live tensors are: a graph that baked the example's layout differs
            for name in ("shared", "pools", "params"):
                if name in groups:
                    groups[name] = {k: laid_out_as(t, state.get(name, {}).get(k)) for k, t in groups[name].items()}
        return groups

    return on_live_state(program, state, make, settle=settle)


def laid_out_as(t: Tensor, live: Tensor | None) -> Tensor:
    """``t``'s values laid out as ``live`` is (its strides and storage offset in a storage of its
    size), where ``live`` has ``t``'s shape and dtype but another layout (a view into a larger
    allocation, a padded row); else ``t`` itself. A step's Python that reads a layout (a stride
    handed to a kernel, a branch on an offset) then reads the live one, which the trace's example
    did not have.

    >>> live = torch.zeros(4, 8)[:, :6]
    >>> moved = laid_out_as(torch.ones(4, 6), live)
    >>> moved.stride(), bool((moved == 1).all())
    ((8, 1), True)
    """
    if (live is None or live.shape != t.shape or live.dtype != t.dtype or live.layout is not torch.strided
            or (live.stride() == t.stride() and live.storage_offset() == t.storage_offset())):
        return t
    room = torch.zeros(live.untyped_storage().nbytes() // live.element_size(), dtype=t.dtype, device=t.device)
    moved = room.as_strided(live.shape, live.stride(), live.storage_offset())
    moved.copy_(t)
    return moved



#: Bumped whenever a run of any step changed what its ledger says the step reads (``Ledger.effect``):
#: a verdict made at an earlier epoch may be stale (``evidence_epoch``).
_EPOCH = 0
_EPOCH_LOCK = threading.Lock()


def evidence_epoch() -> int:
    """A number that changes whenever a run changes what any ledger says its step reads: a cached
    verdict made at another epoch must be made again.

    >>> evidence_epoch() >= 0
    True
    """
    return _EPOCH


@attrs.frozen
class LedgerKey:
    """What a ledger is the evidence of: the bound program (by identity), the model, the batch
    size and where the live state is (``None``: no live state)."""

    program: Program
    cfg: ModelConfig
    batch_size: int
    state: tuple[tuple[Any, ...], ...] | None


#: The ledgers, by bound program, model config, batch size and live state (its place in memory).
_LEDGERS = CACHES.table("ledgers", LedgerKey, "every run of a bound program's code and what it read", limit=256)


def ledger_of(program: Program, cfg: ModelConfig, batch_size: int, state: State | None = None) -> Ledger:
    """The one ledger of ``program`` (bound to the live ``state``, or to none) at ``batch_size``:
    the same object for every run and verdict that asks, forgotten with the traces.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> cfg = ModelConfig()
    >>> program = trace(paged(), ForwardMode.DECODE, cfg=cfg)
    >>> ledger_of(program, cfg, 2) is ledger_of(program, cfg, 2)
    True
    """
    key = LedgerKey(program, cfg, batch_size, None if state is None else state_key(state))
    hit: Ledger | None = _LEDGERS.get(key)
    if hit is None or hit.gone:  # (another state now in the memory of one that died)
        hit = _LEDGERS.put(key, Ledger(program, cfg, batch_size, state))
    return hit


__all__ = ["PYTHON", "REPLAY_SEEDS", "Ledger", "LedgerKey", "Run", "RunKind", "Witness", "a_node", "evidence_epoch", "ledger_of",
           "on_live_state", "state_label", "varied_states"]
