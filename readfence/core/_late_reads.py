"""How readfence tells of a read later than a declaration or a fence allows: what kind of read it
is, in the guide's words, and the one fix, the same from the audit, the lowering, ``verify``
and an engine's audit.

A read is later than declared when the code reads a buffer after the end its backend declares
(the audit refuses the declaration, and so does the lowering), or after the fence that released
it (``verify`` catches it at run time). Either way the user has two ways out: declare the end the
read has, or end the read earlier by snapshotting what it needs before the replay. Every message
that reports such a read says it with :func:`late_read_fix`.

>>> print(late_read_fix("req_to_token", ReadEnd.POST_REPLAY))  # doctest: +NORMALIZE_WHITESPACE
fix: declare 'req_to_token' ending at POST_REPLAY (or later), or end the read earlier: snapshot what
it reads before the replay (in the out-of-graph stage: prepare_out_graph, an engine's
init_forward_metadata_out_graph)
"""

from __future__ import annotations

import enum

from readfence.effects import ReadEnd


class ReadKind(enum.StrEnum):
    """What kind of read reads a buffer that late, in the guide's words (a message says it after
    the reader's ``file:line in function``).

    >>> str(ReadKind.OBSERVER_ONLY)
    'a read only the observer sees'
    """

    TRACED = "a traced read"  # a node of the stage's trace reads it
    VARIED = "its Python on a varied state"  # a step not replayed took a path the trace's example did not
    ESCAPE = "an escape: the stage runs as Python"  # a host read or a reference leaving the trace
    OPAQUE = "an op the tracer cannot see"  # every buffer is then read until the stage's end
    OBSERVED = "an observed read"  # a stage the tracer cannot follow: its reads are observed
    # a kernel reading what an earlier stage kept by reference (a plan/run pair): no static
    # analysis sees it, the runtime read observer does
    OBSERVER_ONLY = "a read only the observer sees"
    RUN = "a read after its release, caught at run time"  # poison or the observer, in ``verify``


def late_read_fix(buffer: str | None, end: ReadEnd | None = None) -> str:
    """The one fix for a read of ``buffer`` later than its declaration or its fence allows:
    declare ``end`` (the end the read has; ``None``: not known, the end of its last read), or end
    the read earlier with a snapshot before the replay.

    >>> late_read_fix(None).startswith("fix: declare the buffer ending where its last read ends")
    True
    """
    what = repr(buffer) if buffer else "the buffer"
    declare = (f"declare {what} ending at {end.name} (or later)" if end is not None
               else f"declare {what} ending where its last read ends")
    return (f"fix: {declare}, or end the read earlier: snapshot what it reads before the replay (in the "
            f"out-of-graph stage: prepare_out_graph, an engine's init_forward_metadata_out_graph)")


__all__ = ["ReadKind", "late_read_fix"]
