"""The runtime read observer: which shared buffers the code really touches, op by op.

One of the checks that do not trust the analysis (with poison on release and fuzzing). It trusts nothing the tracer
computed: a ``TorchDispatchMode`` looks at every op the dispatcher runs and matches the
memory of its tensor arguments against the shared buffers by address range
(:class:`~readfence.core.tracing.BufferMap`), asking the op's schema
(:func:`~readfence.core.tracing.op_aliasing`) whether it is a pure view or a write. So it
sees reads through views, list pieces, tensors captured in closures, attributes or globals
and DLPack aliases alike: it never looks at names. :func:`cross_check` then holds the static
analysis to what was observed.

What it cannot see, it says: work that does not go through the dispatcher (a compiled
kernel reading a raw pointer, numpy code over a tensor's memory, a CUDA graph replay) is
recorded where its pointer or array leaves torch, as an *escape* (``UNKNOWN``), and only
when that hand-over happens in Python on the observed thread. An observation covers only
the paths that ran.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from readfence.effects import ReadEffect, ReadEnd

from ._checks import check_backend, positive_int
from ._late_reads import ReadKind, late_read_fix
from ._model import step_functions
from ._modes import ForwardMode
from ._program import Program
from ._protocol import BackendLike
from ._read_observer import Access as Access
from ._read_observer import Kind as Kind
from ._read_observer import ReadObserver as ReadObserver
from ._state import ModelConfig, check_mode, example_step
from ._step import BODY, STAGE_ENDS, Stage, StageCall, StepFunctions, eval_step
from ._threads import watch_threads
from .tracing import (
    CACHES,
    CodeKey,
    code_key,
)


def _distinct(accesses: Sequence[Access], kinds: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    return tuple(dict.fromkeys((a.buffer, a.stage, a.op) for a in accesses if a.kind in kinds))


@attrs.frozen
class Observation:
    """The shared-buffer accesses a backend's step made, run eagerly under a ``ReadObserver``.

    ``accesses`` in execution order over ``steps`` example steps at each of ``batch_sizes``
    (``()`` for toy inputs). Like ``Program``, it answers ``observed()`` (per buffer, the end
    of its last observed read) and ``last_reader(buffer)`` (``(stage, op)``), and lists the
    ``writes`` of shared buffers it saw. It covers only the paths that ran (``coverage``):
    a branch no observed step took, another batch size or another mode is not in it.
    """

    backend: str
    mode: ForwardMode
    buffers: tuple[str, ...]
    accesses: tuple[Access, ...]
    steps: int
    batch_sizes: tuple[int, ...]
    coverage: str = attrs.field()

    @coverage.default
    def _coverage(self) -> str:
        shapes = f" at each batch size in {self.batch_sizes}" if self.batch_sizes else ""
        return (f"only the paths that ran: {self.steps} step(s) of {self.mode.name}{shapes}; "
                "a branch none of them took is not covered")

    def observed(self) -> ReadEffect:
        """Per buffer, the end of the stage of its last observed read (``UNKNOWN`` if its
        memory escaped the dispatcher); ``NONE`` for a buffer never seen read."""
        ends: dict[str, ReadEnd] = {}
        for a in self.accesses:
            if a.kind != "write":
                ends[a.buffer] = ends.get(a.buffer, ReadEnd.NONE) | a.end
        return ReadEffect.of(ends)

    def last_reader(self, buffer: str) -> tuple[str, str] | None:
        """``(stage, op)`` of the last observed read of ``buffer`` (the latest stage, then the
        latest position within a step); ``None`` if it was never seen read."""
        last = self.last_read(buffer)
        return None if last is None else (last.stage, last.op)

    def last_read(self, buffer: str) -> Access | None:
        """The last observed read of ``buffer`` (as :meth:`last_reader` picks it), or ``None``."""
        rank = {stage: i for i, stage in enumerate(STAGE_ENDS)}
        reads = [a for a in self.accesses if a.buffer == buffer and a.kind != "write"]
        return max(reads, key=lambda a: (rank.get(a.stage, len(rank)), a.seq, a.step)) if reads else None

    @property
    def reads(self) -> tuple[tuple[str, str, str], ...]:
        """Distinct ``(buffer, stage, op)`` reads (escapes included), in first-seen order."""
        return _distinct(self.accesses, ("read", "escape"))

    @property
    def writes(self) -> tuple[tuple[str, str, str], ...]:
        """Distinct ``(buffer, stage, op)`` writes of shared buffers, in first-seen order."""
        return _distinct(self.accesses, ("write",))

    def __str__(self) -> str:
        effect = self.observed()
        names = list(self.buffers) + [b for b in effect.buffers if b not in self.buffers]
        rows = [("buffer", "observed", "last read")]
        for b in names:
            last = self.last_reader(b)
            rows.append((b, effect[b].name, f"{last[0]}: {last[1]}" if last else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"observed {self.backend} in {self.mode.name}, {self.coverage}"]
        lines += [f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}".rstrip() for r in rows]
        writes = ", ".join(f"{b} in {s} by {op}" for b, s, op in self.writes)
        lines.append(f"writes of shared buffers: {writes or 'none'}")
        return "\n".join(lines)


class Watched:
    """The interpreter that runs each stage as written under a :class:`ReadObserver`, labelled
    with its stage and its thread watched (the observer follows the stage's own thread: work
    handed to another is refused); the body's output is read by the step's caller."""

    def __init__(self, observer: ReadObserver) -> None:
        self.observer = observer

    def call(self, call: StageCall) -> Any:
        with self.observer.stage(call.stage.name), watch_threads(call.backend, call.stage.name, "the read observer"):
            out = call()
            if call.stage is BODY:
                self.observer.consume(out, "output")  # the step's caller reads the logits
        return out


def observe_step(fns: StepFunctions, inputs: Mapping[str, Any], *, step: int = 0) -> list[Access]:
    """The accesses of one step of ``fns`` on ``inputs`` (groups, ``shared`` first), run
    eagerly by :func:`~readfence.core.eval_step` under a :class:`ReadObserver` of
    ``inputs["shared"]``, each labelled with ``step``."""
    observer = ReadObserver(inputs.get("shared", {}), step=step)
    with observer:
        eval_step(Watched(observer), fns, inputs)
    return observer.accesses


def observe_functions(
    backend: str,
    mode: ForwardMode,
    *,
    inputs: Mapping[str, Any],
    prepare_out_graph: Callable[..., object],
    prepare_in_graph: Callable[..., object],
    body: Callable[..., object],
) -> Observation:
    """One observed step of three stage functions, run eagerly under a ``ReadObserver``.

    The calling convention of :func:`~readfence.core.tracing.trace_functions` (keyword
    groups; the body sees ``{**out_graph_meta, **in_graph_meta}``), with what
    ``prepare_out_graph`` returns crossing into the graph as a copy
    (:func:`~readfence.core.cross_into_graph`). Tests use it with toy functions.

    >>> import torch
    >>> lens = torch.ones(2, dtype=torch.int32)
    >>> obs = observe_functions(
    ...     "toy", ForwardMode.DECODE, inputs={"shared": {"seq_lens": lens}, "batch": {}},
    ...     prepare_out_graph=lambda shared, batch: {},
    ...     prepare_in_graph=lambda shared, batch, meta: {"n": shared["seq_lens"] + 1},
    ...     body=lambda shared, batch, meta: meta["n"] * 2)
    >>> obs.observed(), obs.last_reader("seq_lens")
    (ReadEffect({'seq_lens': IN_REPLAY}, default=NONE), ('prepare_in_graph', 'aten.add.Tensor'))
    """
    mode = check_mode(mode)
    accesses = observe_step(StepFunctions(prepare_out_graph, prepare_in_graph, body, backend), inputs)
    buffers = tuple(inputs.get("shared", {}).keys())
    return Observation(backend, mode, buffers, tuple(accesses), 1, ())


def _batch_sizes(batch_size: int | Sequence[int], cfg: ModelConfig) -> tuple[int, ...]:
    sizes = (batch_size,) if isinstance(batch_size, int) else batch_size
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"batch_size must be an int in 1..{cfg.max_reqs} or a non-empty sequence "
                         f"of them, got {batch_size!r}")
    for b in sizes:
        positive_int("batch_size", b, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    return tuple(dict.fromkeys(sizes))


def observe(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    batch_size: int | Sequence[int] = 2,
    steps: int = 3,
    cfg: ModelConfig | None = None,
    seed: int = 0,
) -> Observation:
    """The ``Observation`` of ``backend``'s step: what it touches, run eagerly under a ``ReadObserver``.

    Each step is the serial eager step of ``core.run_step``: ``prepare_out_graph`` (whose
    outputs then cross into the graph as copies, read in that stage), ``prepare_in_graph``,
    then the model's ``forward`` (``body``), each labelled with its stage. It runs ``steps``
    different example steps (``example_step(cfg, mode, b, seed=seed + i)``: other requests,
    lengths and tokens) at each batch size ``b`` (an int or a sequence of them). Independent
    of the tracer: the observation covers only the paths those steps took.

    >>> from readfence.backends import paged, trtllm_mha
    >>> obs = observe(paged(), ForwardMode.DECODE, steps=2)
    >>> obs.observed()
    ReadEffect({'req_to_token': IN_REPLAY, 'seq_lens': IN_REPLAY}, default=NONE)
    >>> obs.last_reader("seq_lens")
    ('prepare_in_graph', 'aten.index_select.default')
    >>> observe(trtllm_mha(), ForwardMode.DECODE, batch_size=[1, 3], steps=1).observed().end
    <ReadEnd.PRE_REPLAY: 1>
    """
    check_backend(backend)
    mode = check_mode(mode)
    if cfg is None:
        cfg = ModelConfig()
    elif not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {cfg!r} ({type(cfg).__name__})")
    sizes = _batch_sizes(batch_size, cfg)
    positive_int("steps", steps)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")

    try:
        code: CodeKey | None = code_key(backend)
        key: ObservedKey | None = ObservedKey(code, backend.name, mode, cfg, sizes, steps, seed)  # type: ignore[arg-type]
        hit = _OBSERVED.get(key)
    except TypeError:  # a backend that is not hashable: observed every time
        code, key, hit = None, None, None
    if hit is not None:
        return hit
    fns = None
    accesses: list[Access] = []
    buffers: tuple[str, ...] = ()
    for k, (size, i) in enumerate(itertools.product(sizes, range(steps))):
        # each step runs on its own fresh example: observed once, whatever observation asks
        # for it again (an audit's one step is the first of a checker's three)
        step_key = None if code is None else ObservedStepKey(code, backend.name, mode, cfg, size, seed + i)
        seen = None if step_key is None else _OBSERVED_STEPS.get(step_key)
        if seen is None:
            fns = fns or step_functions(backend, mode, cfg)
            step = example_step(cfg, mode, size, seed=seed + i)
            seen = (tuple(step.shared), tuple(observe_step(fns, step.groups(), step=0)))
            if step_key is not None:
                _OBSERVED_STEPS.put(step_key, seen)
        buffers = seen[0]
        accesses += seen[1] if k == 0 else [attrs.evolve(a, step=k) for a in seen[1]]
    observation = Observation(backend.name, mode, buffers, tuple(accesses), steps, sizes)
    if key is not None:
        _OBSERVED.put(key, observation)
    return observation


@attrs.frozen
class ObservedKey:
    """What an observation depends on: the backend's code and the values it can read
    (``CodeKey``), its name, the mode, the model, the batch sizes, steps and first seed."""

    code: CodeKey
    backend: str
    mode: ForwardMode
    cfg: ModelConfig
    sizes: tuple[int, ...]
    steps: int
    seed: int


@attrs.frozen
class ObservedStepKey:
    """What one observed step depends on: the backend's code and values (``CodeKey``), its name,
    the mode, the model, the batch size and the example's seed."""

    code: CodeKey
    backend: str
    mode: ForwardMode
    cfg: ModelConfig
    size: int
    seed: int


#: Observations already made (like traces: the same code and values on the same fresh examples
#: touch the same memory).
_OBSERVED = CACHES.table("observed", ObservedKey, "what the backend's eager steps touched, op by op", limit=256)

#: The accesses of single observed steps (labelled step 0) and the buffers of their example.
_OBSERVED_STEPS = CACHES.table("observed_steps", ObservedStepKey, "what one eager step touched, and its buffers",
                               limit=1024)


# ------------------------------------------------------------------------------------------
# Cross-checking the static analysis
# ------------------------------------------------------------------------------------------


@attrs.frozen
class Disagreement:
    """An observed access the traced program does not cover: a bug in the static analysis.

    For a faithful stage the trace must contain every read that ran: the observed read of
    ``buffer`` in ``stage`` (by ``op``) ends at ``observed``, but the traced program has the
    buffer only until ``traced`` (its last traced read: ``traced_reader``). A fence placed
    from that trace would release the buffer while the step still reads it. ``kind`` is
    ``write`` for a write of a shared buffer that tracing did not refuse.
    """

    backend: str
    mode: ForwardMode
    buffer: str
    stage: str
    op: str
    kind: Kind
    observed: ReadEnd
    traced: ReadEnd
    traced_reader: tuple[Stage, str] | None
    source: str = ""  # ``file:line in function`` of the read, where the observer knows it

    @property
    def by_reference(self) -> bool:
        """The read happened inside a custom op's kernel (``op`` is ``outer/inner``) and none of the
        kernel's arguments gave it the buffer (the trace holds what they read): the kernel reads
        what an earlier stage kept by reference, a plan/run pair. That is :attr:`ReadKind.OBSERVER_ONLY`,
        a read only the observer sees, not a bug in the analysis."""
        return self.kind != "write" and "/" in self.op

    @property
    def message(self) -> str:
        where = f"backend {self.backend!r} in mode {self.mode.name}"
        if self.by_reference:
            kernel, _, inner = self.op.partition("/")
            at = f" at {self.source}" if self.source else ""
            return (f"{ReadKind.OBSERVER_ONLY}: {where} reads shared buffer {self.buffer!r} in stage {self.stage} "
                    f"inside kernel {kernel} ({inner}{at}), which none of its arguments give it: a reference an "
                    f"earlier stage kept (a plan/run pair), which no static analysis sees; the read ends at "
                    f"{self.observed.name}, and it counts in the verdict as a traced one; "
                    f"{late_read_fix(self.buffer, self.observed)}")
        if self.kind == "write":
            return (f"readfence's static analysis missed a write (a bug in the analysis): {where} "
                    f"writes shared buffer {self.buffer!r} in stage {self.stage} (op {self.op}, "
                    f"observed at run time), which tracing did not refuse")
        traced = ("never reads it" if self.traced is ReadEnd.NONE else
                  f"reads it only until {self.traced.name} (last traced read: "
                  f"{self.traced_reader[0]}:{self.traced_reader[1]})" if self.traced_reader else
                  f"reads it only until {self.traced.name}")
        return (f"readfence's static analysis missed a read (a bug in the analysis): {where} "
                f"reads shared buffer {self.buffer!r} in stage {self.stage} (op {self.op}, observed "
                f"at run time: {self.observed.name}), but the traced program {traced}; a fence "
                f"placed from the trace would release it while it is still read")

    def __str__(self) -> str:
        return self.message


def cross_check(program: Program, observation: Observation) -> tuple[Disagreement, ...]:
    """The observed accesses of ``observation`` that ``program``'s traced reads do not cover.

    Only faithful stages (``StageAnalysis.faithful``) are held to it: there every observed read
    of a buffer must lie within the traced reads (the same buffer read in the same stage or
    a later one, or ``UNKNOWN``), and no shared buffer may be written. An aborted trace makes
    every buffer ``UNKNOWN``, which covers anything. ``()`` means agreement, on the paths the
    observation covers. One disagreement per ``(kind, buffer, stage, op)``, first seen first.

    >>> from readfence.backends import paged
    >>> from readfence.core import trace
    >>> cross_check(trace(paged(), ForwardMode.DECODE), observe(paged(), ForwardMode.DECODE, steps=1))
    ()
    """
    if not isinstance(program, Program):
        raise TypeError(f"program must be a Program, got {program!r} ({type(program).__name__})")
    if not isinstance(observation, Observation):
        raise TypeError(f"observation must be an Observation, got {observation!r} "
                        f"({type(observation).__name__})")
    if (program.backend, program.mode) != (observation.backend, observation.mode):
        raise ValueError(f"cannot cross-check a trace of {program.backend!r} in {program.mode.name} "
                         f"with an observation of {observation.backend!r} in {observation.mode.name}")
    if program.aborted is not None:
        return ()
    traced = program.traced()
    faithful = {s.stage.name for s in program if s.analysis.faithful}
    found: dict[tuple[str, str, str, str], Disagreement] = {}
    for a in observation.accesses:
        if a.stage not in faithful or (a.kind != "write" and a.end <= traced[a.buffer]):
            continue
        key = (a.kind, a.buffer, a.stage, a.op)
        if key not in found:
            found[key] = Disagreement(observation.backend, observation.mode, a.buffer, a.stage, a.op,
                                      a.kind, a.end, traced[a.buffer], program.last_reader(a.buffer), a.source)
    return tuple(found.values())
