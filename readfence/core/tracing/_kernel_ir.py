"""What a triton kernel reads and writes, decided from triton's own IR of the launch.

A kernel's Python can spell one store many ways (``tl.store``, a tensor descriptor's ``store``
method, ``tl.store_tensor_descriptor``, a helper taking ``*args``); triton's
front end turns every spelling into the same op of its IR (TTIR): ``tt.store``, ``tt.atomic_rmw``,
``tt.descriptor_store`` ... :func:`ir_access` builds that IR with triton's own front end, for the
launch's arguments (their types, and the constants and integer values triton specializes on, as a
compiled launch would: an explicit GPU target, so no GPU is needed), and follows each memory op's
address back through the IR's values to the kernel's parameters (``_ttir``), as torch.compile
decides what a user kernel mutates (``torch._higher_order_ops.triton_kernel_wrap``):

* a parameter is **written** when the address of a store, an atomic or a descriptor's store may be
  computed from it, and **read** when a load's (or an atomic's) may;
* a value loaded from memory is data, not an address (it indexes the address: ``indexed`` keeps
  which parameters it was loaded from, "the rows of ``req_to_token`` picked by
  ``req_pool_indices``");
* a loop-carried value may hold what any iteration yields, a branch's result what either branch
  yields (torch's walk maps a loop's value to its initial one only, and misses a pointer swapped
  in the loop);
* a call to a ``@triton.jit`` helper writes what the helper writes through the arguments given;
* a pointer cast of a parameter (``tl.cast(p, tl.pointer_type(...))``, ``.to(...)``,
  ``bitcast``) stays bounded by that parameter, while an address made from an integer
  (``tt.int_to_ptr``), loaded from memory, or reached by impure inline assembly may be any
  address: ``unbounded`` says where.

It fails closed. An IR that cannot be built or holds an op the analysis does not know makes every
parameter read and written, and ``basis`` keeps the reason for the message: a failure is never
"writes nothing" (two consumers of torch's analysis once dropped a kernel that way). The launch
op reads every tensor it is handed whatever the IR says it loads (``reads`` is kept for the
messages): a replay binds each of them through the op.
:func:`kernel_access` is the one entry: this analysis where triton's front end is importable, the
source walk (:func:`~readfence.core.tracing._kernel_access.source_access`) where it is not.

Under ``TRITON_INTERPRET=1`` a kernel is an interpreted function; its IR is built from a
``JITFunction`` made of the same Python function, whose helpers are made the same way.

>>> import importlib.util
>>> bool(frontend_missing()) == (importlib.util.find_spec("triton") is None)
True
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from ._cache import CACHES
from ._guards import Settings, reach
from ._kernel_access import KernelAccess, every_argument, python_function, source_access
from ._ttir import Unanalysable, ttir_access

#: Triton's interpreter patches ``triton.language`` while it runs a kernel, and the front end
#: reads it while it builds one: an interpreted launch and an IR build hold this, one at a time.
interpreter_lock = threading.RLock()


def restore_language() -> None:
    """Undo what triton's interpreter left patched in ``triton.language``; hold :data:`interpreter_lock`.

    The interpreter patches the language modules a kernel's globals hold for each launch and puts
    them back after, but a helper whose module imports ``triton.language.core`` itself (when the
    kernel's module imports only ``triton.language``, or the other way round) patches that module
    again, and nothing puts it back: the front end would then build IR with the interpreter's
    functions (and fail). A patched builtin keeps what it replaced (as its ``member``); the few
    other patches are of names ``triton.language`` and its ``core`` share, one of which the
    launch put back. Nothing is remembered, so a leak before readfence first saw triton is undone
    too.
    """
    if "triton.language" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    here = interpreter.__file__

    def patched(value: Any) -> bool:
        code = getattr(value.func if isinstance(value, functools.partial) else value, "__code__", None)
        return (code is not None and code.co_filename == here) or value is builtins.print

    def original(value: Any) -> Any:
        for _ in range(64):  # a builtin patched by nested launches: one lambda around the next
            kept = getattr(value, "__kwdefaults__", None) or {}
            if not (patched(value) and "member" in kept):
                break
            value = kept["member"]
        return value

    modules = ((tl, tl.core), (tl.core, tl), (tl.math, None))
    classes = (tl.core.tensor, tl.core.dtype, tl.core.tensor_descriptor_base)
    for obj, sibling in (*modules, *((c, None) for c in classes)):
        for name, value in list(vars(obj).items()):
            clean = original(value)
            if patched(clean) and sibling is not None:
                clean = original(getattr(sibling, name, clean))
            if clean is not value and not patched(clean):
                setattr(obj, name, clean)


#: The compile options the IR is built with. Fused multiply-adds are chosen after the IR: asking for
#: none keeps triton's warning about its default quiet. Overflow sanitizing adds, for each integer
#: ``+``, ``-`` and ``*``, a 64-bit twin of the op and a bounds check that only ``debug`` asserts:
#: without ``debug`` (and the IR is built without it) those values are used by nothing, no address is
#: computed from them, and they made a third of the build's time.
IR_OPTIONS = {"enable_fp_fusion": False, "sanitize_overflow": False}

#: The target the IR is built for without a GPU: a Hopper GPU (fp8 types and tensor descriptors exist).
TARGET = ("cuda", 90, 32)

# -- triton's front end ----------------------------------------------------------------------
@functools.cache
def _frontend() -> types.SimpleNamespace | str:
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import code_generator
        from triton.compiler.compiler import ASTSource, make_backend
        from triton.language.core import constexpr
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature
    except (ImportError, AttributeError) as e:
        return f"triton's front end cannot be imported ({type(e).__name__}: {e})"

    class Mirror(JITFunction):
        """A JITFunction of an interpreted kernel's Python function: its helpers mirrored too."""

        def get_capture_scope(self) -> dict[str, Any]:
            scope = super().get_capture_scope()
            return {k: jit_of(v) if isinstance(v, InterpretedFunction) else v for k, v in scope.items()}

        @property
        def cache_key(self) -> str:  # triton's key reads the globals unmirrored; a mirror is one per function
            return f"readfence-mirror:{self._fn_name}:{id(self.fn)}"

        def __hash__(self) -> int:
            return id(self)

    mirrors: dict[Any, Any] = {}

    def jit_of(kernel: Any) -> Any:
        if isinstance(kernel, JITFunction):
            return kernel
        with interpreter_lock:
            found = mirrors.get(kernel.fn)
            if found is None:
                found = mirrors[kernel.fn] = Mirror(kernel.fn, **getattr(kernel, "kwargs", {}))
            return found

    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    return types.SimpleNamespace(ir=ir, ASTSource=ASTSource, JITFunction=JITFunction, Interpreted=InterpretedFunction,
                                 MockTensor=MockTensor, binder=create_function_from_signature, target=target,
                                 backend=backend, jit_of=jit_of, code_generator=code_generator, constexpr=constexpr)


class _InterpretedCall(Exception):
    """The front end reached an interpreted function the analysis did not make a jit function of."""


@contextlib.contextmanager
def _jit_view(front: types.SimpleNamespace) -> Iterator[None]:
    """While an IR is built, the interpreted functions the front end reaches as attributes (of a
    module: ``tl.sum``; of a value: ``x.sum()``, whose method is ``triton.language``'s own jit
    function) are jit functions too; and a call of an interpreted function is refused: it would
    patch ``triton.language`` for the interpreter and leave it so (the interpreter expects a launch
    to restore it), which breaks every later build and launch in the process. Held under
    :data:`interpreter_lock`: no interpreted launch runs meanwhile."""
    generator, interpreted = front.code_generator.CodeGenerator, front.Interpreted
    get_attribute, call = generator.__dict__["get_Attribute"], interpreted.__dict__["__call__"]

    def attribute(self: Any, lhs: Any, attr: str) -> Any:
        value = get_attribute(self, lhs, attr)
        if not isinstance(value, interpreted):
            return value
        owner = lhs.value if isinstance(lhs, front.constexpr) and attr not in ("value", "type") else lhs
        if front.code_generator._is_triton_value(owner):  # a method: bound, as triton binds a jit one
            return front.code_generator.BoundJITMethod(owner, front.jit_of(value))
        return front.jit_of(value)

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _InterpretedCall(f"a call of the interpreted function {self.fn.__qualname__}")

    generator.get_Attribute, interpreted.__call__ = attribute, refuse
    try:
        yield
    finally:
        generator.get_Attribute, interpreted.__call__ = get_attribute, call


def frontend_missing() -> str:
    """Why triton's front end cannot build a kernel's IR here (``""`` when it can)."""
    found = _frontend()
    return found if isinstance(found, str) else ""


def _jit_kernel(kernel: Any, front: types.SimpleNamespace) -> Any:
    # through autotune and heuristics wrappers (each keeps the next in ``fn``) to the jit function
    for _ in range(16):
        if isinstance(kernel, (front.JITFunction, front.Interpreted)):
            return front.jit_of(kernel)
        kernel = getattr(kernel, "fn", None)
    return None


def _for_ir(value: Any, front: types.SimpleNamespace) -> Any:
    """A launch's argument as the front end takes it: a tensor by its dtype only (a fake tensor has
    no address; the alignment triton specializes on is an attribute of the IR, not an op), an
    interpreted helper as a jit function."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype") and not isinstance(value, type):
        return front.MockTensor(value.dtype)
    if isinstance(value, front.Interpreted):
        return front.jit_of(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_for_ir(v, front) for v in value)
    return value


# -- the analysis ----------------------------------------------------------------------------
def kernel_access(kernel: Any, arguments: Mapping[str, Any]) -> KernelAccess:
    """What the triton kernel ``kernel`` reads and writes when launched with ``arguments`` (every
    parameter's value, by name): from its IR (:func:`ir_access`), or from its source where
    triton's front end is missing (:func:`~readfence.core.tracing._kernel_access.source_access`).

    >>> kernel_access(len, {})
    Traceback (most recent call last):
    ...
    TypeError: <built-in function len> (builtin_function_or_method) is not a triton kernel or a Python function
    """
    if python_function(kernel) is None:
        raise TypeError(f"{kernel!r} ({type(kernel).__name__}) is not a triton kernel or a Python function")
    if frontend_missing():
        return source_access(kernel, arguments)
    return ir_access(kernel, arguments)


def ir_access(kernel: Any, arguments: Mapping[str, Any]) -> KernelAccess:
    """What ``kernel`` reads and writes at a launch with ``arguments``, decided from its IR (see the
    module docstring); every parameter read and written, with the reason, where that fails."""
    py = python_function(kernel)
    if py is None:
        raise TypeError(f"{kernel!r} ({type(kernel).__name__}) is not a triton kernel or a Python function")
    front = _frontend()
    if isinstance(front, str):
        return every_argument(py, front)
    jit = _jit_kernel(kernel, front)
    if jit is None:
        return every_argument(py, f"{type(kernel).__name__} is no triton jit function")
    try:
        given = [_for_ir(arguments[p.name], front) for p in jit.params]
        bound, specialization, options = _binder(jit, front)(*given)
        key = KernelIRKey(jit.fn, repr(specialization), reach(jit.fn, "kernel").settings)
    except Exception as e:  # a missing argument, a value triton cannot type
        return every_argument(py, f"its launch's arguments cannot be typed ({_shown(e)})")
    with interpreter_lock:
        found: KernelAccess | None = _ANALYSED.get(key)
        return found if found is not None else _ANALYSED.put(key, _access(jit, front, bound, specialization, options))


@attrs.frozen
class KernelIRKey:
    """What a kernel's IR, and so its access, depends on: its Python ``function``, the launch's
    ``specialization`` (argument types, and the constants and integers triton specializes on: one IR
    per compiled variant, as triton keeps one binary) and the values the function's globals and
    closure hold, its helpers' too (``settings``: a helper or a constant rebound is another key,
    where triton compiles the kernel again)."""

    function: Callable[..., Any]
    specialization: str
    settings: Settings


@attrs.frozen
class BinderKey:
    """A kernel's Python function: what triton's binder of its arguments is made from."""

    function: Callable[..., Any]


#: What each launch of a kernel reads and writes, by :class:`KernelIRKey`.
_ANALYSED = CACHES.table("kernel_ir", KernelIRKey, "what a triton kernel reads and writes at a launch, from its IR",
                         limit=1024)
#: Triton's binder per kernel (its signature's: a pure function of the function).
_BINDERS = CACHES.table("kernel_binders", BinderKey, "triton's binder of a kernel's arguments", limit=1024, kept=True)


def _binder(jit: Any, front: types.SimpleNamespace) -> Callable[..., Any]:
    """Triton's own binder of ``jit``'s arguments (what a compiled launch specializes on)."""
    key = BinderKey(jit.fn)
    found: Callable[..., Any] | None = _BINDERS.get(key)
    return found if found is not None else _BINDERS.put(key, front.binder(jit.signature, jit.params, front.backend))


def _access(jit: Any, front: types.SimpleNamespace, bound: Any, specialization: Any, options: Any) -> KernelAccess:
    py = jit.fn
    try:
        restore_language()
        with _jit_view(front):
            module, names = _build(jit, front, bound, specialization, options)
        return ttir_access(py, module, names)
    except Unanalysable as e:
        return every_argument(py, f"its IR holds {e}")
    except Exception as e:
        return every_argument(py, f"its IR cannot be built ({_shown(e)})")


def _shown(e: BaseException) -> str:
    """An error in one line: its type and the last line of its message (a compilation error's first
    lines are the kernel's source), at most 200 characters."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _build(jit: Any, front: types.SimpleNamespace, bound: Any, specialization: Any, options: Any) -> tuple[Any, list[str]]:
    """The TTIR module of ``jit`` specialized as triton would for these arguments, and the Python
    parameter each of its function's arguments stands for."""
    backend = front.backend
    options, signature, constexprs, attrs_ = jit._pack_args(backend, dict(IR_OPTIONS), bound, specialization, options)
    source = front.ASTSource(jit, signature, constexprs, attrs_)
    context = front.ir.context()
    front.ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(front.target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    names: list[str] = []
    for param in jit.params:
        names.extend(param.name for _ in range(_leaves(signature.get(param.name, "constexpr"))))
    return module, names


def _leaves(sig: Any) -> int:
    """How many IR arguments a parameter of signature ``sig`` becomes (a tuple: one per leaf; a
    ``constexpr``: none, its value is folded into the IR)."""
    if isinstance(sig, (tuple, list)):
        return sum(_leaves(s) for s in sig)
    return 0 if sig == "constexpr" else 1


__all__ = ["TARGET", "frontend_missing", "interpreter_lock", "ir_access", "kernel_access", "restore_language"]
