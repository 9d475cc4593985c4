"""What a triton kernel may store to, decided from its Python source: the fallback of the IR analysis.

readfence decides what a kernel reads and writes from triton's own IR
(:func:`~readfence.core.tracing._kernel_ir.kernel_access`); this module holds what that decision
gives (:class:`KernelAccess`) and the walk of the kernel's source used where triton's front end
cannot be imported. The walk matches names, so it knows only the spellings it lists, where the IR
sees every spelling as the same op (``tests/core/test_kernel_ir.py`` keeps what it misses).

A triton kernel receives tensors as pointers and reads and writes them through ``tl.load`` and
``tl.store`` (and the atomics, and the ``store`` methods of block pointers and tensor descriptors):
no dispatcher sees it. :func:`source_access` reads the kernel's Python source, as triton's own
front end does, and follows, for every value, which pointer arguments it may be derived from (its
*provenance*): an assignment joins its value's provenance into its targets (a name assigned on two
paths may hold either, whatever branch ran), pointer arithmetic joins its operands', ``tl.where``
and any other builtin join their arguments', and a load (the value it returns is data, not an
address) gives none. The arguments whose provenance reaches the pointer of a store or an atomic are
what the kernel may write. It is conservative where it cannot follow:

* a call to another ``@triton.jit`` function is followed into that function (its written parameters
  map back to the arguments given for them);
* a call it cannot resolve to a triton builtin, a Python builtin or a jit function (a local alias
  of ``tl.store``, ``tl.inline_asm_elementwise``) may write whatever its arguments point to;
* any use of a pointer type (``tl.pointer_type``: a cast of an address loaded from memory or
  passed as an int, and, since the source does not say what is cast, of a pointer argument too)
  may point anywhere: the kernel's memory is not bounded by its arguments (``unbounded`` says
  where), and readfence refuses to launch it while it watches;
* a kernel whose source cannot be read writes every argument.

Every tensor argument counts as read, loaded or not.

>>> def copy(src, dst, n, BLOCK):
...     i = tl.arange(0, BLOCK)
...     tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)
>>> tl = _tl_standin()
>>> sorted(source_access(copy).writes)  # (an integer in an address counts too; a launch maps tensors only)
['BLOCK', 'dst']
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from ._cache import CACHES
from ._guards import Settings, reach

#: Triton builtins whose first argument (``pointer``) is a memory location they write.
STORES = frozenset({"store", "atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
                    "atomic_store", "atomic_xchg", "atomic_xor"})
#: Triton builtins that return data read from memory: the value has no pointer provenance.
LOADS = frozenset({"load", "atomic_load", "atomic_poll", *STORES - {"store"}})
#: Names whose use makes a pointer out of an integer.
_POINTER_FROM_INT = frozenset({"pointer_type", "int_to_ptr"})
#: Triton builtins that may run code the analysis cannot read (inline assembly).
_OPAQUE_BUILTINS = frozenset({"inline_asm_elementwise"})
_WILD = "<an address made from an integer>"
_POINTER = "<a pointer type>"  # what a launch handed a parameter, in the cache key (pointer types do not hash)


#: What decided a :class:`KernelAccess` (its ``basis``), where an analysis did.
FROM_IR = "triton's IR"
FROM_SOURCE = "the kernel's source"


@attrs.frozen
class KernelAccess:
    """What one triton kernel may touch, by parameter name.

    ``writes``: the parameters a store's or an atomic's address may be computed from (an
    integer offset too: a launch looks only at the tensors among them); ``sites``: for each, where
    (``(parameter, "file:line: what")``, the first site found); ``unbounded``: why the kernel's
    memory is not bounded by its arguments (``""`` when it is); ``reads``: the parameters a load's
    address may be computed from; ``indexed``: per parameter read or written, the parameters whose
    loaded values its addresses are computed from (``req_to_token`` at the rows
    ``req_pool_indices`` holds); ``basis``: what decided it (triton's IR, the kernel's source, or
    why every argument counts as read and written).

    >>> KernelAccess("k", ("a", "b"), frozenset({"b"})).written(("a", "b"))
    (False, True)
    """

    kernel: str
    params: tuple[str, ...]
    writes: frozenset[str] = frozenset()
    sites: tuple[tuple[str, str], ...] = ()
    unbounded: str = ""
    reads: frozenset[str] = frozenset()
    indexed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    basis: str = FROM_SOURCE

    def written(self, names: tuple[str, ...]) -> tuple[bool, ...]:
        """Per parameter name in ``names``, whether the kernel may write it."""
        return tuple(n in self.writes for n in names)

    def site(self, param: str) -> str:
        """Where the kernel may write ``param`` (``"file:line: tl.store"``), or ``""``."""
        return next((where for p, where in self.sites if p == param), "")

    @property
    def decided(self) -> bool:
        """Whether an analysis decided it (``False``: every argument counts, ``basis`` says why).

        >>> KernelAccess("k", ()).decided, every_argument(lambda a: None, "no IR").decided
        (True, False)
        """
        return self.basis in (FROM_IR, FROM_SOURCE)

    def index_of(self, param: str) -> tuple[str, ...]:
        """The parameters whose loaded values the addresses of ``param`` are computed from.

        >>> KernelAccess("k", ("t", "rows"), indexed=(("t", ("rows",)),)).index_of("t")
        ('rows',)
        """
        return next((by for p, by in self.indexed if p == param), ())


def every_argument(py: Callable[..., Any], why: str) -> KernelAccess:
    """The access of a kernel nothing could be decided of: every parameter read and written, ``why``
    kept as the basis and as each parameter's site (a failed analysis is never "writes nothing").

    >>> def k(a, b): pass
    >>> access = every_argument(k, "its IR cannot be built")
    >>> sorted(access.writes), access.site("a")
    (['a', 'b'], 'its IR cannot be built: every argument counts as read and written')
    """
    params = tuple(inspect.signature(py).parameters)
    site = f"{why}: every argument counts as read and written"
    return KernelAccess(getattr(py, "__name__", "?"), params, frozenset(params), tuple((p, site) for p in params),
                        reads=frozenset(params), basis=site)


def python_function(kernel: Any) -> Callable[..., Any] | None:
    """The Python function a triton kernel object was made from (through ``autotune`` and
    ``heuristics`` wrappers: each keeps the next in ``fn``), or ``None``.

    >>> def k(x): pass
    >>> python_function(types.SimpleNamespace(fn=types.SimpleNamespace(fn=k))) is k
    True
    """
    seen = 0
    while kernel is not None and seen < 16:
        if isinstance(kernel, types.FunctionType):
            return kernel
        kernel = getattr(kernel, "fn", None)
        seen += 1
    return None


def _is_triton(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "")
    return isinstance(module, str) and module.split(".")[0] == "triton"


def _is_pointer_type(obj: Any) -> bool:
    # a triton pointer type (``tl.pointer_type(tl.float32)``), held in a global or handed to a parameter
    return type(obj).__name__ == "pointer_type" and _is_triton(obj)


def _is_jit(obj: Any) -> bool:
    # a @triton.jit function (compiled or interpreted), or a wrapper of one
    return _is_triton(obj) and hasattr(obj, "fn") and python_function(obj) is not None


@attrs.frozen
class SourceKey:
    """A function's compiled code and the file it was compiled from: what its source text is
    (code objects compare equal across files)."""

    code: types.CodeType
    file: str


@attrs.frozen
class _Source:
    """A function's parsed source: its first line, file, ``def`` node, parameters and the names it
    assigns (never changed once made: each walk keeps its own provenance)."""

    first: int
    file: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    params: tuple[str, ...]
    positional: tuple[str, ...]
    locals: frozenset[str]
    #: each assignment's targets (the names each binds) and value, in walk order
    assignments: tuple[tuple[tuple[tuple[str, ...], ...], ast.AST | None], ...]


def _assignments(fdef: ast.AST) -> Iterator[tuple[list[ast.expr], ast.AST | None]]:
    for node in ast.walk(fdef):
        if isinstance(node, ast.Assign):
            yield node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            yield [node.target], node.value
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            yield [node.target], node.iter
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    yield [item.optional_vars], item.context_expr
        elif isinstance(node, ast.NamedExpr):
            yield [node.target], node.value


#: Each function's parsed source, by :class:`SourceKey`: a helper called from many kernels (``tl.sum``
#: from every reduction) is read and parsed once, not at each call the walk follows.
_SOURCES = CACHES.table("kernel_sources", SourceKey, "a triton kernel's parsed source", limit=4096, kept=True)


def parsed_source(fn: Callable[..., Any]) -> _Source:
    """A function's parsed source, read once per code object (``OSError``, ``TypeError``,
    ``SyntaxError`` or ``StopIteration`` where it cannot be read).

    >>> def k(src, dst, n):
    ...     x = src + n
    >>> source = parsed_source(k)
    >>> source.params, sorted(source.locals), parsed_source(k) is source
    (('src', 'dst', 'n'), ['dst', 'n', 'src', 'x'], True)
    """
    code = getattr(fn, "__code__", None)
    key = SourceKey(code, code.co_filename) if isinstance(code, types.CodeType) else None
    found: _Source | None = _SOURCES.get(key) if key is not None else None
    if found is not None:
        return found
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    args = node.args
    params = tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
    assigned = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assignments = tuple((tuple(tuple(n.id for n in ast.walk(t) if isinstance(n, ast.Name)) for t in targets), value)
                        for targets, value in _assignments(node))
    made = _Source(first, inspect.getsourcefile(fn) or "?", node, params,
                   tuple(a.arg for a in (*args.posonlyargs, *args.args)), frozenset(assigned | set(params)), assignments)
    return _SOURCES.put(key, made) if key is not None else made


class _Function:
    """One kernel function's source, names and provenance."""

    def __init__(self, fn: Callable[..., Any], given: Mapping[str, Any]) -> None:
        self.fn, self.given = fn, given
        source = parsed_source(fn)
        self.first, self.file, self.node, self.params = source.first, source.file, source.node, source.params
        self.positional = source.positional
        self.globals: Mapping[str, Any] = getattr(fn, "__globals__", {})
        closure = inspect.getclosurevars(fn)
        self.nonlocals: Mapping[str, Any] = closure.nonlocals
        self.locals, self.assignments = source.locals, source.assignments
        self.provenance: dict[str, frozenset[str]] = {p: frozenset({p}) for p in self.params}

    def where(self, node: ast.AST) -> str:
        return f"{self.file}:{self.first + getattr(node, 'lineno', 1) - 1}"

    # -- resolving names -------------------------------------------------------------------
    def resolve(self, expr: ast.expr) -> tuple[str, Any]:
        """``("object", value)`` for a callee the function's globals name, ``("method", base)``
        for a method of a local value, ``("unknown", None)`` otherwise."""
        chain: list[str] = []
        node = expr
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return ("method", node) if chain else ("unknown", None)
        if node.id in self.given and not chain:  # a kernel or None handed to a parameter at the launch
            return ("object", self.given[node.id])
        if node.id in self.locals:
            return ("method", node) if chain else ("unknown", None)
        if node.id in self.nonlocals:
            value = self.nonlocals[node.id]
        elif node.id in self.globals:
            value = self.globals[node.id]
        elif hasattr(builtins, node.id):
            value = getattr(builtins, node.id)
        else:
            return ("unknown", None)
        for attr in reversed(chain):
            try:
                value = getattr(value, attr)
            except Exception:
                return ("unknown", None)
        return ("object", value)

    # -- provenance ------------------------------------------------------------------------
    def of(self, expr: ast.AST | None) -> frozenset[str]:
        """The parameters ``expr``'s value may point into (``_WILD``: anywhere)."""
        if expr is None:
            return frozenset()
        if isinstance(expr, (ast.Name, ast.Attribute)) and self.makes_pointers(expr):
            return frozenset({_WILD})
        if isinstance(expr, ast.Name):
            return self.provenance.get(expr.id, frozenset())
        if isinstance(expr, ast.Attribute):
            return self.of(expr.value)
        if isinstance(expr, ast.Call):
            kind, value = self.resolve(expr.func)
            name = getattr(value, "__name__", "") if kind == "object" else (
                expr.func.attr if isinstance(expr.func, ast.Attribute) else "")
            if (kind == "object" and _is_triton(value) and name in LOADS) or (kind == "method" and name in LOADS):
                return frozenset()  # data read from memory (a load, an atomic's old value): no address
            parts = self.of(expr.func) if kind == "method" else frozenset()
            for a in [*expr.args, *(k.value for k in expr.keywords)]:
                parts |= self.of(a)
            return parts
        out: frozenset[str] = frozenset()
        for child in ast.iter_child_nodes(expr):
            out |= self.of(child)
        return out

    def makes_pointers(self, node: ast.Name | ast.Attribute) -> bool:
        """Whether ``node`` names a way to make a pointer out of an integer (``tl.pointer_type``, or a
        pointer type a global or a launch's argument holds)."""
        ident = node.id if isinstance(node, ast.Name) else node.attr
        if ident in _POINTER_FROM_INT:
            return True
        kind, value = self.resolve(node)
        return kind == "object" and (value is _POINTER or _is_pointer_type(value))

    def settle(self) -> None:
        """Join every assignment's provenance into its targets until nothing changes."""
        changed = True
        while changed:
            changed = False
            for targets, value in self.assignments:
                source = self.of(value)
                if not source:
                    continue
                for names in targets:
                    for name in names:
                        old = self.provenance.get(name, frozenset())
                        if not source <= old:
                            self.provenance[name] = old | source
                            changed = True


def source_access(fn: Callable[..., Any], given: Mapping[str, Any] | None = None) -> KernelAccess:
    """What the triton kernel ``fn`` (a ``@triton.jit`` object, a wrapper of one, or its Python
    function) may write, by parameter, read from its source; see the module docstring. ``given``: the values a launch
    passes, of which the parameters holding a jit function or ``None`` (a ``constexpr`` callee such
    as a score modifier) are followed (a call of ``None`` is a branch that does not run), and a
    pointer type handed to a parameter makes the kernel unbounded.

    >>> def k(x, out, MOD):
    ...     if MOD is not None:
    ...         MOD(out)
    >>> sorted(source_access(k).writes), sorted(source_access(k, {"MOD": None}).writes)
    (['out'], [])
    """
    py = python_function(fn) if not isinstance(fn, types.FunctionType) else fn
    if py is None:
        raise TypeError(f"{fn!r} ({type(fn).__name__}) is not a triton kernel or a Python function")
    callees = tuple(sorted((k, _POINTER if _is_pointer_type(v) else v) for k, v in (given or {}).items()
                           if v is None or _is_jit(v) or _is_pointer_type(v)))
    key = KernelKey(py, callees, reach(py, "kernel").settings)
    hit: KernelAccess | None = _ACCESS.get(key)
    return hit if hit is not None else _ACCESS.put(key, _access(py, (), dict(callees)))


@attrs.frozen
class KernelKey:
    """What a kernel's access depends on: its Python function (its source, read once per process),
    the callees a launch hands it, and the values its globals and closure hold (``settings``: a
    global rebound to another helper kernel or constant is another key)."""

    function: Callable[..., Any]
    callees: tuple[tuple[str, Any], ...]
    settings: Settings


#: What each kernel may write, by :class:`KernelKey`.
_ACCESS = CACHES.table("kernel_access", KernelKey, "what a triton kernel may store to, from its source",
                       limit=1024)


def _access(py: Callable[..., Any], stack: tuple[Any, ...], given: Mapping[str, Any]) -> KernelAccess:
    name = getattr(py, "__name__", "?")
    try:
        f = _Function(py, given)
    except (OSError, TypeError, SyntaxError, StopIteration) as e:
        return every_argument(py, f"its source cannot be read ({type(e).__name__})")
    f.settle()
    writes: dict[str, str] = {}
    unbounded = ""

    def written(params: frozenset[str], site: str) -> None:
        nonlocal unbounded
        for p in sorted(params):
            if p == _WILD:
                unbounded = unbounded or site
            else:
                writes.setdefault(p, site)

    for node in ast.walk(f.node):
        if isinstance(node, (ast.Name, ast.Attribute)) and not unbounded and f.makes_pointers(node):
            unbounded = f"{f.where(node)}: {ast.unparse(node)}"
        if not isinstance(node, ast.Call):
            continue
        kind, value = f.resolve(node.func)
        shown = ast.unparse(node.func)
        site = f"{f.where(node)}: {shown}"
        if kind == "method":
            if isinstance(node.func, ast.Attribute) and node.func.attr in STORES:
                written(f.of(node.func.value), site)  # a block pointer's or a descriptor's store
            continue
        if kind == "object" and _is_jit(value):
            callee = python_function(value)
            if callee is None or callee in stack or callee is py:
                written(frozenset().union(*(f.of(a) for a in [*node.args, *(k.value for k in node.keywords)])),
                        f"{site} (a recursive call)")
                continue
            inner = _access(callee, (*stack, py), {})
            if inner.unbounded:
                unbounded = unbounded or f"{site} -> {inner.unbounded}"
            positional = inner.params[:len(node.args)]
            for param, arg in zip(positional, node.args):
                if param in inner.writes:
                    written(f.of(arg), f"{site} -> {inner.site(param)}")
            for k in node.keywords:
                if k.arg is None or k.arg in inner.writes:
                    written(f.of(k.value), f"{site} -> {inner.site(k.arg) if k.arg else 'its **kwargs'}")
            continue
        if kind == "object" and value is None:
            continue  # a parameter given None at the launch: the call is on a branch that does not run
        called = getattr(value, "__name__", "") if kind == "object" else ""
        if kind == "object" and _is_triton(value) and called in STORES:
            pointer = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "pointer"), None)
            targets = f.of(pointer) if pointer is not None else frozenset().union(
                *(f.of(a) for a in [*node.args, *(k.value for k in node.keywords)]))
            written(targets, site)
            continue
        pure = kind == "object" and called not in _OPAQUE_BUILTINS and (
            _is_triton(value) or getattr(value, "__module__", None) == "builtins" or isinstance(value, type))
        if not pure:  # a call the analysis cannot follow may write what its arguments point to
            written(frozenset().union(*(f.of(a) for a in [*node.args, *(k.value for k in node.keywords)])),
                    f"{site} (a call the analysis cannot follow)")
    sites = tuple((p, writes[p]) for p in f.params if p in writes)
    return KernelAccess(name, f.params, frozenset(p for p in writes if p in f.params), sites, unbounded,
                        reads=frozenset(f.params))


def _tl_standin() -> Any:
    """A namespace standing in for ``triton.language`` in this module's doctest (triton is optional)."""
    ns = types.SimpleNamespace()
    for n in ("arange", "load", "store"):
        fn = types.FunctionType((lambda *a, **k: None).__code__, {}, n)
        fn.__module__ = "triton.language.core"
        setattr(ns, n, fn)
    ns.__module__ = "triton.language"
    return ns


__all__ = ["FROM_IR", "FROM_SOURCE", "LOADS", "STORES", "KernelAccess", "SourceKey", "every_argument", "parsed_source",
           "python_function", "source_access"]
