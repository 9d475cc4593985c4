"""Translation validation of a capture: the replayed graph must compute what its Python computes.

A lowered step replays the traced graph of each in-graph stage (on CUDA a CUDA graph, on the CPU
device its model of one); an engine runs the same stage's Python. The trace holds the one path
its example took, with every Python value computed on the way baked in as a constant: a host
read the tracer did not notice (``str(t)``, which prints with the dispatcher's modes off; a
``tolist()`` inside TorchScript; a count taken from a data-dependent shape), a value an earlier
stage kept on ``self``. Rather than trust that no such value was missed, :func:`validate_replay`
checks the graph against the code, as a compiler's translation validation does: it runs the
step's Python on generated states of the kinds traffic has, whose values differ from the traced
one (requests at their first token, at the longest context, a mixed batch; other page tables;
the same shapes) and replays each captured stage on the very inputs the Python stage receives
(the memory put back in between), then compares every output and every byte of memory the stage
could write. A difference is :class:`NotGraphSafe`, naming the stage,
the first output that differs and, where a trace on the differing state shows it, the line
that computed the baked value.

What it can miss: a value that happens to be equal on every state it tries (a maximum that is
always the context length), and code that reads the host's clock or other state outside the
step. The runtime checks (poison, the comparison with the serial run) remain the ground truth.

>>> import torch
>>> from readfence.core import ForwardMode, ModelConfig
>>> from readfence.core.internal import StepFunctions, ledger_of, trace_step
>>> def body(shared, batch, meta):          # the longest length, read by printing it
...     return shared["seq_lens"] * float(str(shared["seq_lens"].max())[7:-1])
>>> fns = StepFunctions(lambda shared, batch: {}, lambda shared, batch, meta: {}, body, "printed")
>>> example = lambda seed: {"shared": {"seq_lens": torch.arange(4) + seed}, "batch": {}}
>>> program = trace_step(fns, ForwardMode.DECODE, example(0))
>>> program.unfaithful()                     # the tracer noticed nothing
[]
>>> validate_replay(program, fns, example, seeds=(1,), ledger=ledger_of(program, ModelConfig(), 4))  # doctest: +ELLIPSIS
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

from readfence.effects import ReadfenceError

from ._ledger import REPLAY_SEEDS, Ledger, RunKind, state_label
from ._observe import ReadObserver
from ._program import SOURCE_KEY, Program, StageGraph
from ._step import PREPARE_OUT_GRAPH, Stage, StageCall, StepFunctions, as_static, eval_step
from ._words import as_words, copy_of, words_dtype
from .tracing import CACHES, defined_memory, random_state, same_values, set_random_state, trace_step

#: The seed of the state a capture validated before is checked on at every later use, with the
#: states it was validated on: the Python it was validated against may have changed since through
#: a value no cache key holds (a name no code spells, an attribute whose name the code assigns on
#: another object, state outside Python), and the change shows only where it changes what the step
#: computes (a threshold only short requests cross): on any of the states, not on a chosen one.
RECHECK_SEED = len(REPLAY_SEEDS) + 1


class NotGraphSafe(ReadfenceError, ValueError):
    """A captured stage computes something other than its Python on another step's data.

    The graph replayed in its place bakes a value its Python computes from the step (a host
    read the tracer did not see, a Python value kept between stages, a data-dependent shape);
    on a GPU a CUDA graph freezes it just the same, so this is a bug of the engine's backend
    there too. ``stage``, ``output`` (the first output that differs, or the argument the
    replay left different) and ``line`` (``"?"`` when unknown) say where.
    """

    #: the seed of the generated state it differs on (:func:`validate_replay`'s), where known
    seed: int | None = None

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
    not the backend wrong: a lowering traces it again, and validates the new trace on the states
    it was validated on and on the one this one differs on (``seed``): a backend whose capture is
    wrong there whatever changed is refused, not traced again at every lowering."""


def _first_difference(name: str, got: Tensor, want: Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {tuple(got.shape)} ({got.dtype}) where its Python gives {tuple(want.shape)} ({want.dtype})"
    got, want = as_words(got), as_words(want)  # (a dtype torch cannot compare: its words, as bits)
    differs = (got != want) & ~(got.isnan() & want.isnan()) if got.is_floating_point() else got != want
    index = tuple(int(i) for i in differs.nonzero()[0]) if differs.any() else ()
    return f"{got[index].item()!r} where its Python gives {want[index].item()!r} (element {list(index)})"


def _storage_key(t: Tensor) -> tuple[int, int] | None:
    if t.layout is not torch.strided or t.device.type == "meta":
        return None
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes())


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    """``storage``'s bytes as a tensor of the widest integer its size is a multiple of: equal
    bytes are equal words, and ``torch.equal`` compares 8-byte words six times faster than bytes
    (a 64-layer model's caches are compared after every replay)."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    size = storage.nbytes()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if size % dtype.itemsize == 0:
            return flat.view(dtype)
    return flat


class _Memory:
    """The memory a stage can reach: its tensor arguments' storages and those its graph captured.
    The replay runs on copies of the arguments' storages (each argument viewed as it is, on its
    storage's copy: arguments that share memory still do), and the Python on the memory itself;
    the copies are then compared with what the Python left. Memory the graph captured (and any
    argument over it: an engine object's own reference to the live cache) is the very memory both
    runs use: saved, put back before the Python runs, compared after it. Each storage is looked
    at once, as words (:func:`_bytes`), and the copies of all of them are one call: a 64-layer
    model's stage reaches some 400 storages, whose one by one handling cost more than their
    bytes."""

    def __init__(self, arguments: Sequence[tuple[str, object]], held: Sequence[tuple[str, Tensor]]) -> None:
        in_place: dict[tuple[int, int], tuple[torch.UntypedStorage, str]] = {}
        for name, t in held:
            key = _storage_key(t)
            if key is not None and key not in in_place:
                in_place[key] = (t.untyped_storage(), name)
        spans = [(st.device, key[0], key[0] + key[1]) for key, (st, _) in in_place.items()]
        copied: dict[tuple[int, int], tuple[torch.UntypedStorage, str]] = {}
        for name, leaf in arguments:
            if not isinstance(leaf, Tensor):
                continue
            key = _storage_key(leaf)
            if key is None or key in in_place or key in copied:
                continue
            st = leaf.untyped_storage()
            over_held = any(st.device == d and key[0] < stop and start < key[0] + key[1] for d, start, stop in spans)
            (in_place if over_held or type(leaf) is not Tensor else copied)[key] = (st, name)
        self.names = [name for _, name in in_place.values()]
        self.words = [_bytes(st) for st, _ in in_place.values()]
        self._copied = list(copied)
        self.copied_names = [name for _, name in copied.values()]
        self.copied_words = [_bytes(st) for st, _ in copied.values()]

    def save(self, scratch: _Scratch) -> list[Tensor]:
        """Copies of the memory both runs use."""
        return scratch.copies_of(self.words)

    def restore(self, saved: Sequence[Tensor]) -> None:
        if self.words:
            torch._foreach_copy_(self.words, list(saved))

    def on_copies(self, env: Mapping[str, Tensor], scratch: _Scratch) -> tuple[dict[str, Tensor], list[Tensor]]:
        """``env`` with each argument over a copied storage viewed as it is on that storage's copy,
        and the copies (that :meth:`differs_from` compares with what the Python left)."""
        copies = scratch.copies_of(self.copied_words)
        storage = {key: c.untyped_storage() for key, c in zip(self._copied, copies)}
        viewed = {}
        for name, t in env.items():
            key = _storage_key(t) if type(t) is Tensor else None
            st = storage.get(key) if key is not None else None
            viewed[name] = t if st is None else torch.empty(0, dtype=words_dtype(t.dtype), device=t.device).set_(
                st, t.storage_offset(), t.size(), t.stride()).view(t.dtype)
        return viewed, copies

    def differs_from(self, saved: Sequence[Tensor], copies: Sequence[Tensor]) -> str | None:
        """The first memory whose bytes now are not ``saved``'s, or whose copy (``copies``, as the
        replay left it) is not what the Python left (named by an argument)."""
        for name, now, old in zip(self.names, self.words, saved, strict=True):
            if not torch.equal(now, old):
                return name
        for name, now, replayed in zip(self.copied_names, self.copied_words, copies, strict=True):
            if not torch.equal(now, replayed):
                return name
        return None


class _Scratch:
    """Memory a validation saves into, reused from one save to the next: a new storage per save
    pays for its pages' first touch, most of what saving a 64-layer model's caches cost (0.36 s
    of CPU for a lowering's twelve saves, where copying back into memory already touched took
    0.02 s)."""

    def __init__(self) -> None:
        self.free: dict[tuple[torch.device, torch.dtype, int], list[Tensor]] = {}

    def copies_of(self, words: Sequence[Tensor]) -> list[Tensor]:
        copies = []
        for w in words:
            kept = self.free.get((w.device, w.dtype, w.numel()))
            copies.append(kept.pop() if kept else torch.empty_like(w))
        if copies:
            torch._foreach_copy_(copies, list(words))
        return copies

    def give_back(self, saved: Iterable[Tensor]) -> None:
        for t in saved:
            self.free.setdefault((t.device, t.dtype, t.numel()), []).append(t)


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
    comparing the two. The Python of a stage that runs it in the step (the out-of-graph stage,
    one that escapes the tracer) runs under ``observer``: what it reads on this state is a read of
    the step (a captured stage's graph reads what its trace and the rehearsal say)."""

    def __init__(self, program: Program, replay: Replay, observer: ReadObserver, scratch: _Scratch) -> None:
        self.program, self.replay, self.observer, self.scratch = program, replay, observer, scratch
        self.mismatch: tuple[StageGraph, str, str] | None = None  # (stage, output, what)
        self.crossing = program.stage(PREPARE_OUT_GRAPH).graph.traced_outputs()

    def call(self, call: StageCall) -> Any:
        graph = self.program.stage(call.stage)
        if graph.runs_python:
            with self.observer, self.observer.stage(call.stage.name):
                out = call()
            guard = graph.hooks.guard
            if guard is not None:  # what the lowered step checks of it
                guard.check(out, call.fn, call.kwargs)
            return out
        if self.mismatch is not None:
            return call()
        names, leaves, _ = call.named_leaves()
        env = {n: v for n, v in zip(names, leaves) if isinstance(v, Tensor)}
        # the copies crossing into the graph as its static buffers hold them (the traced layout)
        env.update({n: as_static(env[n], t) for n, t in self.crossing.items() if n in env})
        memory = _Memory(list(env.items()), self._held(graph))
        before = memory.save(self.scratch)
        with _same_randomness(env.values()) as rewind:  # the replay (on copies), then the Python
            on_copies, copies = memory.on_copies(env, self.scratch)
            try:
                replayed = {k: copy_of(v) for k, v in self.replay(graph, on_copies).items()}
            except RuntimeError as e:  # (a view of the example's layout on a state laid out otherwise)
                if _no_fill_kernel(e):
                    raise
                memory.restore(before)
                rewind()
                out = call()
                self.scratch.give_back([*before, *copies])
                what = (str(e).strip().splitlines() or [""])[0]
                self.mismatch = (graph, "(its replay)", f"{type(e).__name__}: {what} where its Python runs")
                return out
            after_replay = memory.save(self.scratch)
            memory.restore(before)
            rewind()
            out = call()
        want = {n: v for n, v in call.output_names(out) if isinstance(v, Tensor)}
        changed = memory.differs_from(after_replay, copies)
        self.scratch.give_back([*before, *after_replay, *copies])
        for name in graph.graph.outputs:
            got, expected = replayed[name], want.get(name)
            if expected is None or not same_values(got, expected):
                what = "an output" if expected is None else _first_difference(name, got, expected)
                self.mismatch = (graph, name, what)
                return out
        if changed is not None:
            self.mismatch = (graph, changed, "other bytes than its Python writes there")
        return out

    def _held(self, graph: StageGraph) -> list[tuple[str, Tensor]]:
        """The tensors ``graph`` captured, and those another captured stage's graph captured that a
        run of this stage's Python writes (a buffer the stage made on its traced call and keeps for
        the next stage: its graph makes a new one at every replay, which the next graph never reads)."""
        name = graph.stage.name
        return [(f"captured {c.target}" + ("" if s is graph else f" of stage {s.stage.name}"),
                 getattr(s.graph.gm, c.target))
                for s in self.program.stages if not s.runs_python
                for c in s.analysis.captured if s is graph or name in c.filled_by]


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
                    ledger: Ledger, seeds: Iterable[int] = REPLAY_SEEDS, replay: Replay = _graph_module,
                    key: Hashable = "GraphModule") -> None:
    """Check that every stage ``program`` replays as a graph computes what ``fns`` computes:
    for each seed, run the step's Python on ``example(seed)`` (fresh input groups: ``shared``,
    ``batch``, ...) and replay the captured stages on the same arguments beside it; raise
    :class:`NotGraphSafe` at the first difference (see the module docstring). ``program`` is
    the program a lowering replays (bound to the live state it runs on); ``replay(stage, env)``
    runs a captured stage's graph (default: its GraphModule), and ``key`` says what that code
    computes beside the program (the lowering's compiled code): a program passes once per seeds
    and key, and another code for it is validated anew. A program that passed before with this
    code is checked again on those states and one more (:data:`RECHECK_SEED`); a difference in a
    program that passed before, with any code, raises :class:`StaleTrace` (its Python may have changed since
    through a value no cache key holds: a lowering traces it again, and the fresh trace gets the
    verdict). What the Python of the stages that run it in the step reads on each state is
    recorded in ``ledger`` (a run of kind ``validation``, named after the state:
    ``core.internal.Ledger``).

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig, ForwardMode, step_functions, trace, varied_step
    >>> from readfence.core.internal import ledger_of
    >>> cfg = ModelConfig()
    >>> program = trace(paged(), ForwardMode.DECODE, cfg=cfg)
    >>> validate_replay(program, step_functions(paged(), ForwardMode.DECODE, cfg),
    ...                 lambda seed: varied_step(cfg, ForwardMode.DECODE, 2, seed=seed).groups(),
    ...                 ledger=ledger_of(program, cfg, 2))
    """
    if program.aborted is not None or all(s.runs_python for s in program.stages):
        return
    # and every state its capture was once found to differ on: asking on others forgets no refusal
    differed: tuple[int, ...] = _DIFFERED.get(DifferedKey(program), ())
    seeds = tuple(dict.fromkeys((*seeds, *differed)))
    validated = ValidatedKey(program, seeds, key)
    scratch = _Scratch()
    try:
        if validated in _VALIDATED:
            # passed before: checked again on every state and one more (a value no key holds that
            # changed since shows where it changes what the step computes: on any of them)
            _compare(program, fns, example, tuple(dict.fromkeys((*seeds, RECHECK_SEED))), replay, scratch, StaleTrace,
                     ledger)
            return
        passed_before = any(k.program is program for k in _VALIDATED)
        _compare(program, fns, example, seeds, replay, scratch, StaleTrace if passed_before else NotGraphSafe, ledger)
    except NotGraphSafe as e:
        if e.seed is not None:
            differs_on(program, e.seed)
        raise
    _VALIDATED.put(validated, True)


def _no_fill_kernel(e: BaseException) -> bool:
    # torch has no kernel to fill new memory of the dtype (bits8, fp4...) under the fixed fill
    return isinstance(e, NotImplementedError) and "fill" in str(e)


def _compare(program: Program, fns: StepFunctions, example: Callable[[int], Mapping[str, Any]], seeds: Iterable[int],
             replay: Replay, scratch: _Scratch, error: type[NotGraphSafe], ledger: Ledger) -> None:
    def compared(seed: int, fill: bool) -> _Comparing:
        groups = example(seed)
        # memory a stage allocates and leaves unwritten (a padded metadata buffer) holds the same
        # value in both runs: a difference there is no value either computed
        with defined_memory() if fill else contextlib.nullcontext(), \
                ledger.watch(RunKind.VALIDATION, state_label(seed), groups["shared"]) as observer:
            comparing = _Comparing(program, replay, observer, scratch)
            with torch.no_grad():
                eval_step(comparing, fns, groups)
        return comparing

    for seed in seeds:
        try:
            comparing = compared(seed, True)
        except NotImplementedError as e:  # a dtype torch cannot fill, allocated by the step: unfilled
            if not _no_fill_kernel(e):
                raise
            comparing = compared(seed, False)
        if comparing.mismatch is not None:
            stage, output, what = comparing.mismatch
            line = _locate(program, fns, example(seed), stage.stage)
            found = error(program.backend, program.mode.name, stage.stage.name, output, what, line)
            found.seed = seed
            raise found


def differs_on(program: Program, seed: int) -> None:
    """Have every later validation of ``program`` try the generated state of ``seed`` too: a capture
    of it (or of a stale trace of the same step, which ``program`` traces again) was found to differ
    there, and asking on other states must not forget it."""
    key = DifferedKey(program)
    _DIFFERED.put(key, tuple(dict.fromkeys((*_DIFFERED.get(key, ()), seed))))


@attrs.frozen
class ValidatedKey:
    """A validation's key: the program validated (by identity: a trace of other code or other
    settings is another program; bound to another state, another too), the seeds tried and what
    the code replayed beside it computes (``validate_replay``'s ``key``)."""

    program: Program
    seeds: tuple[int, ...]
    code: Hashable


@attrs.frozen
class DifferedKey:
    """A program (by identity) whose capture differed from its Python on some generated state."""

    program: Program


#: Per program, the seeds of the states its capture was found to differ on.
_DIFFERED = CACHES.table("differed", DifferedKey, "the seeds of the states the program's captured stages were "
                         "found to compute other than its Python on", limit=256)

#: Programs validated, with the seeds and the code replayed.
_VALIDATED = CACHES.table("validated", ValidatedKey, "the program's captured stages, replayed by the code, compute "
                          "what its Python computes on the seeds' states", limit=256)


__all__ = ["RECHECK_SEED", "REPLAY_SEEDS", "NotGraphSafe", "StaleTrace", "ValidatedKey", "baked_at", "differs_on", "same_values",
           "validate_replay"]
