"""Trace a backend's step into a ``Program``: one FX graph per stage, reads on every node.

Each stage is recorded as it runs once (``_record``: the graph ``make_fx`` would make, written
op by op as the dispatcher runs them), or, where a record cannot hold it, traced with
``make_fx`` (real tensors on CPU; fake tensors for any other device, so ``device="cuda"``
traces on a machine without a GPU). The graphs are *not* functionalized: they keep the ops as
written (views, in-place writes to ``pools``) so they can be executed as they are; reads
through views are found by alias analysis over op schemas instead (see ``_alias``), joined
with the memory each node's real value touches (``_probe``: as the record runs, or when the
graph is run once more on the example; real tensors only, under fake tensors the schemas are
all there is). Tensors are matched to shared buffers by memory range (``_memory``).

Escapes (``_escapes``) are marked in the graph as the stage runs, by the modes it is traced under
(``_trace_modes``), and make the stage unfaithful (see ``_program``: such a stage is given every
shared buffer). Each stage's graph is analysed (``_analysis``), its captured tensors matched
(``_captured``); ``bind`` matches them again on the live state (``_bind``), and traced programs
are cached by code (``_cache``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from readfence.effects import ReadfenceError

from .._modes import ForwardMode
from .._program import INPUT_KEY, Program, StageAnalysis, StageGraph, StageHooks, TracedGraph, Unmatched, flatten_inputs
from .._step import OutputGuard, Stage, StageCall, StepFunctions, eval_step
from .._threads import watch_threads
from ._alias import Analysis
from ._analysis import StageFacts, analysed, in_branches
from ._captured import captured_tensors, fresh_literals_dropped, mark_persistent
from ._collect import collection_paused
from ._consumed import ReadKeys
from ._escapes import OPAQUE_OP
from ._memory import BufferMap
from ._probe import MemoryProbe, ProbeResult
from ._record import GraphRecorder, Unrecordable, record
from ._trace_modes import HostReads, TraceAborted, TraceMode

if TYPE_CHECKING:
    pass


def _through_compiled_functions() -> Any:
    """Trace a ``torch.compile``'d function a stage calls as the Python it compiles.

    Dynamo refuses to be traced by FX unless told to run the original function instead; then
    its ops are traced like the stage's own (and the lowering compiles the stage itself). A
    process that never imported ``torch._dynamo`` has no compiled function to trace through.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return contextlib.nullcontext()
    return dynamo.config.patch(error_on_nested_fx_trace=False)


@contextlib.contextmanager
def _meta_values() -> Iterator[None]:
    """While tracing real tensors: record each node's value (``node.meta["val"]``) as a meta
    tensor of its shape, strides and dtype rather than as a fake tensor.

    make_fx makes a fake tensor per node for that record, about a quarter of a real trace's
    time (a fake tensor costs ~370 us to make, a meta one ~5 us); what readfence reads of
    the record (shapes, strides, dtypes: the compiler's probes, the rehearsal's shape check)
    a meta tensor holds. Values of any other kind keep make_fx's own record.
    """
    from torch.fx.experimental import proxy_tensor

    real = proxy_tensor.extract_val

    def light(val: Any, include_real: bool = False) -> Any:
        if type(val) is torch.Tensor and not val.is_sparse:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return real(val, include_real)

    proxy_tensor.extract_val = light
    try:
        yield
    finally:
        proxy_tensor.extract_val = real


def _forget_nested_dynamo(stages: Iterable[StageGraph]) -> None:
    """After tracing a higher-order op (``torch.cond``), whose eager entry is a dynamo-compiled
    wrapper that the trace ran as plain Python (see ``_through_compiled_functions``): drop what
    dynamo cached meanwhile, or the next eager call of the op fails inside dynamo."""
    hop = torch._ops.HigherOrderOperator
    if any(isinstance(n.target, hop) for s in stages for n in s.graph.gm.graph.nodes) and "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


# -- tracing one stage -----------------------------------------------------------------------
def _identifier(dotted: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in dotted)
    return out if out and not out[0].isdigit() else "_" + out


@attrs.frozen(eq=False)
class _EagerStage:
    """The stage run as written on an environment of its inputs by name (how a stage that runs
    its Python runs in the lowered step), its outputs held to ``guard`` (what the stages after it
    take as traced). In a step that is not replayed (``call.replayed`` False) its Python values
    cross too: it returns them by name, and takes its own from ``env`` where an earlier stage's
    Python returned them (a replayed step's graphs bake them). It keeps the call without its
    arguments and the shape of those, not the traced example's tensors: a cached program would
    keep them alive (a deep model's caches, for every program the trace cache and the lowered
    sizes hold)."""

    call: StageCall  # without its arguments
    spec: pytree.TreeSpec
    skeleton: tuple[Any, ...]  # the arguments' leaves, ``None`` where a tensor goes
    tensors: tuple[tuple[int, str], ...]  # (leaf position, name) of each tensor argument
    values: tuple[tuple[int, str], ...]  # (leaf position, name) of each Python value that crosses
    guard: OutputGuard

    @classmethod
    def of(cls, call: StageCall, names: Sequence[str], leaves: Sequence[Any], spec: pytree.TreeSpec,
           guard: OutputGuard) -> _EagerStage:
        crossing = not call.replayed  # Python values cross between the stages' Python too
        return cls(attrs.evolve(call, kwargs={}), spec,
                   tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves),
                   tuple((i, names[i]) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)),
                   tuple((i, names[i]) for i, leaf in enumerate(leaves) if crossing and not isinstance(leaf, torch.Tensor)),
                   guard)

    def __call__(self, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = list(self.skeleton)
        for i, name in self.tensors:
            flat[i] = env[name]
        for i, name in self.values:
            if name in env:
                flat[i] = env[name]
        bare = self.call
        kwargs = bare.rebuild(flat, self.spec)
        with watch_threads(bare.backend, bare.stage.name):
            out = bare.fn(**kwargs)
        self.guard.check(out, bare.fn, kwargs)  # the stages after it were traced on the traced step's outputs
        crossing = not bare.replayed
        return {n: v for n, v in bare.output_names(out) if crossing or isinstance(v, torch.Tensor)}


@attrs.frozen(eq=False)
class _StageArgs:
    """A stage's arguments as the tracer feeds them: every leaf by its dotted name, and one
    example tensor per distinct name (a tensor the stage receives twice is one input, one
    placeholder)."""

    call: StageCall
    names: tuple[str, ...]  # each leaf's dotted name
    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec
    tensor_pos: tuple[int, ...]  # where the tensor leaves are
    inputs: tuple[str, ...]  # the distinct names of the tensor leaves, in order: the placeholders
    args: tuple[torch.Tensor, ...]  # the example tensor of each input
    # per argument an earlier stage produced (``StageCall.origins``), the keys the stage read of it
    read: Mapping[str, set[Any]] = attrs.Factory(dict)

    @classmethod
    def of(cls, call: StageCall) -> _StageArgs:
        names, leaves, spec = call.named_leaves()
        tensor_pos = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        inputs = tuple(dict.fromkeys(names[i] for i in tensor_pos))
        first: dict[str, torch.Tensor] = {}
        for i in tensor_pos:
            first.setdefault(names[i], leaves[i])
        return cls(call, tuple(names), tuple(leaves), spec, tensor_pos, inputs, tuple(first[n] for n in inputs),
                   {arg: set() for arg in call.origins})

    def kwargs(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The stage's keyword arguments with ``tensors`` (one per input) in place of the example's;
        each argument an earlier stage produced notes the keys the stage reads of it (``_consumed``)."""
        slot = {n: k for k, n in enumerate(self.inputs)}
        flat = list(self.leaves)
        for i in self.tensor_pos:
            flat[i] = tensors[slot[self.names[i]]]
        kwargs = self.call.rebuild(flat, self.spec)
        for arg, read in self.read.items():
            if type(kwargs.get(arg)) is dict:
                kwargs[arg] = ReadKeys(kwargs[arg], read)
        return kwargs

    def consumed(self) -> dict[str, set[Any]]:
        """Per group of an earlier stage's outputs (``meta``, ``meta_in``), the top-level keys of it
        the stage read while traced: the Python values among them its graph may bake."""
        out: dict[str, set[Any]] = {}
        for arg, read in self.read.items():
            origin = self.call.origins[arg]
            for key in read:
                group = origin if isinstance(origin, str) else origin.get(key)
                if group is not None:
                    out.setdefault(group, set()).add(key)
        return out

    def tensor_outputs(self, out: Any) -> list[tuple[str, torch.Tensor]]:
        """The tensors among what the stage returned, by dotted name: the graph's outputs."""
        return [(n, v) for n, v in self.call.output_names(out) if isinstance(v, torch.Tensor)]


@attrs.frozen(eq=False)
class _Run:
    """A stage run once under the tracer: its graph, and what it returned as the step computed it."""

    gm: fx.GraphModule
    out: Any
    outputs: tuple[str, ...]  # the names of its tensor outputs, in the graph's output order
    probe: ProbeResult | None = None  # the memory its ops touched as it ran (a record only)
    recorded: bool = False


@attrs.frozen(eq=False)
class _TracedStage:
    """A stage traced: its graph, its real outputs (handed on to the step), and what each of its
    tensor outputs may alias by name (what the stages after it take as their inputs' aliases)."""

    graph: StageGraph
    out: Any
    output_aliases: Mapping[str, frozenset[str]]
    consumed: Mapping[str, set[Any]]  # per earlier stage's output group, the keys it read (``_StageArgs.consumed``)


def _trace_stage(call: StageCall, shared: Mapping[str, Any], owned: BufferMap, fake_mode: Any, *,
                 before: Iterable[StageGraph], carried: Mapping[str, frozenset[str]], recorded: bool) -> _TracedStage:
    """Trace ``call``: run it once under the tracer, name its inputs, gather what its graph goes
    on, analyse it (refusing writes to shared buffers), and build its :class:`StageGraph`."""
    args = _StageArgs.of(call)
    run = _run_stage(args, shared, fake_mode, recorded=recorded)
    # in a step that is not replayed no graph bakes the shapes or the Python values a stage returns:
    # they may change every step (the stages after it take them by name); its structure may not
    guard = OutputGuard.of(call.stage, run.out, backend=call.backend, values=call.replayed)
    _name_inputs(run.gm, args.inputs)
    facts = _stage_facts(call, args, run, shared, owned, carried, fake=fake_mode is not None)
    result = analysed(call.backend, call.stage, run.gm, facts, before=before, inputs=args.inputs, buffers=shared)
    graph = _stage_graph(args, run, facts, result, guard, fake=fake_mode is not None)
    return _TracedStage(graph, run.out, dict(zip(run.outputs, result.output_aliases, strict=True)), args.consumed())


class UntraceableStage(ReadfenceError, ValueError):
    """A stage that runs as Python, returning what a stage may, but whose ops the tracer cannot
    follow (torch's tracing holds no value of some tensor it makes: a quantized or a nested one,
    a sparse compressed one), named with its backend, its stage and torch's own words."""

    def __init__(self, backend: str, stage: str, error: BaseException) -> None:
        self.backend, self.stage = backend, stage
        words = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(
            f"backend {backend!r} stage {stage}: the tracer cannot follow an op of this stage ({type(error).__name__}: "
            f"{words[:300]}); the stage runs as Python, but its graph cannot be made. Keep the tensors a stage makes "
            f"plain (dense, strided, with data): a quantized, nested or sparse compressed tensor is made and used in "
            f"a kernel of your own (a torch.library op), or not at all")


def _run_stage(args: _StageArgs, shared: Mapping[str, Any], fake_mode: Any, *, recorded: bool) -> _Run:
    """The stage recorded as it runs (``_record``), else traced with ``make_fx``: the same graph.
    Where neither can follow it, the error is the stage's own, as the serial step would raise it
    (:func:`_untraceable`), never torch's from inside the tracer."""
    try:
        if not recorded:
            raise Unrecordable("make_fx asked for")
        return _recorded_run(args, shared, fake_mode)
    except Exception:  # what the record cannot hold, or the stage's own error: make_fx's trace, as always
        pass
    try:
        return _make_fx_run(args, fake_mode)
    except (ReadfenceError, TraceAborted):
        raise
    except Exception as error:
        raise _untraceable(args, fake_mode, error) from error


def _untraceable(args: _StageArgs, fake_mode: Any, error: BaseException) -> BaseException:
    """What to raise for a stage the tracer could not follow (``error``, torch's words): the stage
    run once more as plain Python, as the serial step runs it, names what it returned that a stage
    may not (``StageOutputError``, with backend, stage, key and line) or raises its own error; one
    that runs and returns what it may is :class:`UntraceableStage`."""
    call = args.call
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), \
                watch_threads(call.backend, call.stage.name, "the trace"):
            call.fn(**args.kwargs(args.args))
    except ReadfenceError as own:
        return own
    except Exception as own:  # the stage's own error (under fake tensors, torch's: no stage's)
        return own if fake_mode is None else UntraceableStage(call.backend, call.stage.name, own)
    return UntraceableStage(call.backend, call.stage.name, error)


def _recorded_run(args: _StageArgs, shared: Mapping[str, Any], fake_mode: Any) -> _Run:
    call, fake = args.call, fake_mode is not None

    @contextlib.contextmanager
    def recorded_in(recorder: GraphRecorder) -> Iterator[None]:
        # the stage run eagerly, its ops written down by ``recorder``: the tracer's escapes and
        # source lines (host reads at the dispatcher the recorder marks itself)
        with contextlib.ExitStack() as ctx:
            if fake_mode is not None:
                ctx.enter_context(fake_mode)
            ctx.enter_context(TraceMode(fake=fake, recorder=recorder))
            ctx.enter_context(watch_threads(call.backend, call.stage.name, "the trace"))
            yield

    gm, out, probe = record(lambda *t: call.fn(**args.kwargs(t)), list(args.args), args.inputs,
                            outputs=lambda out: [v for _, v in args.tensor_outputs(out)], context=recorded_in,
                            escape_op=OPAQUE_OP, shared=None if fake else shared, fake=fake)
    return _Run(gm, out, tuple(n for n, _ in args.tensor_outputs(out)), probe=probe, recorded=True)


def _make_fx_run(args: _StageArgs, fake_mode: Any) -> _Run:
    call, fake = args.call, fake_mode is not None
    ran: list[Any] = []  # what the stage returned: make_fx hands back the graph only

    def flat_fn(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with TraceMode(fake=fake), HostReads(fake=fake), watch_threads(call.backend, call.stage.name, "the trace"):
            out = call.fn(**args.kwargs(tensors))
        ran.append(out)
        return tuple(v for _, v in args.tensor_outputs(out))

    with _make_fx_context(fake_mode):
        gm = make_fx(flat_fn, tracing_mode="real")(*args.args)
    out = ran[-1]
    return _Run(gm, out, tuple(n for n, _ in args.tensor_outputs(out)))


@contextlib.contextmanager
def _make_fx_context(fake_mode: Any) -> Iterator[None]:
    with contextlib.ExitStack() as ctx:
        if fake_mode is not None:
            ctx.enter_context(fake_mode)
        else:
            # make_fx records a fake "val" per node; without a fake mode in the tracing
            # context it builds a new FakeTensorMode for every node (most of the tracing
            # time). Share one.
            from torch._guards import TracingContext, tracing
            from torch._subclasses.fake_tensor import FakeTensorMode

            ctx.enter_context(tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))))
            ctx.enter_context(_meta_values())
        ctx.enter_context(_through_compiled_functions())
        # the graph's Python code is made when something calls it, not at every recompile
        ctx.enter_context(_use_lazy_graph_module(True))
        yield


def _name_inputs(gm: fx.GraphModule, inputs: Sequence[str]) -> None:
    """Name each placeholder after its input (the calling convention of ``_program``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, dotted in zip(placeholders, inputs, strict=True):
        node._rename(_identifier(dotted))
        node.target = node.name
        node.meta[INPUT_KEY] = dotted
    gm.recompile()


def _stage_facts(call: StageCall, args: _StageArgs, run: _Run, shared: Mapping[str, Any], owned: BufferMap,
                 carried: Mapping[str, frozenset[str]], *, fake: bool) -> StageFacts:
    """What the analysis of the stage's graph goes on: what each input aliases (its memory, and
    what an earlier stage's analysis says: all there is under fake tensors, whose memory is only
    their storage's identity), its captured tensors, and the memory its nodes touched."""
    gm, buffers = run.gm, BufferMap.of(shared)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    initial = {node.name: buffers.touched(t) | carried.get(dotted, frozenset())
               for node, dotted, t in zip(placeholders, args.inputs, args.args, strict=True)}
    captured = tuple(captured_tensors(call.backend, call.stage, gm, buffers, owned))
    if fake:  # no memory under fake tensors
        return StageFacts(initial=initial, captured=captured, memory={}, copies=None, changed=(),
                          hidden=in_branches(gm, buffers))
    found = run.probe
    if found is None:
        memory_probe = MemoryProbe(gm, shared)
        memory_probe.run(*args.args)
        found = memory_probe.result
    else:  # a recorded stage was probed as it ran; its inputs touch what they hold
        for node, t in zip(placeholders, args.args):
            if buffers.touched_by(t):
                found.touched[node.name] = buffers.touched_by(t)
    return StageFacts(initial=initial, captured=captured, memory=found.touched, copies=frozenset(found.copies),
                      changed=tuple(found.changed), hidden=in_branches(gm, buffers), rebound=found.rebound)


def _stage_graph(args: _StageArgs, run: _Run, facts: StageFacts, result: Analysis, guard: OutputGuard, *,
                 fake: bool) -> StageGraph:
    call = args.call
    return StageGraph(
        stage=call.stage,
        graph=TracedGraph(gm=run.gm, inputs=args.inputs, outputs=run.outputs, recorded=run.recorded),
        analysis=StageAnalysis(reads=result.reads, unknown=result.unknown, opaque=result.opaque,
                               faithful=not result.escapes, captured=facts.captured, memory=facts.memory,
                               copies=facts.copies, hidden=facts.hidden, initial=facts.initial,
                               rebound=facts.rebound),
        hooks=StageHooks(
            eager=_EagerStage.of(call, args.names, args.leaves, args.spec, guard),
            guard=guard,
            # (not in a step that is not replayed: its graphs never run, and a rerun of one on the
            # example would pair its inputs with what the backend's own buffers hold now, from another step)
            example=args.args if facts.captured and not fake and not result.escapes and call.replayed else None,
            replayed=call.replayed,
        ),
    )


class _Tracer:
    """The interpreter that traces each stage into a :class:`StageGraph` and hands on its real
    outputs, as the step computed them."""

    def __init__(self, shared: Mapping[str, Any], owned: BufferMap, fake_mode: Any, recorded: bool = True) -> None:
        self.shared, self.owned, self.fake_mode, self.recorded = shared, owned, fake_mode, recorded
        self.stages: list[StageGraph] = []
        self.current: Stage | None = None  # the stage being traced
        self.carried: dict[str, frozenset[str]] = {}  # what each stage's outputs may alias, by name
        # per stage's output group, the keys a captured stage after it read: what graphs may bake
        self.consumed: dict[str, set[Any]] = {}

    def call(self, call: StageCall) -> Any:
        self.current = call.stage
        traced = _trace_stage(call, self.shared, self.owned, self.fake_mode, before=self.stages,
                              carried=self.carried, recorded=self.recorded)
        self.carried.update(traced.output_aliases)
        self.stages.append(traced.graph)
        if not traced.graph.runs_python:  # a capture: what it read of the stages before it is baked
            for group, keys in traced.consumed.items():
                self.consumed.setdefault(group, set()).update(keys)
        return traced.out

    def guarded(self) -> list[StageGraph]:
        """The stages traced, each output guard holding only the Python values a captured stage
        after it read (``OutputGuard.consuming``): no graph bakes the others."""
        out = []
        for s in self.stages:
            eager, guard = s.hooks.eager, s.hooks.guard
            if isinstance(eager, _EagerStage) and guard is not None:
                guard = guard.consuming(self.consumed.get(s.stage.outputs, ()))
                s = attrs.evolve(s, hooks=attrs.evolve(s.hooks, eager=attrs.evolve(eager, guard=guard), guard=guard))
            out.append(s)
        return out


def _fake_tree(tree: Any, fake_mode: Any, device: str) -> Any:
    def conv(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        with fake_mode:
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=device)

    return pytree.tree_map(conv, tree)


def trace_functions(
    backend: str,
    mode: ForwardMode,
    *,
    inputs: Mapping[str, Any],
    prepare_out_graph: Callable[..., object],
    prepare_in_graph: Callable[..., object],
    body: Callable[..., object],
    device: str = "cpu",
) -> Program:
    """Trace three stage functions over named input groups into a ``Program``.

    ``inputs`` maps group names (``shared`` required, then e.g. ``batch``, ``pools``,
    ``params``) to pytrees of tensors. The stages are called with keyword groups:
    ``prepare_out_graph(shared=, batch=)``, ``prepare_in_graph(shared=, batch=, meta=)`` and
    ``body(**inputs, meta=)``; each prepare stage returns a ``meta`` dict (the body sees
    ``{**out_graph_meta, **in_graph_meta}``, as ``core._model.prepare`` builds it), the body
    returns the logits. This is the engine under ``trace``; tests use it with toy functions.

    >>> import torch
    >>> shared = {"req_to_token": torch.zeros(2, 8, dtype=torch.int32), "seq_lens": torch.ones(2)}
    >>> prog = trace_functions(
    ...     "toy", ForwardMode.DECODE, inputs={"shared": shared, "batch": {}},
    ...     prepare_out_graph=lambda shared, batch: {"pt": shared["req_to_token"][:, :4]},
    ...     prepare_in_graph=lambda shared, batch, meta: {"lens": shared["seq_lens"][:1]},
    ...     body=lambda shared, batch, meta: meta["pt"].float().sum() + meta["lens"].sum())
    >>> prog.traced()  # out-of-graph outputs cross as copies; in-graph views are read in the body
    ReadEffect({'req_to_token': PRE_REPLAY, 'seq_lens': POST_REPLAY}, default=NONE)
    """
    fns = StepFunctions(prepare_out_graph, prepare_in_graph, body, backend)
    return trace_step(fns, mode, inputs, device=device)


def trace_step(fns: StepFunctions, mode: ForwardMode, inputs: Mapping[str, Any], *, device: str = "cpu",
               recorded: bool = True) -> Program:
    """Trace one step of ``fns`` on ``inputs`` (groups: ``shared`` required, then ``batch``,
    ``pools``, ``params``...) into a ``Program``: :func:`~readfence.core.eval_step` run by the
    tracing interpreter, each stage as the step hands it its arguments, recorded as it runs
    (``core._record``) or, where a record cannot hold it (or ``recorded`` is False), traced
    with ``make_fx``: the same graph. On a device other than CPU the inputs become fake tensors.
    """
    device = str(device)
    fake_mode = None
    groups = dict(inputs)
    if torch.device(device).type != "cpu":
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
        groups = {g: _fake_tree(t, fake_mode, device) for g, t in groups.items()}
    shared = groups.get("shared", {})
    owned = BufferMap.of(flatten_inputs(**{g: t for g, t in groups.items() if g != "shared"}))
    tracer = _Tracer(shared, owned, fake_mode, recorded)
    aborted = None
    try:
        with collection_paused():
            eval_step(tracer, fns, groups)
    except TraceAborted as e:
        aborted = f"stage {tracer.current}: {e.why}"
    # (a trace that stopped does not know what the stages it did not reach read: every value held)
    stages = tracer.stages if aborted is not None else tracer.guarded()
    _forget_nested_dynamo(stages)
    rerun = fake_mode is None and aborted is None and any(isinstance(c.matches, Unmatched) for s in stages for c in s.analysis.captured)
    if rerun:
        stages = mark_persistent(stages, fns, groups)
    stages = fresh_literals_dropped(stages, rerun)
    return Program(
        backend=fns.backend, mode=mode, device=device, buffers=tuple(shared.keys()), stages=tuple(stages),
        aborted=aborted,
    )
