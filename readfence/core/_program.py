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
  (the step's ledger runs the Python of every stage that runs it on them:
  ``core.internal.Ledger.observe_varied``);
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

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import fx

from readfence.effects import ReadEffect, ReadEnd

from ._modes import ForwardMode
from ._stage_graph import _NAMES
from ._stage_graph import ALIASES_KEY as ALIASES_KEY
from ._stage_graph import ESCAPE as ESCAPE
from ._stage_graph import INPUT_KEY as INPUT_KEY
from ._stage_graph import OPAQUE_KEY as OPAQUE_KEY
from ._stage_graph import READS_KEY as READS_KEY
from ._stage_graph import SOURCE_KEY as SOURCE_KEY
from ._stage_graph import Captured as Captured
from ._stage_graph import Constant as Constant
from ._stage_graph import Foreign as Foreign
from ._stage_graph import Match as Match
from ._stage_graph import MatchedOn as MatchedOn
from ._stage_graph import NodeReads as NodeReads
from ._stage_graph import NodeReadsIn as NodeReadsIn
from ._stage_graph import Owned as Owned
from ._stage_graph import Shared as Shared
from ._stage_graph import StageAnalysis as StageAnalysis
from ._stage_graph import StageGraph as StageGraph
from ._stage_graph import StageHooks as StageHooks
from ._stage_graph import TracedGraph as TracedGraph
from ._stage_graph import Unmatched as Unmatched
from ._step import BODY, STAGES, Stage, flatten_group

__all__ = [
    "Captured", "Constant", "flatten_group", "flatten_inputs", "Foreign", "Match", "NodeReads", "NodeReadsIn",
    "Owned", "Program", "run_program", "Shared", "StageAnalysis", "StageGraph", "StageHooks", "TracedGraph",
    "Unmatched",
]


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
