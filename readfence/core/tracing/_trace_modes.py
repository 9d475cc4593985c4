"""The modes a stage's Python runs under while it is traced: they mark what the graph cannot hold.

:class:`TraceMode` (a torch function mode) marks each escape (``_escapes``: ``item()``,
``data_ptr()``, ...) on the escaping tensor and names every node after the user's source line;
:class:`HostReads` (a dispatch mode) marks every op that hands the host a value computed from
tensor data, whatever Python spelling reached it. Where the escape has a value to hand over it is
computed on the real tensors, outside the tracer, and the stage runs as Python; under fake
tensors there is none, and the trace stops (:class:`TraceAborted`). Under fake tensors on a
device this build lacks, :class:`TraceMode` also indexes through aten ops.

Their frames sit between a stage and the ops it runs, so ``_escapes`` skips this module when it
looks for the user's line.

>>> from torch.fx.experimental.proxy_tensor import make_fx
>>> def stage(t):
...     return t * int(t.sum())  # int() hands the host a value: an escape
>>> with TraceMode(fake=False):
...     gm = make_fx(stage)(torch.ones(2))
>>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
['aten.sum.default', 'readfence.opaque.default', 'aten.mul.Tensor']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode
from torch.overrides import TorchFunctionMode

from .._program import SOURCE_KEY
from ._dispatch import DispatchMode
from ._escapes import ESCAPES, OPAQUE_OP, user_line
from ._memory import tensors_in
from ._record import HOST_READ, GraphRecorder


class TraceAborted(Exception):
    """An escape the trace cannot go past (under fake tensors there is no value to hand the
    host): the trace stops, and the program names the stage and ``why``."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class HostReads(DispatchMode):
    """Marks, at the dispatcher, every op whose result is a Python value computed from tensor
    data (``torch.Tag.data_dependent_output``: ``equal``, ``allclose``, ``item``, and the
    ``_local_scalar_dense`` under ``bool(t)``, ``x in t``, ``is_nonzero`` and a 0-d tensor used
    as a slice bound), whatever Python spelling reached it, as a value escape, and computes it
    on the real tensors: the graph cannot hold it, so the stage runs as Python. The op tag, not a
    list of spellings, decides. Under fake tensors there is no value to compute: the trace stops.
    """

    supports_higher_order_operators = True  # ``torch.cond`` and the like go on to make_fx's own rules

    def __init__(self, *, fake: bool) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output not in getattr(func, "tags", ()) or get_proxy_mode() is None:
            return func(*args, **kwargs)
        what = f"{HOST_READ}{func}"
        for t in tensors_in((args, kwargs)):
            OPAQUE_OP(t, what)
        if self.fake:
            raise TraceAborted(f"{what} escapes under fake tensors (at {user_line()})")
        with disable_proxy_modes_tracing():
            return func(*args, **kwargs)


class TraceMode(TorchFunctionMode):
    """Records escapes and the user's source line of every node; under fake tensors on a
    device this build lacks, indexes via aten."""

    def __init__(self, *, fake: bool, recorder: GraphRecorder | None = None) -> None:
        super().__init__()
        self.fake = fake
        # the graph being recorded (``_record``), else make_fx's, if any; and how the value an
        # escape hands the host is computed outside it
        self.graph = None if recorder is None else recorder.graph
        self.outside: Callable[[], Any] = disable_proxy_modes_tracing if recorder is None else recorder.paused

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        graph = self.graph
        if graph is None:
            proxy = get_proxy_mode()
            graph = proxy.tracer.graph if proxy is not None else None
        tail = graph._root.prev if graph is not None else None
        try:
            return self._call(func, args, kwargs)
        finally:
            if graph is not None and graph._root.prev is not tail:
                line = user_line()
                node = tail.next if tail is not None else graph._root.next
                while node is not graph._root:
                    node.meta.setdefault(SOURCE_KEY, line)
                    node = node.next

    def _call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        what = ESCAPES.get(func)
        if what is not None and args and isinstance(args[0], torch.Tensor):
            for t in args:  # the memory handed over too (a ``.data`` assignment's value)
                if isinstance(t, torch.Tensor):
                    OPAQUE_OP(t, what)
            if self.fake:
                raise TraceAborted(f"{what} escapes under fake tensors (at {user_line()})")
            # the value leaves the graph: compute it on the real tensor, outside the tracer
            with self.outside():
                return func(*args, **kwargs)
        if self.fake and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            if func is torch.Tensor.__getitem__:
                return _getitem(args[0], args[1])
            if func is torch.Tensor.__setitem__:
                return _setitem(args[0], args[1], args[2])
            # Python bindings that take a device guard this build lacks: use the op instead
            if func is torch.Tensor.__invert__:
                return torch.bitwise_not(args[0])
            if func is torch.Tensor.cuda:
                return args[0].to(torch.device("cuda", args[0].device.index or 0))
            if func is torch.Tensor.type and (len(args) > 1 or kwargs):
                dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
                if isinstance(dtype, torch.dtype):
                    return args[0].to(dtype)
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                # a Python binding that takes a CUDA device guard: call the aten op directly
                packet = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
                if "not linked with support for cuda" not in str(e) or packet is None:
                    raise
                return packet(*args, **kwargs)
        return func(*args, **kwargs)


def _basic_index(t: torch.Tensor, idx: Any) -> tuple[torch.Tensor, list[Any]]:
    """Apply ints, slices, None and Ellipsis; collect tensor indices for ``aten.index``."""
    if not isinstance(idx, tuple):
        idx = (idx,)

    def consumes(i: Any) -> int:
        if i is None or i is Ellipsis:
            return 0
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            return i.dim()
        return 1

    used = sum(consumes(i) for i in idx)
    out, dim = t, 0
    adv: list[torch.Tensor | None] = []  # per indexed dim: its tensor index, None for a kept dim
    for item in idx:
        if item is None:
            out = torch.ops.aten.unsqueeze.default(out, dim)
            adv.append(None)
            dim += 1
        elif item is Ellipsis:
            skip = t.dim() - used  # the dims the ellipsis stands for
            adv.extend([None] * skip)
            dim += skip
        elif isinstance(item, (int, torch.SymInt)) and not isinstance(item, bool):
            out = torch.ops.aten.select.int(out, dim, item)
        elif isinstance(item, slice):
            if any(isinstance(b, torch.Tensor) for b in (item.start, item.stop, item.step)):
                # a tensor as a slice bound is read on the host: no value under fake tensors
                raise TraceAborted(f"{HOST_READ}a tensor used as a slice bound escapes under fake tensors "
                               f"(at {user_line()})")
            start = 0 if item.start is None else item.start
            stop = out.shape[dim] if item.stop is None else item.stop
            out = torch.ops.aten.slice.Tensor(out, dim, start, stop, 1 if item.step is None else item.step)
            adv.append(None)
            dim += 1
        else:
            tensor = item if isinstance(item, torch.Tensor) else torch.tensor(item, device=t.device)
            adv.append(tensor)
            dim += 1
    while adv and adv[-1] is None:
        adv.pop()
    return out, adv


def _getitem(t: torch.Tensor, idx: Any) -> torch.Tensor:
    out, adv = _basic_index(t, idx)
    return torch.ops.aten.index.Tensor(out, adv) if adv else out


def _setitem(t: torch.Tensor, idx: Any, value: Any) -> None:
    out, adv = _basic_index(t, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.ops.aten.full.default([], value, dtype=t.dtype, device=t.device)
    if adv:
        torch.ops.aten.index_put_.default(out, adv, torch.ops.aten._to_copy.default(value, dtype=out.dtype))
    else:
        torch.ops.aten.copy_.default(out, value)
