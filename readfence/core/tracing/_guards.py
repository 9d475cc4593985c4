"""The Python values a backend's code can read, found by walking what that code names: what a
cached trace is keyed by, and where each tensor a graph captured is kept.

A trace bakes every Python value its stages read (a module's flag, a closure's variable, a field
of a config object, an attribute of the backend) into its graph, and captures every tensor they
reach without receiving it. So a cached trace, and everything computed from it, belongs to those
values. As torch.compile's guards do, readfence keys its caches by them; unlike Dynamo it does
not watch the bytecode run: it walks what the code *can* read, starting from the backend object
and following only what some code on the way names (:func:`reach`):

* a function: its code (by identity), defaults, closure cells, and the globals its code names
  (``co_names``, and the string constants, of it and of every code object nested in it);
* a bound method: its object and function; a ``functools.partial``: its function and arguments;
  a property, a static or class method, a ``__wrapped__`` function: what it wraps;
* a module, a class and its bases, an object's ``__dict__`` or slots: the entries whose names some
  reached code names; a list, tuple, deque, dict or set: every item;
* a tensor: its identity, storage, shape, strides and dtype, never its values (the step's data);
  a number, string, enum member or torch dtype: its value;
* a triton kernel (``@triton.jit``, ``autotune``, ``heuristics``, interpreted or not): its identity
  and the Python function it was made from, walked as a function: the helpers and constants its
  globals hold are what triton compiles it with (triton compiles a kernel again when they change);
* anything else of torch, triton, numpy, the standard library or readfence's own machinery: its
  identity, unwalked.

Attributes and globals that the reached code assigns itself (``self.meta = ...``, ``global BUF``)
are the backend's per-step state, not its settings: they stay out of :class:`Settings` (or a
backend keeping metadata on ``self`` would never hit a cache), but the tensors among them are
found all the same, so that each tensor a graph captured is checked where the backend keeps it
(:class:`KeptTensor`). The walk stops at :data:`LIMIT` values and :data:`DEPTH` references; what
lies beyond, and what no code names (a ``getattr`` with a computed name, C state, the
environment), it cannot see: :attr:`Settings.complete` says whether it stopped early.

>>> FLAG = [1.0]
>>> def stage(x):
...     return x * FLAG[0]
>>> before = reach(stage).settings
>>> FLAG[0] = 2.0
>>> str(reach(stage).settings.changed_from(before))
"fn.__globals__['FLAG'][0]"
"""

from __future__ import annotations

import collections
import dis
import functools
import types
from collections.abc import Hashable, Mapping
from typing import Any

import attrs
import torch

from readfence.effects import ReadfenceError

from .._step import BODY, STAGES
from ._memory import unobserved
from ._reached import GONE as GONE
from ._reached import Path as Path
from ._reached import Reach as Reach
from ._reached import Settings as Settings
from ._reached import _memory
from ._reached import tensor_layout as tensor_layout
from ._value_kinds import (
    _ATOM_TYPES,
    _KINDS,
    _MACHINERY_DIRS,
    _OPAQUE_PACKAGES,
    _OPAQUE_READFENCE,
    _WRAPPERS,
    _classify,
    _classify_module,
    _Slots,
    _slots_of,
    _Space,
)

#: At most this many values are walked from one root; what lies beyond is not seen.
LIMIT = 4096
#: ... and at most this many references deep.
DEPTH = 12

#: What the step calls on a backend: the walk starts from these names.
STAGE_NAMES = frozenset({*(s.name for s in STAGES if s is not BODY), "attend", "runs_as", "child_runs", "replayed",
                         "name", "children", "forward"})


# -- the walk ----------------------------------------------------------------------------------
def code_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """``(names, assigned attributes, assigned globals)`` of ``code`` and every code object nested
    in it: the names it reads (``co_names`` and string constants that are identifiers: a
    ``getattr(self, "flag")`` or a ``config["scale"]``), the attributes it assigns, deletes or
    changes the items of, the globals likewise (``global BUF; BUF = ...``, ``SEEN[key] = ...``,
    ``self.cache.append(...)``: per-step state, not settings).

    >>> def f(self):
    ...     self.meta = self.scale * getattr(self, "bias")
    ...     self.per_mode["decode"] = SEEN["lens"] = self.meta
    ...     self.log.append(1)
    >>> names, attrs_set, globals_set = code_names(f.__code__)
    >>> sorted(names & {"meta", "scale", "bias"}), sorted(attrs_set), sorted(globals_set)
    (['bias', 'meta', 'scale'], ['log', 'meta', 'per_mode'], ['SEEN'])
    """
    hit = _CODE_NAMES.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    names: set[str] = set()
    assigned: set[str] = set()
    assigned_globals: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                stack.append(const)
            elif isinstance(const, str) and const.isidentifier():
                names.add(const)
        code_ops = list(dis.get_instructions(c))
        for i, ins in enumerate(code_ops):
            if ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
                assigned.add(ins.argval)
            elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                assigned_globals.add(ins.argval)
            elif ins.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") and i >= 2 and code_ops[i - 1].opname in _SIMPLE_LOADS:
                _changed(code_ops[i - 2], assigned, assigned_globals)  # container[key] = ...
            elif ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in _MUTATORS and i >= 1:
                _changed(code_ops[i - 1], assigned, assigned_globals)  # container.append(...)
    facts = frozenset(names), frozenset(assigned), frozenset(assigned_globals)
    if len(_CODE_NAMES) >= 8192:
        _CODE_NAMES.clear()
    _CODE_NAMES[id(code)] = (code, facts)  # the code object held: its id is not reused
    return facts


#: Loads of one instruction (a key that is a constant or a name).
_SIMPLE_LOADS = frozenset({"LOAD_CONST", "LOAD_FAST", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME"})
#: Methods that change the list, dict or set they are called on.
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "popitem",
                       "add", "discard"})


def _changed(container: dis.Instruction, attributes: set[str], globals_: set[str]) -> None:
    # what an instruction loaded whose items the code then changes: an attribute or a global
    if container.opname in ("LOAD_ATTR", "LOAD_METHOD"):
        attributes.add(container.argval)
    elif container.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
        globals_.add(container.argval)


#: :func:`code_names` by code object (by identity: hashing a code object hashes its bytecode).
_CODE_NAMES: dict[int, tuple[types.CodeType, tuple[frozenset[str], frozenset[str], frozenset[str]]]] = {}


class _Full(Exception):
    """The walk met its limit."""


class _Walk:
    """One walk from one root (see the module docstring)."""

    def __init__(self, limit: int, depth: int, known: _Walk | None = None) -> None:
        self.limit, self.depth = limit, depth
        self.entries: list[tuple[Path, Hashable]] = []
        self.tensors: list[tuple[Path, torch.Tensor]] = []
        self.held: list[Any] = []
        self.seen: dict[int, int] = {}  # id -> the entry of its first visit
        # every name some reached code names, and those it assigns (``known``: a walk before this one's)
        self.names: set[str] = set(STAGE_NAMES) | (known.names if known else set())
        self.fresh: set[str] = set()  # ... of which those not looked up yet in the namespaces met before
        self.assigned: set[str] = set(known.assigned) if known else set()
        self.assigned_globals: set[str] = set(known.assigned_globals) if known else set()
        self.spaces: list[_Space] = []  # the namespaces walked by name
        self.space_ids: set[int] = set()
        # what the code assigns, walked last: a value met there and elsewhere is a setting where
        # it is read, not state where it is kept for a step
        self.deferred: list[tuple[Any, Path, int]] = []
        self.complete = True

    def run(self, root: object, path: Path) -> None:
        try:
            self._run(root, path)
        except _Full:  # what lies beyond the limit is not seen
            self.complete = False

    def _run(self, root: object, path: Path) -> None:
        self.visit(root, path, 0)
        # names found later open entries of namespaces met earlier: look each name up once in
        # each namespace, until no name and no namespace is new; then what the code assigns
        looked = 0
        while self.fresh or looked < len(self.spaces) or self.deferred:
            if not self.fresh and looked == len(self.spaces):
                deferred, self.deferred = self.deferred, []
                for value, at, depth in deferred:
                    self.visit(value, at, depth)
                continue
            fresh, self.fresh = self.fresh, set()
            spaces, met = self.spaces[:looked], self.spaces[looked:]
            looked = len(self.spaces)
            for space, names in [(sp, sp.keys & fresh) for sp in spaces if fresh] + [(sp, sp.keys & self.names) for sp in met]:
                assigned = self.assigned_globals if space.kind == "global" else self.assigned
                for name in sorted(names):
                    try:
                        value = space.mapping[name]
                    except KeyError:
                        continue
                    at = space.path.then(space.kind, name)
                    if name in assigned:
                        self.deferred.append((value, at, space.depth + 1))
                    else:
                        self.visit(value, at, space.depth + 1)

    def excluded(self) -> set[tuple[str, Hashable]]:
        """The path steps that make an entry per-step state: the names the reached code assigns."""
        return {*(("attr", n) for n in self.assigned), *(("entry", n) for n in self.assigned),
                *(("global", n) for n in self.assigned_globals)}

    def settled(self) -> bool:
        """Whether no value is a setting only through a visit that came first under a name found
        assigned later (the walk then walks again, knowing the names from the start)."""
        excluded = self.excluded()
        out = {i for i, (p, _) in enumerate(self.entries) if not excluded.isdisjoint(p.steps)}
        return not any(type(t) is tuple and t[:1] == ("again",) and t[1] in out and i not in out
                       for i, (_, t) in enumerate(self.entries))

    def visit(self, v: Any, path: Path, depth: int) -> None:
        kind = type(v)
        how = _KINDS.get(kind) or _classify(kind)
        if how == "atom":
            self.entries.append((path, (kind.__name__, v.hex() if kind is float else v)))
            return
        if how == "value":
            self.entries.append((path, (kind.__qualname__, str(v))))
            return
        if len(self.entries) >= self.limit:
            raise _Full
        if depth > self.depth:
            self.complete = False
            self.entries.append((path, ("unwalked", id(v))))
            self.held.append(v)
            return
        first = self.seen.get(id(v))
        if first is not None:  # a value met again: where, not what (its first visit said that)
            self.entries.append((path, ("again", first)))
            if how == "tensor":
                self.tensors.append((path, v))
            return
        self.seen[id(v)] = len(self.entries)  # (the entry its visit is about to add)
        self.held.append(v)
        if how == "function" and v.__code__.co_filename.startswith(_MACHINERY_DIRS):
            how = "opaque"  # readfence's machinery (by where its code is: a doctest's functions are not)
        getattr(self, "_" + how)(v, path, depth + 1)

    def _tensor(self, v: torch.Tensor, path: Path, d: int) -> None:
        self.entries.append((path, ("tensor", *tensor_layout(v))))
        self.tensors.append((path, v))

    def _opaque(self, v: Any, path: Path, d: int) -> None:
        self.entries.append((path, ("object", type(v).__qualname__, id(v))))

    def _kernel(self, v: Any, path: Path, d: int) -> None:
        self.entries.append((path, ("kernel", type(v).__qualname__, id(v))))
        fn = getattr(v, "fn", None)  # the function (or the kernel an autotuner or heuristics wraps)
        if fn is not None:
            self.visit(fn, path.then("attr", "fn"), d)

    def _module(self, v: types.ModuleType, path: Path, d: int) -> None:
        self.entries.append((path, ("module", v.__name__)))
        if v.__name__.partition(".")[0] not in _OPAQUE_PACKAGES and not v.__name__.startswith(_OPAQUE_READFENCE):
            self.space(path, vars(v), "attr", d - 1)

    def _function(self, v: types.FunctionType, path: Path, d: int) -> None:
        code = v.__code__
        self.entries.append((path, ("function", v.__qualname__, id(code))))
        names, assigned, assigned_globals = code_names(code)
        if not names <= self.names:
            new = names - self.names
            self.names |= new
            self.fresh |= new
        self.assigned |= assigned
        self.assigned_globals |= assigned_globals
        if v.__defaults__:
            for i, value in enumerate(v.__defaults__):
                self.visit(value, path.then("default", i), d)
        if v.__kwdefaults__:
            for k, value in v.__kwdefaults__.items():
                self.visit(value, path.then("kwdefault", k), d)
        if v.__closure__:
            for i, (name, cell) in enumerate(zip(code.co_freevars, v.__closure__, strict=False)):
                try:
                    contents = cell.cell_contents
                except ValueError:  # a cell not filled yet
                    contents = GONE
                self.visit(contents, path.then("cell", (i, name)), d)
        if "__wrapped__" in v.__dict__:
            self.visit(v.__dict__["__wrapped__"], path.then("attr", "__wrapped__"), d)
        self.space(path, v.__globals__, "global", d - 1)

    def _method(self, v: types.MethodType, path: Path, d: int) -> None:
        self.entries.append((path, ("method",)))
        self.visit(v.__self__, path.then("attr", "__self__"), d)
        self.visit(v.__func__, path.then("attr", "__func__"), d)

    def _partial(self, v: functools.partial[Any], path: Path, d: int) -> None:
        self.entries.append((path, ("partial", len(v.args), tuple(v.keywords))))
        self.visit(v.func, path.then("attr", "func"), d)
        self.visit(v.args, path.then("attr", "args"), d)
        self.visit(v.keywords, path.then("attr", "keywords"), d)

    def _wrapper(self, v: Any, path: Path, d: int) -> None:
        attr = next(a for kind, a in _WRAPPERS.items() if isinstance(v, kind))
        self.entries.append((path, (type(v).__name__,)))
        self.visit(getattr(v, attr), path.then("attr", attr), d)

    def _sequence(self, v: list[Any] | tuple[Any, ...] | collections.deque[Any], path: Path, d: int) -> None:
        self.entries.append((path, (type(v).__name__, len(v))))
        for i, x in enumerate(v):
            self.visit(x, path.then("item", i), d)

    def _mapping(self, v: dict[Any, Any], path: Path, d: int) -> None:
        self.entries.append((path, (type(v).__name__, len(v))))
        for k, x in list(v.items()):
            self.visit(x, path.then("item", k), d)

    def _set(self, v: set[Any] | frozenset[Any], path: Path, d: int) -> None:
        atoms = all(type(x) in _ATOM_TYPES for x in v)
        self.entries.append((path, (type(v).__name__, frozenset(v) if atoms else id(v))))

    def _class(self, v: type, path: Path, d: int) -> None:
        self.entries.append((path, ("class", v.__qualname__, id(v))))
        for i, base in enumerate(v.__mro__):
            if base is not object and _classify_module(base) != "opaque":
                self.space(path if i == 0 else path.then("attr", "__mro__").then("item", i), vars(base), "entry", d - 1)

    def _record(self, v: Any, path: Path, d: int) -> None:
        self.entries.append((path, ("object", type(v).__qualname__)))
        fields = getattr(v, "__dict__", None)
        if type(fields) is dict:
            self.space(path, fields, "attr", d - 1)

    def _object(self, v: Any, path: Path, d: int) -> None:
        kind = type(v)
        self.entries.append((path, ("object", kind.__qualname__)))
        self.visit(kind, path.then("attr", "__class__"), d)
        fields = getattr(v, "__dict__", None)
        if type(fields) is dict:
            self.space(path, fields, "attr", d - 1)
        slots = _slots_of(kind)  # type: ignore[arg-type]
        if slots:
            self.space(path, _Slots(v, slots), "attr", d - 1)

    def space(self, path: Path, namespace: Mapping[str, Any], kind: str, depth: int) -> None:
        # a module's globals reached through each of its functions: walked once, from the first
        key = id(namespace.obj) if isinstance(namespace, _Slots) else id(namespace)
        if key not in self.space_ids:
            self.space_ids.add(key)
            self.spaces.append(_Space(path, namespace, namespace.keys(), kind, depth))


def reach(root: object, name: str = "fn", *, limit: int = LIMIT, depth: int = DEPTH) -> Reach:
    """Walk what code reachable from ``root`` can read (see the module docstring): its
    :class:`Settings` and every tensor it keeps, with their paths (from ``name``).

    >>> def kernel(scale):
    ...     buf = torch.zeros(2)
    ...     def attend(q):
    ...         return q + buf * scale
    ...     return attend
    >>> found = reach(kernel(2.0), "backend")
    >>> [str(p) for p, _ in found.tensors]
    ['backend.__closure__[0].cell_contents']
    >>> reach(kernel(2.0)).settings == reach(kernel(2.0)).settings, found.settings == reach(kernel(3.0)).settings
    (False, False)
    """
    walk = _Walk(limit, depth)
    walk.run(root, Path(name))
    if not walk.settled():
        walk = _Walk(limit, depth, known=walk)
        walk.run(root, Path(name))
    excluded = walk.excluded()
    entries = tuple((p, t) for p, t in walk.entries if excluded.isdisjoint(p.steps))
    return Reach(Settings(entries, walk.complete, tuple(walk.held)), tuple(walk.tensors))


# -- captured tensors, checked where they are kept ---------------------------------------------
class StaleCaptureError(ReadfenceError, ValueError):
    """A lowered graph captured a tensor that the backend has since replaced, resized or moved:
    replayed, it would read the old memory (on a GPU, a CUDA graph holds the old address)."""

    def __init__(self, backend: str, where: str, stage: str, kept: str, what: str) -> None:
        self.backend, self.stage, self.kept = backend, stage, kept
        super().__init__(
            f"backend {backend!r} ({where}): stage {stage} captured the tensor kept at {kept}, which {what} since "
            f"the graph was lowered: replaying it would read the old buffer. Lower the step again once the backend's "
            f"buffers have their final size (a capture list lowers its stale sizes again), or allocate the buffer at "
            f"its largest size before lowering")


class UnkeptCaptureError(ReadfenceError, ValueError):
    """A graph would capture a tensor that the step's Python fills on every step (a metadata buffer
    the backend keeps) but that the backend keeps nowhere the walk of its values can look: whether
    the backend later replaces it (a cache that evicts, a thread-local, a name built at run time)
    cannot be checked, and a replay would then read the old buffer."""

    def __init__(self, backend: str, stage: str, shape: tuple[int, ...], filled_by: str) -> None:
        self.backend, self.stage = backend, stage
        super().__init__(
            f"backend {backend!r}: stage {stage} would capture a tensor of shape {shape} that the Python of stage "
            f"{filled_by} fills on every step, kept where readfence cannot find it again (not an attribute, closure, "
            f"global, default or container item that the backend's code names: e.g. a functools.lru_cache entry, a "
            f"threading.local, a getattr with a computed name): were the backend to replace it, a replay would read "
            f"the old buffer unseen. Keep it on the backend object (or in a list or dict its code names), or return "
            f"it from prepare_out_graph")


@attrs.frozen(eq=False)
class KeptTensor:
    """A tensor a graph captured (``stage``, its ``target`` in the graph), every place the backend
    kept it when the graph was made (``homes``: paths from the backend holding it, or a view of its
    memory; none where no code the walk reached keeps it) and its :func:`tensor_layout` then.

    It is stale once its layout changed (resized or moved in place: a CUDA graph holds the old
    address), or once none of its homes holds it any more (the backend replaced it: what the step's
    Python writes now, the graph does not read). A place that held it only for one step (metadata
    rebuilt every step) may change while another keeps it: that is no change. A tensor the graph's
    own ops re-point (``repointed``: ``set_`` and kin on it) moves at every replay by the graph's
    doing, as the step's Python moves it: its layout is no test, where the backend keeps it still is.
    """

    stage: str
    target: str
    tensor: torch.Tensor = attrs.field(repr=False)
    homes: tuple[tuple[Path, bool], ...]
    layout: tuple[Any, ...]
    repointed: bool = False
    filled_by: frozenset[str] = frozenset()  # the stages whose run writes its memory

    def stale(self, backend: object) -> str | None:
        """How the tensor changed since, seen from ``backend``: ``None`` when the graph still
        reads what the backend keeps (asked at a replay a check mode may watch: readfence's own
        look at memory)."""
        with unobserved():
            return self._stale(backend)

    def _stale(self, backend: object) -> str | None:
        if not self.repointed and tensor_layout(self.tensor) != self.layout:
            return f"was resized or moved in place (now shape {tuple(self.tensor.shape)})"
        if not self.homes:
            return None
        memory = _memory(self.tensor)
        for path, itself in self.homes:
            now = path.resolve(backend)
            if now is self.tensor or (not itself and isinstance(now, torch.Tensor) and _memory(now) == memory):
                return None
        now = self.homes[0][0].resolve(backend)
        if now is GONE:
            return "is no longer there"
        shown = f"a tensor of shape {tuple(now.shape)}" if isinstance(now, torch.Tensor) else type(now).__name__
        return f"was replaced (it holds {shown} now)"

    @property
    def where(self) -> str:
        """Where the backend kept it (its first home), or its name in the graph."""
        return str(self.homes[0][0]) if self.homes else f"{self.target} of the graph"


def kept_tensors(stages: Any, found: Reach) -> tuple[KeptTensor, ...]:
    """Every tensor the graphs of ``stages`` (``StageGraph``\\ s) captured, with where ``found``
    (a :func:`reach` of the backend) saw it kept."""
    out = []
    for s in stages:
        for c in s.analysis.captured:
            t = getattr(s.graph.gm, c.target, None)
            if isinstance(t, torch.Tensor):
                out.append(KeptTensor(s.stage.name, c.target, t, found.homes(t), tensor_layout(t),
                                      repointed=c.target in _repointed(s.graph.gm), filled_by=c.filled_by))
    return tuple(out)


def _repointed(gm: Any) -> frozenset[str]:
    """The captured tensors (``get_attr`` targets) an op of ``gm`` changes the memory of (an
    ``inplace_view`` op, ``set_`` and kin, given it as ``self``)."""
    return frozenset(n.args[0].target for n in gm.graph.nodes
                     if n.op == "call_function" and torch.Tag.inplace_view in getattr(n.target, "tags", ())
                     and n.args and getattr(n.args[0], "op", None) == "get_attr")


def first_stale(kept: tuple[KeptTensor, ...], backend: object) -> tuple[KeptTensor, str] | None:
    """The first of ``kept`` that changed, seen from ``backend``, and how; ``None`` if none did."""
    for k in kept:
        what = k.stale(backend)
        if what is not None:
            return k, what
    return None


__all__ = ["DEPTH", "GONE", "LIMIT", "KeptTensor", "Path", "Reach", "Settings", "StaleCaptureError", "UnkeptCaptureError", "code_names",
           "first_stale", "kept_tensors", "reach", "tensor_layout"]
