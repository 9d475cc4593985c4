"""The lowering options a function that lowers for you hands on to :func:`lower`, as one value."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import attrs

from readfence.core import SHARED_BUFFERS
from readfence.core.internal import check_buffers, positive_int

from ..devices import Event, Timeline
from ._poison import CheckState

#: The most events a graph's ring may hold per buffer: far beyond the steps any loop keeps in flight
#: (each slot is a compiled copy of the step's hooks, built when the step is lowered).
MAX_RING = 64


def _ring_size(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        positive_int(f"LowerOptions.{field.name}", value, at_most=MAX_RING, limit="the most steps a loop keeps in flight")


def _flag(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"LowerOptions.{field.name} must be a bool, got {value!r} ({type(value).__name__})")


def _instance(kind: type, what: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, field: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"LowerOptions.{field.name} must be {what} or None, got {value!r} "
                            f"({type(value).__name__})")
    return check


def _buffers(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"LowerOptions.publish must be a list of buffer names or None, got {value!r} "
                        f"({type(value).__name__})")
    return check_buffers(value, SHARED_BUFFERS, "publish")


def _callable(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"LowerOptions.{field.name} must be a function of an event's name or None, got {value!r} "
                        f"({type(value).__name__})")


@attrs.frozen(kw_only=True)
class LowerOptions:
    """The lowering options: what :func:`lower` takes as ``lowering=``, and what a function that
    lowers for you (``decode_loop``, ``serve_loop``, ``verify``, ``lower_capture_list``,
    ``lower_step``...) takes as ``lowering=`` and hands on, whole, to every ``lower`` it calls.

    ``ring_size``: events per graph and buffer (default: the steps a graph has in flight);
    ``measure``: time each fence against the last reads; ``timeline``: record the stages and
    replays; ``new_event``: make each event from its name (default: the device's);
    ``check``: the poison-on-release check mode over ``state["shared"]``;
    ``optimize``: run the captured stages through readfence's compile passes (constant folding,
    shared subexpressions, Python bindings; ``False``: every node as traced);
    ``UNSAFE_skip_soundness_check``: lower a declaration the audit refuses (to show it failing);
    ``publish``: the shared buffers whose release the graph publishes (default: all).
    A loop sets what it runs with itself (it measures, publishes every buffer its scheduler
    writes, keeps its own timeline and check mode): a record that sets one of those is refused
    there, saying where it goes.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, Policy, decode_loop
    >>> with CpuDevice() as dev:
    ...     loop = decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2,
    ...                        lowering=LowerOptions(ring_size=3))
    ...     loop.lowered.ring_size
    3
    >>> LowerOptions(ring_size=0)
    Traceback (most recent call last):
    ...
    ValueError: LowerOptions.ring_size must be an int in 1..64, got 0 (int); 64 is the most steps a loop keeps in flight
    """

    ring_size: int | None = attrs.field(default=None, validator=_ring_size)
    measure: bool = attrs.field(default=False, validator=_flag)
    timeline: Timeline | None = attrs.field(default=None, validator=_instance(Timeline, "a Timeline"))
    new_event: Callable[[str], Event] | None = attrs.field(default=None, validator=_callable)
    check: CheckState | None = attrs.field(default=None, validator=_instance(CheckState, "a CheckState"))
    optimize: bool = attrs.field(default=True, validator=_flag)
    UNSAFE_skip_soundness_check: bool = attrs.field(default=False, validator=_flag)
    publish: tuple[str, ...] | None = attrs.field(default=None, converter=_buffers)


#: What each option of a default record is (a loop refuses a record that changes one it owns).
_DEFAULT = LowerOptions()


def lowering_options(options: object, caller: str) -> LowerOptions:
    """``options`` (``None``: the defaults) if it is a :class:`LowerOptions`; else a ``TypeError``
    naming ``caller``."""
    if options is None:
        return _DEFAULT
    if not isinstance(options, LowerOptions):
        raise TypeError(f"{caller}(): lowering must be a readfence.graph.LowerOptions, got {options!r} "
                        f"({type(options).__name__})")
    return options


def set_by(options: LowerOptions | None, caller: str, *, keywords: Collection[str] | Mapping[str, str] = (),
           **own: Any) -> LowerOptions:
    """``options`` with the options ``caller`` (a loop) sets itself, ``own``; refuses a record that
    sets one of them already, naming it (and, among ``keywords``, the keyword of ``caller`` that
    says it; a mapping gives how ``caller`` takes each one, ``"options=LoopOptions(check=...)"``):
    each option is said one way at each entry point.

    >>> set_by(LowerOptions(ring_size=2, measure=True), "decode_loop", measure=True)
    Traceback (most recent call last):
    ...
    TypeError: decode_loop() sets the lowering's measure itself: leave measure out of its LowerOptions
    """
    options = lowering_options(options, caller)
    for name in own:
        if getattr(options, name) is not getattr(_DEFAULT, name):
            said = keywords.get(name) if isinstance(keywords, Mapping) else f"{name}=" if name in keywords else None
            hint = f" and pass {said} to {caller}()" if said else ""
            raise TypeError(f"{caller}() sets the lowering's {name} itself: leave {name} out of its LowerOptions{hint}")
    return attrs.evolve(options, **own)


#: The lowering options a loop takes as its own options (in its options record).
LOOP_KEYWORDS = ("timeline", "check", "UNSAFE_skip_soundness_check")
#: What a loop sets in its lowering itself: those, and (no option says them) it measures its
#: fences and publishes every buffer its scheduler writes.
LOOP_OWNED = ("measure", "publish", *LOOP_KEYWORDS)


def for_a_loop(options: LowerOptions | None, caller: str,
               keywords: Collection[str] | Mapping[str, str] = LOOP_KEYWORDS) -> LowerOptions:
    """``options`` as ``caller`` takes it to hand on to a loop: refuses (naming ``caller``, what
    the user called) a record that sets what the loop sets itself (:data:`LOOP_OWNED`);
    ``keywords`` are those ``caller`` takes as its own keywords."""
    return set_by(options, caller, keywords=keywords, **{name: getattr(_DEFAULT, name) for name in LOOP_OWNED})
