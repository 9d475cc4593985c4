"""A triton launch as one operation the dispatcher sees, named after its kernel.

``kernel[grid](*args)`` hands its tensors' raw pointers to compiled code (on a GPU) or to triton's
interpreter (``TRITON_INTERPRET=1``, on the CPU: it copies each argument's storage to the host and
back): no op of the dispatcher stands for what the kernel loads and stores, so a tracer sees a
pointer escape at best and a read observer sees nothing, or the interpreter's copy-back as a write
of every argument. While readfence watches (any dispatch mode is entered: the tracer, the read
observer, fake tensors), each launch runs as **one op**, ``triton_kernel::<kernel name>(launch,
reads, writes)``: its tensor arguments are passed in ``reads`` or in ``writes`` (``Tensor(a!)[]``),
by what the kernel may store to as triton's IR of the launch shows
(:func:`~readfence.core.tracing._kernel_ir.kernel_access`: a possible write is a write; an IR
that cannot be built writes every argument), and ``launch`` names the rest of the call (the
kernel, its grid, its other arguments) in a table the op's kernel looks up. Every tensor the
launch hands over is in one of the two lists, loaded or not: a replay binds each to the live
memory through the op, never a tensor kept from the trace. So the tracer records one node that
reads its arguments and writes its stores' targets (a write of a shared buffer is refused naming
the kernel), the observer one access per buffer named after the kernel, and a traced graph
replays the launch itself. A read by a launch ends with the stage that queued it: the stage's
work is ordered on its stream, and the fence after the stage is recorded after it.

With nothing watching, a launch is the kernel, as triton runs it. The grid is evaluated at the launch
and kept as numbers (a graph freezes it, as a CUDA graph does); so are the non-tensor arguments.
A kernel whose addresses are made from integers (a ``tl.pointer_type`` cast of an integer, an
address loaded from memory, inline assembly not marked pure) may touch any memory: its launch is
refused while readfence watches (:class:`UnboundedKernelError`). A pointer cast of a pointer
argument stays within that argument. A launch readfence does
not make into an op (a compiled kernel called some other way) is still an escape where its
arguments' pointers are taken: ``UNKNOWN``, never a read that was not there.

Triton is never imported here: the launch methods are wrapped when a watch begins and triton is
already imported (:func:`see_launches`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from readfence.effects import ReadfenceError

from .._threads import note_kernel, stage_stream
from ._kernel_access import KernelAccess, python_function
from ._kernel_ir import interpreter_lock, kernel_access
from ._memory import tensors_in

#: The namespace of the launch ops: ``triton_kernel::<kernel name>``.
NAMESPACE = "triton_kernel"

_lock = threading.RLock()
_inside = threading.local()  # .depth: a launch op's kernel is running on this thread
_unseen = threading.local()  # .depth: launches are not made ops on this thread (``launches_unseen``)
_originals: dict[type, Callable[..., Any]] = {}  # the launch classes' own ``run``, while wrapped
_ops: dict[Any, Any] = {}  # Python function of a kernel -> its op overload
_launch_ops: set[Any] = set()  # the op overloads made here, a launch op by this registration
_names: dict[str, Any] = {}  # op name -> Python function
_launches: list[Launch] = []
_launch_ids: dict[Any, int] = {}


class UnboundedKernelError(ReadfenceError, ValueError):
    """A triton kernel makes addresses from integers (or loads them, or runs inline assembly not
    marked pure): the memory it touches is not bounded by its arguments, so no analysis or
    observation of its arguments covers what it reads or writes."""

    def __init__(self, kernel: str, where: str) -> None:
        self.kernel, self.where = kernel, where
        super().__init__(
            f"triton kernel {kernel!r} makes an address from an integer or from memory, or runs code that may "
            f"({where}): the memory it touches is not bounded by its arguments, so readfence cannot tell what it "
            f"reads or writes; pass the tensors it touches as arguments instead of their addresses")


class UnsupportedLaunchError(ReadfenceError, TypeError):
    """A triton launch argument readfence cannot hand to an op (a container holding tensors other
    than a tuple or a list)."""


@attrs.frozen(eq=False)
class Launch:
    """One launch's call, its tensors taken out: ``args``/``kwargs`` hold ``("read", i)`` or
    ``("write", i)`` slots where the tensors were; ``grid`` as numbers; ``params`` the kernel
    parameter each slot was given to, in ``reads`` then ``writes`` order."""

    kernel: Any
    access: KernelAccess
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    grid: tuple[int, ...]
    read_params: tuple[str, ...]
    write_params: tuple[str, ...]

    def call(self, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The launch's arguments with ``reads`` and ``writes`` in their slots."""
        def fill(v: Any) -> Any:
            if isinstance(v, _Slot):
                return (reads if v.kind == "read" else writes)[v.index]
            if isinstance(v, (tuple, list)):
                return type(v)(fill(x) for x in v)
            return v

        return tuple(fill(a) for a in self.args), {k: fill(v) for k, v in self.kwargs.items()}


@attrs.frozen
class _Slot:
    kind: str
    index: int


def kernel_name(kernel: Any) -> str:
    """The name a kernel's launches are recorded under (its Python function's name)."""
    fn = python_function(kernel)
    return getattr(fn, "__name__", type(kernel).__name__)


def launch_of(node_args: Sequence[Any]) -> Launch:
    """The launch a ``triton_kernel`` node's arguments name (``(launch, reads, writes)``)."""
    return _launches[int(node_args[0])]


def is_launch_op(op: object) -> bool:
    """Whether ``op`` is a triton launch's op: one this module registered (``triton_kernel::...``),
    not any op of that namespace.

    >>> is_launch_op(torch.ops.aten.add.Tensor)
    False
    """
    return op in _launch_ops


def launch_write_reason(launch: Launch) -> str:
    """Why a launch writes what it is given in ``writes``: the kernel's parameters and where it
    stores through each, with the parameters whose loaded values index those stores (as
    :func:`~readfence.core.tracing._kernel_ir.kernel_access` found them), or why nothing could be
    decided of the kernel."""
    access = launch.access
    params = list(dict.fromkeys(launch.write_params))
    more = f" and {len(params) - 3} more" if len(params) > 3 else ""
    if not access.decided:
        return f"triton kernel {access.kernel!r}: {access.basis} (its argument(s) {', '.join(params[:3])}{more})"

    def where(p: str) -> str:
        index = access.index_of(p)
        return (access.site(p) or "a store") + (f", at addresses computed from {', '.join(index)}" if index else "")

    shown = [f"{p} ({where(p)})" for p in params[:3]]
    return (f"triton kernel {access.kernel!r} may store through its argument(s) {', '.join(shown)}{more} "
            f"(a possible store counts as a write)")


# -- the ops ---------------------------------------------------------------------------------
def _op_for(kernel: Any) -> Any:
    fn = python_function(kernel)
    with _lock:
        found = _ops.get(fn)
        if found is not None:
            return found
        base = kernel_name(kernel)
        name, k = base, 1
        while name in _names:
            k += 1
            name = f"{base}_{k}"

        def impl(launch: int, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
            _run_launch(launch, reads, writes)

        impl.__name__ = name
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=("writes",))
        op.register_fake(_fake)
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        _ops[fn], _names[name] = overload, fn
        _launch_ops.add(overload)
        return overload


def _fake(launch: int, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
    return None


def _run_launch(index: int, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    launch = _launches[index]
    args, kwargs = launch.call(reads, writes)
    run = _originals.get(type(launch.kernel)) or type(launch.kernel).run
    depth = getattr(_inside, "depth", 0)
    _inside.depth = depth + 1
    try:
        # the kernel's own work (the interpreter's copies, pointers taken) is no op of the stage's
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), _one_at_a_time(launch.kernel):
            run(launch.kernel, *args, grid=launch.grid, warmup=False, **kwargs)
    finally:
        _inside.depth = depth


@contextlib.contextmanager
def _one_at_a_time(kernel: Any) -> Iterator[None]:
    """Triton's interpreter keeps the program being run in module state (the grid index, the
    language's functions patched for the launch): two threads' launches (a stream's replay and the
    scheduler's Python stage) must not interleave, nor a launch and the build of a kernel's IR
    (:data:`~readfence.core.tracing._kernel_ir.interpreter_lock`). Compiled launches need no lock."""
    if type(kernel).__name__ != "InterpretedFunction":
        yield
        return
    with interpreter_lock:
        yield


# -- the launch ------------------------------------------------------------------------------
def _watched() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0 and not getattr(_inside, "depth", 0)


def _frozen(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_frozen(x) for x in v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (type(v).__name__, v)


def _grid(grid: Any, bound: Mapping[str, Any]) -> tuple[int, ...]:
    value = grid(dict(bound)) if callable(grid) else grid
    if isinstance(value, int):
        value = (value,)
    return tuple(int(g) for g in value)


def launch(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` as its op (see the module docstring)."""
    fn = python_function(kernel)
    assert fn is not None
    signature = inspect.signature(fn)
    own = {k: v for k, v in kwargs.items() if k in signature.parameters}
    bound = signature.bind(*args, **own)
    bound.apply_defaults()
    access = kernel_access(kernel, bound.arguments)
    if access.unbounded:
        raise UnboundedKernelError(kernel_name(kernel), access.unbounded)
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    read_params: list[str] = []
    write_params: list[str] = []

    def take(v: Any, param: str) -> Any:
        if isinstance(v, torch.Tensor):
            written = param in access.writes
            out, names = (writes, write_params) if written else (reads, read_params)
            out.append(v)
            names.append(param)
            return _Slot("write" if written else "read", len(out) - 1)
        if isinstance(v, (tuple, list)):
            return type(v)(take(x, param) for x in v)
        if hasattr(v, "base") and isinstance(getattr(v, "base", None), torch.Tensor):
            raise UnsupportedLaunchError(
                f"triton kernel {kernel_name(kernel)!r}: argument {param!r} is a {type(v).__name__} holding a "
                f"tensor; readfence sees tensors passed as arguments (or in tuples of them)")
        return v

    names = list(signature.parameters)
    slotted_args = tuple(take(a, names[i] if i < len(names) else f"#{i}") for i, a in enumerate(args))
    slotted_kwargs = {k: take(v, k) for k, v in kwargs.items()}
    if not reads and not writes:  # nothing of memory: nothing to see
        run = _originals.get(type(kernel)) or type(kernel).run
        with _one_at_a_time(kernel):
            run(kernel, *args, grid=grid, warmup=False, **kwargs)
        return
    numbers = _grid(grid, bound.arguments)
    key = (id(kernel), numbers, _frozen(slotted_args), _frozen(tuple(sorted(slotted_kwargs.items()))))
    with _lock:
        index = _launch_ids.get(key)
        if index is None:
            index = len(_launches)
            _launches.append(Launch(kernel, access, slotted_args, slotted_kwargs, numbers, tuple(read_params),
                                    tuple(write_params)))
            _launch_ids[key] = index
    _op_for(kernel)(index, reads, writes)


class LaunchStreamError(ReadfenceError, ValueError):
    """A triton kernel is launched, while readfence watches a stage, on a stream other than the one
    the stage began on: its reads run on a clock of their own, after the fence recorded on the stage's."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        super().__init__(
            f"triton kernel {kernel!r} is launched on a stream other than the stage's: what it reads is ordered "
            f"after no fence readfence records (COARSE included); launch it on the stage's own stream")


def _check_stream(kernel: Any) -> None:
    began = stage_stream()
    if began is not None and torch.cuda.current_stream() != began:
        raise LaunchStreamError(kernel_name(kernel))


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        note_kernel(kernel_name(self))  # on a thread a watched stage started: its refusal names the kernel
        if getattr(_unseen, "depth", 0) and torch._C._len_torch_dispatch_stack() > 0:
            # a launch readfence does not make an op, as on a GPU: triton's launcher takes each
            # tensor's pointer in Python (an escape), and the kernel's own work is no op of the
            # stage's (the interpreter's host copies and its copy-back of every argument are not)
            for t in tensors_in((args, kwargs)):
                t.data_ptr()
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), _one_at_a_time(self):
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not _watched():
            with _one_at_a_time(self):
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        _check_stream(self)
        return launch(self, args, kwargs, grid)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    run.__readfence_launch__ = True  # type: ignore[attr-defined]
    return run


def see_launches() -> bool:
    """Make triton's launches ops while readfence watches (see the module docstring): wraps the
    ``run`` of triton's jit and interpreted functions once, when triton is imported; returns whether
    it is. Called as each readfence dispatch mode is entered; cheap after the first time.

    >>> see_launches() == ("triton" in sys.modules)
    True
    """
    if "triton" not in sys.modules:
        return False
    if _originals:
        return True
    with _lock:
        if _originals:
            return True
        classes = []
        for module, name in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
            try:
                cls = getattr(__import__(module, fromlist=[name]), name)
            except (ImportError, AttributeError):
                continue
            classes.append(cls)
        for cls in classes:
            run = cls.__dict__.get("run")
            if run is None or getattr(run, "__readfence_launch__", False):
                continue
            _originals[cls] = run
            cls.run = _wrapped(run)
        return bool(_originals)


@contextlib.contextmanager
def launches_unseen() -> Iterator[None]:
    """Launches run as triton runs them in the block, watched or not: what a launch readfence did not
    make an op looks like (its pointers are taken in Python, an escape: ``UNKNOWN``). For tests of
    what readfence reports of kernels it cannot see.

    >>> with launches_unseen():
    ...     _unseen.depth
    1
    """
    depth = getattr(_unseen, "depth", 0)
    _unseen.depth = depth + 1
    try:
        yield
    finally:
        _unseen.depth = depth


__all__ = ["NAMESPACE", "Launch", "LaunchStreamError", "UnboundedKernelError", "UnsupportedLaunchError", "is_launch_op", "kernel_name",
           "launch", "launch_of", "launch_write_reason", "launches_unseen", "see_launches"]
