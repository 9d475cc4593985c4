"""One stage's traced graph and what is known of it: the node metadata keys, what each captured
tensor was matched to (:data:`Match`), the graph with its inputs (:class:`TracedGraph`), its
reads (:class:`StageAnalysis`), how it runs (:class:`StageHooks`), and all of it as one
:class:`StageGraph`. A :class:`~readfence.core.Program` is a step's stage graphs.

>>> Shared("seq_lens") == Shared("seq_lens"), Owned() == Unmatched()
(True, False)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias, assert_never

import attrs
import torch
from torch import fx

from readfence.effects import ReadEnd

from ._step import STAGES, OutputGuard, Stage

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
    # the stages that write its memory too: a buffer the backend keeps and fills (its own snapshot)
    filled_by: frozenset[str] = frozenset()
    # consumed only by the copy torch makes of a tensor literal (``lift_fresh_copy``): a
    # literal made while tracing is a fresh constant, but one built over memory the stage
    # keeps (``torch.tensor`` of a numpy mirror of a buffer) is copied from it on every run
    literal: bool = False

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.matches.buffers) if isinstance(self.matches, Shared) else frozenset()

    @property
    def of_another_state(self) -> bool:
        """Whether its memory is a shared buffer of another state than the one last matched
        against: wherever the step reads it, the fences of the state given do not guard it."""
        return isinstance(self.matches, Foreign)

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

    def traced_outputs(self) -> dict[str, Any]:
        """Output name -> the value it had on the traced step (``None`` where none was recorded).

        >>> import torch
        >>> from torch import fx
        >>> TracedGraph(fx.symbolic_trace(lambda x: (x + 1,)), ("shared.seq_lens",), ("meta.n",)).traced_outputs()
        {'meta.n': None}
        """
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        return {name: getattr(node, "meta", {}).get("val") for name, node in zip(self.outputs, values)}


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
    ``rebound`` maps an op node to the argument nodes its run pointed at a shared buffer's memory
    (``set_``, a kernel re-pointing its ``out``), to those buffers.

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
