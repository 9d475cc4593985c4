"""Per-step metadata an engine backend keeps on ``self``, lifted into readfence's stage outputs.

An engine backend stores what ``init_forward_metadata_*`` computes on itself
(``self.forward_metadata = ...``) and reads it back in ``forward``. readfence's stages are
functions whose outputs cross from one stage to the next (and out of the graph as copies), so
the adapter *lifts* that state: around each method it notes the tensors reachable from the
object, and what changed becomes the stage's output; before the next stage it is put back.

What changed is classified by memory, so what crosses means what it means in the engine:

* a fresh tensor (computed by the method) is an output of the stage: out of the graph it
  crosses as a copy (a snapshot), inside the graph as itself;
* a view of a shared buffer stays a view of the live buffer: put back as the same view of the
  next call's buffer, so a kept reference to the page table is read where it is used (late);
* a view of a pool, of a tensor the object already held (its own persistent buffers), or of a
  fresh output is put back as that view of it; a buffer the graph runner's first calls (capture,
  warm-up) allocated and the step refills in place is the object's own, as on every later step.

Metadata is found wherever the object keeps it: attributes, dicts keyed by anything hashable (the
engine's mode enum, tuples), lists, tuples and namedtuples, nested. A stored forward batch is put
back as the current call's.
"""

from __future__ import annotations

import contextlib
import enum
import types
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.core.internal import Span, span_of

from ._contract import EngineError
from ._view import AttentionLayer, ForwardBatch, ModelConfigView, ReqToTokenPool, StatePool, TokenToKVPool, _Pools

Step = tuple[str, Any]  # ("attr", name) or ("item", key or index)
Path = tuple[Step, ...]

_DEPTH = 8
_NODES = 20_000  # objects visited at most: an engine's metadata is small, a model is not walked
_OPAQUE_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                 torch.dtype, torch.device, torch.Generator, enum.Enum, str, bytes, int, float, complex, bool,
                 type(None), _Pools, ReqToTokenPool, TokenToKVPool, StatePool, ModelConfigView, AttentionLayer)


def path_text(path: Path) -> str:
    """``forward_metadata.kv_indices``, ``attn_backend_list[0].cache['k']``, ``md[Mode.DECODE]``.

    >>> path_text((("attr", "md"), ("item", 0), ("attr", "lens")))
    'md[0].lens'
    >>> path_text((("attr", "by_mode"), ("item", enum.Enum("Mode", "DECODE").DECODE), ("item", ("kv", 0))))
    "by_mode[Mode.DECODE][('kv', 0)]"
    """
    out = ""
    for kind, key in path:
        out += (f".{key}" if out else key) if kind == "attr" else f"[{_key_text(key)}]"
    return out


def _key_text(key: Any) -> str:
    """A dict key as code would write it: ``'k'``, ``0``, ``Mode.DECODE``, ``('kv', Mode.DECODE)``."""
    if isinstance(key, enum.Enum):
        return f"{type(key).__name__}.{key.name}"
    if isinstance(key, tuple):
        return "(" + ", ".join(_key_text(k) for k in key) + ("," if len(key) == 1 else "") + ")"
    return repr(key)


def _children(node: Any) -> Iterator[tuple[Step, Any]]:
    if isinstance(node, dict):  # keyed by anything hashable: names, indices, a mode enum, tuples
        for k, v in node.items():
            yield ("item", k), v
    elif isinstance(node, tuple) and hasattr(node, "_fields"):  # a namedtuple: by field name
        for name in node._fields:
            yield ("attr", name), getattr(node, name)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield ("item", i), v
    else:
        names = vars(node) if hasattr(node, "__dict__") else {}
        yield from ((("attr", k), v) for k, v in names.items())
        for cls in type(node).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and not slot.startswith("__") and hasattr(node, slot):
                    yield ("attr", slot), getattr(node, slot)


def leaves(obj: object) -> Iterator[tuple[Path, Tensor | ForwardBatch]]:
    """Every tensor and forward batch reachable from ``obj``'s attributes, by every path.

    Follows attributes, dicts, lists and tuples (depth 8, no cycles), not into tensors, the
    runner view and its pools, functions, modules or plain values. An object reachable two
    ways is listed under both paths: the metadata one method replaces under one name may
    stay under another (``self.forward_metadata = self.prefill_snapshot``).
    """
    stack: list[tuple[Path, Any, frozenset[int]]] = [((), obj, frozenset({id(obj)}))]
    budget = _NODES
    while stack and budget:
        path, node, above = stack.pop()
        budget -= 1
        if len(path) >= _DEPTH:
            continue
        kids = []
        for step, value in _children(node):
            if isinstance(value, (Tensor, ForwardBatch)):
                yield (*path, step), value
            elif not isinstance(value, _OPAQUE_TYPES) and id(value) not in above:
                kids.append(((*path, step), value, above | {id(value)}))
        stack.extend(reversed(kids))


@attrs.frozen
class Record:
    """How to put one lifted value back: ``kind`` ``meta`` (the stage output ``key``), ``view``
    (``as_strided`` of a base: ``base`` is ``("shared", name)``, ``("pool", name)``, ``("owned",
    tensor)`` or ``("meta", key)``) or ``batch`` (the current forward batch)."""

    path: Path
    kind: str
    key: str = ""
    base: tuple[str, Any] = ("", None)
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0  # elements from the base's first element


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # memory bookkeeping is not the step's work: no trace node, no observed escape
    with torch._C.DisableTorchFunction():
        yield


def _within(t: Tensor, span: Span | None, base: Tensor) -> int | None:
    """Elements from ``base``'s first element to ``t``'s, if ``t`` lies within ``base`` (an empty
    ``t`` at a place in ``base``'s storage lies there too: ``buffer[:n]`` on a step where ``n`` is 0)."""
    if t.numel() == 0 and span is not None and t.dtype == base.dtype and t.layout is torch.strided \
            and t.device == base.device and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
        delta = int(t.storage_offset()) - int(base.storage_offset())
        return delta if 0 <= delta <= base.numel() else None
    s = span_of(t)
    if s is None or span is None or s.space != span.space or not (span.start <= s.start and s.stop <= span.stop):
        return None
    if t.dtype != base.dtype:
        raise EngineError(f"a per-step tensor of dtype {t.dtype} reinterprets a buffer of dtype {base.dtype}; "
                          f"the adapter keeps views of the same dtype only")
    delta = s.start - span.start
    return delta // t.element_size() if delta % t.element_size() == 0 else None


class Lifter:
    """Lifts one method call's per-step state: ``with lifter.around(obj):`` then ``records``
    and ``outputs`` (the stage's fresh tensors, by key).

    ``bases`` are the named tensors a view may be of: ``{"shared": [{...}, ...], "pool": [...]}``
    (the call's and the bound state's: a kept reference is the same buffer as the argument);
    ``inputs`` the earlier stages' outputs this call received.
    """

    def __init__(self, tag: str, bases: Mapping[str, list[Mapping[str, Tensor]]],
                 inputs: Mapping[str, Tensor] | None = None) -> None:
        self.tag, self.bases, self.inputs = tag, bases, dict(inputs or {})
        self.records: list[Record] = []
        self.outputs: dict[str, Tensor] = {}
        self._settled: dict[Path, Any] | None = None

    @contextlib.contextmanager
    def around(self, obj: object) -> Iterator[None]:
        with _quiet():
            before = dict(leaves(obj))
        yield
        with _quiet():
            self._lift(obj, before)

    def settle(self, obj: object) -> None:
        """Mark what the object holds now, after the graph runner's first calls (capture and warm-up),
        inside :meth:`around`: a tensor they allocated that the step's own call then refills in place
        (the same object at the same path afterwards) is the object's own buffer, as on every later
        step, not a per-step output of this one."""
        with _quiet():
            self._settled = dict(leaves(obj))

    def _lift(self, obj: Any, before: Mapping[Path, Any]) -> None:
        after = list(leaves(obj))
        named: list[tuple[str, Any, Tensor, Span | None]] = [
            (kind, name, t, span_of(t)) for kind in ("shared", "pool")
            for group in self.bases.get(kind, []) for name, t in group.items()]
        if self._settled is not None:
            now = dict(after)
            kept = {p: v for p, v in self._settled.items() if isinstance(v, Tensor) and before.get(p) is not v
                    and now.get(p) is v and not any(_within(v, span, base) is not None for _, _, base, span in named)}
            before = {**before, **kept}
        changed = [(p, v) for p, v in after if before.get(p) is not v]
        held = {id(v): v for v in before.values() if isinstance(v, Tensor)}
        # an earlier stage's output put back on the object is that output, not a constant
        named += [("meta", key, t, span_of(t)) for key, t in self.inputs.items() if isinstance(t, Tensor)]
        named += [("owned", t, t, span_of(t)) for t in held.values()]
        fresh: dict[int, str] = {}  # id(tensor) -> key of its output
        pending: list[tuple[Path, Tensor]] = []
        for path, value in changed:
            if isinstance(value, ForwardBatch):
                self.records.append(Record(path, "batch"))
                continue
            for kind, name, base, span in named:
                offset = _within(value, span, base)
                if offset is not None:
                    self.records.append(Record(path, "view", base=(kind, name), size=tuple(value.shape),
                                               stride=tuple(value.stride()), offset=offset))
                    break
            else:
                pending.append((path, value))
        # fresh tensors: one output per object; a view of a contiguous fresh output stays its view
        pending.sort(key=lambda pv: -pv[1].numel())
        outs: list[tuple[str, Tensor, Span | None]] = []
        for path, value in pending:
            if id(value) in fresh:
                self.records.append(Record(path, "meta", key=fresh[id(value)]))
                continue
            for key, base, span in outs:
                offset = _within(value, span, base)
                if offset is not None:
                    self.records.append(Record(path, "view", base=("meta", key), size=tuple(value.shape),
                                               stride=tuple(value.stride()), offset=offset))
                    break
            else:
                key = f"{self.tag}/{path_text(path)}"
                fresh[id(value)] = key
                self.outputs[key] = value
                self.records.append(Record(path, "meta", key=key))
                if value.is_contiguous():
                    outs.append((key, value, span_of(value)))


def restore(obj: object, records: list[Record], meta: Mapping[str, Tensor], bases: Mapping[str, Mapping[str, Tensor]],
            batch: ForwardBatch, who: str) -> None:
    """Put ``records`` back on ``obj``: outputs from ``meta``, views over ``bases`` (this call's
    shared buffers and pools), forward batches as ``batch``."""
    for r in records:
        if r.kind == "batch":
            value: Any = batch
        elif r.kind == "meta":
            value = _output(meta, r.key, who)
        else:
            kind, ref = r.base
            if kind == "owned":
                base = ref
            elif kind == "meta":
                base = _output(meta, ref, who)
            else:
                base = bases[kind][ref]
            value = base.as_strided(r.size, r.stride, base.storage_offset() + r.offset)
        _set_path(obj, r.path, value, who)


def _output(meta: Mapping[str, Tensor], key: str, who: str) -> Tensor:
    if key not in meta:
        raise EngineError(f"{who}: the per-step metadata {key!r} an earlier stage kept on the object is not "
                          f"among this stage's inputs ({sorted(meta)}); run the stages in order")
    return meta[key]


def _set_path(node: Any, path: Path, value: Any, who: str) -> Any:
    """Set ``path`` under ``node`` to ``value``; returns ``node`` (a new one for a tuple)."""
    (kind, key), rest = path[0], path[1:]
    try:
        child = getattr(node, key) if kind == "attr" else node[key]
    except (AttributeError, KeyError, IndexError, TypeError):
        raise EngineError(f"{who}: cannot put per-step metadata back at {path_text(path)!r}: the object no "
                          f"longer has it (its metadata's structure changed between stages)") from None
    new = value if not rest else _set_path(child, rest, value, who)
    if new is child:
        return node
    if kind == "attr" and isinstance(node, tuple):
        return node._replace(**{key: new})  # type: ignore[attr-defined]
    if kind == "attr":
        object.__setattr__(node, key, new)
        return node
    if isinstance(node, tuple):
        items = list(node)
        items[key] = new
        return type(node)(items)
    node[key] = new
    return node
