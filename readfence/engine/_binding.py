"""The binding of an adapted engine: one engine object tree built over one readfence state, its
profile and mode map, and what the adapter notes while the tree runs (lifted metadata, capture-time
calls, output shapes). Every :class:`~readfence.engine.EngineBackend` of one tree shares one."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
from torch import Tensor

from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEnd

from ._contract import EngineError
from ._lift import Record
from ._profile import EngineProfile, Modes
from ._tree import Path, children, follow
from ._view import AttentionLayer, ForwardBatch, ModelRunnerView

Factory = Callable[[ModelRunnerView], Any]
State = dict[str, dict[str, Tensor]]
_SERIALS = itertools.count()
Tensors = Mapping[str, Tensor]


@attrs.define(eq=False)
class Binding:
    """One engine object tree built over one state, and what the adapter notes while it runs."""

    factory: Factory
    layout: dict[str, str | None]
    cfg: ModelConfig
    state: State
    server_args: dict[str, object]
    runner: ModelRunnerView
    root: Any
    profile: EngineProfile
    modes: Modes
    name: str | None = None  # the root's label when adapt was given one
    # the engine's own forward-batch fields readfence's step does not set, and their defaults
    fields: Mapping[str, Callable[[], Any]] = attrs.Factory(dict)
    # the per-step metadata lifted from each (node, stage, mode, batch size)
    records: dict[tuple[Path, str, ForwardMode, int], list[Record]] = attrs.Factory(dict)
    # what resolve_prefill_shared_read_ends returned while building the snapshot, per (node, batch size)
    prefill: dict[tuple[Path, int], ReadEnd] = attrs.Factory(dict)
    layers: dict[int, Any] = attrs.Factory(dict)
    # the shapes of each lifted output on its first call (they cross into static buffers)
    shapes: dict[tuple[Path, str, ForwardMode, int], dict[str, tuple[int, ...]]] = attrs.Factory(dict)
    # the (node, mode, batch size) whose capture-time call has run
    captured: set[tuple[Path, ForwardMode, int]] = attrs.Factory(set)
    # the (node, mode, batch size) whose capture-time or warm-up call was refused, and why: raised
    # again by every later call (the call ran once; what it did is not undone by asking again)
    refused: dict[tuple[Path, ForwardMode, int], Exception] = attrs.Factory(dict)
    # what each capture-time call left on the objects of the tree: (object, attribute, value)
    frozen: dict[tuple[Path, ForwardMode, int], list[tuple[Any, str, Any]]] = attrs.Factory(dict)
    # names this binding in the caches of traces and verdicts (an id() is reused once it is collected)
    serial: int = attrs.Factory(lambda: next(_SERIALS))

    def object_at(self, path: Path) -> Any:
        return follow(self.root, path)

    def forward_batch(self, mode: ForwardMode, shared: Tensors, batch: Tensors, pools: Mapping[str, Tensor],
                      lens: Tensor | None, *, spec: bool = True) -> ForwardBatch:
        """A forward batch of one call, completed by the profile (``bind_batch``) as the engine
        completes its own (SGLang binds its KV write plan)."""
        fb = ForwardBatch(self.cfg, mode, shared, batch, pools, self.layout, self.modes.engine(mode), lens,
                          self.profile.spec_for(mode) if spec else None, self.fields)
        hook = self.profile.bind_batch
        if hook is not None:
            with self.profile.context(self.runner):
                try:
                    hook(fb, self.runner)
                except Exception as e:
                    raise EngineError(f"the profile's bind_batch hook raised {type(e).__name__} in {mode.name}: "
                                      f"{e}") from e
        return fb

    def layer(self, layer_id: int) -> Any:
        if layer_id not in self.layers:
            make = self.profile.layer
            if make is None:
                self.layers[layer_id] = AttentionLayer(self.cfg, layer_id)
            else:
                with self.profile.context(self.runner):
                    try:
                        self.layers[layer_id] = make(self.runner, layer_id)
                    except Exception as e:
                        raise EngineError(f"the profile's layer(runner, {layer_id}) raised {type(e).__name__}: "
                                          f"{e}") from e
        return self.layers[layer_id]

    @property
    def graphs(self) -> bool:
        """Whether the engine graph-replays this tree at all (not if any backend in it is one the
        engine turns graphs off for)."""
        return all(self.profile.replayed(obj) for obj in _objects(self.root))

    def replayed(self, path: Path, mode: ForwardMode) -> bool:
        """Whether the engine replays a step in ``mode`` from a captured graph."""
        return mode.uses_graph and mode not in self.profile.eager and self.graphs


def _objects(root: Any) -> Iterator[Any]:
    stack, seen = [root], set[int]()
    while stack:
        obj = stack.pop()
        yield obj
        stack.extend(child for _, child in children(obj, seen))
