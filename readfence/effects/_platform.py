"""What a platform can signal, and the sound fence end it can offer for a declared effect."""

from __future__ import annotations

from typing import TypeVar

import attrs

from ._read_effect import ReadEffect
from ._read_end import ReadEnd

X = TypeVar("X", ReadEnd, ReadEffect)


@attrs.frozen
class Capabilities:
    """What a device can do: record events inside a captured graph; capture graphs at all.

    >>> Capabilities(in_graph_events=False, graphs=True)
    Capabilities(in_graph_events=False, graphs=True)
    """

    in_graph_events: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    graphs: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


def _degrade_end(end: ReadEnd, caps: Capabilities) -> ReadEnd:
    # An in-graph read can only be fenced after the whole replay when the graph cannot record
    # events inside itself. Later is sound, earlier is not: never fall back to PRE_REPLAY.
    # Without graphs every stage is an eager launch, and events between launches always work.
    if caps.graphs and not caps.in_graph_events and end is ReadEnd.IN_REPLAY:
        return ReadEnd.POST_REPLAY
    return end


def degrade(x: X, caps: Capabilities) -> X:
    """The least end at or after ``x`` that the platform can signal (a closure operator).

    >>> degrade(ReadEnd.IN_REPLAY, Capabilities(in_graph_events=False))
    <ReadEnd.POST_REPLAY: 3>
    """
    if not isinstance(caps, Capabilities):
        raise TypeError(f"degrade needs Capabilities, got {caps!r}")
    if isinstance(x, ReadEnd):
        return _degrade_end(x, caps)
    if isinstance(x, ReadEffect):
        return x.map(lambda e: _degrade_end(e, caps))
    raise TypeError(f"degrade takes a ReadEnd or a ReadEffect, got {x!r} ({type(x).__name__})")


def resolve(declared: ReadEnd | ReadEffect, *, owns_publish: bool, caps: Capabilities) -> ReadEnd:
    """The end at which this phase may publish its fence: ``UNKNOWN`` if it does not publish.

    >>> resolve(ReadEnd.IN_REPLAY, owns_publish=True, caps=Capabilities(in_graph_events=False))
    <ReadEnd.POST_REPLAY: 3>
    >>> resolve(ReadEnd.PRE_REPLAY, owns_publish=False, caps=Capabilities())
    <ReadEnd.UNKNOWN: 4>
    """
    if not owns_publish:
        return ReadEnd.UNKNOWN
    if isinstance(declared, ReadEffect):
        return degrade(declared, caps).end
    return degrade(declared, caps)
