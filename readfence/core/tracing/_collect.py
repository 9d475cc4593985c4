"""Python's cycle collector, held off while readfence builds and walks large graphs.

A trace of a deep model makes hundreds of thousands of objects (graph nodes, their metadata,
the records of every op), most of them alive until the trace is done. Each time enough new
objects pile up, CPython's collector walks every object of the generations it collects, the
oldest among them every so often; over a 64-layer trace those walks were about a third of the
time, and they found next to nothing to free. :func:`collection_paused` holds the collector
off for the length of such a phase; the garbage the phase leaves is collected by the next
collection after it, as any other (reference counting frees everything without cycles at
once in any case).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0  # phases in progress (on any thread) that hold the collector off


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Hold the cycle collector off while the block runs, unless it was already off (then it
    stays off); nested and concurrent blocks turn it back on when the last one ends.

    >>> import gc
    >>> with collection_paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    """
    global _holders
    with _lock:
        counted = _holders > 0 or gc.isenabled()  # a collector the user turned off stays off
        if counted:
            _holders += 1
            gc.disable()
    try:
        yield
    finally:
        if counted:
            with _lock:
                _holders -= 1
                if _holders == 0:
                    gc.enable()
