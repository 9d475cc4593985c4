"""The adapter: an engine's stateful backend object, lifted into a readfence backend value.

``adapt(factory)`` builds the object over a readfence state (``factory(runner)``, the runner
being :class:`~readfence.engine.ModelRunnerView`) and returns an :class:`EngineBackend`: a
:class:`~readfence.backends.Backend` whose three stages call the object's contract methods,

* ``prepare_out_graph``: ``init_forward_metadata_out_graph(forward_batch, in_capture=False)``
  in a mode the engine replays, the eager entry point ``init_forward_metadata(forward_batch)``
  in one it runs eagerly (EXTEND, and every mode of a backend the engine never replays), when
  the object has it (in EXTEND also ``resolve_prefill_shared_read_ends(..., build_snapshot=True)``
  when the object has it: the prefill snapshot is built before the forward, out of the graph);
* ``prepare_in_graph``: ``init_forward_metadata_in_graph(forward_batch)`` (nothing after the
  eager entry point, which did both);
* ``attend`` (each layer of the body): ``forward(q, k, v, layer, forward_batch)``,

with the metadata the object keeps on ``self`` lifted between them (``_lift``), and whose
declaration is the object's scalar ``shared_read_ends(mode)`` made per buffer: the same end
for every shared buffer it may read. The capture-time calls run once, on the bound state and
outside any trace, as the engine's graph runner makes them: ``init_cuda_graph_state(max_bs,
max_num_tokens)`` after construction, and ``init_forward_metadata_out_graph(forward_batch,
in_capture=True)`` before the first step of each replayed mode and batch size. A wrapper's
children are found wherever it keeps them (``_tree``). An :class:`~readfence.engine.EngineProfile`
says what the engine's values are: its mode enum, layers, runtime context, buffers.

The object keeps references to the state it was built over, so an :class:`EngineBackend` is
*bound* to that state (``.state``): audit it, lower it and run it there (pass ``state=engine.state``
and ``cfg=engine.cfg``), or ``engine.bind(other)`` to build it again over another state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from readfence.backends import MODES, Backend
from readfence.core import (
    SHARED_BUFFERS,
    ForwardMode,
    ModelConfig,
    ReadObserver,
    StageWriteError,
)
from readfence.core.internal import (
    BufferMap,
    check_buffers,
    check_mode,
    example_step,
    model_config,
    refuse_writes,
    span_of,
)
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import make_state

from ._binding import Binding, Factory, State, Tensors, _objects
from ._contract import (
    PREFILL,
    ContractError,
    EngineError,
    call,
    check_contract,
    forward_method,
    read_end_of,
    stage_of_method,
)
from ._lift import Lifter, leaves, path_text, restore
from ._profile import EngineProfile
from ._tree import Path, children, step_text
from ._view import ForwardBatch, ModelRunnerView, absent, check_layout, check_state

#: Why the out-of-graph stage of an engine backend runs as Python (what the trace records).
EAGER = "eager: init_forward_metadata_out_graph runs its Python before every replay"
#: The engine's eager entry point (out of graph and in graph in one call).
EAGER_ENTRY = "init_forward_metadata"
#: The stage output holding the runner's copy of the batch's lengths (an engine without shared ``seq_lens``).
RUNNER_LENS = "runner/seq_lens"


def _factory_name(factory: object) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def _check_tree(root: Any, name: str) -> None:
    stack: list[tuple[Any, str]] = [(root, name)]
    seen: set[int] = set()
    while stack:
        obj, who = stack.pop()
        check_contract(obj, who)
        for step, child in children(obj, seen):
            stack.append((child, f"{who}.{step_text(step)} ({type(child).__name__})"))



@contextlib.contextmanager
def watched_call(shared: Mapping[str, Tensor], who: str, method: str, what: str, *,
                 also: Mapping[str, Tensor] | None = None) -> Iterator[None]:
    """The block, a call of the engine's code ``method`` that readfence makes outside any run of
    the step (its capture-time call, its warm-up, ``shared_read_ends``, the prefill's resolution,
    ``init_cuda_graph_state``), under a read observer of the live shared buffers (and ``also``,
    the state a call's forward batch is over): a write of one is refused (``StageWriteError``, in
    the method's stage, naming ``what`` saw it) as a write any run of the step saw is. Where one of
    readfence's modes is on, a run watches the call already: nothing more is done."""
    if torch._C._len_torch_dispatch_stack():
        yield
        return
    given = [shared, *([also] if also is not None else [])]
    observer = ReadObserver(BufferMap.of(shared).union([BufferMap.of(m) for m in given[1:]]),
                            held=[t for m in given for t in m.values()])
    with observer, observer.stage(stage_of_method(method).name):
        yield
    refuse_writes(who, ((what, a) for a in observer.accesses))


def _capture_state(root: Any, who: str, cfg: ModelConfig, shared: Mapping[str, Tensor]) -> None:
    """The graph runner's ``init_cuda_graph_state(max_bs, max_num_tokens)``, where the class has one
    (the base class's raises ``NotImplementedError``: a backend that keeps no graph state)."""
    fn = getattr(root, "init_cuda_graph_state", None)
    if not callable(fn):
        return
    try:
        with watched_call(shared, who, "init_cuda_graph_state", "the engine's call of init_cuda_graph_state"):
            fn(max_bs=cfg.max_reqs, max_num_tokens=cfg.max_reqs * cfg.max_ctx)
    except NotImplementedError:
        return
    except StageWriteError:
        raise
    except Exception as e:
        raise EngineError(f"{who}.init_cuda_graph_state raised {type(e).__name__}: {e}",
                          method="init_cuda_graph_state") from e


def adapt(
    factory: Factory,
    *,
    buffers: Mapping[str, str | None] | None = None,
    cfg: ModelConfig | None = None,
    state: State | None = None,
    name: str | None = None,
    reads: Iterable[str] | None = None,
    server_args: Mapping[str, object] | None = None,
    profile: EngineProfile | None = None,
) -> EngineBackend:
    """Lift the engine backend ``factory(runner)`` builds into a readfence backend.

    ``factory(runner) -> backend object``: a backend class or any callable taking a
    :class:`~readfence.engine.ModelRunnerView` (``runner.req_to_token_pool.req_to_token``,
    ``runner.token_to_kv_pool``, ``runner.model_config``, ``runner.device``,
    ``runner.server_args``...). ``buffers`` names where the engine finds each shared buffer
    (``{"req_to_token": "req_to_token_pool.req_to_token", ...}``: dotted paths on the runner and
    on every forward batch; defaults in :data:`~readfence.engine.DEFAULT_LAYOUT`). ``state`` is the
    state to build it over (fresh by default, for ``cfg``); ``reads`` the shared buffers its
    scalar declaration covers (every one by default); ``server_args`` become
    ``runner.server_args``; ``profile`` what the engine's contract looks like
    (:class:`~readfence.engine.EngineProfile`: its mode enum, layers, runtime context, the buffers
    it does not have; its ``buffers`` come before ``buffers``). A factory that raises, an object
    missing a contract method and a declaration that is not one of the four names fail here,
    naming what was wrong.

    >>> from readfence.engine.reference import TritonBackend
    >>> engine = adapt(TritonBackend)
    >>> engine.read_effect(ForwardMode.DECODE)["req_to_token"], str(engine)
    (<ReadEnd.IN_REPLAY: 2>, 'TritonBackend')
    """
    if not callable(factory):
        raise TypeError(f"factory must be callable (runner) -> backend object, got {factory!r} "
                        f"({type(factory).__name__})")
    cfg = model_config(cfg)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a readfence.core.ModelConfig, got {cfg!r} ({type(cfg).__name__})")
    profile = EngineProfile() if profile is None else profile
    if not isinstance(profile, EngineProfile):
        raise TypeError(f"profile must be a readfence.engine.EngineProfile, got {profile!r} "
                        f"({type(profile).__name__})")
    if buffers is not None and not isinstance(buffers, Mapping):
        raise TypeError(f"buffers must be a mapping {{shared buffer: dotted path}}, got {buffers!r} "
                        f"({type(buffers).__name__})")
    layout = check_layout({**profile.buffers, **(buffers or {})})
    if isinstance(reads, str):
        raise TypeError(f"reads must be a list of buffer names, got {reads!r} (str); write [{reads!r}]")
    lacks = absent(layout)
    covered = tuple(b for b in (SHARED_BUFFERS if reads is None else check_buffers(reads, SHARED_BUFFERS, "reads"))
                    if b not in lacks)
    fname = _factory_name(factory)
    state = make_state(cfg) if state is None else state
    check_state(cfg, state, f"adapt({fname})")
    runner = ModelRunnerView(cfg, state, layout, server_args)
    with profile.context(runner):
        fields = _engine_values(profile, runner)
        try:
            root = factory(runner)
        except Exception as e:
            raise EngineError(f"the factory {fname}(runner) raised {type(e).__name__}: {e}") from e
        if root is None or isinstance(root, (bool, int, float, str, Tensor)):
            raise ContractError(f"the factory {fname}(runner) returned {root!r} ({type(root).__name__}), "
                                f"not an engine backend object")
        label = type(root).__name__ if name is None else name
        if not isinstance(label, str) or not label:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        _check_tree(root, label)
        modes = profile.modes_for(root)
        binding = Binding(factory, layout, cfg, state, dict(server_args or {}), runner, root, profile, modes, name,
                          fields)
        if binding.graphs:
            _capture_state(root, label, cfg, state["shared"])
        _own_buffers(root, state)
        return _node(binding, (), label, covered, set())


_NOTHING = object()

#: The prefix of the pool entries that are an engine object's own persistent buffers.
OWN = "engine/"


def _own_buffers(root: Any, state: State) -> None:
    """The tensors the object tree holds once built (with its graph state: SGLang's ``kv_indptr``,
    ``cuda_graph_kv_indices``...), added to the state's pools as ``engine/<path>``: they are the
    backend's own state, kept from step to step like the KV cache, not constants a trace made. A
    view of a shared buffer, a pool or a parameter is that, and is not added."""
    known = [span_of(t) for group in ("shared", "pools", "params") for t in state[group].values()]
    seen: list[Any] = []
    for path, value in leaves(root):
        if not isinstance(value, Tensor) or value.device.type == "meta":
            continue
        span = span_of(value)
        if span is None or any(k is not None and k.overlaps(span) for k in known + seen):
            continue
        seen.append(span)
        state["pools"][OWN + path_text(path).replace(".", "/")] = value


def _engine_values(profile: EngineProfile, runner: ModelRunnerView) -> Mapping[str, Callable[[], Any]]:
    """The profile's completion of the runner view, run; the engine's forward-batch fields."""
    for hook in ("runner", "batch_fields"):
        fn = getattr(profile, hook)
        if fn is None:
            continue
        try:
            if hook == "runner":
                fn(runner)
            else:
                return dict(fn())
        except Exception as e:
            raise EngineError(f"the profile's {hook} hook raised {type(e).__name__}: {e}") from e
    return {}


def _declaration(binding: Binding, obj: Any, who: str, reads: tuple[str, ...]) -> tuple[ReadEffect, ...]:
    # a buffer the engine does not have is copied by its graph runner before the replay and released
    # with the rest: the engine's one event covers it too
    covered = reads + absent(binding.layout)
    table = []
    for mode in MODES:
        em = binding.modes.engine(mode)
        with watched_call(binding.state["shared"], who, "shared_read_ends", "the engine's call of shared_read_ends"):
            value = call(obj, who, "shared_read_ends", em, obj.shared_read_ends, em)
        table.append(ReadEffect.uniform(covered, read_end_of(value, f"{who}.shared_read_ends({mode.name})")))
    return tuple(table)


def _node(binding: Binding, path: Path, label: str, reads: tuple[str, ...], seen: set[int]) -> EngineBackend:
    obj = binding.object_at(path)
    found = children(obj, seen)  # breadth first: a child is named by the nearest wrapper that keeps it
    kids = tuple((step_text(step), _node(binding, (*path, step), type(child).__name__, reads, seen))
                 for step, child in found)
    return EngineBackend(binding, path, label, reads, _declaration(binding, obj, label, reads), kids)


@attrs.frozen(eq=False, repr=False)
class EngineBackend(Backend):
    """An engine's backend object as a readfence backend, bound to the state it was built over.

    Build with :func:`adapt`. Its effect table is the object's ``shared_read_ends(mode)`` per
    buffer; its children are the ``attn_backend_list`` of a wrapper; ``object`` is the engine
    object, ``state`` and ``cfg`` what to run it on.
    """

    binding: Binding
    path: Path
    label: str
    reads: tuple[str, ...]
    declaration: tuple[ReadEffect, ...]
    kids: tuple[tuple[str, EngineBackend], ...] = ()
    _table: Any = attrs.field(init=False, default=None)
    _hash: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._finish(tuple(self.declaration))

    # -- the backend value ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.label

    def children(self) -> tuple[tuple[str, Backend], ...]:
        return self.kids

    def _shallow(self) -> tuple[Any, ...]:
        return (self.binding.serial, self.path, self.label, self.declaration)

    def _spec_parts(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        return self.label, ()

    # -- what it is bound to ----------------------------------------------------------------
    @property
    def object(self) -> Any:
        """The engine backend object this node runs."""
        return self.binding.object_at(self.path)

    @property
    def state(self) -> State:
        """The state the object was built over (``shared``, ``pools``, ``params``)."""
        return self.binding.state

    @property
    def cfg(self) -> ModelConfig:
        return self.binding.cfg

    @property
    def runner(self) -> ModelRunnerView:
        return self.binding.runner

    def bind(self, state: State | None = None) -> EngineBackend:
        """The same node, its object tree built again by the factory over ``state`` (fresh by default)."""
        b = self.binding
        root = adapt(b.factory, buffers=b.layout, cfg=b.cfg, state=state, name=b.name, reads=self.reads,
                     server_args=b.server_args, profile=b.profile)
        node = root
        for step in self.path:
            node = dict(node.kids)[step_text(step)]
        return node

    def redeclared(self, mode: ForwardMode, end: ReadEnd) -> EngineBackend:
        """A copy (without children) whose declaration in ``mode`` is ``end`` for every buffer it covers."""
        table = list(self.declaration)
        table[MODES.index(check_mode(mode))] = ReadEffect.uniform(self.reads + absent(self.binding.layout), end)
        return attrs.evolve(self, declaration=tuple(table), kids=())

    def who(self) -> str:
        """The object's place in the wrapper tree, for messages."""
        return self.label if not self.path else f"{type(self.binding.root).__name__}" + "".join(
            f".{step_text(step)}" for step in self.path) + f" ({self.label})"

    def replayed(self, mode: ForwardMode) -> bool:
        """Whether the engine replays this node's step in ``mode`` from a captured graph (else it
        runs it eagerly, and publishes no read end from its declaration but the prefill's)."""
        return self.binding.replayed(self.path, check_mode(mode))

    def _invoke(self, method: str, em: Any, fn: Callable[..., Any], *args: Any, captured: bool = False,
                alone: bool = False, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a contract method, in the engine's runtime context; ``captured``: a
        call the engine makes while it captures a graph (the graph's code runs once, then, in the engine);
        ``alone``: a call readfence makes outside any run of the step, watched (:func:`watched_call`)."""
        b = self.binding
        watched = contextlib.nullcontext() if not alone else watched_call(
            b.state["shared"], self.who(), method,
            f"the engine's {'capture-time call' if captured else 'call'} of {method} outside any step")
        with b.profile.context(b.runner), b.profile.capture(b.runner) if captured else contextlib.nullcontext(), watched:
            return call(self.object, self.who(), method, em, fn, *args, **kwargs)

    # -- the stages -------------------------------------------------------------------------
    def _call(self, mode: ForwardMode, shared: Tensors, batch: Tensors, pools: Mapping[str, Tensor] | None,
              meta: Tensors | None = None) -> tuple[Any, Any, ForwardBatch]:
        b = self.binding
        table = shared["req_to_token"]
        if tuple(table.shape) != (b.cfg.max_reqs, b.cfg.max_ctx):
            raise ContractError(f"{self.who()} was adapted for max_reqs={b.cfg.max_reqs}, max_ctx={b.cfg.max_ctx}, "
                                f"but runs on a page table of {tuple(table.shape)}: pass cfg=engine.cfg "
                                f"and state=engine.state")
        em = b.modes.engine(mode)
        lens = None if meta is None or "seq_lens" not in absent(b.layout) else meta.get(RUNNER_LENS)
        fb = b.forward_batch(mode, shared, batch, b.state["pools"] if pools is None else pools, lens)
        return self.object, em, fb

    def _capture(self, mode: ForwardMode, batch_size: int) -> bool:
        """The graph runner's capture-time ``init_forward_metadata_out_graph(forward_batch,
        in_capture=True)``, once per mode and batch size, on the bound state and outside any trace,
        then its warm-up: the replay-time calls once (``init_forward_metadata_out_graph`` and
        ``init_forward_metadata_in_graph``), where a backend allocates its static metadata buffers
        on first use. In a mode the engine runs eagerly there is no capture, only the warm-up (the
        engine's warm-up batch): the eager calls once (:meth:`_warm_up`). Returns whether it ran now."""
        b = self.binding
        key = (self.path, mode, batch_size)
        if key in b.refused:
            raise b.refused[key]
        if key in b.captured:
            return False
        b.captured.add(key)
        try:
            return self._capture_now(mode, batch_size, key)
        except StageWriteError as e:
            b.refused[key] = e  # (a tracer that falls back to another way of tracing calls again)
            raise

    def _capture_now(self, mode: ForwardMode, batch_size: int, key: tuple[Any, ...]) -> bool:
        b = self.binding
        step = example_step(b.cfg, mode, batch_size)
        # a warm-up batch of its own (its lengths agree with its batch); a capture pads over the live state
        eager = not b.replayed(self.path, mode)
        example, shared = step.batch, step.shared if eager else b.state["shared"]
        lens = shared["seq_lens"].index_select(0, example["req_pool_indices"]) if "seq_lens" in absent(b.layout) else None
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            fb = b.forward_batch(mode, shared, example, b.state["pools"], lens)
            if eager:  # (its forward batch is over an example state of its own: watched too)
                with watched_call(b.state["shared"], self.who(), EAGER_ENTRY, "the engine's warm-up call",
                                  also=shared):
                    self._warm_up(mode, fb)
                return True
        obj = self.object
        before = {id(o): dict(vars(o)) for o in _objects(obj) if hasattr(o, "__dict__")}
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            self._invoke("init_forward_metadata_out_graph", fb.forward_mode, obj.init_forward_metadata_out_graph, fb,
                         captured=True, alone=True, in_capture=True)
        b.frozen[key] = [(o, name, value) for o in _objects(obj) if hasattr(o, "__dict__")
                         for name, value in vars(o).items() if before.get(id(o), {}).get(name, _NOTHING) is not value]
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            self._invoke("init_forward_metadata_out_graph", fb.forward_mode, obj.init_forward_metadata_out_graph, fb,
                         alone=True, in_capture=False)
            self._invoke("init_forward_metadata_in_graph", fb.forward_mode, obj.init_forward_metadata_in_graph, fb,
                         captured=True, alone=True)
        self._recall(mode, batch_size)
        return True

    def _warm_up(self, mode: ForwardMode, fb: ForwardBatch) -> None:
        """The metadata calls of a step the engine runs eagerly, once, before its first step (an
        engine's warm-up batch): a buffer the backend allocates on first use and refills in place
        on every later step is then the object's own state, as on every later step, not a per-step
        output of the first one (nor a constant a trace of it baked)."""
        obj = self.object
        if self._eager_method(mode) == EAGER_ENTRY:
            self._invoke(EAGER_ENTRY, fb.forward_mode, obj.init_forward_metadata, fb)
            return
        self._invoke("init_forward_metadata_out_graph", fb.forward_mode, obj.init_forward_metadata_out_graph, fb,
                     in_capture=False)
        self._invoke("init_forward_metadata_in_graph", fb.forward_mode, obj.init_forward_metadata_in_graph, fb)

    def _recall(self, mode: ForwardMode, batch_size: int) -> None:
        """What the capture-time call of ``mode`` and ``batch_size`` left on the objects, put back as a
        step begins and as its in-graph part begins: the code a graph replays read it while the graph
        was captured (``self.forward_metadata`` over the graph's buffers), whatever another mode's
        capture or step left there since (each layer's ``forward`` then sees what this step's
        ``init_forward_metadata_in_graph`` left, as in the capture)."""
        for o, name, value in self.binding.frozen.get((self.path, mode, batch_size), ()):
            object.__setattr__(o, name, value)

    def _bases(self, shared: Tensors, pools: Mapping[str, Tensor] | None) -> dict[str, list[Tensors]]:
        bound = self.binding.state
        # (the object's own buffers are held by it: a view of one is put back as that view of it)
        pool: list[Tensors] = [{k: t for k, t in p.items() if not k.startswith(OWN)}
                               for p in (pools, bound["pools"]) if p is not None]
        return {"shared": [shared, bound["shared"]], "pool": pool}

    def _runner_copy(self, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        """What the engine's graph runner copies out of the shared buffers it does not share with the
        backend (the batch's ``seq_lens``), before the replay."""
        if "seq_lens" not in absent(self.binding.layout):
            return {}
        return {RUNNER_LENS: shared["seq_lens"].index_select(0, batch["req_pool_indices"])}

    def _restore(self, obj: Any, tags: tuple[str, ...], mode: ForwardMode, fb: ForwardBatch, shared: Tensors,
                 pools: Mapping[str, Tensor] | None, meta: Tensors) -> None:
        records = [r for tag in tags for r in self.binding.records.get((self.path, tag, mode, fb.batch_size), [])]
        if records:
            bases = {"shared": shared, "pool": self.binding.state["pools"] if pools is None else pools}
            restore(obj, records, meta, bases, fb, self.who())

    def _lifted(self, tag: str, mode: ForwardMode, fb: ForwardBatch, lifter: Lifter, method: str) -> dict[str, Tensor]:
        key = (self.path, tag, mode, fb.batch_size)
        shapes = {k: tuple(v.shape) for k, v in lifter.outputs.items()}
        first = self.binding.shapes.setdefault(key, shapes)
        if first != shapes and self.replayed(mode):  # a replayed graph reads static buffers of one shape
            changed = sorted(set(first) ^ set(shapes)) or [k for k in shapes if shapes[k] != first[k]]
            raise EngineError(
                f"{self.who()}.{method} keeps per-step metadata {changed[0]!r} of shape "
                f"{shapes.get(changed[0], 'absent')} now, {first.get(changed[0], 'absent')} on its first call in "
                f"{mode.name} at batch size {fb.batch_size}: what crosses into a replayed graph keeps one shape "
                f"per batch size (pad it, as graph runners do)")
        self.binding.records[key] = lifter.records
        return dict(lifter.outputs)

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        if check_mode(mode) is ForwardMode.IDLE:
            return {}
        copied = self._runner_copy(shared, batch)
        obj, em, fb = self._call(mode, shared, batch, None, copied)
        # the engine runs this method's Python before every replay (host work, pointer swaps,
        # plans kept on self): marked so, the lowering runs it rather than its traced graph
        torch.ops.readfence.opaque.default(torch.empty(0, device=fb.input_ids.device), EAGER)
        self._recall(mode, fb.batch_size)
        lifter = Lifter("out", self._bases(shared, None))
        who = self.who()
        method = self._eager_method(mode)
        with lifter.around(obj):
            # inside the lift: what the capture-time call leaves on the object is classified as the
            # replay-time call's would be (a kept view of the page table stays a view of the live one);
            # what it allocated and this call refills in place is the object's own buffer
            if self._capture(mode, fb.batch_size):
                lifter.settle(obj)
            if method == EAGER_ENTRY:
                self._invoke(method, em, obj.init_forward_metadata, fb)
            else:
                self._invoke(method, em, obj.init_forward_metadata_out_graph, fb, in_capture=False)
            if mode is ForwardMode.EXTEND and callable(getattr(obj, PREFILL, None)):
                end = self._invoke(PREFILL, em, getattr(obj, PREFILL), fb, num_qo_tokens=fb.num_tokens,
                                   build_snapshot=True)
                self.binding.prefill[(self.path, fb.batch_size)] = read_end_of(end, f"{who}.{PREFILL}")
        return {**self._lifted("out", mode, fb, lifter, method), **copied}

    def _eager_method(self, mode: ForwardMode) -> str:
        """``init_forward_metadata`` where the engine runs ``mode`` eagerly and the object has it,
        else ``init_forward_metadata_out_graph``."""
        if not self.replayed(mode) and callable(getattr(self.object, EAGER_ENTRY, None)):
            return EAGER_ENTRY
        return "init_forward_metadata_out_graph"

    def prepare_in_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        if check_mode(mode) is ForwardMode.IDLE:
            return {}
        obj, em, fb = self._call(mode, shared, batch, None, meta)
        self._recall(mode, fb.batch_size)
        self._restore(obj, ("out",), mode, fb, shared, None, meta)
        lifter = Lifter("in", self._bases(shared, None), meta)
        if self._eager_method(mode) == EAGER_ENTRY:  # the eager entry point did this stage's work too
            return {}
        with lifter.around(obj):
            self._invoke("init_forward_metadata_in_graph", em, obj.init_forward_metadata_in_graph, fb,
                         captured=self.replayed(mode))
        return self._lifted("in", mode, fb, lifter, "init_forward_metadata_in_graph")

    def attend(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        if check_mode(mode) is ForwardMode.IDLE:
            return q.new_zeros(q.shape)
        obj, em, fb = self._call(mode, shared, batch, pools, meta)
        self._restore(obj, ("out", "in"), mode, fb, shared, pools, meta)
        method, fn = forward_method(obj, mode is ForwardMode.DECODE)
        who = self.who()
        out = self._invoke(method, em, fn, q, k, v, self.binding.layer(layer), fb, save_kv_cache=True,
                           captured=self.replayed(mode))
        if not isinstance(out, Tensor) or out.numel() != q.numel():
            shown = tuple(out.shape) if isinstance(out, Tensor) else f"{out!r} ({type(out).__name__})"
            raise EngineError(f"{who}.{method} returned {shown} in {em.name}; expected a tensor of "
                              f"{q.shape[0]} tokens x {q.shape[1]} heads x {q.shape[2]} dims "
                              f"([T, H * D] or [T, H, D])")
        return out.reshape(q.shape)

    # -- the per-batch prefill resolution -------------------------------------------------------
    def prefill_end(self, batch: Tensors) -> ReadEnd | None:
        """What ``resolve_prefill_shared_read_ends(forward_batch, num_qo_tokens=T,
        build_snapshot=False)`` says for an EXTEND batch (host tensors), or ``None`` when the
        object has no such method. It runs on the host before the step, over the bound state:
        it may look at the batch's sizes and flags, not at the shared buffers' contents."""
        obj = self.object
        fn = getattr(obj, PREFILL, None)
        if not callable(fn):
            return None
        b = self.binding
        em = b.modes.engine(ForwardMode.EXTEND)
        lens = self._runner_copy(self.state["shared"], batch).get(RUNNER_LENS)
        fb = b.forward_batch(ForwardMode.EXTEND, self.state["shared"], batch, self.state["pools"], lens, spec=False)
        end = self._invoke(PREFILL, em, fn, fb, alone=True, num_qo_tokens=fb.num_tokens, build_snapshot=False)
        return read_end_of(end, f"{self.who()}.{PREFILL}")

    def declared_end(self, mode: ForwardMode) -> ReadEnd:
        """The object's scalar declaration in ``mode``, asked now (``shared_read_ends``)."""
        obj, em = self.object, self.binding.modes.engine(check_mode(mode))
        # (not watched again: asked every step of a loop, it was watched in every mode when adapted)
        value = self._invoke("shared_read_ends", em, obj.shared_read_ends, em)
        return read_end_of(value, f"{self.who()}.shared_read_ends({em.name})")

    def __repr__(self) -> str:
        return f"<EngineBackend {self.who()}>"


def check_engine(engine: object) -> EngineBackend:
    """``engine`` if it is an adapted backend (:func:`adapt`'s result); else a ``TypeError`` that
    names the bad value and its type, and says how to adapt it.

    >>> check_engine("trtllm_mha")
    Traceback (most recent call last):
    ...
    TypeError: engine must be an adapted backend, got 'trtllm_mha' (str); adapt the engine's backend class first: readfence.engine.adapt(BackendClass)
    """
    if isinstance(engine, EngineBackend):
        return engine
    # the likely slip is passing the engine's class itself: name it in the fix
    cls = engine.__name__ if isinstance(engine, type) else "BackendClass"
    raise TypeError(f"engine must be an adapted backend, got {engine!r} ({type(engine).__name__}); adapt the "
                    f"engine's backend class first: readfence.engine.adapt({cls})")
