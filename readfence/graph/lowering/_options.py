"""The lowering options a function that lowers for you hands on to :func:`lower`, as one value."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs
from torch import Tensor

from readfence.core import BackendLike, ForwardMode, ModelConfig
from readfence.core.internal import positive_int

from ..devices import Device, Event, Stream, Timeline
from ._lower import Lowered, lower
from ._poison import CheckState
from ._policy import Policy


def _ring_size(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        positive_int(f"LowerOptions.{field.name}", value)


def _flag(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"LowerOptions.{field.name} must be a bool, got {value!r} ({type(value).__name__})")


def _instance(kind: type, what: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, field: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"LowerOptions.{field.name} must be {what} or None, got {value!r} "
                            f"({type(value).__name__})")
    return check


def _callable(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"LowerOptions.{field.name} must be a function of an event's name or None, got {value!r} "
                        f"({type(value).__name__})")


@attrs.frozen(kw_only=True)
class LowerOptions:
    """The lowering options a function that lowers for you (``decode_loop``, ``serve_loop``,
    ``verify``, ``lower_capture_list``, ``lower_step``...) hands on, whole, to every
    :func:`lower` it calls. ``lower`` itself takes these as its own keywords, which mean the same
    (and a few no caller hands on: ``publish``, ``steps_in_flight``).

    ``ring_size``: events per graph and buffer (default: the steps a graph has in flight);
    ``measure``: time each fence against the last reads; ``timeline``: record the stages and
    replays; ``new_event``: make each event from its name (default: the device's);
    ``check``: the poison-on-release check mode over ``state["shared"]``;
    ``optimize``: run the captured stages through readfence's compile passes (constant folding,
    shared subexpressions, Python bindings; ``False``: every node as traced);
    ``UNSAFE_skip_soundness_check``: lower a declaration the audit refuses (to show it failing).
    A loop sets what it runs with itself (it measures, keeps its own timeline and check mode):
    those are its keywords, and a record that sets one of them is refused there.

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
    ValueError: LowerOptions.ring_size must be a positive int, got 0 (int)
    """

    ring_size: int | None = attrs.field(default=None, validator=_ring_size)
    measure: bool = attrs.field(default=False, validator=_flag)
    timeline: Timeline | None = attrs.field(default=None, validator=_instance(Timeline, "a Timeline"))
    new_event: Callable[[str], Event] | None = attrs.field(default=None, validator=_callable)
    check: CheckState | None = attrs.field(default=None, validator=_instance(CheckState, "a CheckState"))
    optimize: bool = attrs.field(default=True, validator=_flag)
    UNSAFE_skip_soundness_check: bool = attrs.field(default=False, validator=_flag)


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


#: What a loop sets in its lowering itself: it measures its fences, and its timeline, check mode
#: and soundness check are its own options (in its options record).
LOOP_OWNED = ("measure", "timeline", "check", "UNSAFE_skip_soundness_check")
#: Those a loop takes as its own options (it always measures: no option says that).
LOOP_KEYWORDS = tuple(name for name in LOOP_OWNED if name != "measure")


def for_a_loop(options: LowerOptions | None, caller: str,
               keywords: Collection[str] | Mapping[str, str] = LOOP_KEYWORDS) -> LowerOptions:
    """``options`` as ``caller`` takes it to hand on to a loop: refuses (naming ``caller``, what
    the user called) a record that sets what the loop sets itself (:data:`LOOP_OWNED`);
    ``keywords`` are those ``caller`` takes as its own keywords."""
    return set_by(options, caller, keywords=keywords, **{name: getattr(_DEFAULT, name) for name in LOOP_OWNED})


def lower_with(options: LowerOptions, backend: BackendLike, mode: ForwardMode, *, batch_size: int, device: Device,
               policy: Policy, cfg: ModelConfig | None = None, stream: Stream | None = None,
               state: Mapping[str, dict[str, Tensor]] | None = None, steps_in_flight: int = 1) -> Lowered:
    """:func:`lower` with ``options``: how a function that lowers for its caller calls it."""
    return lower(backend, mode, batch_size=batch_size, device=device, policy=policy, cfg=cfg, stream=stream,
                 state=state, ring_size=options.ring_size, steps_in_flight=steps_in_flight,
                 measure=options.measure, timeline=options.timeline, new_event=options.new_event,
                 check=options.check, optimize=options.optimize,
                 UNSAFE_skip_soundness_check=options.UNSAFE_skip_soundness_check)
