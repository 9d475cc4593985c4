"""Building a generated leaf: the stage functions of a :class:`FuzzLeaf` (one shared code value, so
equal leaves share a cached trace), the references to live buffers it keeps, and how its prepare
stages pack their metadata in each return shape."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.core import ForwardMode
from readfence.core.internal import tokens_per_request

from .._attention import page_meta, softmax_attention, store_kv
from .._backend import Backend, leaf
from ._axes import _LIVE_VIAS, _STASH_VIAS, ATTEND, IN, OUT, Tensors
from ._leaf import FuzzLeaf, Placement
from ._ops import keep
from ._vocabulary import Site, fingerprint


class _Holder:
    """An engine-style object keeping a reference to a live buffer."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


_GLOBALS: dict[str, Tensor] = {}  # module globals some leaves read (one key per leaf and placement)


def _live_buffer(live: Tensors | None, spec: FuzzLeaf, p: Placement) -> Tensor:
    if live is None:  # FuzzProgram.build refuses to build such a program without the state
        raise ValueError(f"leaf {spec.name!r} keeps a reference to {p.buffer!r}: build it with the live state")
    return live[p.buffer]


class _Refs:
    """What a built leaf keeps: references to live buffers per placement, the handles of its
    planned buffers, and what ``prepare_out_graph`` stashed. Compared by identity: two leaves
    holding references are never the same code."""

    def __init__(self, spec: FuzzLeaf, live: Tensors | None) -> None:
        self.sources: dict[int, Callable[[], Tensor]] = {}
        self.handles: dict[int, int] = {}
        self.stash: dict[int, Tensor] = {}
        for i, p in enumerate(spec.placements):
            if p.pattern.invisible:
                self.handles[i] = keep(_live_buffer(live, spec, p))
            if p.via in _LIVE_VIAS:
                self.sources[i] = self._source(p.via, _live_buffer(live, spec, p), f"{id(self)}/{i}")
            elif p.via in _STASH_VIAS:
                self.sources[i] = functools.partial(self.stash.__getitem__, i)

    def _source(self, via: str, buf: Tensor, key: str) -> Callable[[], Tensor]:
        if via == "closure":
            return lambda: buf
        if via == "attribute":
            holder = _Holder(buf)
            return lambda: holder.tensor
        if via == "global":
            _GLOBALS[key] = buf
            weakref.finalize(self, _GLOBALS.pop, key, None)
            return lambda: _GLOBALS[key]
        alias = torch.from_dlpack(torch.to_dlpack(buf))  # a new storage object over the same memory
        return lambda: alias


@attrs.frozen
class _Code:
    """The code of a generated leaf, shared by its three stage functions. Equal code traces
    equally, so leaves drawn twice share a cached trace (``refs`` compares by identity)."""

    placements: tuple[Placement, ...]
    meta_stage: str | None
    refs: _Refs | None
    returns: str = "flat"

    def source(self, i: int, shared: Tensors) -> Tensor:
        p = self.placements[i]
        if self.refs is not None and i in self.refs.sources:
            return self.refs.sources[i]()
        return shared[p.buffer]

    def value(self, i: int, mode: ForwardMode, shared: Tensors, batch: Tensors, layer: int | None) -> Tensor:
        p = self.placements[i]
        handle = self.refs.handles.get(i, -1) if self.refs is not None else -1
        return p.pattern.op(self.source(i, shared), Site(p.buffer, p.stage, mode, batch, layer, handle))

    def prepared(self, stage: str, mode: ForwardMode, shared: Tensors, batch: Tensors,
                 meta: Mapping[Any, Any] | None = None) -> dict[Any, Any]:
        out = page_meta(shared, batch) if self.meta_stage == stage else {}
        for i, p in enumerate(self.placements):
            if p.stage == stage:
                x = self.value(i, mode, shared, batch, None)
                out[f"p{i}"] = x if p.carry else fingerprint(x).reshape(1)
        return _packed(self.returns, stage, out, meta)

    def unpacked(self, meta: Mapping[Any, Any]) -> dict[str, Tensor]:
        return _unpacked(self.returns, meta)


def _packed(shape: str, stage: str, out: dict[str, Tensor], meta: Mapping[Any, Any] | None) -> dict[Any, Any]:
    """``out`` (flat, string keys) as a leaf of return shape ``shape`` returns it from ``stage``."""
    if shape == "nested":
        return {stage: out} if out else {}
    if shape == "sequences":
        return {stage: [(k, (v,)) for k, v in out.items()]} if out else {}
    if shape == "odd_keys":
        return {(stage, int(k[1:])) if k.startswith("p") else k: v for k, v in out.items()}
    if shape == "python_values":
        return {**out, f"{stage}.scale": 1, f"{stage}.none": None, f"{stage}.on": True, f"{stage}.tag": "t"}
    if shape == "same_key" and stage == IN and meta is not None and "kv_lens" in meta and "kv_lens" not in out:
        return {**out, "kv_lens": meta["kv_lens"].clamp(min=1)}  # refines the copy under its own key
    return out


def _unpacked(shape: str, meta: Mapping[Any, Any]) -> dict[str, Tensor]:
    """The flat metadata the attention reads, from what both prepare stages returned."""
    if shape == "nested":
        return {k: v for stage in (OUT, IN) for k, v in meta.get(stage, {}).items()}
    if shape == "sequences":
        return {k: v[0] for stage in (OUT, IN) for k, v in meta.get(stage, [])}
    if shape == "odd_keys":
        return {f"p{k[1]}" if isinstance(k, tuple) else k: v for k, v in meta.items()}
    if shape == "python_values":
        scale = sum(v for k, v in meta.items() if isinstance(k, str) and k.endswith(".scale"))
        return {k: v * scale if k.startswith("p") else v for k, v in meta.items() if isinstance(v, Tensor)}
    return dict(meta)


@attrs.frozen
class _Out:
    code: _Code

    def __call__(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        refs = self.code.refs
        if refs is not None:  # a leaf that stashes holds references (see _build_leaf)
            for i, p in enumerate(self.code.placements):
                if p.via == "stash_clone":
                    refs.stash[i] = shared[p.buffer].clone()
                elif p.via == "stash_dlpack":
                    refs.stash[i] = torch.from_dlpack(torch.to_dlpack(shared[p.buffer]))
        return self.code.prepared(OUT, mode, shared, batch)


@attrs.frozen
class _In:
    code: _Code

    def __call__(self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return self.code.prepared(IN, mode, shared, batch, meta)


def _batch_meta(mode: ForwardMode, batch: Tensors) -> tuple[Tensor, Tensor]:
    # attention over each request's newest token only: indices and lengths from the batch
    rows, n = batch["req_pool_indices"].shape[0], tokens_per_request(mode)
    last = batch["out_cache_loc"].view(rows, n).narrow(1, n - 1, 1)
    lens = batch["positions"].view(rows, n).narrow(1, n - 1, 1).squeeze(1) + 1
    return last, lens


@attrs.frozen
class _Attend:
    code: _Code

    def __call__(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
                 shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        code = self.code
        meta = code.unpacked(meta)
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        if code.meta_stage is None:
            indices, lens = _batch_meta(mode, batch)
        else:
            m = page_meta(shared, batch) if code.meta_stage == ATTEND else meta
            indices, lens = m["kv_indices"], m["kv_lens"]
        out = softmax_attention(mode, q, pools, layer, indices, lens)
        mix = []
        for i, p in enumerate(code.placements):
            if p.stage == ATTEND:
                mix.append(fingerprint(code.value(i, mode, shared, batch, layer)))
            else:  # a carried result is read here; a reduced one is already a fingerprint
                mix.append(fingerprint(meta[f"p{i}"]) if p.carry else meta[f"p{i}"].sum())
        if not mix:
            return out
        return out + torch.stack(mix).sum().mul(0.125)


def _build_leaf(spec: FuzzLeaf, live: Tensors | None) -> Backend:
    holds = any(p.via != "argument" or p.pattern.invisible for p in spec.placements)
    code = _Code(spec.placements, spec.meta_stage, _Refs(spec, live) if holds else None, spec.returns)
    effect = spec.effect()
    return leaf(spec.name, _Attend(code), prepare_out_graph=_Out(code), prepare_in_graph=_In(code),
                declare=lambda mode: effect)
