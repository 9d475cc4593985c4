"""What the running launch is, per stream thread: its declared records, for ``record_here``.

A launched (or replayed) function runs inside an op context that holds the ``Record`` items
its ``ops`` declared, in order; ``device.record_here(event)`` pops the next one, and a launch
that returns with records still pending fails. ``record_here`` and ``delay_point`` are also
plain functions, convenient as targets of FX ``call_function`` nodes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import CaptureError
from ._protocol import Event


class _OpContext:
    """What the current thread is running: a launched function and its declared records."""

    __slots__ = ("device", "stream", "label", "pending")

    def __init__(self, device: Any, stream: str, label: str, pending: Sequence[tuple[Any, Any]]) -> None:
        self.device = device
        self.stream = stream
        self.label = label
        # (event, token) pairs in declared order; the token is device specific.
        self.pending: deque[tuple[Any, Any]] = deque(pending)


class _OpContextStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[_OpContext] = []


_CONTEXT = _OpContextStack()


def _current_context() -> _OpContext | None:
    return _CONTEXT.stack[-1] if _CONTEXT.stack else None


class _running:
    """Context manager: run a launched function with its declared records pending."""

    def __init__(self, ctx: _OpContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> _OpContext:
        _CONTEXT.stack.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _CONTEXT.stack.pop()


def _take_pending(event: Any) -> tuple[_OpContext, Any]:
    """Pop the next declared record of the running launch; it must be ``event``."""
    ctx = _current_context()
    name = getattr(event, "name", repr(event))
    if ctx is None:
        raise CaptureError(
            f"record_here({name!r}) called outside a launched function: record_here is for "
            "code running on a stream (use stream.record(event) from the host)"
        )
    if not ctx.pending:
        raise CaptureError(
            f"record_here({name!r}) in op {ctx.label!r} on stream {ctx.stream!r} was not "
            "declared: add Record(event) to the ops of the launch"
        )
    expected, token = ctx.pending[0]
    if expected is not event:
        raise CaptureError(
            f"record_here({name!r}) in op {ctx.label!r} on stream {ctx.stream!r} is out of "
            f"the declared order: the next declared Record is {expected.name!r}"
        )
    ctx.pending.popleft()
    return ctx, token


def _check_all_recorded(ctx: _OpContext) -> None:
    if ctx.pending:
        names = [ev.name for ev, _ in ctx.pending]
        raise CaptureError(
            f"op {ctx.label!r} on stream {ctx.stream!r} declared Record items it never "
            f"recorded with record_here: {names}"
        )


def _run_launched(device: Any, stream: str, label: str, fn: Callable[..., Any], args: Sequence[Any],
                  pending: Sequence[tuple[Any, Any]]) -> None:
    """Run a launched ``fn(*args)`` with its declared records ``pending`` (``(event, token)``
    pairs, for ``record_here``); each of them must be recorded by the time it returns."""
    ctx = _OpContext(device, stream, label, pending)
    with _running(ctx):
        fn(*args)
    _check_all_recorded(ctx)


def record_here(event: Event) -> None:
    """Record ``event`` at this point of the running launch: ``event.device.record_here(event)``.

    A plain module-level function, convenient as the target of an FX ``call_function`` node.
    """
    event.device.record_here(event)


def delay_point(label: str) -> None:
    """A fault-injection point inside the running launch (no-op outside one or without faults).

    A plain module-level function, convenient as the target of an FX ``call_function`` node.
    """
    ctx = _current_context()
    if ctx is not None:
        ctx.device.delay_point(label)


def _label_of(fn: Callable[..., Any], label: str) -> str:
    return label or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
