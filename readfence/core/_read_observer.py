"""The read observer: a dispatch mode that records which shared buffers each op touches, by memory.

It trusts nothing the tracer computed (see :mod:`readfence.core._observe`, which runs it over
whole steps and holds the static analysis to what it saw): it matches the memory of each op's
tensor arguments against the shared buffers by address range and asks the op's schema whether
it is a pure view or a write. An :class:`Access` is one such touch.

>>> import torch
>>> lens = torch.arange(4, dtype=torch.int32)
>>> obs = ReadObserver({"seq_lens": lens})
>>> with obs, obs.stage("body"):
...     _ = lens + 1
>>> [(a.buffer, a.kind) for a in obs.accesses]
[('seq_lens', 'read')]
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from readfence.effects import ReadEnd

from ._step import STAGE_ENDS
from .tracing import (
    CACHES,
    PLAIN_VALUES,
    REFERENCE_ESCAPES,
    BufferMap,
    DispatchMode,
    Listing,
    OpAliasing,
    Segment,
    SegmentSignature,
    bind_arguments,
    is_launch_op,
    leaves,
    metadata_claim_holds,
    metadata_templates,
    moves_metadata_only,
    op_aliasing,
    rerun_with,
    segment_signature,
    tensors_in,
    trusted_op,
    unobserved,
    user_line,
    view_claim_holds,
)

Kind = Literal["read", "write", "escape"]

#: readfence's core, whose frames run a stage and observe it: a read's line is the first frame outside.
_OBSERVER_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
_T = TypeVar("_T")

#: The ops each model segment dispatched when last observed, by signature (``run_segment``):
#: the observer's own record, not the recorder's templates.
_SEGMENT_OPS = CACHES.table("segment_ops", SegmentSignature, "the ops an observed run of a model segment "
                            "dispatched; rechecked at use: the ops a run dispatches must be these", limit=4096,
                            depended_on=False)

#: Python-level tensor methods that read the data on the host without an op.
_HOST_READS: dict[Any, str] = {
    torch.Tensor.tolist: "tolist()",
    torch.Tensor.__repr__: "__repr__()",
    torch.Tensor.__format__: "__format__()",
}



_function_modes, _dispatch_modes = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack

#: The dispatch keys through which Python modes (and tensor subclasses) see an op.
_MODE_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)


@functools.lru_cache(maxsize=4096)  # keyed by op overload: a finite set per process
def _quiet_op(func: Any) -> bool:
    """Whether ``func`` is an op whose run can touch only the memory it is handed: torch's own
    (or readfence's), not a kernel launch (``ReadObserver.run_node_op``)."""
    return isinstance(func, torch._ops.OpOverload) and trusted_op(func) and not is_launch_op(func)


def _untouched(buffers: BufferMap, tree: Any) -> bool:
    """Whether every tensor in ``tree`` is a plain ``torch.Tensor`` (a subclass needs the Python
    key to run) touching none of ``buffers``."""
    for t in leaves(tree):
        if isinstance(t, torch.Tensor) and (type(t) is not torch.Tensor or buffers.touched(t)):
            return False
    return True


@functools.lru_cache(maxsize=4096)  # keyed by op overload: a finite set per process
def _decomposes(func: Any) -> bool:
    """``func`` has a CompositeImplicitAutograd kernel (``func.decompose`` runs it)."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


@attrs.frozen
class Access:
    """One observed touch of one shared buffer by one executed op.

    ``kind``: ``read`` (the op consumed it), ``write`` (the schema says the op writes an
    argument over it) or ``escape`` (its memory left the dispatcher: read ``UNKNOWN``).
    ``note`` says why an access counts when the schema does not say so (``no schema``,
    ``host read``...). ``step`` and ``seq`` (the op's position among every op the step ran)
    order accesses within one observed step.

    >>> Access("seq_lens", "body", "aten.sum.default", "read").end
    <ReadEnd.POST_REPLAY: 3>
    """

    buffer: str
    stage: str
    op: str
    kind: Kind
    note: str = ""
    step: int = 0
    seq: int = 0
    # ``file:line in function`` of a write, or of a read inside a custom op's kernel (where a kernel
    # reads what an earlier stage kept by reference: no trace has that line); "" elsewhere
    source: str = ""

    @property
    def end(self) -> ReadEnd:
        """The read end this access implies: its stage's (``STAGE_ENDS``; a label ``stage:node``
        is its stage's), ``UNKNOWN`` for an escape or a stage label outside ``STAGE_ENDS``."""
        if self.kind == "escape":
            return ReadEnd.UNKNOWN
        return STAGE_ENDS.get(self.stage.partition(":")[0], ReadEnd.UNKNOWN)


class _HostReads(TorchFunctionMode):
    """The part of ``ReadObserver`` above the dispatcher: host reads and escapes without an op."""

    def __init__(self, observer: ReadObserver) -> None:
        super().__init__()
        self.observer = observer

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        obs = self.observer
        if not obs._busy and args and isinstance(args[0], torch.Tensor):
            if func in _HOST_READS:
                obs._record(args[0], _HOST_READS[func], "read", "host read without an op")
            elif func in REFERENCE_ESCAPES:  # the tracer's table: the two agree on what hands memory out
                for t in args:  # (and what it is handed: a ``.data`` assignment's value)
                    if isinstance(t, torch.Tensor):
                        obs._record(t, REFERENCE_ESCAPES[func], "escape", "memory leaves the dispatcher")
                obs._left_dispatcher()
        return func(*args, **(kwargs or {}))


class ReadObserver(DispatchMode):
    """A dispatch mode that records which shared buffers each executed op touches, by memory.

    Enter it (``with observer:``) around eager code; label the stage with
    ``observer.stage(name)``. For every op it runs, each tensor argument (lists of them
    flattened: the ``split`` pieces ``cat`` receives) is matched against ``buffers`` by
    address range. A pure view (``op_aliasing(op).is_view``) reads nothing: its consumers do;
    the claim is checked on the op's output, and one whose output shares no memory with what
    it claims to alias (a copy: a functional ``_foreach_*`` op) read it. An argument an op uses
    for its metadata only (``zeros_like``'s ``self``) is not read, unless its run refutes the
    claim (:func:`~readfence.core.tracing.metadata_claim_holds`).
    Any other op reads every buffer an argument touches, and also writes those of the
    arguments its schema marks written. An op without a schema, or with an argument type
    the schema cannot describe, counts as a read of what it touches, with a ``note`` saying
    so. Host reads go through ops (``item()``, ``int(t)``, ``bool(t)``:
    ``aten._local_scalar_dense``); those that do not (``tolist()``, ``repr``) are caught
    above the dispatcher, as are escapes (``data_ptr()``, ``numpy()``, ``__dlpack__()``,
    ``untyped_storage()``), whose buffers become ``UNKNOWN``.

    Custom ops (any op torch or readfence did not register itself, whatever its namespace:
    ``core.tracing``): the mode records the op with its arguments,
    then runs its kernel *under the mode* (a redispatch below the Python key with the mode
    pushed back, since a handler runs with its mode popped), so the ops inside a
    ``torch.library.custom_op`` Python implementation (or any kernel that calls back into
    the dispatcher) are observed too, named ``outer/inner``. That is how a plan/run kernel
    is caught: ``run`` reading a tensor that ``plan`` stored in a Python object earlier.
    Composite ops that reach the mode (below autograd: inside such a kernel, under
    ``inference_mode``) are decomposed under it, as ``FakeTensorMode`` does, since their
    schema cannot say whether they alias or copy (``reshape``, ``to``).

    What stays opaque: a compiled kernel (C++/CUDA extension, Triton) reading memory through
    a raw pointer it was given or kept, numpy code over an array it was handed, a custom op
    without tensor arguments (no device to redispatch on: it runs as usual), a CUDA graph
    replay, and anything on another thread (modes are thread-local). A pointer or array
    handed over in Python on this thread is recorded as an escape; one kept from before the
    observer was entered is invisible. An alias made without handing anything out
    (``torch.from_dlpack(torch.to_dlpack(t))``) is just memory, read where it is consumed;
    ``torch.from_dlpack(t)`` calls ``t.__dlpack__()``, an escape.

    >>> shared = {"seq_lens": torch.arange(4, dtype=torch.int32)}
    >>> obs = ReadObserver(shared)
    >>> with obs, obs.stage("body"):
    ...     head = shared["seq_lens"][:2]     # a view: reads nothing
    ...     total = head.sum()                # reads seq_lens
    >>> [(a.buffer, a.stage, a.op) for a in obs.accesses]
    [('seq_lens', 'body', 'aten.sum.default')]
    """

    supports_higher_order_operators = True  # a higher-order op reads its operands (see below)

    def __init__(self, buffers: BufferMap | Mapping[str, torch.Tensor], *, step: int = 0,
                 held: Iterable[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.buffers = buffers if isinstance(buffers, BufferMap) else BufferMap.of(buffers)
        # the buffers' tensor objects themselves (``None``: not known): an in-place view op
        # (``moves_metadata_only``) writes no byte, only the object it is called on, which is a
        # write where that object is one of these and nothing where it is a view of one
        if held is None and not isinstance(buffers, BufferMap):
            held = buffers.values()
        self._held = None if held is None else {id(t) for t in held}
        self.step = step
        self.current_stage = "unlabelled"
        self.accesses: list[Access] = []
        self._seq = 0
        self._within: list[str] = []  # the custom ops whose kernels are running under the mode
        self._busy = False
        self._skipping = False  # a model segment that can touch no buffer is running
        self._listed: Listing | None = None  # the calls a segment's run made so far
        self._host: _HostReads | None = None

    # -- use -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[ReadObserver]:
        """Label the accesses made inside the block with ``label`` (e.g. ``"body"``)."""
        if not isinstance(label, str):
            raise TypeError(f"stage label must be a str, got {label!r} ({type(label).__name__})")
        before, self.current_stage = self.current_stage, label
        try:
            yield self
        finally:
            self.current_stage = before

    def run_segment(self, segment: Segment, tensors: Sequence[Any]) -> Any:
        """``segment(*tensors)``, a piece of the model (``core._segment``: a function of its
        tensor arguments alone), unobserved where none of them holds memory of a shared buffer in
        its storage (looked at here, not taken from any trace) and it makes the very calls, in
        order, of an observed run with the same signature that touched no buffer, each on the same
        values (``tracing.Listing``: an input, or an earlier call's result), each an op of torch's
        own (:meth:`quiet`). Such ops on such values touch no memory but theirs and what they make.
        Anything else runs observed: a piece that made other calls, or one given a tensor from
        outside it (a closure's, a global's: it may be a buffer on another run) or calling an op
        whose kernel is not torch's (it may reach memory it was not handed), at every run."""
        fn = segment.fn
        if self._skipping or self._listed is not None or any(type(t) is not torch.Tensor for t in tensors):
            return fn(*tensors)
        if self._quietly(lambda: any(self.buffers.in_storage_of(t) for t in tensors)):
            return fn(*tensors)
        signature = segment_signature(segment, tensors)
        expected = _SEGMENT_OPS.get(signature)
        seen = len(self.accesses)
        listing, out = self._listing(fn, tensors, None if expected is None else expected[0])
        if expected is None:
            if self._reference(listing) and len(self.accesses) == seen:  # (one that touched a buffer is none)
                _SEGMENT_OPS.put(signature, (tuple(listing.calls), listing.returned(out)))
        elif listing.diverged:  # observed from its first call not the reference's: the next run is observed whole
            _SEGMENT_OPS.forget(signature)
        return out

    def below_modes(self) -> bool:
        """Whether this observer is the only mode on this thread's stacks (its host-read mode the
        only function mode): then an op :meth:`run_node_op` runs below them hides it from no other."""
        dispatch = _get_current_dispatch_mode_stack()
        function = torch.overrides._get_current_function_mode_stack()
        return (len(dispatch) == 1 and dispatch[0] is self and len(function) == 1 and function[0] is self._host
                and not self._skipping and self._listed is None)

    @staticmethod
    def quiet(func: Any) -> bool:
        """Whether ``func`` touches only the memory it is handed: an op of torch's own (or
        readfence's), not a kernel launch or a higher-order op (:meth:`run_node_op`)."""
        return _quiet_op(func)

    def holds_no_buffer(self, value: Any) -> bool:
        """Whether no buffer's memory lies in the storage of any tensor in ``value`` (plain
        tensors only), by the observer's own look at it (``BufferMap.in_storage_of``). Then no op
        of torch's own on it reaches a buffer, nor on what such ops make of it: new memory, or
        views of those storages (a view's bounds are its storage's).

        >>> arena = torch.zeros(8)
        >>> obs = ReadObserver({"seq_lens": arena[:2]})
        >>> obs.holds_no_buffer([torch.ones(2), 3]), obs.holds_no_buffer(arena[4:])
        (True, False)
        """
        with unobserved():
            return all(type(t) in PLAIN_VALUES or (isinstance(t, torch.Tensor) and not self.buffers.in_storage_of(t))
                       for t in leaves(value))  # (a storage, a module, any other object: not known)

    def run_node_op(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], alone: bool,
                    clean: bool = False) -> Any:
        """``func(*args, **kwargs)``, one node of a stage graph run under this observer; with
        ``alone`` (:meth:`below_modes`), below the modes where what the mode would record of it
        is nothing: ``func`` is torch's own (``trusted_op``, decided by where it was registered;
        not a launch or a higher-order op, whose kernels the mode runs under itself) and, by the
        observer's own look at their memory, none of its tensors (plain ones only) touches a
        buffer. A torch kernel touches only the memory it is handed: its args' (a composite's
        decomposition works on the same). Every other op runs through the mode, as in eager code.
        ``clean``: the caller knows ``func`` is :meth:`quiet` (or Python's ``getitem``) and no tensor
        of its arguments holds a buffer in its storage (each made by such ops from values
        :meth:`holds_no_buffer` passed): the look is not repeated.

        >>> shared = {"seq_lens": torch.arange(4)}
        >>> obs = ReadObserver(shared)
        >>> with obs:
        ...     alone = obs.below_modes()
        ...     x = obs.run_node_op(torch.ops.aten.mul.Tensor, (torch.ones(4), 2), {}, alone)   # touches nothing
        ...     y = obs.run_node_op(torch.ops.aten.sum.default, (shared["seq_lens"],), {}, alone)
        >>> alone, [(a.buffer, a.op) for a in obs.accesses]
        (True, [('seq_lens', 'aten.sum.default')])
        """
        # (the stacks' depths again: a kernel that left a mode of its own on them sees every later op)
        if alone and _function_modes() == 1 and _dispatch_modes() == 1 and (clean or _quiet_op(func)):
            if not clean:
                with unobserved():
                    clean = _untouched(self.buffers, args) and (not kwargs or _untouched(self.buffers, kwargs))
            if clean:
                with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(_MODE_KEYS):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _listing(self, fn: Callable[..., Any], tensors: Sequence[Any],
                 expected: Sequence[Any] | None) -> tuple[Listing, Any]:
        """``fn(*tensors)`` and the listing of its calls. With ``expected`` (a reference's calls),
        unobserved as long as each call is the reference's at its place, observed from the first
        that is not (or once memory is re-pointed or handed out without an op): the calls before
        it were the reference's, on the same values, and touched no buffer. One run: whatever it
        does (a cache it fills, an error it raises) is the run's own, never made again."""
        listing = self._listed = Listing(tensors, expected)
        self._skipping = expected is not None
        try:
            # (the host-read mode stays on unobserved: a host read or an escape reaches no
            # dispatcher, so no op list can tell a run that makes one from one that does not)
            out = fn(*tensors)
        finally:
            self._listed, self._skipping = None, False
        return listing, out

    @staticmethod
    def _reference(listing: Listing) -> bool:
        """Whether another run may be held to ``listing``'s calls: each on an input or an earlier
        call's value, each an op of torch's own (its kernel touches only what it is handed)."""
        return not listing.outside and all(t is operator.getitem or _quiet_op(t) for t, _, _ in listing.calls)

    def _left_dispatcher(self) -> None:
        # memory handed out or re-pointed without an op (``.data``, ``numpy()``) while a piece runs:
        # its listing is no reference, and an unobserved run is observed from here on
        listing = self._listed
        if listing is not None:
            listing.outside = listing.diverged = True
            self._skipping = False

    def consume(self, tree: object, what: str) -> None:
        """Record a read of every buffer the tensors of ``tree`` touch, by ``what``.

        For consumers outside the observed code, e.g. the step's caller reading the body's
        output after the forward."""
        for t in tensors_in(tree):
            self._record(t, what, "read", "consumed after the stage")

    def __enter__(self) -> ReadObserver:
        if self._host is not None:
            raise RuntimeError("this ReadObserver is already entered; use one observer per `with` block")
        self._host = _HostReads(self)
        self._host.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._host.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._host is not None:
                self._host.__exit__(*exc)
                self._host = None

    # -- the dispatcher's side -------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        listing = self._listed
        if listing is None:
            return self._dispatch(func, args, kwargs)
        at = listing.enter(func, args, kwargs)
        if listing.diverged:  # not the reference's call: this one and every later one observed
            self._skipping = False
        out = self._dispatch(func, args, kwargs)
        listing.leave(at, out)
        return out

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        composite = _decomposes(func)
        if not self._skipping:
            self._seq += 1
        elif self._listed is None or not composite:
            return func(*args, **kwargs)
        if composite:
            # It may alias or copy and its schema cannot say which: its decomposition says it
            # op by op (and an unobserved run lists its ops as an observed one does). Torch
            # function off: ``decompose`` goes through the op's Python binding, which a
            # host-read mode on the stack would send back here.
            with self._pushed(host=False), torch._C.DisableTorchFunction():
                return func.decompose(*args, **kwargs)
        claimed = self._quietly(self._record_op, func, args, kwargs) if self.buffers else None
        # an op whose kernels are not torch's or readfence's own (``trusted_op``: decided by where it
        # was registered, not by its namespace) may be a Python or extension kernel: its inner ops are
        # run under the mode (torch's C++ kernels are not: their inner ops would see tensors without
        # a Python storage)
        if isinstance(func, torch._ops.OpOverload) and not trusted_op(func) and not is_launch_op(func):
            out = self._run_kernel_observed(func, args, kwargs)
        elif isinstance(func, torch._ops.HigherOrderOperator):
            out = self._run_higher_order_observed(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if claimed is not None:
            self._quietly(self._check_view_claim, func, claimed, args, kwargs, out)
        return out

    def _run_higher_order_observed(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        # ``torch.cond`` and the like: counted as reading what it is given (``_record_op``: no
        # schema), then run as usual; the ops of the branch it runs are not seen one by one
        # (under make_fx a branch's captured tensors become the op's operands, so they count)
        return func(*args, **kwargs)

    def _check_view_claim(self, func: Any, aliasing: OpAliasing, args: Sequence[Any], kwargs: Mapping[str, Any],
                          out: Any) -> None:
        # a view claim is checked on memory: an op whose output shares no memory with what its
        # schema says it aliases copied it (a functional foreach op, a list-returning custom op);
        # so is a metadata claim: an output that shares the argument's memory or changes with its
        # bytes read it
        if not aliasing.is_view:
            templates = metadata_templates(func, args, kwargs, aliasing.metadata_args, self.buffers)
            if metadata_claim_holds(out, templates, lambda ts: rerun_with(func, args, kwargs, templates, ts)):
                return
            for b in sorted(self.buffers.touched_by(templates)):
                self._add(b, self._qualified(str(func)), "read", "uses it for its metadata only, its run says otherwise")
            return
        values = bind_arguments(func, args, kwargs)
        outs = out if len(aliasing.outputs) > 1 else (out,)
        if view_claim_holds(outs, [[values[i] for i in src] for src in aliasing.outputs]):
            return
        for b in sorted(self._quietly(self.buffers.touched_by, values)):
            self._add(b, self._qualified(str(func)), "read", "its schema claims a view, its output is a copy")

    @contextlib.contextmanager
    def _pushed(self, *, host: bool) -> Iterator[None]:
        """The mode back on the stack inside its own handler (which runs with it popped);
        with ``host``, the host-read mode as well (popped while it handles the op's call)."""
        with contextlib.ExitStack() as stack:
            mode = self._host
            on_stack = torch.overrides._get_current_function_mode_stack()
            if host and mode is not None and mode not in on_stack:
                stack.enter_context(mode)
            TorchDispatchMode.__enter__(self)
            stack.callback(TorchDispatchMode.__exit__, self, None, None, None)
            yield

    def _record_op(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> OpAliasing | None:
        """Record what ``func`` reads and writes; a view claim is returned, to be checked on the
        op's output once it ran."""
        touched = self.buffers.touched_by((args, kwargs))
        if not touched:  # most ops: what follows looks only at these arguments
            return None
        aliasing = op_aliasing(func)
        if aliasing is None:
            for b in sorted(touched):
                self._add(b, self._qualified(str(func)), "read", "no schema: counted as a read")
            return None
        if aliasing.is_view:
            return aliasing
        values = bind_arguments(func, args, kwargs)
        if moves_metadata_only(func):  # re-shapes or re-points ``self``: reads no byte, writes the object
            if self._held is None or id(values[0]) in self._held:
                for b in sorted(self.buffers.touched_by(values[0])):
                    self._add(b, self._qualified(str(func)), "write", "")
            return None
        read = self.buffers.touched_by([values[i] for i in aliasing.data_args(len(values))])
        name = self._qualified(str(func))
        note = "opaque argument type: counted as a read" if aliasing.opaque else ""
        for b in sorted(read):
            self._add(b, name, "read", note)
        for i in aliasing.writes:
            for b in sorted(self.buffers.touched_by(values[i])):
                self._add(b, name, "write", note)
        # arguments it uses for their metadata only (``zeros_like``): not read, if its run says so
        return aliasing if aliasing.metadata_args and self.buffers.touched_by(
            [values[i] for i in aliasing.metadata_args]) else None

    def _run_kernel_observed(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        # Inside __torch_dispatch__ the mode is popped, so the kernel's inner ops would go
        # unseen; push it back and redispatch below the Python key, straight to the kernel.
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
        for t in tensors_in((args, kwargs)):
            keys = keys | torch._C._dispatch_keys(t)
        keys = keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
        if keys.highestPriorityTypeId() == torch._C.DispatchKey.Undefined:
            return func(*args, **kwargs)  # no tensor argument: no device to redispatch on
        self._within.append(self._qualified(str(func)))
        try:
            with self._pushed(host=True):
                return func.redispatch(keys, *args, **kwargs)
        finally:
            self._within.pop()

    # -- bookkeeping -----------------------------------------------------------------------
    def _qualified(self, name: str) -> str:
        return "/".join([*self._within[-1:], name]) if self._within else name

    def _add(self, buffer: str, op: str, kind: Kind, note: str) -> None:
        source = user_line(_OBSERVER_FILES) if self._within or kind == "write" else ""
        self.accesses.append(Access(buffer, self.current_stage, op, kind, note, self.step, self._seq, source))

    def _record(self, t: torch.Tensor, what: str, kind: Kind, note: str) -> None:
        for b in sorted(self._quietly(self.buffers.touched, t)):
            self._add(b, self._qualified(what), kind, note)

    def _quietly(self, look: Callable[..., _T], *args: Any) -> _T:
        """``look(*args)``, the observer's own look at memory (``data_ptr()``, storages): no
        host read or escape of the code it observes. No torch-function mode sees it either (a
        tensor's ``data_ptr()`` or ``numel()`` through a mode's handler cost 10 us where the
        look itself costs 1.5 us: most of what observing an op cost)."""
        busy, self._busy = self._busy, True
        try:
            with unobserved():
                return look(*args)
        finally:
            self._busy = busy
