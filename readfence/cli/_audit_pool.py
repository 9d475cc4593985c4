"""``readfence audit --jobs N``: the (backend, mode) audits run in worker processes.

One task per mode: traces and observations are keyed by mode, so a mode's nodes share them
(a composition's children are the leaves audited before it) and no two modes do; a task is
the mode's reports, in the order given, and the reports come back in that order, whichever
worker finished first. Backends cross to the workers as their spec text, which each worker
parses back (a backend whose text does not give it back, e.g. one built in Python with its
own functions, is not sent: the caller audits in this process). A worker runs torch on one
thread; it forgets a mode's traces once the mode is done, as no later task can use them.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from readfence.backends import parse
from readfence.core import AuditReport, ForwardMode, clear_trace_cache
from readfence.core.internal import audit_report


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform says, else all).

    >>> available_cpus() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def sendable(backends: Sequence[Any]) -> bool:
    """Every backend's spec text parses back to that very backend (what a worker gets is what
    this process would audit).

    >>> from readfence.backends import paged, redeclare
    >>> from readfence.effects import ReadEffect
    >>> sendable([paged()]), sendable([redeclare(paged(), lambda m: ReadEffect.unknown())])
    (True, False)
    """
    return all(parse(str(b)).map(b.__eq__).value_or(False) is True for b in backends)


def audit_in_workers(pairs: Sequence[tuple[Any, ForwardMode]], *, jobs: int, batch_sizes: Sequence[int] | None,
                     done: Callable[[int], object] = lambda n: None) -> list[AuditReport] | None:
    """One report per ``(backend, mode)`` of ``pairs``, in that order, audited by ``jobs``
    worker processes (one task per mode); ``done(n)`` is called as ``n`` more are ready.
    ``None`` when a backend cannot be sent (see :func:`sendable`) or a worker failed: the
    caller then audits in this process, which raises what the sequential audit raises.

    >>> from readfence.backends import paged
    >>> [r.sound for r in audit_in_workers([(paged(), ForwardMode.IDLE)], jobs=1, batch_sizes=[1])]
    [True]
    """
    if not sendable([b for b, _ in pairs]):
        return None
    by_mode: dict[ForwardMode, list[int]] = {}
    for i, (_, mode) in enumerate(pairs):
        by_mode.setdefault(mode, []).append(i)
    sizes = None if batch_sizes is None else tuple(batch_sizes)
    reports: list[AuditReport | None] = [None] * len(pairs)
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(by_mode)), mp_context=_context(),
                                                  initializer=torch.set_num_threads, initargs=(1,))
    try:
        tasks = {pool.submit(_audit_mode, tuple(str(pairs[i][0]) for i in index), mode.name, sizes): index
                 for mode, index in by_mode.items()}
        for task in concurrent.futures.as_completed(tasks, timeout=WORKER_TIMEOUT_S):
            if task.exception() is not None:
                return None
            for i, report in zip(tasks[task], task.result(), strict=True):
                reports[i] = report
            done(len(tasks[task]))
    except concurrent.futures.TimeoutError:
        return None  # a worker that never answers: audit here instead, never hang
    finally:
        _stop(pool)
    return [r for r in reports if r is not None]


#: The longest the workers may take over all modes before the audit runs in this process.
WORKER_TIMEOUT_S = 600.0


def _stop(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    # a worker still running (a failure elsewhere, a timeout) is killed rather than waited for
    for process in list(getattr(pool, "_processes", {}).values()):
        if process.is_alive():
            process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def _context() -> Any:
    # forked, as torch's DataLoader starts its workers: they inherit this process's imports
    # (torch and readfence: 3 s a spawned worker would spend) and set torch to one thread
    # before any op, so no intra-op thread pool is used across the fork. Only a process with
    # no other thread is forked: a lock another thread holds at the fork stays held in the
    # child forever (a caller running devices, a test runner); those get a fork server, which
    # imports this module (torch and readfence) once if it starts here, so that each worker of
    # this pool and of every later one forks from it instead of importing them again (as
    # ``readfence.parallel.launch`` preloads its own module for its ranks).
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        multiprocessing.set_forkserver_preload([__name__])  # (effective when this starts the server)
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def _audit_mode(specs: tuple[str, ...], mode: str, batch_sizes: tuple[int, ...] | None) -> list[AuditReport]:
    """A worker's task: the reports of each spec in ``mode``."""
    try:
        return [audit_report(parse(s).unwrap(), ForwardMode[mode], batch_sizes=batch_sizes) for s in specs]
    finally:
        clear_trace_cache()  # no later task (another mode) can use them
