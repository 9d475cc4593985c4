"""A traced step: one FX graph per stage, every node annotated with the shared buffers it reads.

Calling convention (what the lowering relies on)
------------------------------------------------
Every value that crosses a stage boundary has a *name* (``core.flatten_group``):
``<group>.<key path>`` with group one of ``shared``, ``batch``, ``pools``, ``params``, ``meta``
(``prepare_out_graph``'s outputs, as copied into the graph), ``meta_in`` (``prepare_in_graph``'s)
and ``logits`` for the body's output (nested keys are joined with dots, list indices
included: ``params.layers.0.wq``). The body's ``meta`` argument mixes the two groups, key by key,
as ``core.eval_step`` merges them. A stage's ``GraphModule`` takes its tensors *positionally*, in the order of
``TracedGraph.inputs`` (the placeholder nodes carry the same order; each placeholder is named
after its dotted name with non-identifier characters replaced by ``_`` and keeps the dotted
name in ``node.meta["readfence_input"]``), and returns a tuple of tensors in the order of
``TracedGraph.outputs``. Non-tensor leaves (ints, ``None``) are baked into the graph.

``StageGraph.run(env)`` and ``Program.run_stage(stage, env)`` do the lookup for you:
``env`` maps names to tensors, the result maps the stage's output names to tensors;
``Program.run(env)`` runs every stage in order, each reading what the ones before it wrote.
Writes the stage makes to ``pools`` happen in place on the tensors passed in, exactly as
in eager mode (the graphs are not functionalized: they execute the traced ops as they are).

Reads
-----
``node.meta["readfence_reads"]`` is a ``frozenset`` of shared-buffer names the node reads
(it consumes, as data, a tensor whose memory may overlap a shared buffer's). View nodes do
not read (they only alias); their consumers do. ``node.meta["readfence_opaque"]`` is set on a
node the tracer cannot see through (an escape such as ``item()`` or ``data_ptr()``, a
higher-order op or an op whose schema cannot be reasoned about); ``node.meta
["readfence_source"]`` is the user's source line that made the node.

Stages that cannot be traced faithfully
---------------------------------------
A stage with an escape ran Python the graph does not hold (a host read, a branch on data):
the graph holds one path, the one the example took, and the stage runs its Python function
instead, in the step, every time. What it costs is the stage's ``escape_end`` (see
``core.Stage``, which says why):

* ``prepare_out_graph`` (eager, before the replay): ``NONE``, an escape counts for the buffers
  it reaches. Every read it makes, on any path, ends as it returns (``PRE_REPLAY``), and its
  outputs cross into the graph as copies, so nothing it touched is read later. Which buffers:
  the trace's (the value a host read hands over is computed from traced reads: ``int(t.max())``
  of a copy of ``seq_lens`` reads ``seq_lens``), joined with what its Python was seen to read
  on the example steps and on the varied states, where a branch on the value goes another way
  (:meth:`Program.varied_stages`);
* ``prepare_in_graph``: ``POST_REPLAY`` for every buffer; its outputs are not copied, and on a
  path not traced they may be views of any buffer, read wherever the body consumes them. The
  body's inputs that it returns are analysed as aliasing every buffer (their consumers read
  every buffer), so EXACT places each event after the last body node that may read through them;
* the body: ``POST_REPLAY`` for every buffer; its reads end with it, before the replay's end.

That holds where the stage's Python runs inside the step, before the fence that follows it:
the CPU device runs it in the forward, in a replayed graph or an eager launch alike. A CUDA
graph captures kernels, not Python: ``lower`` refuses an in-graph stage that escapes on CUDA
(``UncapturableStage``; the trace there runs on fake tensors, and already stops at the escape).

What the rule does not cover is work the stage hands to code that runs later, outside the
step's launches: a callback, or a tensor, pointer or array it keeps for a kernel to read (the
plan/run pattern). Threads are watched (``readfence.core._threads``): a thread or pool job a
stage starts is refused while it is traced or observed, and when still running as the
stage's Python returns in a step. A reference escaping on the traced path
(``data_ptr()``, DLPack, numpy) may be read through at any later time: its buffers are
``UNKNOWN`` wherever it happens; on a path the trace did not take only the runtime checks see
such reads. A view the stage keeps on ``self`` and reads in a later step's Python stage is
read in that step, within that step's own fences; the view left there while the step was
traced or rehearsed points at an example state (trace-time state that only the comparison
with the serial run sees).

Tensors captured from outside the arguments
-------------------------------------------
A tensor a stage reads without receiving it (a closure, an attribute, a global) is a
constant of its graph (a ``get_attr`` node), listed in ``StageAnalysis.captured``. It is matched
by memory range against the state the program runs on: the example when traced, the live
state when lowered (``core.bind``). One that matches a live shared buffer is a read of that
buffer; a pool or a parameter is fine. Anything else is fine only if it is *persistent*: the
step, run once more, reads the very same memory again (weights the backend keeps, a metadata
buffer it allocated once and refills), and then it is the backend's own whatever its shape,
unless its memory is a shared buffer of another state (one readfence made or was given, still
alive): that is refused, naming it. A tensor the stage computed while being traced (a
``.clone()`` kept from the call, a DLPack view of the example) is trace-time state baked into
the graph, stale on the next step: it is refused. Without the live state (``audit`` without
``state=``), a captured tensor that is not part of the example, and that the step does not
read again or whose memory is a known state's buffer, may be any live buffer: every buffer is
``UNKNOWN``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias, assert_never

import attrs
import torch
from torch import fx

from readfence.effects import ReadEffect, ReadEnd

from ._modes import ForwardMode
from ._step import BODY, STAGES, OutputGuard, Stage, flatten_group

__all__ = [
    "Captured", "Constant", "flatten_group", "flatten_inputs", "Foreign", "Match", "NodeReads", "NodeReadsIn",
    "Owned", "Program", "run_program", "Shared", "StageAnalysis", "StageGraph", "StageHooks", "TracedGraph",
    "Unmatched",
]

READS_KEY = "readfence_reads"
ALIASES_KEY = "readfence_aliases"  # the shared buffers a node's value may alias, as the analysis found
OPAQUE_KEY = "readfence_opaque"
INPUT_KEY = "readfence_input"
SOURCE_KEY = "readfence_source"
ESCAPE = "escape: "  # how an escape node's OPAQUE_KEY reason starts

@attrs.frozen
class Shared:
    """Memory of the state's shared buffers ``buffers``: the captured tensor is a read of them."""

    buffers: tuple[str, ...]


@attrs.frozen
class Owned:
    """Memory of a pool or a parameter of the state."""


@attrs.frozen
class Constant:
    """Memory of no state that the step reads again on every call: the backend's own (its
    weights, a metadata buffer it allocated once and refills), whatever its shape."""


@attrs.frozen
class Foreign:
    """The memory of shared buffer ``buffer`` of another state readfence has met (one it made or
    was given, still alive): a reference the backend kept to a state other than the one given."""

    buffer: str


@attrs.frozen
class Unmatched:
    """Memory of no state: trace-time state baked into the graph, or, without the live state, any."""


_NAMES = frozenset(s.name for s in STAGES)

#: What a run of a program read, per stage and node: the shared buffers each node read.
NodeReads: TypeAlias = dict[Stage, dict[str, frozenset[str]]]
#: The same, as a function that only reads it accepts it.
NodeReadsIn: TypeAlias = Mapping[Stage, Mapping[str, frozenset[str]]]

#: What a captured tensor's memory is, in the state it was last matched against.
Match: TypeAlias = Shared | Owned | Constant | Foreign | Unmatched


class MatchedOn(enum.Enum):
    """The state a captured tensor's memory was last matched against."""

    EXAMPLE = "example"  # the state the trace ran on: what it reads there is trace-time state
    LIVE = "live"  # the live state lowering binds to


@attrs.frozen
class Captured:
    """A tensor a stage reads without receiving it as an argument (closure, attribute, global).

    ``node`` is its ``get_attr`` node, ``users`` the nodes that consume it, ``source`` the
    user's line that first consumed it. ``matches`` says what the tensor's memory is, in the
    state last matched against (a :data:`Match`); ``state`` names that state (a :class:`MatchedOn`).
    """

    stage: Stage
    node: str
    target: str
    users: tuple[str, ...]
    source: str
    matches: Match
    state: MatchedOn = MatchedOn.EXAMPLE
    # the stage reads the same memory again on the next call: a constant it keeps (an
    # indexer's weights), not a value it computed once while being traced
    persistent: bool = False
    # the step writes its memory too: a buffer the backend keeps and fills (its own snapshot)
    filled: bool = False
    # consumed only by the copy torch makes of a tensor literal (``lift_fresh_copy``): a
    # literal made while tracing is a fresh constant, but one built over memory the stage
    # keeps (``torch.tensor`` of a numpy mirror of a buffer) is copied from it on every run
    literal: bool = False

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.matches.buffers) if isinstance(self.matches, Shared) else frozenset()

    @property
    def usable(self) -> bool:
        """Memory the step really uses on every call: a live shared buffer, pool or parameter,
        or a constant the stage keeps (persistent, and no part of the example state)."""
        if self.state is not MatchedOn.LIVE:
            return False
        return isinstance(self.matches, Shared | Owned | Constant)

    def why(self) -> str:
        """Why lowering cannot use it, in words."""
        match self.matches:
            case Shared():
                what = f"shared buffer(s) {sorted(self.buffers)}"
            case Owned():
                what = "a pool or parameter"
            case Constant():
                what = "a constant"
            case Unmatched():
                what = "no shared buffer, pool or parameter"
            case Foreign(buffer):
                return (f"captured tensor {self.target!r} (used by {', '.join(self.users)} at {self.source}) "
                        f"is no buffer of the state given, but the memory of shared buffer {buffer!r} of another "
                        f"state")
            case _:
                assert_never(self.matches)
        if self.state is MatchedOn.EXAMPLE:
            return (f"captured tensor {self.target!r} (used by {', '.join(self.users)} at {self.source}) "
                    f"is {what} of the example state the trace ran on: trace-time state baked into the "
                    f"graph, stale on every later step")
        return (f"captured tensor {self.target!r} (used by {', '.join(self.users)} at {self.source}) "
                f"matches {what} of the live state, and the step does not read it again on its next "
                f"call: trace-time state baked into the graph")


@attrs.frozen(eq=False)
class TracedGraph:
    """A stage's code as traced: its ``GraphModule`` and its calling convention.

    The module takes ``inputs`` positionally and returns ``outputs`` in order (see the module
    docstring); ``recorded`` says the graph was recorded as the stage ran (``core._record``)
    rather than traced with make_fx.

    >>> import torch
    >>> from torch import fx
    >>> g = TracedGraph(fx.symbolic_trace(lambda x: (x + 1,)), ("shared.seq_lens",), ("meta.n",))
    >>> g.node_order()
    {'x': 0, 'add': 1, 'output': 2}
    """

    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    recorded: bool = False

    def source(self, node: str) -> str:
        """The user's source line that made ``node`` (``"?"`` when unknown)."""
        for n in self.gm.graph.nodes:
            if n.name == node:
                return str(n.meta.get(SOURCE_KEY, "?"))
        return "?"

    def node_order(self) -> dict[str, int]:
        """Node name -> its position in the graph."""
        return {n.name: i for i, n in enumerate(self.gm.graph.nodes)}


@attrs.frozen
class StageAnalysis:
    """What the analysis found of one stage's graph.

    ``reads`` maps node name -> shared buffers read (only nodes that read something);
    ``unknown`` is the set of buffers an opaque node touches; ``opaque`` maps each node the
    tracer cannot see through to why; ``faithful`` is False when the graph misses work the
    tracer could not see (an escape: then the step runs the stage's Python). ``captured`` are the
    tensors it reads without receiving them; ``memory`` maps node -> buffers its real value
    touched; ``copies`` are the nodes whose view claim their real memory refutes (``None``: no
    memory, fake tensors); ``hidden`` maps a higher-order op node to the buffers its branch
    graphs' captured tensors touch; ``initial`` maps a placeholder to the buffers it aliases;
    ``data_escapes`` are the escape nodes that hand the stage's Python a value or memory with data
    in it, which it may branch on (``Program.varied_stages``); ``rebound`` maps an op node to the
    argument nodes its run pointed at a shared buffer's memory (``set_``, a kernel re-pointing its
    ``out``), to those buffers.

    >>> a = StageAnalysis({"add": frozenset({"seq_lens"}), "mul": frozenset({"seq_lens", "swa_map"})})
    >>> sorted(a.buffers_read()), a.last_reader("seq_lens")
    (['seq_lens', 'swa_map'], 'mul')
    """

    reads: Mapping[str, frozenset[str]]
    unknown: frozenset[str] = frozenset()
    opaque: Mapping[str, str] = attrs.Factory(dict)
    faithful: bool = True
    captured: tuple[Captured, ...] = ()
    memory: Mapping[str, frozenset[str]] = attrs.Factory(dict)
    copies: frozenset[str] | None = None
    hidden: Mapping[str, frozenset[str]] = attrs.Factory(dict)
    initial: Mapping[str, frozenset[str]] = attrs.Factory(dict)
    data_escapes: tuple[str, ...] = ()
    rebound: Mapping[str, Mapping[str, frozenset[str]]] = attrs.Factory(dict)

    def buffers_read(self) -> frozenset[str]:
        """Every shared buffer some node reads."""
        out: frozenset[str] = frozenset()
        for bufs in self.reads.values():
            out |= bufs
        return out

    def last_reader(self, buffer: str) -> str | None:
        """Name of the last node (in graph order) that reads ``buffer``, or ``None``."""
        last = None
        for name, bufs in self.reads.items():  # insertion order is graph order
            if buffer in bufs:
                last = name
        return last

    def first_escape(self) -> str | None:
        """The first node that escapes the tracer (what makes the stage unfaithful), or ``None``."""
        return next((n for n, why in self.opaque.items() if why.startswith(ESCAPE)), None)


@attrs.frozen(eq=False)
class StageHooks:
    """How a step runs one stage besides its graph.

    ``eager`` runs the stage's Python function with the graph's calling convention; ``guard``
    is what the graphs after it bake of its outputs (checked when it runs its Python);
    ``replayed`` says whether the step is replayed from a capture (``StepFunctions.replayed``),
    else it runs every stage's Python. ``example`` keeps the tensors the stage was traced on
    (real tensors only) when a faithful stage of a replayed step captured tensors: ``bind`` runs
    it again on them to see what its nodes touch of the live state (nothing else keeps them: a
    cached program would keep a model's caches alive).

    >>> from readfence.backends import paged
    >>> from readfence.core import BODY, ForwardMode, trace
    >>> hooks = trace(paged(), ForwardMode.EXTEND).stage(BODY).hooks
    >>> hooks.replayed, hooks.eager is not None  # EXTEND runs eagerly: every stage's Python
    (False, True)
    """

    eager: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    guard: OutputGuard | None = None
    example: tuple[torch.Tensor, ...] | None = None
    replayed: bool = True


@attrs.frozen(eq=False)
class StageGraph:
    """One traced stage: the :class:`Stage` it is, its :class:`TracedGraph`, what the analysis
    found of it (:class:`StageAnalysis`) and how a step runs it (:class:`StageHooks`).

    >>> import torch
    >>> from torch import fx
    >>> from readfence.core import PREPARE_IN_GRAPH
    >>> s = StageGraph(PREPARE_IN_GRAPH, TracedGraph(fx.symbolic_trace(torch.nn.Identity()), (), ()),
    ...                StageAnalysis({}, faithful=False))
    >>> s.escape_end
    <ReadEnd.POST_REPLAY: 3>
    """

    stage: Stage
    graph: TracedGraph
    analysis: StageAnalysis
    hooks: StageHooks = StageHooks()

    @property
    def end(self) -> ReadEnd:
        """The read end of a read in this stage (``Stage.end``)."""
        return self.stage.end

    @property
    def escape_end(self) -> ReadEnd:
        """The end of every shared buffer if this stage escapes the tracer, beyond what it is
        traced and seen to read (``Stage.escape_end``): ``NONE`` out of the graph (an escape
        there counts for the buffers it reaches), ``POST_REPLAY`` inside it."""
        return self.stage.escape_end

    def escapes(self) -> list[tuple[str, str, str]]:
        """``(node, why, source)`` of every node the tracer could not see through."""
        return [(node, why, self.graph.source(node)) for node, why in self.analysis.opaque.items()]

    def escaping(self) -> list[tuple[str, str, str]]:
        """The escapes proper (what makes the stage unfaithful): ``(node, why, source)``."""
        return [e for e in self.escapes() if e[1].startswith(ESCAPE)]

    @property
    def runs_python(self) -> bool:
        """Whether a step runs this stage's Python function rather than its graph: an
        out-of-graph stage always does, as engines run their out-of-graph hooks every step
        (its host reads and side effects happen each step); every stage of a step that is not
        replayed (``StageHooks.replayed``) does, as engines run such a mode eagerly (EXTEND; every
        mode of a backend the engine never graph-replays); an in-graph stage of a replayed step
        only when it escapes the tracer (on the CPU device; CUDA refuses to capture it).

        Its reads are still the trace's, joined with what checks observe; each ends when the work
        the stage queued ends (the stage's end), or, for a stage that escapes, at its
        :attr:`escape_end`.

        >>> from torch import fx
        >>> from readfence.core import PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH
        >>> def graph(stage, replayed=True):
        ...     return StageGraph(stage, TracedGraph(fx.symbolic_trace(torch.nn.Identity()), (), ()),
        ...                       StageAnalysis({}), StageHooks(eager=lambda env: {}, replayed=replayed))
        >>> graph(PREPARE_OUT_GRAPH).runs_python, graph(PREPARE_IN_GRAPH).runs_python
        (True, False)
        >>> graph(PREPARE_IN_GRAPH, replayed=False).runs_python
        True
        """
        return self.hooks.eager is not None and (not self.analysis.faithful or not self.stage.in_graph
                                                 or not self.hooks.replayed)

    def run(self, env: Mapping[str, torch.Tensor], *,
            call: Callable[..., Iterable[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """Execute the stage on ``env`` (name -> tensor); outputs by name: its Python function
        when it :attr:`runs_python`, else its graph (``call(*tensors)``, when given, runs the
        graph instead of the module: an ``fx.Interpreter``'s ``run``)."""
        if self.runs_python:
            assert self.hooks.eager is not None
            return self.hooks.eager(env)
        g = self.graph
        missing = [n for n in g.inputs if n not in env]
        if missing:
            raise KeyError(f"stage {self.stage}: missing inputs {missing}")
        outs = (g.gm if call is None else call)(*[env[n] for n in g.inputs])
        return dict(zip(g.outputs, outs, strict=True))

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Positional call in ``graph.inputs`` order, returning outputs in ``graph.outputs`` order."""
        if self.runs_python:
            out = self.run(dict(zip(self.graph.inputs, tensors, strict=True)))
            return tuple(out[n] for n in self.graph.outputs)
        return tuple(self.graph.gm(*tensors))


@attrs.frozen(eq=False)
class Program:
    """A backend's step, traced: stage graphs in execution order, with their reads.

    ``buffers`` are the shared buffers of the step (the keys of the ``shared`` group).
    ``aborted`` is set when tracing had to stop at an escape it cannot follow under fake
    tensors; then every buffer is ``UNKNOWN``.

    >>> import torch
    >>> from readfence.core.tracing import trace_functions
    >>> prog = trace_functions(
    ...     "toy", ForwardMode.DECODE,
    ...     inputs={"shared": {"seq_lens": torch.ones(2, dtype=torch.int32)}, "batch": {}},
    ...     prepare_out_graph=lambda shared, batch: {},
    ...     prepare_in_graph=lambda shared, batch, meta: {"n": shared["seq_lens"] + 1},
    ...     body=lambda shared, batch, meta: meta["n"] * 2)
    >>> prog.traced()
    ReadEffect({'seq_lens': IN_REPLAY}, default=NONE)
    >>> from readfence.core import PREPARE_IN_GRAPH
    >>> prog.last_reader("seq_lens")
    (Stage(name='prepare_in_graph', ...), 'add')
    >>> prog.stage(PREPARE_IN_GRAPH).graph.inputs
    ('shared.seq_lens',)
    """

    backend: str
    mode: ForwardMode
    device: str
    buffers: tuple[str, ...]
    stages: tuple[StageGraph, ...]
    aborted: str | None = None

    # -- structure ---------------------------------------------------------------------------
    def stage(self, stage: Stage) -> StageGraph:
        """The graph of ``stage`` (a :class:`Stage` value: ``BODY``, not ``"body"``).

        >>> Program("toy", ForwardMode.DECODE, "cpu", (), ()).stage("body")
        Traceback (most recent call last):
        ...
        TypeError: stage must be a readfence.core.Stage (PREPARE_OUT_GRAPH, PREPARE_IN_GRAPH, BODY), got 'body' (str): write readfence.core.BODY
        """
        if not isinstance(stage, Stage):
            named = f": write readfence.core.{stage.upper()}" if isinstance(stage, str) and stage in _NAMES else ""
            raise TypeError(f"stage must be a readfence.core.Stage ({', '.join(s.name.upper() for s in STAGES)}), "
                            f"got {stage!r} ({type(stage).__name__}){named}")
        for s in self.stages:
            if s.stage == stage:
                return s
        raise KeyError(f"no stage {stage}; stages: {[str(s.stage) for s in self.stages]}")

    def __iter__(self) -> Iterator[StageGraph]:
        return iter(self.stages)

    @property
    def replayed(self) -> bool:
        """Whether the step is replayed from a capture; one that is not runs every stage's Python
        (``StageGraph.runs_python``)."""
        return all(s.hooks.replayed for s in self.stages)

    @property
    def graphs(self) -> dict[Stage, fx.GraphModule]:
        """Stage -> GraphModule, in execution order."""
        return {s.stage: s.graph.gm for s in self.stages}

    def reads(self, stage: Stage) -> dict[str, frozenset[str]]:
        """Node name -> shared buffers it reads, for the nodes of ``stage`` that read any."""
        return dict(self.stage(stage).analysis.reads)

    # -- effects -----------------------------------------------------------------------------
    def traced(self) -> ReadEffect:
        """The effect the traced code has: per buffer, the end of the stage of its last read.

        A buffer touched by an opaque node is ``UNKNOWN``; a buffer never read is ``NONE``. A
        stage that cannot be traced faithfully reads every buffer until its ``escape_end``
        (``POST_REPLAY`` inside the graph; out of it ``NONE``: an escape there counts for the
        buffers it reaches, which its traced reads hold, and what its Python reads on other
        paths is joined in by the audit and ``lower`` from the runs that saw it); a captured
        tensor whose memory is not known to be part of the state makes every buffer
        ``UNKNOWN`` (see the module docstring).

        >>> import torch
        >>> from readfence.core.tracing import trace_functions
        >>> shared = {"seq_lens": torch.arange(1, 3), "swa_map": torch.arange(2)}
        >>> def snapshot(shared, batch):  # a host read of a copy of the lengths: a bound
        ...     lens = shared["seq_lens"] + 0
        ...     return {"lens": lens, "bound": int(lens.max())}
        >>> trace_functions("toy", ForwardMode.DECODE, inputs={"shared": shared, "batch": {}},
        ...                 prepare_out_graph=snapshot, prepare_in_graph=lambda shared, batch, meta: {},
        ...                 body=lambda shared, batch, meta: meta["lens"] * 2).traced()
        ReadEffect({'seq_lens': PRE_REPLAY}, default=NONE)
        """
        if self.aborted is not None:
            return ReadEffect.unknown()
        ends: dict[str, ReadEnd] = {}

        def at_least(buf: str, end: ReadEnd) -> None:
            ends[buf] = ends.get(buf, ReadEnd.NONE) | end

        for s in self.stages:
            a = s.analysis
            for buf in a.buffers_read():
                at_least(buf, s.end)
            if not a.faithful:
                for buf in self.buffers:
                    at_least(buf, s.escape_end)
            for buf in a.unknown:
                at_least(buf, ReadEnd.UNKNOWN)
            if any(isinstance(c.matches, Unmatched) and c.state is MatchedOn.EXAMPLE for c in a.captured):
                for buf in self.buffers:  # not matched against the live state: it may be any
                    at_least(buf, ReadEnd.UNKNOWN)
        return ReadEffect.of(ends)

    @property
    def aborted_stage(self) -> Stage | None:
        """The stage whose escape stopped the trace (``aborted``), or ``None``.

        >>> str(Program("toy", ForwardMode.DECODE, "cuda", (), (), aborted="item() escapes").aborted_stage)
        'prepare_out_graph'
        """
        if self.aborted is None:
            return None
        traced = {s.stage for s in self.stages}
        return next((s for s in STAGES if s not in traced), None)

    def varied_stages(self) -> tuple[Stage, ...]:
        """The stages whose Python the step runs and that may take a path there the trace's
        example did not, on data: what they read on the generated states counts (the step's
        ledger runs the Python of every stage that runs it there, these among them:
        ``core.internal.Ledger.observe_varied``). Every stage of a step that is not replayed (it runs
        their Python; a branch on a Python value may go either way); in a replayed step, a stage
        that escapes where an escape counts only for the buffers it reaches (``escape_end``
        ``NONE``: the out-of-graph stage) and hands its Python data (``StageAnalysis.data_escapes``),
        since its Python may branch on what it read.

        >>> from readfence.backends import paged
        >>> from readfence.core import trace
        >>> trace(paged(), ForwardMode.DECODE).varied_stages(), len(trace(paged(), ForwardMode.EXTEND).varied_stages())
        ((), 3)
        """
        if not self.replayed:
            return tuple(s.stage for s in self.stages)
        return tuple(s.stage for s in self.stages
                     if s.runs_python and s.analysis.data_escapes and s.escape_end is ReadEnd.NONE)

    def unfaithful(self) -> list[tuple[Stage, str, str, str]]:
        """``(stage, node, why, source)`` of every escape: what makes a stage unfaithful."""
        return [(s.stage, *e) for s in self.stages for e in s.escaping()]

    def captured(self) -> tuple[Captured, ...]:
        """Every tensor a stage reads without receiving it (see the module docstring)."""
        return tuple(c for s in self.stages for c in s.analysis.captured)

    def last_reader(self, buffer: str) -> tuple[Stage, str] | None:
        """``(stage, node_name)`` of the last node that reads ``buffer``; ``None`` if unread.

        A stage that runs its Python function (unfaithful) and whose escape holds every buffer
        (its ``escape_end`` is not ``NONE``: an in-graph stage) may read any buffer: when it comes
        after every traced read of ``buffer``, its first escape is the reader. The EXACT fence
        policy records the buffer's event right after that node, or, in a stage that runs its
        Python function, at the stage's end.
        """
        for s in reversed(self.stages):
            node = s.analysis.last_reader(buffer)
            if (node is None and not s.analysis.faithful and s.escape_end is not ReadEnd.NONE
                    and buffer in self.buffers):
                node = s.analysis.first_escape()
            if node is not None:
                return (s.stage, node)
        return None

    def opaque(self) -> dict[Stage, dict[str, str]]:
        """Per stage, the opaque nodes and why the tracer could not see through them."""
        return {s.stage: dict(s.analysis.opaque) for s in self.stages if s.analysis.opaque}

    # -- execution ---------------------------------------------------------------------------
    def run_stage(self, stage: Stage, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run one stage on ``env`` (dotted name -> tensor); see the module docstring."""
        return self.stage(stage).run(env)

    def run(self, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run all stages in order (:func:`run_program`); returns the env with every output."""
        out = dict(env)
        run_program(self, out)
        return out


def run_program(program: Program, env: dict[str, torch.Tensor],
                run: Callable[[StageGraph, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                ) -> torch.Tensor:
    """Run ``program``'s stages in order on ``env`` (name -> tensor), each writing its outputs
    into it; returns the body's output. ``run(stage, env)``, when given, runs each stage in
    place of ``stage.run(env)`` (an observer labelling its nodes, a watch).

    The traced step's data flow is in its names (``core.eval_step`` gave them), so this is all
    there is to running it: the copies into the graph are nodes of the out-of-graph stage, and
    the body reads each metadata key from the stage that produced it.

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig, run_step, trace
    >>> from readfence.core.internal import example_step
    >>> step = example_step(ModelConfig(), ForwardMode.DECODE, 2)
    >>> env = flatten_inputs(**step.clone().groups())
    >>> torch.equal(run_program(trace(paged(), ForwardMode.DECODE), env), run_step(paged(), ForwardMode.DECODE,
    ...             ModelConfig(), step))
    True
    """
    for s in program.stages:
        env.update(s.run(env) if run is None else run(s, env))
    return env[BODY.outputs]


def flatten_inputs(**groups: object) -> dict[str, Any]:
    """Flatten named groups into one env of dotted names (the Program calling convention).

    >>> import torch
    >>> sorted(flatten_inputs(shared={"seq_lens": torch.ones(1)}, batch={"input_ids": torch.ones(1)}))
    ['batch.input_ids', 'shared.seq_lens']
    """
    env: dict[str, Any] = {}
    for prefix, tree in groups.items():
        if tree is None:
            continue
        env.update(flatten_group(prefix, tree))
    return env
