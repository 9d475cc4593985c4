"""The options of the loops, one record per loop: :class:`LoopOptions` for the decode loop and
:class:`ServeOptions` for the serving loop; and the message a loop gives for a keyword it does
not take, which says where that keyword goes.

A loop takes as keywords what a run is about: what runs (``backend``, ``mode``, ``cfg``,
``state``), where (``device``), under which fence (``policy``), at which size (``batch_size``;
the serving loop: ``traffic`` and ``capture_sizes``) and for how long (``steps``, in the
``run_*`` helpers). Everything else (the scheduler's seed, the synthetic scheduler work, a
staging ring, what watches the run) is in its record, which a loop and the helpers that run it
take whole: a new knob is one field, read in one place, and no helper can forget to hand it on.
How each graph is lowered is :class:`~readfence.graph.LowerOptions`, passed as ``lowering=``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import attrs

from readfence.core.internal import positive_int

from ..devices import Timeline
from ..lowering import CheckState, LowerOptions
from ..lowering.internal import LOOP_KEYWORDS
from ._staging import StagingRing, check_ring

T = TypeVar("T")


def _seed(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field.name} must be an int, got {value!r} ({type(value).__name__})")


def _count(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field.name} must be an int >= 0, got {value!r} ({type(value).__name__})")


def _seconds(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{field.name} must be a finite number of seconds >= 0, got {value!r} "
                         f"({type(value).__name__})")


def _probability(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{field.name} must be a probability in [0, 1], got {value!r} ({type(value).__name__})")


def _flag(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{field.name} must be a bool, got {value!r} ({type(value).__name__})")


def _check(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (bool, CheckState)):
        raise TypeError(f"{field.name} must be a bool or a CheckState, got {value!r} ({type(value).__name__})")


def _optional(kind: type, what: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, field: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{field.name} must be {what} or None, got {value!r} ({type(value).__name__})")
    return check


def _progress(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{field.name} must be a function of the step's index or None, got {value!r} "
                        f"({type(value).__name__})")


#: The checks :func:`~readfence.graph.verify` can run (a record's ``checks``); the observer only
#: where Python runs the step.
CHECKS: tuple[str, ...] = ("poison", "guard", "observer")


def _checks(value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"checks must be a collection of names from {list(CHECKS)}, got {value!r} "
                        f"({type(value).__name__})")
    chosen = frozenset(value)
    if not chosen or not chosen <= set(CHECKS):
        raise ValueError(f"checks must name at least one of {list(CHECKS)}, got {sorted(map(str, chosen))!r}")
    return chosen


def _ring(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_ring(value)


def _max_prefill(_: object, field: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        positive_int(field.name, value)


@attrs.frozen(kw_only=True)
class _RunOptions:
    """What both loops' records hold: the synthetic scheduler work (``write_cost``,
    ``write_wait_s``) and what watches the run (``timeline``, ``check``, ``sanitize``,
    ``progress``, ``UNSAFE_skip_soundness_check``, ``checks``): one set of fields, checked in one
    place, documented on :class:`LoopOptions`."""

    write_cost: int = attrs.field(default=0, validator=_count)
    write_wait_s: float = attrs.field(default=0.0, validator=_seconds)
    timeline: Timeline | None = attrs.field(default=None, validator=_optional(Timeline, "a Timeline"))
    check: bool | CheckState = attrs.field(default=False, validator=_check)
    sanitize: bool = attrs.field(default=True, validator=_flag)
    progress: Callable[[int], None] | None = attrs.field(default=None, validator=_progress)
    UNSAFE_skip_soundness_check: bool = attrs.field(default=False, validator=_flag)
    checks: frozenset[str] | None = attrs.field(default=None, converter=_checks)

    def __attrs_post_init__(self) -> None:
        if self.write_cost and self.write_wait_s:
            raise ValueError("give write_cost (a matmul) or write_wait_s (a wait), not both")


@attrs.frozen(kw_only=True)
class LoopOptions(_RunOptions):
    """The decode loop's options: the record :func:`~readfence.graph.decode_loop` and the helpers
    that run it (:func:`~readfence.graph.run_overlapped`, :func:`~readfence.graph.run_traced`,
    :func:`~readfence.graph.run_serial`) take whole, as ``options=``.

    The workload: ``seed`` and ``finish_prob`` drive the seeded scheduler (the chance that a
    request finishes at each step); ``write_cost`` adds an ``n x n`` matmul to each page-table
    write, or ``write_wait_s`` a wait that uses no compute (synthetic scheduler work that must
    follow the fence, to make overlap measurable); ``staging`` (a
    :class:`~readfence.graph.runtime.Staging` or an engine's ring) stages each step's shared state
    in host buffers that the scheduler's copy reads when it runs.

    What watches the run: ``timeline`` records the stages, writes and fences; ``check`` (``True``,
    or a :class:`~readfence.graph.CheckState` over ``state["shared"]``) lowers the poison-on-release
    check mode, the scheduler writing each step after the previous one ended; ``sanitize`` has the
    race sanitizer watch a run; ``progress(i)`` is called after step ``i``;
    ``UNSAFE_skip_soundness_check`` lowers (and stages through) what the soundness checks refuse,
    to show it failing.

    ``run_serial``, the reference, reads the workload and ``progress`` and nothing else: one record
    serves the loop and the reference it is compared with. ``sanitize`` is for the ``run_*``
    helpers; a :class:`~readfence.graph.DecodeLoop` you run yourself is watched by what you add to
    its device. ``checks`` is for :func:`~readfence.graph.verify`, which runs the loop in its own
    check mode: the names from :data:`CHECKS` it runs (default: all, the observer where it can
    watch; ``{"poison"}`` shows what poison alone catches).

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, Policy, run_overlapped, run_serial
    >>> options = LoopOptions(seed=3, finish_prob=0.5)
    >>> with CpuDevice() as dev:
    ...     res = run_overlapped(paged(), steps=4, policy=Policy.EXACT, device=dev, batch_size=2, options=options)
    >>> res.matches(run_serial(paged(), steps=4, batch_size=2, options=options))
    True
    >>> LoopOptions(write_cost=-1)
    Traceback (most recent call last):
    ...
    ValueError: write_cost must be an int >= 0, got -1 (int)
    """

    #: what its fields are, in the message for one given as a keyword (``names_keywords``)
    option_kind: ClassVar[str] = "a loop option"

    seed: int = attrs.field(default=0, validator=_seed)
    finish_prob: float = attrs.field(default=0.1, validator=_probability)
    staging: StagingRing | None = attrs.field(default=None, validator=_ring)


@attrs.frozen(kw_only=True)
class ServeOptions(_RunOptions):
    """The serving loop's options: the record :func:`~readfence.graph.serve_loop` and the helpers
    that run it (:func:`~readfence.graph.run_serve`, :func:`~readfence.graph.run_serve_serial`)
    take whole, as ``options=``.

    ``max_prefill`` caps the tokens of one prefill step (default: the model's limit);
    ``write_cost`` / ``write_wait_s``, ``timeline``, ``check``, ``sanitize``, ``progress``,
    ``UNSAFE_skip_soundness_check`` and ``checks`` (for :func:`~readfence.graph.verify_serve`)
    are as for :class:`LoopOptions`. The reference,
    ``run_serve_serial``, reads ``max_prefill``, ``write_wait_s`` and ``progress``.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, Policy, Traffic, run_serve, run_serve_serial
    >>> traffic, options = Traffic(rate=1.0, prompt=(4, 8), output=(2, 4)), ServeOptions(max_prefill=4)
    >>> with CpuDevice() as dev:
    ...     res = run_serve(paged(), steps=8, policy=Policy.EXACT, device=dev, traffic=traffic,
    ...                     capture_sizes=[1, 2, 4], options=options)
    >>> res.matches(run_serve_serial(paged(), steps=8, traffic=traffic, capture_sizes=[1, 2, 4], options=options))
    True
    """

    option_kind: ClassVar[str] = "a serving loop option"

    max_prefill: int | None = attrs.field(default=None, validator=_max_prefill)


#: A loop's record, by the keyword a loop takes it as.
Options = LoopOptions | ServeOptions


def options_of(options: object, kind: type[T], caller: str) -> T:
    """``options`` (``None``: the defaults) if it is a ``kind``; else a ``TypeError`` naming
    ``caller`` and, for the other records, where they go.

    >>> options_of(None, LoopOptions, "decode_loop").seed
    0
    >>> options_of(ServeOptions(), LoopOptions, "run_overlapped")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: run_overlapped(): options must be a readfence.graph.LoopOptions, got ServeOptions(...)
    (the serving loop's options: serve_loop, run_serve and verify_serve take it)
    """
    if options is None:
        return kind()
    if isinstance(options, kind):
        return options
    where = {LowerOptions: "lowering options: pass it as lowering=",
             LoopOptions: "the decode loop's options: decode_loop, run_overlapped, run_traced, run_serial and verify "
                          "take it",
             ServeOptions: "the serving loop's options: serve_loop, run_serve and verify_serve take it"}
    shown = f"{type(options).__name__}(...)" if type(options) in where else repr(options)
    hint = next((f" ({text})" for record, text in where.items() if isinstance(options, record)), "")
    raise TypeError(f"{caller}(): options must be a readfence.graph.{kind.__name__}, got {shown}{hint}"
                    if hint else f"{caller}(): options must be a readfence.graph.{kind.__name__}, got {shown} "
                                 f"({type(options).__name__})")


def said_in(record: type) -> dict[str, str]:
    """How a loop whose record is ``record`` takes each lowering option it sets itself
    (``LOOP_KEYWORDS``): the hint of ``set_by``'s refusal.

    >>> said_in(LoopOptions)["check"]
    'options=LoopOptions(check=...)'
    """
    return {name: f"options={record.__name__}({name}=...)" for name in LOOP_KEYWORDS}


def as_record(values: Mapping[str, Any], record: type[T]) -> T:
    """``record`` of those of ``values`` that are its fields (the rest are not its business):
    how a caller that holds its options as keywords (a command line) builds one.

    >>> as_record({"seed": 2, "steps": 9}, LoopOptions).seed
    2
    """
    fields = attrs.fields_dict(record)  # type: ignore[arg-type]
    return record(**{k: v for k, v in values.items() if k in fields})
