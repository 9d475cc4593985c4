"""The caches of what a backend's code does: traced programs by code, mode and arguments, and
the caches of other parts (observations, bindings, validations) forgotten with them.

A trace depends on a backend's code, never its declaration (:func:`code_key`), so ``redeclare``d
copies share one. Every cache is bounded (:func:`remember`): a forgotten entry only costs
computing it again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from .._protocol import BackendLike

if TYPE_CHECKING:
    from .._program import Program


def _code_key(backend: BackendLike) -> Any:
    """What a trace depends on: the code, not the declaration.

    A leaf that carries a ``kernel`` (the backends layer's ``Leaf``) is keyed by its name,
    kernel and options, so ``redeclare``d copies share one trace; anything else by itself.
    """
    kernel = getattr(backend, "kernel", None)
    if kernel is not None and not backend.children():
        try:
            key = (type(backend), backend.name, kernel, tuple(getattr(backend, "options", ())))
            hash(key)
            return key
        except TypeError:
            pass
    return backend


_CACHE: dict[Any, Program] = {}
_CACHE_LIMIT = 1024
#: ... and at most this many graph nodes in all, the oldest forgotten first: a program of a
#: 64-layer model is some 20,000 nodes (about 6 MB), and lowering every size of a capture list
#: traces three programs per size for a combinator of two
_CACHE_NODES = 1_000_000
_CACHE_SIZES: dict[Any, int] = {}  # nodes per cached program


#: Other caches of what a backend's code does (``observe``'s): forgotten with the traces.
_DEPENDENT_CACHES: list[dict[Any, Any]] = []


def code_key(backend: BackendLike) -> Any:
    """What a trace or an observation of ``backend`` depends on: its code, not its declaration
    (see ``_code_key``)."""
    return _code_key(backend)


def cache_with_traces(cache: dict[Any, Any]) -> dict[Any, Any]:
    """Register ``cache`` to be forgotten with the traces (``clear_trace_cache``)."""
    _DEPENDENT_CACHES.append(cache)
    return cache


_V = TypeVar("_V")


def remember(cache: dict[Any, Any], key: Any, value: _V, limit: int) -> _V:
    """Put ``value`` in ``cache`` under ``key``, forgetting the oldest entry first when the
    cache holds ``limit``; returns ``value``. The one rule of readfence's bounded caches: a
    forgotten entry only costs computing it again.

    >>> cache = {}
    >>> [remember(cache, k, k * 10, 2) for k in (1, 2, 3)], cache
    ([10, 20, 30], {2: 20, 3: 30})
    """
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def clear_trace_cache() -> None:
    """Forget every cached trace and observation (``trace`` caches one program per backend code,
    mode, model config, batch size, device and seed, ``observe`` one observation per backend
    code and its arguments; the next call traces or observes again).

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, trace
    >>> clear_trace_cache(); _ = trace(paged(), ForwardMode.DECODE); trace_cache_size()
    1
    """
    _CACHE.clear()
    _CACHE_SIZES.clear()
    for cache in _DEPENDENT_CACHES:
        cache.clear()


def trace_cache_size() -> int:
    """How many traced programs are cached (at most 1024 programs and a million graph nodes in
    all: the oldest is forgotten first)."""
    return len(_CACHE)


def cached_trace(key: Hashable, make: Callable[[], Program]) -> Program:
    """The program traced under ``key`` (``code_key`` of the backend, then the trace's arguments),
    ``make()``'s on a miss, kept within the cache's bounds (oldest forgotten first)."""
    hit = _CACHE.get(key)
    if hit is None:
        hit = make()
        nodes = sum(len(s.graph.gm.graph.nodes) for s in hit.stages)
        while _CACHE and (len(_CACHE) >= _CACHE_LIMIT or sum(_CACHE_SIZES.values()) + nodes > _CACHE_NODES):
            oldest = next(iter(_CACHE))
            del _CACHE[oldest], _CACHE_SIZES[oldest]
        _CACHE[key], _CACHE_SIZES[key] = hit, nodes
    return hit
