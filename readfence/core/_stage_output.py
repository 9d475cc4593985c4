"""What a stage may return, and what a graph may rely on of it: the check of a stage's output
(:func:`check_stage_output`), its crossing into the graph (:func:`cross_into_graph`) and the guard
on the values a captured graph baked in (:class:`OutputGuard`).

>>> from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH
>>> check_stage_output(PREPARE_IN_GRAPH, {"n": 3})["n"]
3
"""


from __future__ import annotations

import math
import os
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._stages import BODY, Stage, StageOutputError
from ._words import copy_of, words_dtype

_T = TypeVar("_T")


# -- what a stage may return -----------------------------------------------------------------
#: Python values a stage may return besides tensors: constants of the traced graph.
PYTHON_VALUES = (bool, int, float, str, type(None))

_OWN = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _like(leaf: object, value: object) -> bool:
    # the same object, or, the stage having run again, one like it: an equal Python value, a
    # tensor of the same shape and dtype, or a value of the same unusual type (a set, a subclass)
    if leaf is value:
        return True
    if type(leaf) is not type(value):
        return False
    if isinstance(value, PYTHON_VALUES):
        return same_value(leaf, value)
    if type(value) is Tensor and not value.is_nested:  # (a nested tensor has no one shape)
        return bool(leaf.shape == value.shape and leaf.dtype == value.dtype)  # type: ignore[attr-defined]
    return True


def _holds(tree: object, value: object) -> bool:
    return _like(tree, value) or (isinstance(tree, (dict, list, tuple)) and any(_like(v, value) for v in pytree.tree_leaves(tree)))


def returned_at(fn: Callable[..., object], kwargs: Mapping[str, Any], value: object) -> str:
    """``file:line in function`` of the innermost frame outside torch and readfence that returns a
    dict, list or tuple holding ``value`` (else the outermost returning ``value``) when
    ``fn(**kwargs)`` runs again; ``"?"``
    if none does. Only to name a line in an error: a stage is pure, so running it again is
    harmless, and its error, if it raises, is not this one's.

    >>> def stage():
    ...     return {"n": marker}
    >>> marker = object()
    >>> returned_at(stage, {}, marker).endswith("in stage")
    True
    """
    found: list[tuple[bool, str]] = []  # (returned a container holding it, where)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "return" and not frame.f_code.co_filename.startswith(_OWN) and _holds(arg, value):
            found.append((isinstance(arg, (dict, list, tuple)),
                          f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"))

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn(**kwargs)
    except Exception:  # only looking for a line: the stage's own error is not this one's
        pass
    finally:
        sys.setprofile(old)
    # the innermost frame of a file that put it in what the stage returns (code made at run time,
    # ``<string>``, is torch's or a library's more often than the user's); else the outermost returning it
    held = [where for contains, where in found if contains]
    return next((w for w in held if not w.startswith("<")), held[0] if held else found[-1][1] if found else "?")


def foreign_subclass(t: Tensor) -> bool:
    """A tensor subclass that is not torch's own (fake tensors, functional collectives'
    wrappers): one readfence does not trace through.

    >>> foreign_subclass(torch.zeros(1)), foreign_subclass(torch.nn.Parameter(torch.zeros(1)))
    (False, False)
    """
    module = type(t).__module__
    return type(t) is not Tensor and module != "torch" and not module.startswith("torch.")


def unfit_tensor(t: Tensor) -> tuple[str, str] | None:
    """What makes ``t`` a tensor a stage may not return, and how to return it instead; ``None`` for
    a tensor it may: dense and strided (a graph's static buffers hold exactly that), of any dtype,
    shape (empty ones too), strides and device. A tensor subclass wrapping others (a DTensor, a
    nested tensor), a sparse, nested or quantized tensor is refused.

    >>> unfit_tensor(torch.zeros(2, dtype=torch.complex64).t()) is None
    True
    >>> unfit_tensor(torch.eye(2).to_sparse())
    ('a torch.sparse_coo tensor', 'return it dense (.to_dense())')
    """
    if t.is_nested:
        return "a nested tensor", "return its values and offsets as tensors (.values(), .offsets())"
    if foreign_subclass(t) or (type(t) is not Tensor and is_traceable_wrapper_subclass(t)):
        return f"a {type(t).__name__} (a tensor subclass)", "unwrap a tensor subclass inside the stage"
    if t.layout is not torch.strided:
        return f"a {t.layout} tensor", "return it dense (.to_dense())"
    if t.is_quantized:
        return "a quantized tensor", "return its integer values and its scale as tensors (.int_repr(), .q_scale())"
    return None


def _fits(out: Tensor, like: Tensor) -> bool:
    # q's shape, or its rows flattened ([T, heads * dim]): what the model reshapes it from; q's
    # dtype and device, which the model's next matmul takes it on
    return (out.dtype == like.dtype and out.device == like.device
            and (out.shape == like.shape or (out.shape[:1] == like.shape[:1] and out.numel() == like.numel())))


def check_stage_output(stage: Stage, out: _T, *, backend: str = "?", fn: Callable[..., object] | None = None,
                       kwargs: Mapping[str, Any] | None = None, like: Tensor | None = None,
                       layer: int | None = None) -> _T:
    """``out`` if ``stage`` may return it (see :class:`StageOutputError`), else the error naming
    ``backend``, the stage, the key and (when ``fn`` and its ``kwargs`` are given) the line.
    With ``like`` (``q``), ``out`` is what ``attend`` returned in ``layer``: a tensor shaped like ``q``.

    >>> from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH
    >>> check_stage_output(PREPARE_IN_GRAPH, {"n": 3, "rows": [torch.ones(1), None]})["n"]
    3
    >>> check_stage_output(PREPARE_IN_GRAPH, {"n": {1, 2}}, backend="mine")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.core._stages.StageOutputError: backend 'mine' stage prepare_in_graph returned set {1, 2} at key ['n'] (at ?): ...
    >>> check_stage_output(PREPARE_OUT_GRAPH, torch.zeros(2), backend="mine")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.core._stages.StageOutputError: backend 'mine' stage prepare_out_graph returned Tensor tensor([0., 0.])
    instead of a dict (at ?): a prepare stage returns a dict (of tensors, Python scalars, None, and dicts, lists and
    tuples of them): put the tensor under a key, e.g. {'kv_indices': ...}
    >>> q = torch.zeros(2, 4, 8)
    >>> check_stage_output(BODY, q[:, :1], backend="mine", like=q, layer=0)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.core._stages.StageOutputError: backend 'mine' attend returned a tensor of shape [2, 1, 8] (torch.float32 on cpu)
    in layer 0 (at ?): attend returns a tensor shaped like q, [2, 4, 8], of q's dtype and device (torch.float32 on cpu)
    >>> check_stage_output(BODY, q.double(), backend="mine", like=q, layer=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.core._stages.StageOutputError: backend 'mine' attend returned a tensor of shape [2, 4, 8] (torch.float64 on cpu) ...
    """
    bad: object
    if stage is BODY and like is not None:
        unfit = unfit_tensor(out) if isinstance(out, Tensor) else None
        if isinstance(out, Tensor) and unfit is None and _fits(out, like):
            return out
        got = (unfit[0] if unfit is not None else f"a tensor of shape {list(out.shape)} ({out.dtype} on {out.device})"
               if isinstance(out, Tensor) else f"{type(out).__name__} {_short(out)}")
        line = "?" if fn is None else returned_at(fn, kwargs or {}, out)
        unwrap = f" (a plain tensor: {unfit[1]})" if unfit is not None else ""
        raise StageOutputError(f"backend {backend!r} attend returned {got} in layer {layer} (at {line}): attend returns "
                               f"a tensor shaped like q, {list(like.shape)}, of q's dtype and device ({like.dtype} on "
                               f"{like.device}){unwrap}", stage=stage.name)
    if stage is BODY:
        if isinstance(out, Tensor) and unfit_tensor(out) is None:
            return out
        bad, where = out, "as its output"
    elif not isinstance(out, Mapping):
        line = "?" if fn is None else returned_at(fn, kwargs or {}, out)
        hint = ": put the tensor under a key, e.g. {'kv_indices': ...}" if isinstance(out, Tensor) else ""
        raise StageOutputError(f"backend {backend!r} stage {stage.name} returned {type(out).__name__} {_short(out)} "
                               f"instead of a dict (at {line}): a prepare stage returns a dict (of tensors, Python "
                               f"scalars, None, and dicts, lists and tuples of them){hint}", stage=stage.name)
    else:
        unkeyed = _key_not_a_value(out, "")
        if unkeyed is not None:
            where, key = unkeyed
            line = "?" if fn is None else returned_at(fn, kwargs or {}, out)
            raise StageOutputError(
                f"backend {backend!r} stage {stage.name} returned a dict keyed by {type(key).__name__} {_short(key)}"
                f"{where} (at {line}): the stages after it find its outputs by key, and this key is equal to "
                f"nothing as a Python value (its == gives {type(_equal(key)).__name__}); key it by a str, an int, "
                f"an enum or a tuple of them", stage=stage.name)
        pairs, _ = pytree.tree_flatten_with_path(dict(out))
        wrong = next(((p, v) for p, v in pairs
                      if not isinstance(v, (Tensor, *PYTHON_VALUES)) or (isinstance(v, Tensor) and unfit_tensor(v))),
                     None)
        if wrong is None:
            return out
        bad, where = wrong[1], f"at key {pytree.keystr(wrong[0])}"
    line = "?" if fn is None else returned_at(fn, kwargs or {}, bad)
    what = "a tensor (the logits)" if stage is BODY else (
        "tensors, Python scalars (bool, int, float, str), None, and dicts, lists and tuples of them")
    unfit = unfit_tensor(bad) if isinstance(bad, Tensor) else None
    got = f"{type(bad).__name__} {_short(bad)}"
    if unfit is not None:
        got = f"{unfit[0]}"
        what += f" (plain dense tensors, as a graph's static buffers hold: {unfit[1]})"
    raise StageOutputError(f"backend {backend!r} stage {stage.name} returned {got} "
                           f"{where} (at {line}): a stage returns {what}", stage=stage.name)


def _equal(key: object) -> object:
    try:
        return key == key
    except Exception as e:  # (an == that raises: no key either)
        return e


def _key_not_a_value(value: object, where: str) -> tuple[str, object] | None:
    """The first dict key in ``value`` (at any depth) whose ``==`` is no Python bool (a tensor's is
    elementwise), with where its dict is: a key is found by comparing, which such a key cannot."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if type(_equal(k)) is not bool:
                return (f" at key {where}" if where else ""), k
            found = _key_not_a_value(v, f"{where}[{k!r}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _key_not_a_value(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _short(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # a tensor subclass whose repr fails: its type names it
        return f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def cross_into_graph(meta: _T) -> _T:
    """What the graph sees of ``prepare_out_graph``'s outputs: copies made when it returns.

    A captured graph reads static input buffers, so the out-of-graph stage's outputs are
    copied into them before the replay, at the end of that stage: a view of a shared buffer
    returned from ``prepare_out_graph`` is read by that copy (its read ends at
    ``PRE_REPLAY``), and reading it inside the graph reads the copy, never the shared buffer.
    ``prepare_in_graph`` runs inside the graph and its outputs are not copied: a view it
    returns is read wherever the body consumes it (``POST_REPLAY``). :func:`eval_step` makes
    the copies, inside the stage, for every interpreter.

    >>> lens = torch.arange(4)
    >>> meta = cross_into_graph({"lens": lens[:2], "rows": [lens[2:]], "n": 2})
    >>> meta["lens"].untyped_storage().data_ptr() != lens.untyped_storage().data_ptr(), meta["n"]
    (True, 2)
    """
    return pytree.tree_map(lambda v: copy_of(v) if isinstance(v, Tensor) else v, meta)


def as_static(value: Tensor, traced: object) -> Tensor:
    """``value`` as the graph's static buffer for it holds it: laid out as the traced step's output
    ``traced`` (what the graph was traced reading: a stride a stage hands a kernel is the traced
    one), where the two differ only in layout; else ``value`` itself. The lowered step copies each
    step's output into that buffer, so a capture is validated on this, not on the Python's layout.

    >>> traced = torch.zeros(3, 2).t()
    >>> as_static(torch.ones(2, 3), traced).stride(), as_static(torch.ones(2, 3), torch.zeros(2, 3)).stride()
    ((1, 2), (3, 1))
    """
    if (not isinstance(traced, Tensor) or value.is_meta or traced.shape != value.shape or traced.dtype != value.dtype
            or traced.stride() == value.stride() or value.layout is not torch.strided):
        return value
    static = torch.empty_strided(value.shape, traced.stride(), dtype=words_dtype(value.dtype),
                                 device=value.device).view(value.dtype)
    return static.copy_(value)


def same_value(a: object, b: object) -> bool:
    """Whether two Python values a stage returned are the same for a graph that bakes one of them.

    Floats are the same when both are NaN, or when their bits are: ``nan`` equals ``nan`` (a fresh
    ``float("nan")`` is the sentinel it was when traced; no op reads a NaN's payload), and ``-0.0``
    is not ``0.0`` (``1 / x`` and ``copysign`` tell them apart, so a graph that baked one computes
    something else with the other). Any other values are the same when they are equal.

    >>> same_value(float("nan"), float("nan")), same_value(-0.0, 0.0), same_value(3, 3)
    (True, False, True)
    """
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


@attrs.frozen(eq=False)
class OutputGuard:
    """What the graphs after a stage bake of its outputs: their structure, their tensors' shapes
    and dtypes, and the Python values they consume, as the traced step returned them.

    A stage that runs its Python in the step (out of the graph, or escaping the tracer) may return
    other values on another step; the graphs after it were traced on these. :meth:`check` refuses a
    change (``StageOutputError`` naming backend, stage and key), before anything reads it. Python
    values are compared by :func:`same_value` (``nan`` is ``nan``; ``-0.0`` is not ``0.0``).

    Only a Python value some captured stage after it reads is held to its traced value
    (``consumed``: the top-level keys they read, as :meth:`consuming` records; ``None``, every
    key): one that no graph reads (a bound kept for the host, a sentinel) bakes nothing and may
    change, though it stays a Python value, not a tensor. In a step that is not replayed
    (``values=False``) no graph bakes a shape or a value: only the structure (the keys, and which
    leaves are tensors) is held, by which the stages after it take their arguments. That a value
    no graph reads may change is checked independently: ``core.validate_replay`` runs the step's
    Python beside each capture on varied states, where such values differ.

    >>> from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH
    >>> guard = OutputGuard.of(PREPARE_OUT_GRAPH, {"n": 3, "lens": torch.zeros(2)}, backend="mine")
    >>> guard.check({"n": 3, "lens": torch.ones(2)})
    >>> guard.check({"n": 4, "lens": torch.ones(2)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.core._stages.StageOutputError: backend 'mine' stage prepare_out_graph returned 4 at key ['n'] where the traced step returned 3 ...
    >>> guard.consuming({"lens"}).check({"n": 4, "lens": torch.ones(2)})  # no graph reads ``n``
    """

    stage: Stage
    backend: str
    spec: pytree.TreeSpec
    paths: tuple[pytree.KeyPath, ...]
    baked: tuple[tuple[str, object, object], ...]  # per leaf: ("tensor", shape, dtype) or ("value", type, value)
    values: bool = True  # tensors' shapes and dtypes and the Python values are baked (a replayed step)
    # the top-level keys whose Python values a captured stage after it reads; None: every key
    consumed: frozenset[Any] | None = None

    def _holds(self, path: pytree.KeyPath) -> bool:
        """Whether the Python value at ``path`` is held to its traced value."""
        if not self.values:
            return False
        return self.consumed is None or (bool(path) and _key_of(path[0]) in self.consumed)

    def _baked(self, path: pytree.KeyPath, leaf: object) -> tuple[str, object, object]:
        if isinstance(leaf, Tensor):
            return ("tensor", tuple(leaf.shape), leaf.dtype) if self.values else ("tensor", None, None)
        return ("value", type(leaf), leaf) if self._holds(path) else ("value", None, None)

    @staticmethod
    def _same(now: tuple[str, object, object], baked: tuple[str, object, object]) -> bool:
        return now[:2] == baked[:2] and (now[0] == "tensor" and now[2] == baked[2] or
                                         now[0] == "value" and same_value(now[2], baked[2]))

    @classmethod
    def of(cls, stage: Stage, out: object, *, backend: str = "?", values: bool = True) -> OutputGuard:
        """The guard of ``stage``'s output ``out`` as traced.

        >>> from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH
        >>> OutputGuard.of(PREPARE_OUT_GRAPH, {"n": 3, "t": torch.zeros(2)}, values=False).check({"n": 4, "t": torch.zeros(3)})
        >>> OutputGuard.of(PREPARE_OUT_GRAPH, {"none": float("nan")}).check({"none": float("nan")})
        """
        pairs, spec = pytree.tree_flatten_with_path(out)
        guard = cls(stage, backend, spec, tuple(p for p, _ in pairs), (), values)
        return attrs.evolve(guard, baked=tuple(guard._baked(p, v) for p, v in pairs))

    def consuming(self, keys: Iterable[Any]) -> OutputGuard:
        """The guard that holds only the Python values under the top-level ``keys`` (those the
        captured stages after it read) to their traced values; every other Python value stays a
        Python value, whatever it is.

        >>> from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH
        >>> guard = OutputGuard.of(PREPARE_OUT_GRAPH, {"n": 3, "bound": 7}).consuming({"n"})
        >>> guard.check({"n": 3, "bound": 9})
        >>> guard.check({"n": 3, "bound": torch.zeros(1)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        readfence.core._stages.StageOutputError: ... where the traced step returned a Python value (at ?): ...
        """
        narrowed = attrs.evolve(self, consumed=frozenset(keys))
        baked = tuple(b if b[0] == "tensor" or narrowed._holds(p) else ("value", None, None)
                      for p, b in zip(self.paths, self.baked, strict=True))
        return attrs.evolve(narrowed, baked=baked)

    def check(self, out: object, fn: Callable[..., object] | None = None, kwargs: Mapping[str, Any] | None = None) -> None:
        """Refuse ``out`` unless it has the structure, shapes, dtypes and consumed Python values
        traced (``fn`` and ``kwargs``, the stage's call, only to name the line in the error). A
        dict's keys are held as a set: the stages after it take its values by key, in any order.

        >>> from readfence.core import PREPARE_OUT_GRAPH
        >>> OutputGuard.of(PREPARE_OUT_GRAPH, {"a": 1, "b": {"c": 2, "d": 3}}).check({"b": {"d": 3, "c": 2}, "a": 1})
        """
        pairs, spec = pytree.tree_flatten_with_path(_ordered_like(out, self.spec))
        if spec == self.spec and all(self._same(self._baked(p, v), b) for (p, v), b in zip(pairs, self.baked)):
            return

        def fail(what: str, value: object, why: str) -> StageOutputError:
            line = "?" if fn is None else returned_at(fn, kwargs or {}, value)
            return StageOutputError(f"backend {self.backend!r} stage {self.stage.name} returned {what} (at {line}): {why}",
                                    stage=self.stage.name)

        after = ("the graphs after it read the outputs of the step they were traced on" if self.values else
                 "the stages after it take its outputs by the keys of the step it was traced on")
        if spec != self.spec:
            raise fail(f"keys {sorted(pytree.keystr(p) for p, _ in pairs)} where the traced step returned "
                       f"{sorted(pytree.keystr(p) for p in self.paths)}", out,
                       f"{after}; return the same keys every step")
        path, value, baked = next((p, v, b) for (p, v), b in zip(pairs, self.baked)
                                  if not self._same(self._baked(p, v), b))
        key = pytree.keystr(path)
        if baked[1] is None or not isinstance(value, Tensor) and baked[0] == "tensor":
            was = "a tensor" if baked[0] == "tensor" else "a Python value"
            raise fail(f"{_short(value)} at key {key} where the traced step returned {was}", value,
                       f"{after}; return a tensor or a Python value at a key every step, not one or the other")
        if baked[0] == "tensor" and isinstance(value, Tensor):
            raise fail(f"a tensor of shape {tuple(value.shape)} ({value.dtype}) at key {key} where the traced step "
                       f"returned shape {baked[1]} ({baked[2]})", value,
                       "a graph reads metadata of one shape per batch size; pad it to a fixed shape, as engines' "
                       "graph runners do")
        was = _short(baked[2]) if baked[0] == "value" else f"a tensor of shape {baked[1]}"
        raise fail(f"{_short(value)} at key {key} where the traced step returned {was}", value,
                   "the graphs after it bake the Python values of the step they were traced on; return it as a "
                   "tensor, or compute it from shapes only")


def _ordered_like(value: Any, spec: pytree.TreeSpec) -> Any:
    """``value`` with each plain dict in it that has the keys of the dict at its place in ``spec``
    holding them in ``spec``'s order (a dict whose insertion order changed is the same output)."""
    if spec.type is dict and type(value) is dict:
        keys = spec.context
        if len(keys) != len(value) or not all(k in value for k in keys):
            return value
        return {k: _ordered_like(value[k], child) for k, child in zip(keys, spec.children(), strict=True)}
    if spec.type in (list, tuple) and type(value) is spec.type and len(value) == spec.num_children:
        return spec.type(_ordered_like(v, child) for v, child in zip(value, spec.children(), strict=True))
    return value


def _key_of(entry: Any) -> Any:
    """The key a pytree path entry stands for (a dict key, a sequence index, an attribute)."""
    if isinstance(entry, pytree.MappingKey):
        return entry.key
    if isinstance(entry, pytree.SequenceKey):
        return entry.idx
    return getattr(entry, "name", entry)
