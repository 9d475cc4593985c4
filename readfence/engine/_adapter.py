"""The adapter: an engine's stateful backend object, lifted into a readfence backend value.

``adapt(factory)`` builds the object over a readfence state (``factory(runner)``, the runner
being :class:`~readfence.engine.ModelRunnerView`) and returns an :class:`EngineBackend`: a
:class:`~readfence.backends.Backend` whose three stages call the object's contract methods,

* ``prepare_out_graph``: ``init_forward_metadata_out_graph(forward_batch, in_capture=False)``
  (in EXTEND also ``resolve_prefill_shared_read_ends(..., build_snapshot=True)`` when the
  object has it: the prefill snapshot is built before the forward, out of the graph);
* ``prepare_in_graph``: ``init_forward_metadata_in_graph(forward_batch)``;
* ``attend`` (each layer of the body): ``forward(q, k, v, layer, forward_batch)``,

with the metadata the object keeps on ``self`` lifted between them (``_lift``), and whose
declaration is the object's scalar ``shared_read_ends(mode)`` made per buffer: the same end
for every shared buffer it may read. A wrapper's ``attn_backend_list`` are its children.

The object keeps references to the state it was built over, so an :class:`EngineBackend` is
*bound* to that state (``.state``): audit it, lower it and run it there (pass ``state=engine.state``
and ``cfg=engine.cfg``), or ``engine.bind(other)`` to build it again over another state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.backends import MODES, Backend
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.core.internal import check_buffers, check_mode
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import make_state

from ._contract import PREFILL, ContractError, EngineError, EngineMode, call, check_contract, forward_method, read_end_of
from ._lift import Lifter, Record, restore
from ._view import AttentionLayer, ForwardBatch, ModelRunnerView, check_layout, check_state

Factory = Callable[[ModelRunnerView], Any]

#: Why the out-of-graph stage of an engine backend runs as Python (what the trace records).
EAGER = "eager: init_forward_metadata_out_graph runs its Python before every replay"
State = dict[str, dict[str, Tensor]]
Tensors = Mapping[str, Tensor]


def _factory_name(factory: object) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__name__


@attrs.define(eq=False)
class Binding:
    """One engine object tree built over one state, and what the adapter notes while it runs."""

    factory: Factory
    layout: dict[str, str]
    cfg: ModelConfig
    state: State
    server_args: dict[str, object]
    runner: ModelRunnerView
    root: Any
    name: str | None = None  # the root's label when adapt was given one
    # the per-step metadata lifted from each (node, stage, mode, batch size)
    records: dict[tuple[tuple[int, ...], str, ForwardMode, int], list[Record]] = attrs.Factory(dict)
    # what resolve_prefill_shared_read_ends returned while building the snapshot, per (node, batch size)
    prefill: dict[tuple[tuple[int, ...], int], ReadEnd] = attrs.Factory(dict)
    layers: dict[int, AttentionLayer] = attrs.Factory(dict)
    # the shapes of each lifted output on its first call (they cross into static buffers)
    shapes: dict[tuple[tuple[int, ...], str, ForwardMode, int], dict[str, tuple[int, ...]]] = attrs.Factory(dict)

    def object_at(self, path: tuple[int, ...]) -> Any:
        obj = self.root
        for i in path:
            obj = obj.attn_backend_list[i]
        return obj

    def layer(self, layer_id: int) -> AttentionLayer:
        if layer_id not in self.layers:
            self.layers[layer_id] = AttentionLayer(self.cfg, layer_id)
        return self.layers[layer_id]


def _check_tree(root: Any, name: str) -> None:
    stack: list[tuple[Any, str]] = [(root, name)]
    while stack:
        obj, who = stack.pop()
        check_contract(obj, who)
        for i, child in enumerate(getattr(obj, "attn_backend_list", None) or ()):
            stack.append((child, f"{who}.attn_backend_list[{i}] ({type(child).__name__})"))


def adapt(
    factory: Factory,
    *,
    buffers: Mapping[str, str] | None = None,
    cfg: ModelConfig | None = None,
    state: State | None = None,
    name: str | None = None,
    reads: Iterable[str] | None = None,
    server_args: Mapping[str, object] | None = None,
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
    ``runner.server_args``. A factory that raises, an object missing a contract method and a
    declaration that is not one of the four names fail here, naming what was wrong.

    >>> from readfence.engine.reference import TritonBackend
    >>> engine = adapt(TritonBackend)
    >>> engine.read_effect(ForwardMode.DECODE)["req_to_token"], str(engine)
    (<ReadEnd.IN_REPLAY: 2>, 'TritonBackend')
    """
    if not callable(factory):
        raise TypeError(f"factory must be callable (runner) -> backend object, got {factory!r} "
                        f"({type(factory).__name__})")
    cfg = ModelConfig() if cfg is None else cfg
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a readfence.core.ModelConfig, got {cfg!r} ({type(cfg).__name__})")
    layout = check_layout(buffers)
    covered = SHARED_BUFFERS if reads is None else check_buffers(reads, SHARED_BUFFERS, "reads")
    if isinstance(reads, str):
        raise TypeError(f"reads must be a list of buffer names, got {reads!r} (str); write [{reads!r}]")
    fname = _factory_name(factory)
    state = make_state(cfg) if state is None else state
    check_state(cfg, state, f"adapt({fname})")
    runner = ModelRunnerView(cfg, state, layout, server_args)
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
    binding = Binding(factory, layout, cfg, state, dict(server_args or {}), runner, root, name)
    return _node(binding, (), label, tuple(covered))


def _declaration(obj: Any, who: str, reads: tuple[str, ...]) -> tuple[ReadEffect, ...]:
    table = []
    for mode in MODES:
        em = EngineMode.of(mode)
        value = call(obj, who, "shared_read_ends", em, obj.shared_read_ends, em)
        table.append(ReadEffect.uniform(reads, read_end_of(value, f"{who}.shared_read_ends({mode.name})")))
    return tuple(table)


def _node(binding: Binding, path: tuple[int, ...], label: str, reads: tuple[str, ...]) -> EngineBackend:
    obj = binding.object_at(path)
    kids = tuple((f"attn_backend_list[{i}]", _node(binding, (*path, i), type(child).__name__, reads))
                 for i, child in enumerate(getattr(obj, "attn_backend_list", None) or ()))
    return EngineBackend(binding, path, label, reads, _declaration(obj, label, reads), kids)


@attrs.frozen(eq=False, repr=False)
class EngineBackend(Backend):
    """An engine's backend object as a readfence backend, bound to the state it was built over.

    Build with :func:`adapt`. Its effect table is the object's ``shared_read_ends(mode)`` per
    buffer; its children are the ``attn_backend_list`` of a wrapper; ``object`` is the engine
    object, ``state`` and ``cfg`` what to run it on.
    """

    binding: Binding
    path: tuple[int, ...]
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
        return (id(self.binding), self.path, self.label, self.declaration)

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
                     server_args=b.server_args)
        node = root
        for i in self.path:
            node = node.kids[i][1]
        return node

    def redeclared(self, mode: ForwardMode, end: ReadEnd) -> EngineBackend:
        """A copy (without children) whose declaration in ``mode`` is ``end`` for every buffer it covers."""
        table = list(self.declaration)
        table[MODES.index(check_mode(mode))] = ReadEffect.uniform(self.reads, end)
        return attrs.evolve(self, declaration=tuple(table), kids=())

    def who(self) -> str:
        """The object's place in the wrapper tree, for messages."""
        return self.label if not self.path else f"{type(self.binding.root).__name__}" + "".join(
            f".attn_backend_list[{i}]" for i in self.path) + f" ({self.label})"

    # -- the stages -------------------------------------------------------------------------
    def _call(self, mode: ForwardMode, shared: Tensors, batch: Tensors,
              pools: Mapping[str, Tensor] | None) -> tuple[Any, EngineMode, ForwardBatch]:
        b = self.binding
        table = shared["req_to_token"]
        if tuple(table.shape) != (b.cfg.max_reqs, b.cfg.max_ctx):
            raise ContractError(f"{self.who()} was adapted for max_reqs={b.cfg.max_reqs}, max_ctx={b.cfg.max_ctx}, "
                                f"but runs on a page table of {tuple(table.shape)}: pass cfg=engine.cfg "
                                f"and state=engine.state")
        em = EngineMode.of(mode)
        fb = ForwardBatch(b.cfg, em, shared, batch, b.state["pools"] if pools is None else pools, b.layout)
        return self.object, em, fb

    def _bases(self, shared: Tensors, pools: Mapping[str, Tensor] | None) -> dict[str, list[Tensors]]:
        bound = self.binding.state
        return {"shared": [shared, bound["shared"]], "pool": [p for p in (pools, bound["pools"]) if p is not None]}

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
        if first != shapes and mode.uses_graph:  # a replayed graph reads static buffers of one shape
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
        obj, em, fb = self._call(mode, shared, batch, None)
        # the engine runs this method's Python before every replay (host work, pointer swaps,
        # plans kept on self): marked so, the lowering runs it rather than its traced graph
        torch.ops.readfence.opaque.default(torch.empty(0, device=fb.input_ids.device), EAGER)
        lifter = Lifter("out", self._bases(shared, None))
        who = self.who()
        with lifter.around(obj):
            call(obj, who, "init_forward_metadata_out_graph", em, obj.init_forward_metadata_out_graph, fb,
                 in_capture=False)
            if mode is ForwardMode.EXTEND and callable(getattr(obj, PREFILL, None)):
                end = call(obj, who, PREFILL, em, getattr(obj, PREFILL), fb, num_qo_tokens=fb.num_tokens,
                           build_snapshot=True)
                self.binding.prefill[(self.path, fb.batch_size)] = read_end_of(end, f"{who}.{PREFILL}")
        return self._lifted("out", mode, fb, lifter, "init_forward_metadata_out_graph")

    def prepare_in_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        if check_mode(mode) is ForwardMode.IDLE:
            return {}
        obj, em, fb = self._call(mode, shared, batch, None)
        self._restore(obj, ("out",), mode, fb, shared, None, meta)
        lifter = Lifter("in", self._bases(shared, None), meta)
        with lifter.around(obj):
            call(obj, self.who(), "init_forward_metadata_in_graph", em, obj.init_forward_metadata_in_graph, fb)
        return self._lifted("in", mode, fb, lifter, "init_forward_metadata_in_graph")

    def attend(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        if check_mode(mode) is ForwardMode.IDLE:
            return q.new_zeros(q.shape)
        obj, em, fb = self._call(mode, shared, batch, pools)
        self._restore(obj, ("out", "in"), mode, fb, shared, pools, meta)
        method, fn = forward_method(obj, em)
        who = self.who()
        out = call(obj, who, method, em, fn, q, k, v, self.binding.layer(layer), fb, save_kv_cache=True)
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
        fb = ForwardBatch(self.cfg, EngineMode.EXTEND, self.state["shared"], batch, self.state["pools"],
                          self.binding.layout)
        end = call(obj, self.who(), PREFILL, EngineMode.EXTEND, fn, fb, num_qo_tokens=fb.num_tokens,
                   build_snapshot=False)
        return read_end_of(end, f"{self.who()}.{PREFILL}")

    def declared_end(self, mode: ForwardMode) -> ReadEnd:
        """The object's scalar declaration in ``mode``, asked now (``shared_read_ends``)."""
        obj, em = self.object, EngineMode.of(check_mode(mode))
        value = call(obj, self.who(), "shared_read_ends", em, obj.shared_read_ends, em)
        return read_end_of(value, f"{self.who()}.shared_read_ends({em.name})")

    def __repr__(self) -> str:
        return f"<EngineBackend {self.who()}>"
