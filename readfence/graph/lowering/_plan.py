"""Fence planning: from a declared (or traced) effect to the points where events are recorded.

Pure and device-independent: ``plan_fences`` decides, per shared buffer, the point of one
lowered step after which the scheduler may overwrite it. The lowering turns each distinct
point into one event (or one event ring) owned by the lowered graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from readfence.core import STAGES, Stage
from readfence.effects import Capabilities, ReadEffect, ReadEnd, degrade, resolve

from ._policy import Policy

#: The stages that run inside the graph.
IN_GRAPH_STAGES: frozenset[Stage] = frozenset(s for s in STAGES if s.in_graph)

_END_TEXT = {
    ReadEnd.NONE: "never (not read: no wait)",
    ReadEnd.PRE_REPLAY: "after prepare_out_graph, before replay",
    ReadEnd.IN_REPLAY: "inside the graph, after prepare_in_graph",
    ReadEnd.POST_REPLAY: "after the replay",
    ReadEnd.UNKNOWN: "after the whole forward",
}


@attrs.frozen
class LastRead:
    """Where the trace saw the last read of one buffer."""

    stage: Stage
    node: str
    index: int  # position of the node within its stage's graph


@attrs.frozen
class Placement:
    """A point of one lowered step at which an event is recorded.

    ``end`` is the stage-level end; EXACT placements also name the node they follow.

    >>> str(Placement(ReadEnd.IN_REPLAY))
    'inside the graph, after prepare_in_graph'
    >>> from readfence.core import BODY
    >>> str(Placement(ReadEnd.POST_REPLAY, LastRead(BODY, "index_2", 40)))
    'after node body:index_2'
    """

    end: ReadEnd
    after: LastRead | None = None

    @property
    def sort_key(self) -> tuple[int, int, int]:
        # Node placements sit inside their stage: before the stage-level point of the same end.
        if self.after is None:
            return (self.end.value, 1, 0)
        return (self.end.value, 0, self.after.index)

    @property
    def waits(self) -> bool:
        """False for buffers that are never read: the scheduler need not wait at all."""
        return self.end is not ReadEnd.NONE

    def __str__(self) -> str:
        if self.after is not None:
            return f"after node {self.after.stage}:{self.after.node}"
        return _END_TEXT[self.end]


def _by_buffer(placements: Mapping[str, Placement]) -> dict[str, Placement]:
    return dict(sorted(placements.items()))


@attrs.frozen
class FencePlan:
    """Per buffer, where its release is published; one event per distinct placement."""

    policy: Policy
    placements: Mapping[str, Placement] = attrs.field(converter=_by_buffer)

    def points(self) -> tuple[Placement, ...]:
        """Distinct placements that need an event, in execution order."""
        distinct = {p for p in self.placements.values() if p.waits}
        return tuple(sorted(distinct, key=lambda p: p.sort_key))

    def buffers_at(self, point: Placement) -> tuple[str, ...]:
        return tuple(b for b, p in self.placements.items() if p == point)

    def end(self, buffer: str) -> ReadEnd:
        return self.placements[buffer].end

    def describe(self) -> list[dict[str, str]]:
        """Rows ``{buffer, end, placement}`` for printing."""
        return [{"buffer": b, "end": p.end.name, "placement": str(p)} for b, p in self.placements.items()]


def plan_fences(
    *,
    buffers: Iterable[str],
    declared: ReadEffect,
    caps: Capabilities,
    policy: Policy,
    last_reads: Mapping[str, LastRead | None] | None = None,
    observed: ReadEffect | None = None,
    graphed: bool = True,
) -> FencePlan:
    """Decide where each buffer's release is published.

    ``declared`` drives JOINED and PER_BUFFER; EXACT uses the trace (``last_reads`` and
    ``observed``). ``graphed=False`` (an eager phase such as EXTEND) places every point between
    eager launches, which every platform can signal.

    >>> e = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "state_slots": ReadEnd.IN_REPLAY})
    >>> p = plan_fences(buffers=["req_to_token", "state_slots"], declared=e,
    ...                 caps=Capabilities(), policy=Policy.PER_BUFFER)
    >>> [p.end(b).name for b in ("req_to_token", "state_slots")]
    ['PRE_REPLAY', 'IN_REPLAY']
    >>> plan_fences(buffers=["req_to_token"], declared=e, caps=Capabilities(),
    ...             policy=Policy.JOINED).end("req_to_token").name
    'IN_REPLAY'
    """
    buffers = tuple(buffers)
    caps = caps if graphed else attrs.evolve(caps, graphs=False)
    if policy is Policy.COARSE:
        return FencePlan(policy, {b: Placement(ReadEnd.UNKNOWN) for b in buffers})
    if policy is Policy.JOINED:
        joined = resolve(declared, owns_publish=True, caps=caps)
        return FencePlan(policy, {b: Placement(joined) for b in buffers})
    if policy is Policy.PER_BUFFER:
        return FencePlan(policy, {b: Placement(degrade(declared[b], caps)) for b in buffers})
    if policy is Policy.EXACT:
        if last_reads is None or observed is None:
            raise ValueError("the EXACT policy needs the trace: pass last_reads and observed")
        return FencePlan(policy, {b: _exact(b, observed, last_reads.get(b), caps) for b in buffers})
    raise TypeError(f"policy must be a readfence.graph.Policy, got {policy!r}")


def placing_effect(policy: Policy, *, declared: ReadEffect, observed: ReadEffect) -> ReadEffect:
    """The effect ``policy`` places a buffer's event from: ``plan_fences``'s own input.

    A multi-phase step chooses each buffer's publishing phase from this effect, so that
    the phase it picks is the one whose plan places that buffer's event. EXACT places from the
    trace: a phase that only *declares* a read (a leaf's default ``UNKNOWN``) observes none,
    and publishing from it would place "no wait" after an earlier phase's real read. COARSE
    uses no read information at all: every buffer waits for the whole step, even under a
    declaration that lowering did not check.

    >>> declared = ReadEffect.unknown()
    >>> observed = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY})
    >>> placing_effect(Policy.EXACT, declared=declared, observed=observed)["swa_map"].name
    'NONE'
    >>> placing_effect(Policy.PER_BUFFER, declared=declared, observed=observed)["swa_map"].name
    'UNKNOWN'
    """
    if policy is Policy.COARSE:
        return ReadEffect.unknown()
    if policy is Policy.EXACT:
        return observed
    if policy in (Policy.JOINED, Policy.PER_BUFFER):
        return declared
    raise TypeError(f"policy must be a readfence.graph.Policy, got {policy!r}")


def _exact(buffer: str, observed: ReadEffect, last: LastRead | None, caps: Capabilities) -> Placement:
    end = observed[buffer]
    if end in (ReadEnd.NONE, ReadEnd.UNKNOWN) or last is None:
        return Placement(end if last is None else ReadEnd.UNKNOWN)
    in_graph_ok = caps.in_graph_events or not caps.graphs  # eager stages can always record
    if degrade(end, caps) is not end or (last.stage in IN_GRAPH_STAGES and not in_graph_ok):
        # No in-graph events: fall back to the stage-level point after the replay (later is
        # sound); a node-level record inside a captured graph would fail the capture.
        return Placement(degrade(end, caps))
    return Placement(last.stage.end, last)
