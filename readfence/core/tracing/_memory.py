"""Which shared buffers a tensor touches, by memory range rather than by Python identity.

Two tensors alias when the bytes they may touch overlap: a view, a piece of ``split``, a
``torch.from_dlpack`` round trip or a ``torch.frombuffer`` over the same memory all make new
tensor (and even new storage) objects over a buffer's bytes, so identity misses them while
an address range does not. A tensor's span is the interval from its first to one past its
last addressable element (strides included): an over-approximation for strided views, which
is the sound side. Fake and meta tensors have no addresses: their span lives in the space of
their storage object instead (identity is all there is to compare under fake tensors).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._words import as_words


@attrs.frozen
class Span:
    """The bytes ``[start, stop)`` a tensor may touch within one address ``space``.

    >>> base = torch.zeros(4, 8, dtype=torch.int32)
    >>> span_of(base[1]).overlaps(span_of(base)), span_of(base[1]).overlaps(span_of(base[2]))
    (True, False)
    """

    space: Hashable  # ("cpu", None) / ("cuda", 0) for real memory; a StorageWeakRef otherwise
    start: int
    stop: int

    def overlaps(self, other: Span) -> bool:
        # spaces of two kinds (real memory, a storage object's) never meet: a meta tensor's span
        # beside a CPU tensor's is no overlap, and compares without asking either for the other's parts
        return (type(self.space) is type(other.space) and self.space == other.space
                and self.start < other.stop and other.start < self.stop)


def _addressless(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor:  # the common case, decided without the import below
        return t.is_meta
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


#: The address space of every CPU tensor (``t.device`` builds a new object per call).
_CPU = ("cpu", None)


def sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors a sparse tensor holds its data in (indices and values); ``()`` for a
    strided tensor or a layout with no parts to see.

    >>> [tuple(p.shape) for p in sparse_parts(torch.eye(3).to_sparse())]
    [(2, 3), (3,)]
    """
    layout = t.layout
    if layout is torch.sparse_coo:
        return (t._indices(), t._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()


def unobserved() -> contextlib.AbstractContextManager[None]:
    """A block of readfence's own look at memory (``data_ptr()``, storages) while a step may be
    watched: no torch-function mode (a read observer of check mode) takes it for the step's code
    handing memory out.

    >>> with unobserved():
    ...     torch.zeros(2).data_ptr() != 0
    True
    """
    return torch._C.DisableTorchFunction()


def span_of(t: torch.Tensor) -> Span | None:
    """The span of ``t``'s elements, or ``None`` when it has none (``numel() == 0``).

    >>> t = torch.zeros(10)
    >>> s = span_of(t[2:5]); s.stop - s.start
    12
    >>> span_of(torch.from_dlpack(torch.to_dlpack(t))) == span_of(t)
    True
    """
    # Called for every tensor argument of every op the tracer and the read observer see: the
    # fast paths (contiguous, CPU, plain tensors) took it from 8.8 to about 3 us a call.
    if t.layout is not torch.strided:  # a sparse tensor: no one span (``BufferMap`` looks at its parts)
        return None
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):  # its memory is the tensors it wraps
        return None
    numel = t.numel()
    if numel == 0:
        return None
    size = t.element_size()
    offset = int(t.storage_offset())  # a plain int: readfence traces with static shapes
    if t.is_contiguous():
        last = offset + numel - 1
    else:
        last = offset
        for n, stride in zip(t.shape, t.stride()):
            last += (n - 1) * abs(stride)
    storage = t.untyped_storage()
    if _addressless(t):
        return Span(StorageWeakRef(storage), offset * size, (last + 1) * size)
    base = storage.data_ptr()
    space = _CPU if t.is_cpu else (t.device.type, t.device.index)
    return Span(space, base + offset * size, base + (last + 1) * size)


def leaves(tree: object) -> list[Any]:
    """The leaves of a pytree, in ``pytree.tree_leaves`` order: lists, tuples and dicts walked
    here (the arguments of every op are only these), other registered containers by pytree.

    The hot path of every per-op check (the memory probe, the observer, the layer recorder):
    pytree's generic walk costs ~10 us a leaf, this ~0.3 us.

    >>> leaves(([1, (2, None)], {"a": 3}))
    [1, 2, None, 3]
    """
    out: list[Any] = []
    _walk(tree, out)
    return out


def _walk(tree: object, out: list[Any]) -> None:
    kind = type(tree)
    if kind is list or kind is tuple or kind is immutable_list:
        for x in tree:  # type: ignore[attr-defined]
            if type(x) in _SCALARS or isinstance(x, torch.Tensor):
                out.append(x)
            else:
                _walk(x, out)
    elif kind is dict or kind is immutable_dict:
        for x in tree.values():  # type: ignore[attr-defined]
            _walk(x, out)
    elif kind in _SCALARS or isinstance(tree, torch.Tensor):
        out.append(tree)
    else:  # subclasses (namedtuples, torch.Size) and other containers as pytree sees them
        out.extend(pytree.tree_leaves(tree))


_NONE: frozenset[str] = frozenset()

#: Leaves that hold no tensor, skipped without asking the pytree registry.
_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})

#: Values that hold no memory (what a graph's arguments are besides its nodes and tensors).
PLAIN_VALUES = _SCALARS


def tensors_in(tree: object) -> Iterator[torch.Tensor]:
    """Every tensor in a pytree (lists of pieces, dicts, tuples), in order; a wrapper subclass
    (an ``AsyncCollectiveTensor``, a ``DTensor``) as the tensors it wraps, which hold its memory."""
    for leaf in leaves(tree):
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor and is_traceable_wrapper_subclass(leaf):
                names, _ = leaf.__tensor_flatten__()
                yield from tensors_in([getattr(leaf, n) for n in names])
            else:
                yield leaf


def view_claim_holds(outputs: Sequence[Any], sources: Sequence[Sequence[Any]]) -> bool:
    """Whether each output really shares memory with the inputs its schema says it aliases:
    ``outputs[i]`` (a tensor or a list of them) with some tensor of ``sources[i]``.

    An op whose schema claims a view but returns fresh memory (a functional ``_foreach_*`` op,
    a list-returning custom op: ``Tensor[] -> Tensor[]`` lets the alias oracle assume the
    worst) copied: it read what it was given. An empty output has no memory to share.

    >>> x = torch.arange(6)
    >>> view_claim_holds([list(x.split(2))], [[x]]), view_claim_holds([torch._foreach_add([x], 0)], [[[x]]])
    (True, False)
    """
    for out, srcs in zip(outputs, sources):
        spans = [s for t in tensors_in(srcs) if (s := span_of(t)) is not None]
        for t in tensors_in(out):
            mine = span_of(t)
            if mine is None or not any(mine.overlaps(s) for s in spans):
                return False
    return True


def metadata_claim_holds(outputs: Any, templates: Sequence[torch.Tensor],
                         rerun: Callable[[Sequence[torch.Tensor]], Any]) -> bool:
    """Whether an op that claims to use ``templates`` only for their metadata (shape, dtype,
    device, strides) does, on its real run: its ``outputs`` share no memory with them, and its
    outputs do not change when their bytes do. ``rerun(tensors)`` runs the op again with
    ``tensors`` in the templates' places: once on the templates and once on twins (the same
    metadata, every element changed), from one random state (put back afterwards) and with the
    memory torch allocates uninitialised filled (``empty_like``'s output is then defined).

    >>> lens = torch.arange(4, dtype=torch.int32)
    >>> metadata_claim_holds(torch.zeros_like(lens), [lens], lambda ts: torch.zeros_like(ts[0]))
    True
    >>> metadata_claim_holds(lens.clone(), [lens], lambda ts: ts[0].clone())  # a claim its values refute
    False
    """
    spans = [s for t in templates if (s := span_of(t)) is not None]
    for t in tensors_in(outputs):
        mine = span_of(t)
        if mine is not None and any(mine.overlaps(s) for s in spans):
            return False
    devices = sorted({t.device.index or 0 for t in templates if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), defined_memory():
        state = random_state(devices)
        same = rerun(templates)
        set_random_state(state, devices)
        other = rerun([_twin(t) for t in templates])
    return _same(same, other)


_FILL_LOCK = threading.RLock()  # (a run inside may check an op's claim: the same thread enters again)


@contextlib.contextmanager
def defined_memory() -> Iterator[None]:
    """Memory torch allocates uninitialised (``torch.empty``, ``empty_like``, ``new_empty``) filled
    with a fixed value (NaN, the dtype's largest) while inside: torch does so under deterministic
    algorithms, which are switched on here (warning rather than failing, where they were off) and
    put back as they were. Two runs compared inside then differ only where what they computed does.
    (The debug-mode switch, not ``use_deterministic_algorithms``: that one imports the compiler.)

    >>> with defined_memory():
    ...     torch.empty(2).isnan().all().item()
    True
    """
    with _FILL_LOCK:
        mode, fill = torch.get_deterministic_debug_mode(), torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
        if mode == 0:
            torch.set_deterministic_debug_mode(1)
        if not fill:
            torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            torch.set_deterministic_debug_mode(mode)
            if not fill:
                torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def _twin(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s size, strides, storage offset, dtype and device, each element changed."""
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(t.storage_offset() + extent, dtype=t.dtype, device=t.device)
    twin = base.as_strided(t.size(), t.stride(), t.storage_offset())
    twin.copy_(t)
    return twin.logical_not_() if t.dtype is torch.bool else twin.add_(1)


@contextlib.contextmanager
def random_kept() -> Iterator[None]:
    """The random number generators (the CPU's, every visible CUDA device's) put back as they were
    when the block ends: readfence's own runs of a step's code (traces, observers, validations,
    rehearsals) draw nothing the user's program would draw next. Also a decorator.

    >>> before = torch.get_rng_state()
    >>> with random_kept():
    ...     _ = torch.rand(3)
    >>> torch.equal(torch.get_rng_state(), before)
    True
    """
    devices = cuda_devices()
    state = random_state(devices)
    try:
        yield
    finally:
        set_random_state(state, devices)


def cuda_devices() -> list[int]:
    """Every visible CUDA device's index (none without CUDA): the generators :func:`random_kept`
    keeps besides the CPU's."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def random_state(devices: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU generator's state and those of the CUDA ``devices``: what :func:`set_random_state`
    puts back, so that a second run draws the numbers the first one drew."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def set_random_state(state: tuple[torch.Tensor, list[torch.Tensor]], devices: Sequence[int] = ()) -> None:
    """Put back what :func:`random_state` took."""
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1]):
        torch.cuda.set_rng_state(s, d)


def _same(a: Any, b: Any) -> bool:
    """The same values, leaf by leaf (tensors by shape, dtype and elements, NaN equal to NaN)."""
    xs, ys = leaves(a), leaves(b)
    return len(xs) == len(ys) and all(_same_leaf(x, y) for x, y in zip(xs, ys))


def _same_leaf(x: Any, y: Any) -> bool:
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and bool(x == y)
    return same_values(x, y)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same tensor: shape, dtype, device and every element (NaN equal to NaN).

    >>> same_values(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    True
    >>> same_values(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    False
    """
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.device.type == "meta":  # no data: nothing to differ
        return True
    a, b = as_words(a), as_words(b)
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


# Every state's shared buffers readfence has met (made or given), by memory, held weakly: a
# tensor a backend keeps is another state's buffer only when its memory is one of these.
_MET: list[tuple[StorageWeakRef, Span, str]] = []
_MET_LOCK = threading.Lock()


def meet_shared(shared: Mapping[str, object]) -> None:
    """Remember the memory of a state's shared buffers (``make_shared_state``'s, a live state's),
    as long as they live: :func:`met_shared` then knows a tensor over it for one.

    >>> lens = torch.zeros(4, dtype=torch.int32)
    >>> meet_shared({"seq_lens": lens}); met_shared(lens[1:])
    'seq_lens'
    """
    with torch._C.DisableTorchFunction():  # readfence's own look at memory: no escape of a traced stage
        found = [(StorageWeakRef(t.untyped_storage()), span, name) for name, t in shared.items()
                 if isinstance(t, torch.Tensor) and not _addressless(t) and (span := span_of(t)) is not None]
    with _MET_LOCK:
        _MET[:] = [m for m in _MET if not m[0].expired()]  # forget the states that died (their memory is reused)
        known = {(m[1], m[2]) for m in _MET}
        _MET.extend(m for m in found if (m[1], m[2]) not in known)


def met_shared(t: torch.Tensor) -> str | None:
    """The name of a shared buffer of a state readfence has met (and that still lives) whose memory
    ``t`` touches, else ``None``: a tensor no state's buffer is over is a backend's own.

    >>> met_shared(torch.ones(3, dtype=torch.int32)) is None
    True
    """
    with torch._C.DisableTorchFunction():
        span = None if _addressless(t) else span_of(t)
    if span is None:
        return None
    with _MET_LOCK:
        met = list(_MET)
    return next((name for ref, other, name in met if not ref.expired() and span.overlaps(other)), None)


@attrs.frozen
class BufferMap:
    """Named memory regions (the shared buffers of a step) and which of them a tensor touches.

    >>> live = {"seq_lens": torch.zeros(4, dtype=torch.int32), "swa_map": torch.zeros(8)}
    >>> bm = BufferMap.of(live)
    >>> bm.touched(live["seq_lens"].chunk(2)[1]), bm.touched(torch.zeros(4))
    (frozenset({'seq_lens'}), frozenset())
    """

    spans: tuple[tuple[str, Span], ...]
    # the CPU spans as ``(name, start, stop)``: what a plain CPU tensor is matched against
    _cpu: tuple[tuple[str, int, int], ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        cpu = tuple((n, s.start, s.stop) for n, s in self.spans if type(s.space) is tuple and s.space == _CPU)
        object.__setattr__(self, "_cpu", cpu)

    @classmethod
    def of(cls, named: Mapping[str, object]) -> BufferMap:
        """From ``{name: tensor}`` (non-tensors and empty tensors are skipped)."""
        spans = []
        for name, t in named.items():
            if isinstance(t, torch.Tensor):
                s = span_of(t)
                if s is not None:
                    spans.append((name, s))
        return cls(tuple(spans))

    def __bool__(self) -> bool:
        return bool(self.spans)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for n, _ in self.spans))

    def touched(self, t: torch.Tensor) -> frozenset[str]:
        """The names whose memory ``t`` may touch (a sparse tensor's: its indices' and values').

        >>> lens = torch.arange(4.0)
        >>> m = BufferMap.of({"seq_lens": lens})
        >>> sorted(m.touched(torch.sparse_coo_tensor(torch.tensor([[0, 2]]), lens[:2], (4,))))
        ['seq_lens']
        >>> m.touched(torch.eye(2).to_sparse())
        frozenset()
        >>> sorted(m.touched(torch.nested.nested_tensor_from_jagged(lens, torch.tensor([0, 1, 4]))))
        ['seq_lens']
        """
        if not self.spans:
            return _NONE
        if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):  # a DTensor, a jagged nested tensor
            return frozenset().union(*(self.touched(p) for p in tensors_in(t)))
        if t.layout is not torch.strided:
            return frozenset().union(*(self.touched(p) for p in sparse_parts(t)))
        if type(t) is torch.Tensor and t.is_cpu and not t.is_meta:
            # the hot path (every tensor argument of every op the probe and the observer see):
            # ``span_of``'s interval from one data pointer, without its storage or a Span
            numel = t.numel()
            if numel == 0:
                return _NONE
            start = t.data_ptr()
            if t.is_contiguous():
                stop = start + numel * t.element_size()
            else:
                stop = start + (sum((n - 1) * abs(d) for n, d in zip(t.shape, t.stride())) + 1) * t.element_size()
            hits = [n for n, lo, hi in self._cpu if lo < stop and start < hi]
            return frozenset(hits) if hits else _NONE
        s = span_of(t)
        if s is None:
            return frozenset()
        return frozenset(n for n, span in self.spans if span.overlaps(s))

    def in_storage_of(self, t: torch.Tensor) -> bool:
        """Whether any named memory may lie in the storage ``t`` is a view of (where that is not
        known, a tensor subclass, a sparse or an addressless tensor: True). A view of that storage,
        whatever its offset and strides, touches nothing else (torch checks a view's bounds against
        its storage): when this is False, no torch op on ``t`` can reach a named region.

        >>> arena = torch.zeros(8)
        >>> m = BufferMap.of({"seq_lens": arena[:2]})
        >>> m.in_storage_of(arena[4:]), m.in_storage_of(torch.zeros(8))
        (True, False)
        """
        if not self.spans:
            return False
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_meta:
            return True
        storage = t.untyped_storage()
        start = storage.data_ptr()
        stop = start + storage.nbytes()
        if start == stop:
            return False
        if t.is_cpu:
            return any(lo < stop and start < hi for _, lo, hi in self._cpu)
        whole = Span((t.device.type, t.device.index), start, stop)
        return any(span.overlaps(whole) for _, span in self.spans)

    def touched_by(self, tree: object) -> frozenset[str]:
        """The names touched by any tensor of a pytree."""
        if not self.spans:
            return _NONE
        if type(tree) is torch.Tensor:
            return self.touched(tree)
        out = _NONE
        for t in tensors_in(tree):
            hit = self.touched(t)
            if hit:  # (most tensors touch nothing: no new set for them)
                out = out | hit
        return out

    def union(self, others: Iterable[BufferMap]) -> BufferMap:
        spans = list(self.spans)
        for o in others:
            spans.extend(o.spans)
        return BufferMap(tuple(spans))
