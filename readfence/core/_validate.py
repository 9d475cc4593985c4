"""Translation validation of a capture: the replayed graph must compute what its Python computes.

A lowered step replays the traced graph of each in-graph stage (on CUDA a CUDA graph, on the CPU
device its model of one); an engine runs the same stage's Python. The trace holds the one path
its example took, with every Python value computed on the way baked in as a constant: a host
read the tracer did not notice (``str(t)``, which prints with the dispatcher's modes off; a
``tolist()`` inside TorchScript; a count taken from a data-dependent shape), a value an earlier
stage kept on ``self``. Rather than trust that no such value was missed, :func:`validate_replay`
checks the graph against the code, as a compiler's translation validation does: it runs the
step's Python on fresh example states whose values differ from the traced one (other lengths,
other page tables, the same shapes) and replays each captured stage on the very inputs the
Python stage receives (the memory put back in between), then compares every output and every
byte of memory the stage could write. A difference is :class:`NotGraphSafe`, naming the stage,
the first output that differs and, where a trace on the differing state shows it, the line
that computed the baked value.

What it can miss: a value that happens to be equal on every state it tries (a maximum that is
always the context length), and code that reads the host's clock or other state outside the
step. The runtime checks (poison, the comparison with the serial run) remain the ground truth.

>>> import torch
>>> from readfence.core import ForwardMode
>>> from readfence.core.internal import StepFunctions, trace_step
>>> def body(shared, batch, meta):          # the longest length, read by printing it
...     return shared["seq_lens"] * float(str(shared["seq_lens"].max())[7:-1])
>>> fns = StepFunctions(lambda shared, batch: {}, lambda shared, batch, meta: {}, body, "printed")
>>> example = lambda seed: {"shared": {"seq_lens": torch.arange(4) + seed}, "batch": {}}
>>> program = trace_step(fns, ForwardMode.DECODE, example(0))
>>> program.unfaithful()                     # the tracer noticed nothing
[]
>>> validate_replay(program, fns, example, seeds=(1,))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
readfence.core._validate.NotGraphSafe: backend 'printed' in DECODE: stage body is not graph-safe: ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, fx

from readfence.effects import ReadEffect, ReadEnd, ReadfenceError

from ._model import step_functions
from ._observe import ReadObserver, Watched, join_node_reads, observe_program
from ._program import SOURCE_KEY, NodeReads, NodeReadsIn, Program, StageGraph, flatten_inputs
from ._protocol import BackendLike
from ._state import ModelConfig, varied_step
from ._step import Stage, StageCall, StepFunctions, eval_step, stage_named
from .tracing._bind import state_key
from .tracing._cache import CACHES
from .tracing._memory import BufferMap, random_state, same_values, set_random_state
from .tracing._trace import trace_step

#: The seeds of the fresh states a capture is validated on (``core.varied_step``: the youngest
#: batch, the oldest, a random one; the trace's example is another, so that the values computed
#: from the step's data differ from the traced ones).
REPLAY_SEEDS: tuple[int, ...] = (1, 2, 3)

#: The seed of the state a capture validated before is checked on again at every later use: the
#: Python it was validated against may have changed since through a value no cache key holds (a
#: name no code spells, state outside Python). One more state, not all: a check, not a validation.
RECHECK_SEED = 4


class NotGraphSafe(ReadfenceError, ValueError):
    """A captured stage computes something other than its Python on another step's data.

    The graph replayed in its place bakes a value its Python computes from the step (a host
    read the tracer did not see, a Python value kept between stages, a data-dependent shape);
    on a GPU a CUDA graph freezes it just the same, so this is a bug of the engine's backend
    there too. ``stage``, ``output`` (the first output that differs, or the argument the
    replay left different) and ``line`` (``"?"`` when unknown) say where.
    """

    def __init__(self, backend: str, mode: str, stage: str, output: str, what: str, line: str) -> None:
        self.backend, self.mode, self.stage, self.output, self.line = backend, mode, stage, output, line
        where = f" (the graph bakes what {line} computed on the traced step)" if line != "?" else ""
        super().__init__(
            f"backend {backend!r} in {mode}: stage {stage} is not graph-safe: replayed on another step's state, "
            f"its graph gives {output} = {what}{where}. A captured graph "
            f"replays the traced step's Python values and kernels, not the code (a CUDA graph freezes them too: on a "
            f"GPU this stage computes the wrong thing); compute the value with tensor ops or move it to "
            f"prepare_out_graph, which runs as Python every step, and keep no state between calls")


class StaleTrace(NotGraphSafe):
    """A capture validated before no longer computes what its Python computes now: the Python
    changed since the program was traced, through a value no cache key holds. The trace is stale,
    not the backend wrong: a lowering traces it again, and validates the new trace."""


def _first_difference(name: str, got: Tensor, want: Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {tuple(got.shape)} ({got.dtype}) where its Python gives {tuple(want.shape)} ({want.dtype})"
    differs = (got != want) & ~(got.isnan() & want.isnan()) if got.is_floating_point() else got != want
    index = tuple(int(i) for i in differs.nonzero()[0]) if differs.any() else ()
    return f"{got[index].item()!r} where its Python gives {want[index].item()!r} (element {list(index)})"


def _storage_key(t: Tensor) -> tuple[int, int] | None:
    if t.layout is not torch.strided or t.device.type == "meta":
        return None
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes())


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Memory:
    """The memory a stage can reach (its tensor arguments' storages and those its graph captured),
    saved: put back before the second run, compared after it. A graph may write through a
    captured tensor that is an argument's memory too (an engine object's own reference to the
    live cache): both runs then run on the very memory the step uses, one after the other."""

    def __init__(self, named: Sequence[tuple[str, object]]) -> None:
        self.storages: dict[tuple[int, int], tuple[torch.UntypedStorage, str]] = {}
        for name, leaf in named:
            if not isinstance(leaf, Tensor):
                continue
            key = _storage_key(leaf)
            if key is not None and key not in self.storages:
                self.storages[key] = (leaf.untyped_storage(), name)

    def save(self, scratch: _Scratch) -> list[torch.UntypedStorage]:
        return [scratch.copy_of(st) for st, _ in self.storages.values()]

    def restore(self, saved: Sequence[torch.UntypedStorage]) -> None:
        for (st, _), old in zip(self.storages.values(), saved):
            _bytes(st).copy_(_bytes(old))

    def differs_from(self, saved: Sequence[torch.UntypedStorage]) -> str | None:
        """The first memory whose bytes now are not ``saved``'s (named by an argument)."""
        for (st, name), old in zip(self.storages.values(), saved):
            if not torch.equal(_bytes(st), _bytes(old)):
                return name
        return None


class _Scratch:
    """Storages a validation saves memory into, reused from one save to the next: a new storage
    per save pays for its pages' first touch, most of what saving a 64-layer model's caches cost
    (0.36 s of CPU for a lowering's twelve saves, where copying back into memory already touched
    took 0.02 s)."""

    def __init__(self) -> None:
        self.free: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}

    def copy_of(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        kept = self.free.get((storage.device, storage.nbytes()))
        copy = kept.pop() if kept else torch.UntypedStorage(storage.nbytes(), device=storage.device)
        _bytes(copy).copy_(_bytes(storage))
        return copy

    def give_back(self, saved: Iterable[torch.UntypedStorage]) -> None:
        for storage in saved:
            self.free.setdefault((storage.device, storage.nbytes()), []).append(storage)


@contextlib.contextmanager
def _same_randomness(tensors: Iterable[Tensor]) -> Iterator[Callable[[], None]]:
    # both runs draw the same random numbers (on every device the stage's tensors are on): a
    # stage that samples is not a baked value
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    state = random_state(devices)
    yield lambda: set_random_state(state, devices)


class _Comparing:
    """The interpreter that runs each stage's Python, as the engine does, and replays each
    captured stage's graph first on the same arguments and memory, put back in between,
    comparing the two."""

    def __init__(self, program: Program, replay: Replay, scratch: _Scratch) -> None:
        self.program, self.replay, self.scratch = program, replay, scratch
        self.mismatch: tuple[StageGraph, str, str] | None = None  # (stage, output, what)

    def call(self, call: StageCall) -> Any:
        graph = self.program.stage(call.stage)
        if graph.runs_python or self.mismatch is not None:
            out = call()
            guard = graph.hooks.guard
            if graph.runs_python and guard is not None:  # what the lowered step checks of it
                guard.check(out, call.fn, call.kwargs)
            return out
        names, leaves, _ = call.named_leaves()
        env = {n: v for n, v in zip(names, leaves) if isinstance(v, Tensor)}
        held = [(f"captured {c.target}", getattr(graph.graph.gm, c.target)) for c in graph.analysis.captured]
        memory = _Memory([*env.items(), *held])
        before = memory.save(self.scratch)
        with _same_randomness(env.values()) as rewind:  # the replay, then the Python, on the same memory
            replayed = {k: v.clone() for k, v in self.replay(graph, env).items()}
            after_replay = memory.save(self.scratch)
            memory.restore(before)
            rewind()
            out = call()
        want = {n: v for n, v in call.output_names(out) if isinstance(v, Tensor)}
        changed = memory.differs_from(after_replay)
        self.scratch.give_back([*before, *after_replay])
        for name in graph.graph.outputs:
            got, expected = replayed[name], want.get(name)
            if expected is None or not same_values(got, expected):
                what = "an output" if expected is None else _first_difference(name, got, expected)
                self.mismatch = (graph, name, what)
                return out
        if changed is not None:
            self.mismatch = (graph, changed, "other bytes than its Python writes there")
        return out


def _node_key(node: fx.Node, index: Mapping[fx.Node, int], gm: fx.GraphModule, state: frozenset[str]) -> tuple[Any, ...]:
    def arg(v: Any) -> Any:
        if isinstance(v, fx.Node):
            return ("node", index.get(v))
        if isinstance(v, (list, tuple)):
            return tuple(arg(x) for x in v)
        if isinstance(v, dict):
            return tuple((k, arg(x)) for k, x in v.items())
        if isinstance(v, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
            return v
        return type(v).__name__
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, Tensor) else None
    if node.op == "get_attr":  # a constant: its values, unless it is state (another on each trace)
        value = getattr(gm, str(node.target), None)
        held = (tuple(value.flatten().tolist()) if isinstance(value, Tensor) and value.numel() <= 4096
                and node.target not in state and value.device.type != "meta" else None)
        return (node.op, held, shape)
    return (node.op, str(node.target), arg(node.args), arg(node.kwargs), shape)


def baked_at(traced: fx.GraphModule, again: fx.GraphModule, state: Iterable[str] = ()) -> fx.Node | None:
    """The first node of ``again`` that differs from its place in ``traced`` (op, Python
    arguments, output shape, a constant's values), two traces of one stage on two states: where a
    value computed from the data was baked. ``state`` names the constants that are state (tensors
    the stage captured), whose values are not compared. ``None`` when the two graphs are alike.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> f = lambda x: x * float(str(x.sum())[7:-1])
    >>> baked_at(make_fx(f)(torch.ones(2)), make_fx(f)(torch.zeros(2))).args[1]
    0.0
    """
    held = frozenset(state)
    a, b = list(traced.graph.nodes), list(again.graph.nodes)
    ia, ib = {n: i for i, n in enumerate(a)}, {n: i for i, n in enumerate(b)}
    return next((nb for na, nb in zip(a, b) if _node_key(na, ia, traced, held) != _node_key(nb, ib, again, held)),
                None)


def _locate(program: Program, fns: StepFunctions, example: Mapping[str, Any], stage: Stage) -> str:
    # the stage traced once more on the state where it differs: the first node that changed
    try:
        again = trace_step(fns, program.mode, example, device=program.device)
        state = {c.target for s in (program.stage(stage), again.stage(stage)) for c in s.analysis.captured}
        node = baked_at(program.stage(stage).graph.gm, again.stage(stage).graph.gm, state)
        if node is not None and node.op == "get_attr":  # a constant: where its first use is
            node = next(iter(node.users), node)
        return "?" if node is None else str(node.meta.get(SOURCE_KEY, "?"))
    except Exception:  # only looking for a line: the refusal stands without one
        return "?"


#: How a captured stage is replayed on an environment of names: ``StageGraph.run`` by default
#: (its GraphModule); the lowering hands its own compiled code.
Replay = Callable[[StageGraph, Mapping[str, Tensor]], Mapping[str, Tensor]]


def _graph_module(stage: StageGraph, env: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    return stage.run(env)


def validate_replay(program: Program, fns: StepFunctions, example: Callable[[int], Mapping[str, Any]], *,
                    seeds: Iterable[int] = REPLAY_SEEDS, replay: Replay = _graph_module,
                    key: Hashable = "GraphModule") -> None:
    """Check that every stage ``program`` replays as a graph computes what ``fns`` computes:
    for each seed, run the step's Python on ``example(seed)`` (fresh input groups: ``shared``,
    ``batch``, ...) and replay the captured stages on the same arguments beside it; raise
    :class:`NotGraphSafe` at the first difference (see the module docstring). ``program`` is
    the program a lowering replays (bound to the live state it runs on); ``replay(stage, env)``
    runs a captured stage's graph (default: its GraphModule), and ``key`` says what that code
    computes beside the program (the lowering's compiled code): a program passes once per seeds
    and key, and another code for it is validated anew. A program that passed before with this
    code is checked on one more state (:data:`RECHECK_SEED`); a difference in a program that
    passed before, with any code, raises :class:`StaleTrace` (its Python may have changed since
    through a value no cache key holds: a lowering traces it again, and the fresh trace gets the
    verdict).

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig, ForwardMode, step_functions, trace, varied_step
    >>> cfg = ModelConfig()
    >>> validate_replay(trace(paged(), ForwardMode.DECODE, cfg=cfg), step_functions(paged(), ForwardMode.DECODE, cfg),
    ...                 lambda seed: varied_step(cfg, ForwardMode.DECODE, 2, seed=seed).groups())
    """
    seeds = tuple(seeds)
    if program.aborted is not None or all(s.runs_python for s in program.stages):
        return
    validated = ValidatedKey(program, seeds, key)
    scratch = _Scratch()
    if validated in _VALIDATED:  # passed before: checked again on one more state
        _compare(program, fns, example, (RECHECK_SEED,), replay, scratch, StaleTrace)
        return
    passed_before = any(k.program is program for k in _VALIDATED)
    _compare(program, fns, example, seeds, replay, scratch, StaleTrace if passed_before else NotGraphSafe)
    _VALIDATED.put(validated, True)


def _compare(program: Program, fns: StepFunctions, example: Callable[[int], Mapping[str, Any]], seeds: Iterable[int],
             replay: Replay, scratch: _Scratch, error: type[NotGraphSafe]) -> None:
    for seed in seeds:
        comparing = _Comparing(program, replay, scratch)
        with torch.no_grad():
            eval_step(comparing, fns, example(seed))
        if comparing.mismatch is not None:
            stage, output, what = comparing.mismatch
            line = _locate(program, fns, example(seed), stage.stage)
            raise error(program.backend, program.mode.name, stage.stage.name, output, what, line)


def observe_varied(program: Program, example: Callable[[int], Mapping[str, Any]], live: Mapping[str, Tensor], *,
                   seeds: Iterable[int] = REPLAY_SEEDS) -> NodeReads:
    """What a step that is not replayed (every stage runs its Python: no capture to validate)
    really reads on the fresh states ``example(seed)``, per stage and node (``observe_program``;
    ``live``, the live shared buffers a backend keeps references to, count too). Its Python may take
    a path there that the trace's example did not: the fences join what these runs see, never
    placing a release below it, as the rehearsal's observations.

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig, ForwardMode, trace, varied_step
    >>> cfg = ModelConfig()
    >>> seen = observe_varied(trace(paged(), ForwardMode.EXTEND, cfg=cfg),
    ...                       lambda seed: varied_step(cfg, ForwardMode.EXTEND, 2, seed=seed).groups(), {})
    >>> sorted(b for nodes in seen.values() for bufs in nodes.values() for b in bufs)[:1]
    ['req_to_token']
    """
    runs = []
    for seed in seeds:
        groups = example(seed)
        buffers = BufferMap.of(groups["shared"]).union([BufferMap.of(live)])
        with torch.no_grad():
            runs.append(observe_program(program, flatten_inputs(**groups), buffers))
    return join_node_reads(*runs)


@attrs.frozen
class ValidatedKey:
    """A validation's key: the program validated (by identity: a trace of other code or other
    settings is another program; bound to another state, another too), the seeds tried and what
    the code replayed beside it computes (``validate_replay``'s ``key``)."""

    program: Program
    seeds: tuple[int, ...]
    code: Hashable


#: Programs validated, with the seeds and the code replayed.
_VALIDATED = CACHES.table("validated", ValidatedKey, "the program's captured stages, replayed by the code, compute "
                          "what its Python computes on the seeds' states", limit=256)

#: The live tensors a step runs on: ``shared``, ``pools``, ``params``, each name -> tensor.
State = Mapping[str, Mapping[str, Tensor]]


@contextlib.contextmanager
def varied_states(program: Program, cfg: ModelConfig, batch_size: int, state: State | None, *,
                  settle: Callable[[], None] | None = None) -> Iterator[Callable[[int], dict[str, Any]]]:
    """``example(seed)``: the input groups of ``core.varied_step``'s fresh state for ``seed``, at
    ``batch_size``, on the live ``state``'s device (``None``: no live state, the program's device),
    for a check to run ``program``'s step on. A backend that keeps references to the live state
    (an engine object holding its runner's page table: the program captured tensors) reads that
    state, not an example: its varied states are written into the live buffers (after
    ``settle()``, which lets what was enqueued on them finish), which hold their values again when
    the block ends (as they do after the Python writes memory it keeps a reference to)."""
    where = program.device if state is None else next(iter(state["shared"].values())).device
    keeps = state is not None and bool(program.captured())
    if keeps and settle is not None:  # nothing enqueued may run on the live buffers while they hold the varied states
        settle()
    saved = [(t, t.clone()) for group in (state or {}).values() for t in group.values()] if keeps else []

    def example(seed: int) -> dict[str, Any]:
        groups: dict[str, Any] = varied_step(cfg, program.mode, batch_size, seed=seed, device=where).groups()
        if not keeps or state is None:
            return groups
        for name in ("shared", "pools", "params"):
            live, varied = state.get(name, {}), groups[name]
            for buffer, t in live.items():
                if buffer in varied and varied[buffer].shape == t.shape and varied[buffer].dtype == t.dtype:
                    t.copy_(varied[buffer])
            groups[name] = {**varied, **live}
        return groups

    try:
        yield example
    finally:
        for t, old in saved:
            t.copy_(old)


def _observe_python(program: Program, fns: StepFunctions, example: Callable[[int], Mapping[str, Any]],
                    live: Mapping[str, Tensor], stages: Iterable[Stage], *,
                    seeds: Iterable[int] = REPLAY_SEEDS) -> NodeReads:
    """What the Python of a replayed step's ``stages`` reads on the fresh states ``example(seed)``,
    each on its stage's first node (as ``observe_program`` attributes what a stage's Python reads):
    the step run as written (:func:`~readfence.core.eval_step`, as the serial step and
    :func:`validate_replay`'s Python side run it), under a read observer of its state and ``live``."""
    first = {s.stage: next(iter(s.graph.gm.graph.nodes)).name for s in program.stages if s.stage in set(stages)}
    runs: list[NodeReads] = []
    for seed in seeds:
        groups = example(seed)
        observer = ReadObserver(BufferMap.of(groups["shared"]).union([BufferMap.of(live)]))
        with torch.no_grad(), observer:
            eval_step(Watched(observer), fns, groups)
        seen: NodeReads = {}
        for a in observer.accesses:
            stage = stage_named(a.stage.partition(":")[0])
            if a.kind != "write" and stage in first:
                nodes = seen.setdefault(stage, {})
                nodes[first[stage]] = nodes.get(first[stage], frozenset()) | {a.buffer}
        runs.append(seen)
    return join_node_reads(*runs)


def varied_reads(program: Program, cfg: ModelConfig, batch_size: int, state: State | None = None, *,
                 settle: Callable[[], None] | None = None, backend: BackendLike | None = None) -> NodeReads:
    """What the Python of the stages that may take a path the trace's example did not
    (``Program.varied_stages``: every stage of a step that is not replayed; in a replayed step, an
    out-of-graph stage that escapes) reads on the varied states, per stage and node
    (:func:`observe_varied` on :func:`varied_states`); ``{}`` where there is none (a replayed
    step's captures are validated on those states instead) or the trace stopped. Such a stage may
    branch there on a value the example did not hold: the audit's verdict counts what it reads
    there, and the lowering's fences join it. Cached per program, batch size and live state, so
    the audit and every lowering of one step on one live state run it once.

    A step that is not replayed is run as its program runs it (every stage's Python); a replayed
    one as the step written (``backend``'s step functions: required there), its captures' Python
    too, as :func:`validate_replay` runs it beside them (an engine object's Python then sees the
    calls its own methods make, in their order).

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> cfg = ModelConfig()
    >>> program = trace(paged(), ForwardMode.EXTEND, cfg=cfg)
    >>> seen_effect(program, varied_reads(program, cfg, 2))["req_to_token"]
    <ReadEnd.IN_REPLAY: 2>
    >>> varied_reads(trace(paged(), ForwardMode.DECODE, cfg=cfg), cfg, 2)
    {}
    """
    stages = program.varied_stages()
    if not stages or program.aborted is not None:
        return {}
    key = VariedKey(program, cfg, batch_size, None if state is None else state_key(state))
    hit: NodeReads | None = _VARIED.get(key)
    if hit is not None:
        return hit
    if program.replayed and backend is None:
        raise TypeError(f"varied_reads of the replayed step of {program.backend!r} in {program.mode.name} needs "
                        f"backend=: its Python runs as the step is written")
    live = {} if state is None else state["shared"]
    with varied_states(program, cfg, batch_size, state, settle=settle) as example:
        if program.replayed:
            assert backend is not None
            seen = _observe_python(program, step_functions(backend, program.mode, cfg), example, live, stages)
        else:
            seen = observe_varied(program, example, live)
    return _VARIED.put(key, {s: nodes for s, nodes in seen.items() if s in stages})


def seen_effect(program: Program, observed: NodeReadsIn) -> ReadEffect:
    """The effect of the reads ``observed`` (per stage, per node, buffers): each buffer until
    the end of the last stage a run saw reading it.

    >>> from readfence.backends import paged
    >>> from readfence.core import BODY, ForwardMode, trace
    >>> seen_effect(trace(paged(), ForwardMode.DECODE), {BODY: {"mul": frozenset({"seq_lens"})}})
    ReadEffect({'seq_lens': POST_REPLAY}, default=NONE)
    """
    ends: dict[str, ReadEnd] = {}
    for s in program.stages:
        for bufs in observed.get(s.stage, {}).values():
            for b in bufs:
                ends[b] = ends.get(b, ReadEnd.NONE) | s.end
    return ReadEffect.of(ends)


def seen_reader(program: Program, observed: NodeReadsIn, buffer: str) -> tuple[Stage, str] | None:
    """``(stage, node)`` where a run last saw ``buffer`` read, in ``observed`` (per stage, per node,
    buffers; a stage that runs its Python has its reads on its first node), or ``None``.

    >>> from readfence.backends import paged
    >>> from readfence.core import BODY, ForwardMode, trace
    >>> seen_reader(trace(paged(), ForwardMode.DECODE), {BODY: {"mul": frozenset({"seq_lens"})}}, "seq_lens")
    (Stage(name='body', ...), 'mul')
    """
    return next(((s.stage, node) for s in reversed(program.stages)
                 for node, bufs in observed.get(s.stage, {}).items() if buffer in bufs), None)


@attrs.frozen
class VariedKey:
    """What the reads on the varied states depend on: the program (by identity), the model, the
    batch size and where the live state is (``None``: no live state)."""

    program: Program
    cfg: ModelConfig
    batch_size: int
    state: tuple[tuple[Any, ...], ...] | None


#: What a step that is not replayed read on the varied states (``varied_reads``).
_VARIED = CACHES.table("varied", VariedKey, "per stage and node, what the step's Python read on the varied states",
                       limit=64)


__all__ = ["RECHECK_SEED", "REPLAY_SEEDS", "NotGraphSafe", "StaleTrace", "baked_at", "observe_varied", "same_values", "seen_effect", "seen_reader",
           "validate_replay", "varied_reads", "varied_states"]
