"""What a triton kernel reads and writes, decided from triton's own IR of the launch.

A kernel's Python can spell one store many ways (``tl.store``, a block pointer's or a tensor
descriptor's ``store`` method, ``tl.store_tensor_descriptor``, a helper taking ``*args``); triton's
front end turns every spelling into the same op of its IR (TTIR): ``tt.store``, ``tt.atomic_rmw``,
``tt.descriptor_store`` ... :func:`ir_access` builds that IR with triton's own front end, for the
launch's arguments (their types, and the constants and integer values triton specializes on, as a
compiled launch would: an explicit GPU target, so no GPU is needed), and follows each memory op's
address back through the IR's values to the kernel's parameters, as torch.compile decides what a
user kernel mutates (``torch._higher_order_ops.triton_kernel_wrap``):

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
parameter read and written, and ``failure`` keeps the reason for the message: a failure is never
"writes nothing" (two consumers of torch's analysis once dropped a kernel that way).
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
import re
import sys
import threading
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs

from ._kernel_access import FROM_IR, KernelAccess, every_argument, python_function, source_access

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


#: The target the IR is built for without a GPU: a Hopper GPU (fp8 types and tensor descriptors exist).
TARGET = ("cuda", 90, 32)

#: Memory ops by what they do at the address of their first operand (TritonOps.td: the ops with a
#: MemRead or MemWrite effect).
WRITES = frozenset({"tt.store", "tt.atomic_store", "tt.descriptor_store", "tt.descriptor_scatter",
                    "tt.descriptor_reduce", "tt.experimental_descriptor_store"})
READS = frozenset({"tt.load", "tt.atomic_load", "tt.atomic_poll", "tt.descriptor_load", "tt.descriptor_gather",
                   "tt.experimental_descriptor_load"})
READ_WRITES = frozenset({"tt.atomic_rmw", "tt.atomic_cas"})
#: Ops of triton's dialect with no memory effect: their results carry their operands' provenance.
PURE = frozenset({
    "tt.addptr", "tt.advance", "tt.assert", "tt.bitcast", "tt.broadcast", "tt.cat", "tt.clampf", "tt.dot",
    "tt.dot_scaled", "tt.expand_dims", "tt.fp_to_fp", "tt.gather", "tt.get_num_programs", "tt.get_program_id",
    "tt.histogram", "tt.join", "tt.make_range", "tt.make_tensor_descriptor", "tt.make_tensor_ptr", "tt.mulhiui",
    "tt.precise_divf", "tt.precise_sqrt", "tt.print", "tt.ptr_to_int", "tt.reduce.return", "tt.reshape",
    "tt.return", "tt.scan.return", "tt.splat", "tt.split", "tt.trans", "tt.unsplat", "scf.yield", "scf.condition",
    "gpu.barrier", "ttg.barrier", "ub.poison", "tt.grid_dependency_wait", "tt.grid_dependency_launch_dependents",
})
#: Unstructured branches (an early ``return``): their operands become the arguments of blocks of their region.
BRANCHES = frozenset({"cf.br", "cf.cond_br"})
#: Dialects whose every op is arithmetic on values.
PURE_DIALECTS = ("arith.", "math.")
#: Ops that run code the analysis cannot read unless marked pure.
OPAQUE = frozenset({"tt.elementwise_inline_asm", "tt.extern_elementwise"})


class _Unanalysable(Exception):
    """The IR holds something the analysis cannot follow: every argument is read and written."""


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
        bound, specialization, options = jit_binder(jit, front)(*given)
        key = (jit.fn, repr(specialization))
    except Exception as e:  # a missing argument, a value triton cannot type
        return every_argument(py, f"its launch's arguments cannot be typed ({_shown(e)})")
    with interpreter_lock:
        found = _analysed.get(key)
        if found is None:
            found = _analysed[key] = _access(jit, front, bound, specialization, options)
        return found


_binders: dict[Callable[..., Any], Callable[..., Any]] = {}
#: Per kernel's Python function and specialization (one IR per compiled variant, as triton keeps one binary): a
#: kernel's source does not change in a process.
_analysed: dict[tuple[Callable[..., Any], str], KernelAccess] = {}


def jit_binder(jit: Any, front: types.SimpleNamespace) -> Callable[..., Any]:
    """Triton's own binder of ``jit``'s arguments (what a compiled launch specializes on)."""
    found = _binders.get(jit.fn)
    if found is None:
        found = _binders[jit.fn] = front.binder(jit.signature, jit.params, front.backend)
    return found


def _access(jit: Any, front: types.SimpleNamespace, bound: Any, specialization: Any, options: Any) -> KernelAccess:
    py = jit.fn
    try:
        restore_language()
        with _jit_view(front):
            module, names = _build(jit, front, bound, specialization, options)
        return _analyse(py, module, names)
    except _Unanalysable as e:
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
    # (fused multiply-adds are chosen after the IR: asking for none keeps triton's warning about its default quiet)
    options, signature, constexprs, attrs_ = jit._pack_args(backend, {"enable_fp_fusion": False}, bound,
                                                            specialization, options)
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


@attrs.frozen
class _Op:
    name: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    block: int
    regions: tuple[int, ...]
    site: str
    callee: str = ""
    pure: bool = True
    pointer_result: bool = False


@attrs.frozen
class _Function:
    params: tuple[int, ...]
    ops: tuple[_Op, ...]


@attrs.frozen
class _Summary:
    """One IR function's effects by argument index: where each is written or read, the argument
    indices whose loaded values index it, and why its memory is unbounded (``""``: it is not)."""

    writes: Mapping[int, str]
    reads: Mapping[int, str]
    indexed: Mapping[int, frozenset[int]]
    unbounded: str


class _Graph:
    """The IR read into values and the values each may come from (its *sources*)."""

    def __init__(self, module: Any) -> None:
        self.sites = _Sites(str(module))
        self.block_ops: dict[int, list[_Op]] = defaultdict(list)
        self.block_args: dict[int, tuple[int, ...]] = {}
        self.region_blocks: dict[int, list[int]] = defaultdict(list)
        self.block_region: dict[int, int] = {}
        self.functions: dict[str, _Function] = {}
        self.sources: dict[int, set[int]] = defaultdict(set)
        self.loaded: dict[int, int] = {}  # a value read from memory -> the address it was read at
        self.summaries: dict[str, _Summary] = {}
        pending: list[_Op] = []

        def visit(op: Any) -> None:  # called bottom-up: a region's ops before the op holding it
            name = op.get_name()
            if name == "builtin.module":
                return
            block = op.get_block()
            bid = block.id() if block is not None else -1
            if block is not None and bid not in self.block_args:
                self.block_args[bid] = tuple(block.get_argument(i).id() for i in range(block.get_num_arguments()))
                region = block.get_parent()
                if region is not None:
                    self.region_blocks[region.id()].append(bid)
                    self.block_region[bid] = region.id()
            results = tuple(op.get_result(i) for i in range(op.get_num_results()))
            record = _Op(name, tuple(op.get_operand(i).id() for i in range(op.get_num_operands())),
                         tuple(r.id() for r in results), bid, tuple(op.get_region(i).id() for i in range(op.get_num_regions())),
                         self.sites.next(name, results),
                         op.get_flat_symbol_ref_attr("callee") if name == "tt.call" else "",
                         bool(op.get_bool_attr("pure")) if name in OPAQUE else True,
                         any("!tt.ptr" in str(r.get_type()) for r in results))
            if name == "tt.func":
                blocks = self.region_blocks.get(record.regions[0], []) if record.regions else []
                if not blocks:
                    raise _Unanalysable(f"a function without a body ({op.get_str_attr('sym_name')})")
                self.functions[op.get_str_attr("sym_name")] = _Function(self.block_args[blocks[0]], tuple(pending))
                pending.clear()
                return
            pending.append(record)
            self.block_ops[bid].append(record)

        module.walk(visit)
        for function in self.functions.values():
            for record in function.ops:
                self._connect(record)

    def _terminator(self, block: int) -> tuple[int, ...]:
        ops = self.block_ops.get(block, [])
        return ops[-1].operands if ops else ()

    def _connect(self, op: _Op) -> None:
        """Record where ``op``'s results (and its regions' block arguments) may come from."""
        if op.regions:
            blocks = [self.region_blocks.get(r, []) for r in op.regions]
            if op.name == "scf.for" and len(blocks) == 1 and blocks[0]:
                body = blocks[0][0]
                iv, *carried = self.block_args[body]
                inits, yielded = op.operands[3:], self._terminator(body)
                self._same_length(op, carried, inits, yielded, op.results)
                self.sources[iv].update(op.operands[:3])
                for i, value in enumerate(carried):  # a loop's value: its initial one or any iteration's
                    self.sources[value].update((inits[i], yielded[i]))
                    self.sources[op.results[i]].update((inits[i], yielded[i]))
                return
            if op.name == "scf.while" and len(blocks) == 2 and blocks[0] and blocks[1]:
                before, after = blocks[0][0], blocks[1][0]
                condition, yielded = self._terminator(before), self._terminator(after)
                forwarded = condition[1:]
                self._same_length(op, self.block_args[before], op.operands, yielded)
                self._same_length(op, self.block_args[after], forwarded, op.results)
                for i, value in enumerate(self.block_args[before]):
                    self.sources[value].update((op.operands[i], yielded[i]))
                for i, value in enumerate(self.block_args[after]):
                    self.sources[value].add(forwarded[i])
                    self.sources[op.results[i]].add(forwarded[i])
                return
            if op.name == "scf.if":
                for region in blocks:
                    for block in region:
                        yielded = self._terminator(block)
                        self._same_length(op, yielded, op.results)
                        for result, value in zip(op.results, yielded):
                            self.sources[result].add(value)
                return
            # any other op with regions (a reduction, a scan): whatever flows in may flow anywhere
            inner = [b for region in blocks for b in region]
            flows = set(op.operands).union(*(self._terminator(b) for b in inner))
            for value in (*op.results, *(a for b in inner for a in self.block_args[b])):
                self.sources[value].update(flows)
            return
        if op.name in BRANCHES:  # (an early return): its operands may flow to any later block's arguments
            entry, *later = self.region_blocks.get(self.block_region.get(op.block, -1), [op.block])
            for block in later:
                for value in self.block_args[block]:
                    self.sources[value].update(op.operands)
            return
        if op.name in READS or op.name in READ_WRITES:
            for result in op.results:  # data read from memory: indexes an address, is none
                self.loaded[result] = op.operands[0]
            return
        for result in op.results:
            self.sources[result].update(op.operands)

    @staticmethod
    def _same_length(op: _Op, *lists: Iterable[int]) -> None:
        if len({len(tuple(x)) for x in lists}) > 1:
            raise _Unanalysable(f"an {op.name} whose values the analysis cannot pair ({op.site})")

    # -- effects -------------------------------------------------------------------------
    def summary(self, name: str, stack: tuple[str, ...] = ()) -> _Summary:
        """What function ``name`` reads and writes through its arguments (``stack``: its callers)."""
        if name in stack:
            raise _Unanalysable(f"a recursive call of {name}")
        if name not in self.functions:
            raise _Unanalysable(f"a call of {name}, which it does not define")
        found = self.summaries.get(name)
        if found is None:
            found = self.summaries[name] = self._summary(name, stack)
        return found

    def _summary(self, name: str, stack: tuple[str, ...]) -> _Summary:
        function = self.functions[name]
        param = {value: i for i, value in enumerate(function.params)}
        writes: dict[int, str] = {}
        reads: dict[int, str] = {}
        indexed: dict[int, set[int]] = defaultdict(set)
        unbounded = ""

        walked: dict[int, tuple[frozenset[int], frozenset[int]]] = {}

        def walk(value: int) -> tuple[frozenset[int], frozenset[int]]:
            """The arguments ``value`` may point into, and the addresses of the loads it is computed from."""
            found = walked.get(value)
            if found is None:
                into: set[int] = set()
                loads: set[int] = set()
                todo, seen = [value], set()
                while todo:
                    v = todo.pop()
                    if v in seen:
                        continue
                    seen.add(v)
                    if v in param:
                        into.add(param[v])
                    elif v in self.loaded:
                        loads.add(self.loaded[v])
                    else:
                        todo.extend(self.sources.get(v, ()))
                found = walked[value] = (frozenset(into), frozenset(loads))
            return found

        def roots(value: int) -> tuple[frozenset[int], set[int]]:
            """The arguments ``value`` may point into, and those whose loaded values index it."""
            into, loads = walk(value)
            return into, set().union(*(walk(address)[0] for address in loads))

        def note(effects: dict[int, str], value: int, site: str) -> None:
            into, index = roots(value)
            for i in into:
                effects.setdefault(i, site)
                indexed[i] |= index

        for op in function.ops:
            if op.name in WRITES or op.name in READ_WRITES:
                note(writes, op.operands[0], op.site)
            if op.name in READS or op.name in READ_WRITES:
                note(reads, op.operands[0], op.site)
                if op.pointer_result:
                    unbounded = unbounded or f"{op.site} (an address loaded from memory)"
            if op.name == "tt.int_to_ptr":
                unbounded = unbounded or f"{op.site} (an address made from an integer)"
            elif op.name in OPAQUE and not op.pure:
                unbounded = unbounded or f"{op.site} (code the analysis cannot read, not marked pure)"
            elif op.name == "tt.call":
                inner = self.summary(op.callee, (*stack, name))
                unbounded = unbounded or (f"{op.site} -> {inner.unbounded}" if inner.unbounded else "")
                for effects, theirs in ((writes, inner.writes), (reads, inner.reads)):
                    for i, site in theirs.items():
                        note(effects, op.operands[i], f"{op.site} -> {site}")
                for i, by in inner.indexed.items():
                    for j in by:
                        indexed_into = roots(op.operands[i])[0]
                        for k in indexed_into:
                            indexed[k] |= roots(op.operands[j])[0]
            elif not op.regions and not _known(op.name):
                raise _Unanalysable(f"an op it does not know: {op.name} ({op.site})")
        return _Summary(writes, reads, {i: frozenset(v) for i, v in indexed.items()}, unbounded)


def _known(name: str) -> bool:
    return (name in PURE or name in WRITES or name in READS or name in READ_WRITES or name in OPAQUE or name in BRANCHES
            or name in ("tt.call", "tt.int_to_ptr") or name.startswith(PURE_DIALECTS))


class _Sites:
    """Where each op of a printed IR module comes from (``file:line``), by op name and order: the
    bindings give a location to values only, and a store has none. A leaf op is the n-th of its
    name in the printed text (pre-order) and in the walk (post-order) alike."""

    _LINE = re.compile(r'^\s*(?:%[^=]*=\s*)?([a-z_]+\.[a-z_.]+)\b.*\bloc\((#loc\d*|"[^"]*":\d+:\d+)\)\s*$')
    _ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
    _FILE = re.compile(r'"([^"]+)":(\d+):\d+')

    def __init__(self, text: str) -> None:
        aliases: dict[str, str] = {}
        found: dict[str, list[str]] = defaultdict(list)
        lines = text.splitlines()
        for line in lines:
            m = self._ALIAS.match(line)
            if m:
                aliases[m.group(1)] = m.group(2)
        for line in lines:
            m = self._LINE.match(line)
            if m:
                found[m.group(1)].append(self._resolve(m.group(2), aliases, 0))
        self.found = found
        self.taken: dict[str, int] = defaultdict(int)

    def _resolve(self, ref: str, aliases: Mapping[str, str], depth: int) -> str:
        text = aliases.get(ref, ref)
        m = self._FILE.search(text)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        for inner in re.findall(r"#loc\d*", text):
            if depth < 16 and inner != ref:
                found = self._resolve(inner, aliases, depth + 1)
                if found:
                    return found
        return ""

    def next(self, name: str, results: tuple[Any, ...]) -> str:
        index = self.taken[name]
        self.taken[name] += 1
        where = self.found[name][index] if index < len(self.found[name]) else ""
        if not where and results:
            m = self._FILE.search(str(results[0].get_loc()))
            where = f"{m.group(1)}:{m.group(2)}" if m else ""
        return f"{where}: {name}" if where else name


def _analyse(py: Callable[..., Any], module: Any, names: list[str]) -> KernelAccess:
    graph = _Graph(module)
    entry = module.get_entry_func_name()
    function = graph.functions.get(entry)
    if function is None:
        raise _Unanalysable(f"no function named {entry}")
    if len(function.params) != len(names):
        raise _Unanalysable(f"{len(function.params)} arguments for the {len(names)} the launch passes")
    summary = graph.summary(entry)
    params = tuple(_params(py))

    def by_name(effects: Mapping[int, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for i, site in sorted(effects.items()):
            out.setdefault(names[i], site)
        return out

    writes, reads = by_name(summary.writes), by_name(summary.reads)
    indexed: dict[str, set[str]] = defaultdict(set)
    for i, by in summary.indexed.items():
        indexed[names[i]] |= {names[j] for j in by}
    return KernelAccess(
        getattr(py, "__name__", "?"), params, frozenset(writes), tuple((p, writes[p]) for p in params if p in writes),
        summary.unbounded, reads=frozenset(reads), basis=FROM_IR,
        indexed=tuple((p, tuple(sorted(indexed[p]))) for p in params if indexed.get(p)))


def _params(py: Callable[..., Any]) -> list[str]:
    import inspect

    return list(inspect.signature(py).parameters)


__all__ = ["TARGET", "frontend_missing", "interpreter_lock", "ir_access", "kernel_access", "restore_language"]
