"""The step: its stages as values, and the one function that runs a step through an interpreter.

Every part of readfence runs the same step: the serial reference, the tracer, the runtime
read observer, the rehearsal before a capture, the fuzzer, the engine adapter. Each is an
*interpreter* of :func:`eval_step`, as every JAX transformation is an interpreter of
``eval_jaxpr``: it is handed one :class:`StageCall` per stage and decides what running it
means (call it, trace it, watch it). The protocol is written here and nowhere else:

1. ``prepare_out_graph(shared=, batch=)`` runs before the replay; what it returns is checked
   (:func:`check_stage_output`) and crosses into the graph as copies (:func:`cross_into_graph`),
   made inside the stage, so a view of a shared buffer it returns is read by that copy;
2. ``prepare_in_graph(shared=, batch=, meta=)`` runs first in the graph, ``meta`` being this
   step's copies;
3. ``body(shared=, batch=, pools=, params=, meta=)`` runs the model, ``meta`` being the copies
   with ``prepare_in_graph``'s outputs merged over them by top-level key (its own, not copied).

Every value that crosses a stage boundary has a *name* (:func:`flatten_group`): ``meta.<key>``
for a copy, ``meta_in.<key>`` for an in-graph output, ``logits`` for the body's output, and
``shared.``, ``batch.``, ``pools.``, ``params.`` for the step's inputs. A traced program runs
on an environment of those names (``Program.run``), so a same-key output of
``prepare_in_graph`` never takes the place of the next step's copy.

>>> import torch
>>> fns = StepFunctions(
...     prepare_out_graph=lambda shared, batch: {"n": shared["seq_lens"] + 0},
...     prepare_in_graph=lambda shared, batch, meta: {"n": meta["n"].clamp(min=2)},
...     body=lambda shared, batch, meta: meta["n"] * 10)
>>> eval_step(EAGER, fns, {"shared": {"seq_lens": torch.tensor([1, 3])}, "batch": {}})
tensor([20, 30])
"""

from __future__ import annotations

import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any, Protocol, TypeVar, cast

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from readfence.effects import ReadEnd, ReadfenceError

_T = TypeVar("_T")


@attrs.frozen
class Stage:
    """One stage of a step: its name, whether it runs inside the graph, and read ends.

    ``end`` is the read end of a read made in it. ``escape_end`` is what an escape costs it (a
    host read, a reference handed out, a branch on data: Python the trace could not see, so the
    step runs the stage's Python): the end until which every shared buffer counts as read, beyond
    what the stage is traced and seen to read. ``outputs`` is the group its outputs are named under.

    * In the graph it is ``POST_REPLAY``: on a path the trace did not take, ``prepare_in_graph``
      may hand the body a view of any buffer, read wherever the body consumes it; and a CUDA
      graph cannot capture the stage at all (``lower`` refuses it there).
    * Out of the graph it is ``NONE``: an escape counts for the buffers it reaches, no more.
      *When*: whatever the stage's Python reads, on any path, it reads before it returns, and
      what it returns crosses into the graph as copies, so each read ends at ``PRE_REPLAY``, its
      ``end``. *Which*: the value a host read hands over is computed from the escaping tensor,
      whose memory and whose ancestors in the traced graph are traced reads of the stage (a host
      read of a copy of ``seq_lens`` reads ``seq_lens``, not ``swa_map``); on the traced path the
      trace holds every read. On another path, taken where the Python branches on the value,
      the runs of its Python show what it reads: the read observer on the example steps, and on
      the varied states, whose values differ so that a branch on data goes another way
      (``Program.varied_stages``, ``core.internal.Ledger.observe_varied``); the audit and ``lower`` count
      what they saw. A path none of them takes (a threshold no state crosses) is what ``verify``'s
      poison and the comparison with the serial run catch, as for any out-of-graph stage's Python
      that branches on what no trace sees (a counter it keeps).

    >>> PREPARE_IN_GRAPH.end, PREPARE_IN_GRAPH.escape_end, PREPARE_IN_GRAPH.in_graph
    (<ReadEnd.IN_REPLAY: 2>, <ReadEnd.POST_REPLAY: 3>, True)
    >>> PREPARE_OUT_GRAPH.escape_end
    <ReadEnd.NONE: 0>
    """

    name: str
    in_graph: bool
    end: ReadEnd
    escape_end: ReadEnd
    outputs: str

    def __str__(self) -> str:
        return self.name


#: Before the replay, host-launched; its outputs cross into the graph as copies, so nothing it
#: touched is read later: an escape counts for the buffers it reaches (see :class:`Stage`).
PREPARE_OUT_GRAPH = Stage("prepare_out_graph", in_graph=False, end=ReadEnd.PRE_REPLAY,
                          escape_end=ReadEnd.NONE, outputs="meta")
#: The graph's first nodes; its outputs are not copied: on a path the trace did not take they
#: may be views of any buffer, read wherever the body consumes them (POST_REPLAY).
PREPARE_IN_GRAPH = Stage("prepare_in_graph", in_graph=True, end=ReadEnd.IN_REPLAY,
                         escape_end=ReadEnd.POST_REPLAY, outputs="meta_in")
#: The model body, ``attend`` in every layer; its reads end with the replay.
BODY = Stage("body", in_graph=True, end=ReadEnd.POST_REPLAY, escape_end=ReadEnd.POST_REPLAY, outputs="logits")

#: The stages of one step, in execution order.
STAGES: tuple[Stage, ...] = (PREPARE_OUT_GRAPH, PREPARE_IN_GRAPH, BODY)
_BY_NAME = {s.name: s for s in STAGES}

#: Per stage name, the read end of a read in it: for what names a stage as text (the read
#: observer's labels); everything else holds the :class:`Stage` value and asks its ``end``.
STAGE_ENDS: dict[str, ReadEnd] = {s.name: s.end for s in STAGES}


def stage_named(name: str) -> Stage:
    """The :class:`Stage` called ``name``.

    >>> stage_named("body") is BODY
    True
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}; stages: {list(_BY_NAME)}") from None


# -- names -----------------------------------------------------------------------------------
_PLAIN = re.compile(r"[A-Za-z_][^.\[\]]*")


def _segment(key: Any) -> str:
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.MappingKey):
        k = key.key
        if isinstance(k, str) and _PLAIN.fullmatch(k):
            return k
        return f"[{k!r}]"
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return f"[{key!r}]"  # pragma: no cover - other key kinds


def flatten_group(prefix: str, tree: object) -> list[tuple[str, Any]]:
    """``[(name, leaf)]`` for a pytree (dicts, lists, tuples) under ``prefix``.

    A name joins the key path with dots: a string key that starts with a letter or ``_`` and
    holds no ``.``, ``[`` or ``]`` as it is, a sequence index as digits, any other key as
    ``[repr(key)]``. So keys ``"a.b"`` and ``"a"`` / ``"b"`` nested, or ``1`` and ``"1"``, never
    share a name; two distinct keys whose reprs agree do, and are refused.

    >>> flatten_group("params", {"layers": [{"wq": 1}], "emb": 2})
    [('params.layers.0.wq', 1), ('params.emb', 2)]
    >>> [n for n, _ in flatten_group("meta", {"a.b": 1, "a": {"b": 2}, 1: 3, "1": 4})]
    ["meta.['a.b']", 'meta.a.b', 'meta.[1]', "meta.['1']"]
    """
    pairs, _ = pytree.tree_flatten_with_path(tree)
    out = [(".".join([prefix, *map(_segment, path)]), leaf) for path, leaf in pairs]
    _check_distinct(prefix, [n for n, _ in out], [p for p, _ in pairs])
    return out


def _check_distinct(prefix: str, names: Sequence[str], paths: Sequence[Any]) -> None:
    if len(set(names)) == len(names):
        return
    seen: dict[str, Any] = {}
    for name, path in zip(names, paths):
        if name in seen:
            raise StageOutputError(f"the keys {pytree.keystr(seen[name])} and {pytree.keystr(path)} of {prefix} "
                                   f"both flatten to {name!r} (distinct keys whose reprs agree): rename one")
        seen[name] = path


# -- what a stage may return -----------------------------------------------------------------
#: Python values a stage may return besides tensors: constants of the traced graph.
PYTHON_VALUES = (bool, int, float, str, type(None))

_OWN = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class StageOutputError(ReadfenceError, ValueError):
    """A stage returned what a step cannot carry, or what the traced graph cannot reproduce.

    A stage returns a dict (``prepare_*``) or a tensor (``body``); a dict holds tensors, Python
    scalars (``bool``, ``int``, ``float``, ``str``), ``None``, and dicts, lists and tuples of
    them, under keys of any hashable type. A traced graph bakes the Python values and tensor
    shapes of the one step it traced, so one that changes from step to step is refused too.
    The message names the backend, the stage, the key and the line that returned it; ``stage``
    is the stage's name (``None`` where no one stage is at fault).
    """

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


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
    # q's shape, or its rows flattened ([T, heads * dim]): what the model reshapes it from
    return out.shape == like.shape or (out.shape[:1] == like.shape[:1] and out.numel() == like.numel())


def check_stage_output(stage: Stage, out: _T, *, backend: str = "?", fn: Callable[..., object] | None = None,
                       kwargs: Mapping[str, Any] | None = None, like: Tensor | None = None,
                       layer: int | None = None) -> _T:
    """``out`` if ``stage`` may return it (see :class:`StageOutputError`), else the error naming
    ``backend``, the stage, the key and (when ``fn`` and its ``kwargs`` are given) the line.
    With ``like`` (``q``), ``out`` is what ``attend`` returned in ``layer``: a tensor shaped like ``q``.

    >>> check_stage_output(PREPARE_IN_GRAPH, {"n": 3, "rows": [torch.ones(1), None]})["n"]
    3
    >>> check_stage_output(PREPARE_IN_GRAPH, {"n": {1, 2}}, backend="mine")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.core._step.StageOutputError: backend 'mine' stage prepare_in_graph returned set {1, 2} at key ['n'] (at ?): ...
    >>> check_stage_output(PREPARE_OUT_GRAPH, torch.zeros(2), backend="mine")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.core._step.StageOutputError: backend 'mine' stage prepare_out_graph returned Tensor tensor([0., 0.])
    instead of a dict (at ?): a prepare stage returns a dict (of tensors, Python scalars, None, and dicts, lists and
    tuples of them): put the tensor under a key, e.g. {'kv_indices': ...}
    >>> q = torch.zeros(2, 4, 8)
    >>> check_stage_output(BODY, q[:, :1], backend="mine", like=q, layer=0)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.core._step.StageOutputError: backend 'mine' attend returned a tensor of shape [2, 1, 8] in layer 0 (at ?):
    attend returns a tensor shaped like q, [2, 4, 8]
    """
    bad: object
    if stage is BODY and like is not None:
        unfit = unfit_tensor(out) if isinstance(out, Tensor) else None
        if isinstance(out, Tensor) and unfit is None and _fits(out, like):
            return out
        got = (unfit[0] if unfit is not None else f"a tensor of shape {list(out.shape)}"
               if isinstance(out, Tensor) else f"{type(out).__name__} {_short(out)}")
        line = "?" if fn is None else returned_at(fn, kwargs or {}, out)
        unwrap = f" (a plain tensor: {unfit[1]})" if unfit is not None else ""
        raise StageOutputError(f"backend {backend!r} attend returned {got} in layer {layer} (at {line}): attend returns "
                               f"a tensor shaped like q, {list(like.shape)}{unwrap}", stage=stage.name)
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
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v, meta)


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

    >>> guard = OutputGuard.of(PREPARE_OUT_GRAPH, {"n": 3, "lens": torch.zeros(2)}, backend="mine")
    >>> guard.check({"n": 3, "lens": torch.ones(2)})
    >>> guard.check({"n": 4, "lens": torch.ones(2)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.core._step.StageOutputError: backend 'mine' stage prepare_out_graph returned 4 at key ['n'] where the traced step returned 3 (at ?): ...
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

        >>> guard = OutputGuard.of(PREPARE_OUT_GRAPH, {"n": 3, "bound": 7}).consuming({"n"})
        >>> guard.check({"n": 3, "bound": 9})
        >>> guard.check({"n": 3, "bound": torch.zeros(1)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        readfence.core._step.StageOutputError: ... where the traced step returned a Python value (at ?): ...
        """
        narrowed = attrs.evolve(self, consumed=frozenset(keys))
        baked = tuple(b if b[0] == "tensor" or narrowed._holds(p) else ("value", None, None)
                      for p, b in zip(self.paths, self.baked, strict=True))
        return attrs.evolve(narrowed, baked=baked)

    def check(self, out: object, fn: Callable[..., object] | None = None, kwargs: Mapping[str, Any] | None = None) -> None:
        """Refuse ``out`` unless it has the structure, shapes, dtypes and consumed Python values
        traced (``fn`` and ``kwargs``, the stage's call, only to name the line in the error)."""
        pairs, spec = pytree.tree_flatten_with_path(out)
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


def _key_of(entry: Any) -> Any:
    """The key a pytree path entry stands for (a dict key, a sequence index, an attribute)."""
    if isinstance(entry, pytree.MappingKey):
        return entry.key
    if isinstance(entry, pytree.SequenceKey):
        return entry.idx
    return getattr(entry, "name", entry)


# -- one stage's call ------------------------------------------------------------------------
Origin = str | Mapping[Any, str]


@attrs.frozen
class StageCall:
    """One stage of one step, as the protocol hands it to an interpreter.

    ``fn(**kwargs)`` runs it (the user's function, its output checked, and for
    ``prepare_out_graph`` copied into the graph). ``origins`` names the leaves of each
    argument: a group name, or per top-level key the group of the stage that produced it
    (the body's ``meta`` mixes copies, ``meta``, and in-graph outputs, ``meta_in``).
    """

    stage: Stage
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any]
    origins: Mapping[str, Origin] = attrs.Factory(dict)
    backend: str = "?"
    # the step's in-graph stages are replayed from a capture (``StepFunctions.replayed``)
    replayed: bool = True

    def __call__(self) -> Any:
        """Run the stage as written."""
        return self.fn(**self.kwargs)

    def named_leaves(self) -> tuple[list[str], list[Any], pytree.TreeSpec]:
        """The names and leaves of the arguments, in flattening order, and the spec that
        :meth:`rebuild` uses.

        >>> call = StageCall(BODY, lambda **kw: None, {"meta": {"a": 1, "b": 2}},
        ...                  {"meta": {"a": "meta", "b": "meta_in"}})
        >>> call.named_leaves()[0]
        ['meta.a', 'meta_in.b']
        """
        pairs, spec = pytree.tree_flatten_with_path(dict(self.kwargs))
        names = []
        for path, _ in pairs:
            arg = cast(pytree.MappingKey, path[0]).key  # the arguments are a dict, so is a mapped one
            origin = self.origins.get(arg, arg)
            group = origin if isinstance(origin, str) else origin[cast(pytree.MappingKey, path[1]).key]
            names.append(".".join([group, *map(_segment, path[1:])]))
        _check_distinct(f"stage {self.stage.name}'s arguments", names, [p for p, _ in pairs])
        return names, [leaf for _, leaf in pairs], spec

    def rebuild(self, leaves: Sequence[object], spec: pytree.TreeSpec) -> dict[str, Any]:
        """The arguments with their leaves replaced by ``leaves`` (same order and spec)."""
        return dict(pytree.tree_unflatten(list(leaves), spec))

    def output_names(self, out: object) -> list[tuple[str, Any]]:
        """``[(name, leaf)]`` of what the stage returned, under its ``outputs`` group."""
        return flatten_group(self.stage.outputs, out)


class Interpreter(Protocol):
    """What runs a step's stages: handed each :class:`StageCall` in order, it returns what the
    stage returned (on real tensors, as the step would)."""

    def call(self, call: StageCall) -> Any:
        """Run one stage."""
        ...


class Eager:
    """The interpreter that runs each stage as written: the serial reference.

    >>> EAGER.call(StageCall(BODY, lambda x: x + 1, {"x": 1}))
    2
    """

    def call(self, call: StageCall) -> Any:
        return call()


EAGER = Eager()


# -- the step --------------------------------------------------------------------------------
@attrs.frozen
class StepFunctions:
    """A step's three stage functions over keyword groups (what :func:`eval_step` calls).

    ``prepare_out_graph(shared, batch) -> dict``, ``prepare_in_graph(shared, batch, meta) ->
    dict`` and ``body(**inputs, meta) -> logits``, ``inputs`` being the step's groups
    (``shared``, ``batch``, then e.g. ``pools``, ``params``). ``backend`` names them in errors.
    ``replayed`` says whether the step's in-graph stages are replayed from a capture (a mode the
    engine graph-replays: ``core._protocol.replayed``); a step that is not runs every stage as its
    Python, as the engine does. ``readfence.core.step_functions`` makes them for a backend and the
    tiny model.
    """

    prepare_out_graph: Callable[..., object]
    prepare_in_graph: Callable[..., object]
    body: Callable[..., object]
    backend: str = "?"
    replayed: bool = True


def _checked(stage: Stage, fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    def run(**kwargs: Any) -> Any:
        return check_stage_output(stage, fn(**kwargs), backend=backend, fn=fn, kwargs=kwargs)

    return run


def _crossing(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    checked = _checked(PREPARE_OUT_GRAPH, fn, backend)

    def run(**kwargs: Any) -> Any:
        return cross_into_graph(checked(**kwargs))

    return run


def eval_step(interp: Interpreter, fns: StepFunctions, inputs: Mapping[str, object]) -> Any:
    """Run one step of ``fns`` on ``inputs`` (groups: ``shared``, ``batch``, ...) through
    ``interp``; returns what the body returned. The step's protocol, written once (see the
    module docstring): every interpretation of a step is a call of this function.

    >>> fns = StepFunctions(lambda shared, batch: {"k": shared["x"][:1]},
    ...                     lambda shared, batch, meta: {}, lambda shared, batch, meta: meta["k"])
    >>> x = torch.ones(2)
    >>> eval_step(EAGER, fns, {"shared": {"x": x}, "batch": {}}).data_ptr() != x.data_ptr()  # a copy
    True
    """
    shared, batch = inputs["shared"], inputs.get("batch", {})
    name, replayed = fns.backend, fns.replayed
    meta = interp.call(StageCall(PREPARE_OUT_GRAPH, _crossing(fns.prepare_out_graph, name),
                                 {"shared": shared, "batch": batch}, backend=name, replayed=replayed))
    own = interp.call(StageCall(PREPARE_IN_GRAPH, _checked(PREPARE_IN_GRAPH, fns.prepare_in_graph, name),
                                {"shared": shared, "batch": batch, "meta": meta},
                                {"meta": PREPARE_OUT_GRAPH.outputs}, backend=name, replayed=replayed))
    merged = {**meta, **own}
    origins = {k: PREPARE_IN_GRAPH.outputs if k in own else PREPARE_OUT_GRAPH.outputs for k in merged}
    return interp.call(StageCall(BODY, _checked(BODY, fns.body, name), {**inputs, "meta": merged},
                                 {"meta": origins}, backend=name, replayed=replayed))
