"""Work a stage hands to another thread: no fence covers it.

readfence sees and fences what a stage does on its own thread: the tracer and the runtime
read observer follow that thread alone (torch's dispatch modes are thread-local), and a
stage's reads end with the stage's launch. A thread the stage starts, or a job it submits to
a thread pool, reads on a clock of its own: while the trace runs it is invisible, and once
the stage has returned it may read a shared buffer after any fence, COARSE's included.

`watch_threads` puts a stage's run under watch: the threads its thread starts
(``threading.Thread.start``, which ``Timer`` and new pool workers use too, or the primitive
under it, ``_thread.start_new_thread``) and the jobs it submits to a
``concurrent.futures.ThreadPoolExecutor``. While a stage is traced or observed,
any such work is refused (the trace and the observer follow one thread); when its Python runs
in a step, work still running when it returns is refused. Work handed over another way (a job queued to a thread that already runs, a callback a
library calls later) is not seen: the output comparison with the serial run is the check
for it.

The watch wraps ``Thread.start``, ``_thread.start_new_thread`` and ``ThreadPoolExecutor.submit``
while some stage is watched, and puts them back when the last watch ends (``threading`` keeps
its own reference to the primitive, so a ``Thread`` is seen once; a reference to a primitive
taken outside a watch is not seen); the wrappers only look up whether the calling thread is
running a watched stage, so the rest of the process is unaffected, and once no stage is
watched the process runs torch's and Python's own functions.
"""

from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

from readfence.effects import ReadfenceError

_watching = threading.local()  # .started: the work started by this thread's watched stage; .watcher: what watches
_install_lock = threading.Lock()
_OWN_FILES = (os.path.dirname(__file__), threading.__file__, os.path.dirname(concurrent.futures.__file__))


class StageThreadError(ReadfenceError, ValueError):
    """A stage hands work to another thread, which no fence covers.

    ``what`` names the thread or job (its name and function), ``source`` the user's
    ``file:line in function`` that started it; ``watcher`` is what found it: ``"the trace"`` or ``"the read observer"``
    (any such work: they follow one thread), or ``None`` when the stage's Python ran in a step
    (work still running when the stage returned).
    """

    def __init__(self, backend: str, stage: str, what: str, source: str, watcher: str | None) -> None:
        self.backend, self.stage, self.what, self.source, self.watcher = backend, stage, what, source, watcher
        when = (f"while {watcher} watched it ({watcher} follows the stage's own thread only)" if watcher
                else "that was still running when the stage returned")
        super().__init__(
            f"backend {backend!r} stage {stage} starts {what} at {source} {when}; what another thread "
            f"reads is covered by no fence (COARSE included): do the work in the stage itself"
        )


def _user_line() -> str:
    # the innermost frame outside threading, concurrent.futures and this module
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_OWN_FILES):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "?"


def _describe(fn: Any, kind: str, name: str | None = None) -> str:
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{kind} {name!r} running {qual}" if name else f"{kind} running {qual}"


def _carrying(kernels: list[str], fn: Any) -> Any:
    """``fn``, run on another thread, noting there the kernels it launches (:func:`note_kernel`)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        _watching.kernels = kernels
        try:
            return fn(*args, **kwargs)
        finally:
            _watching.kernels = None

    return run


def note_kernel(name: str) -> None:
    """A kernel named ``name`` is launched on this thread: if a watched stage started the thread,
    its refusal names the kernel (a launch on a thread of its own is on a clock of its own)."""
    kernels = getattr(_watching, "kernels", None)
    if kernels is not None:
        kernels.append(name)


def _current_stream() -> Any:
    # the CUDA stream current on this thread, where CUDA is in use (never initialised here)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


def stage_stream() -> Any:
    """The CUDA stream current when the watched stage running on this thread began (``None`` where
    no stage is watched or CUDA is not in use)."""
    return getattr(_watching, "stream", None) if getattr(_watching, "started", None) is not None else None


def _wrappers() -> tuple[tuple[Any, str, Any], ...]:
    """``(owner, attribute, wrapper)`` of each primitive the watch wraps, around the originals."""
    start, submit = threading.Thread.start, concurrent.futures.ThreadPoolExecutor.submit
    start_new = _thread.start_new_thread

    def watched_start(self: threading.Thread) -> None:
        started = getattr(_watching, "started", None)
        if started is not None:
            target = getattr(self, "_target", None) or getattr(self, "function", None) or self.run  # Timer: function
            kernels: list[str] = []
            self.run = _carrying(kernels, self.run)  # type: ignore[method-assign]
            started.append((self.is_alive, _describe(target, "a thread", self.name), _user_line(), kernels))
        start(self)

    def watched_submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        started = getattr(_watching, "started", None)
        if started is None:
            return submit(self, fn, *args, **kwargs)
        line = _user_line()
        kernels: list[str] = []
        _watching.started = None  # the pool's own worker threads are the job's, not the stage's
        try:
            future = submit(self, _carrying(kernels, fn), *args, **kwargs)
        finally:
            _watching.started = started
        started.append((lambda: not future.done(), _describe(fn, "a thread-pool job"), line, kernels))
        return future

    def watched_start_new_thread(function: Any, args: tuple[Any, ...], kwargs: Any = None, /) -> int:
        started = getattr(_watching, "started", None)
        if started is None:
            return start_new(function, args, {} if kwargs is None else kwargs)
        done = threading.Event()
        kernels: list[str] = []
        carried = _carrying(kernels, function)

        def run(*a: Any, **k: Any) -> Any:
            try:
                return carried(*a, **k)
            finally:
                done.set()

        started.append((lambda: not done.is_set(), _describe(function, "a thread"), _user_line(), kernels))
        return start_new(run, args, {} if kwargs is None else kwargs)

    return ((threading.Thread, "start", watched_start),
            (concurrent.futures.ThreadPoolExecutor, "submit", watched_submit),
            (_thread, "start_new_thread", watched_start_new_thread),
            (_thread, "start_new", watched_start_new_thread))


_active = 0  # watches running now, on any thread
_saved: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, wrapper) while installed


def _enter() -> None:
    global _active
    with _install_lock:
        if _active == 0:
            for owner, name, wrapper in _wrappers():
                _saved.append((owner, name, getattr(owner, name), wrapper))
                setattr(owner, name, wrapper)
        _active += 1


def _exit() -> None:
    global _active
    with _install_lock:
        _active -= 1
        if _active == 0:
            for owner, name, original, wrapper in reversed(_saved):
                if getattr(owner, name) is wrapper:  # not if someone wrapped it again meanwhile
                    setattr(owner, name, original)
            _saved.clear()


def installed() -> bool:
    """Whether the thread primitives are wrapped now: only while some stage is watched.

    >>> installed()
    False
    >>> with watch_threads("toy", "body"):
    ...     installed()
    True
    """
    return _active > 0


@contextlib.contextmanager
def watch_threads(backend: str, stage: str, watcher: str | None = None) -> Iterator[None]:
    """Run a stage's Python under watch for work it hands to other threads.

    ``watcher`` (``"the trace"``, ``"the read observer"``): what follows the stage's thread
    meanwhile; any such work is refused. ``None``: the stage runs in a step; work still running
    when the block ends is refused. A watch inside another hands what it saw to the outer one,
    and leaves the refusal to it when the outer has a watcher (it refuses any such work, and
    names what watched; an inner watch would refuse only work still running, which depends on
    timing). Raises :class:`StageThreadError`.

    >>> import threading
    >>> with watch_threads("toy", "body"):
    ...     t = threading.Thread(target=lambda: None); t.start(); t.join()
    >>> try:
    ...     with watch_threads("toy", "body", "the trace"):
    ...         t = threading.Thread(target=lambda: None, name="helper"); t.start(); t.join()
    ... except StageThreadError as e:
    ...     print(e.what)
    a thread 'helper' running <lambda>
    """
    _enter()
    outer, outer_watcher = getattr(_watching, "started", None), getattr(_watching, "watcher", None)
    outer_stream = getattr(_watching, "stream", None)
    started: list[tuple[Any, str, str, list[str]]] = []
    _watching.started, _watching.watcher = started, watcher or outer_watcher
    _watching.stream = outer_stream if outer is not None else _current_stream()
    try:
        yield
    finally:
        _watching.started, _watching.watcher, _watching.stream = outer, outer_watcher, outer_stream
        _exit()
        if outer is not None:
            outer.extend(started)
    if outer_watcher is not None:
        return
    for running, what, source, kernels in started:
        if watcher is not None or running():
            launching = f" launching triton kernel {', '.join(repr(k) for k in dict.fromkeys(kernels))}" if kernels else ""
            raise StageThreadError(backend, stage, what + launching, source, watcher)
