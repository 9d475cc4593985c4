"""Where an engine's runners publish, against where its phases' reads really end.

An engine's step is one or more phases (a target verify, a draft extend...), each replayed by
its own runner, and its scheduler waits on one runner's read-done event (SGLang's
``last_shared_read_runner``). The runner records that event at a point its code decides: from
the backend's declaration (``shared_read_ends``), moved where it has no in-graph marker, placed
where its code records it (:class:`~readfence.engine.RunnerModel`). Three things can put the
event before a read: the declaration (``audit_engine`` sees that), the runner's publish point
(a draft-extend runner recording before its replay, a fallback earlier than declared), and the
choice of runner (one whose phase is not the last to read). :func:`audit_runner` checks the
last two, before anything runs: per buffer, the position (phase, end) the scheduler's event is
recorded at against the position of the buffer's last read over the phases, each phase's
truth coming from :func:`~readfence.engine.audit_engine` (traced, or observed where the tracer
cannot follow).

:func:`runner_step` makes the same phases a step readfence's loops run: each phase its runner
model, every buffer fenced by the publisher's event (the scheduler waits for the whole step
where it published nothing), so ``verify`` and ``run_overlapped`` show the race the audit names.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from returns.result import Result, Success
from torch import Tensor

from readfence.core import SHARED_BUFFERS, ForwardMode
from readfence.core.internal import check_forward_mode, example_step, positive_int
from readfence.effects import Capabilities, Failure, Position, ReadEffect, ReadEnd, publish_positions
from readfence.effects.internal import table
from readfence.graph import StepShape
from readfence.graph.steps import Phase

from ._adapter import EngineBackend, check_engine
from ._audit import EngineRow, audit_engine
from ._runner import RunnerModel, resolve_end, runner_model


def _run_mode(mode: ForwardMode) -> ForwardMode:
    return check_forward_mode(mode, "run")


@attrs.frozen
class RunnerPhase:
    """One phase of an engine's step: ``engine`` in ``mode``, replayed by a runner that publishes
    as ``model`` says.

    >>> from readfence.engine.reference import triton_engine
    >>> RunnerPhase("decode", triton_engine(), ForwardMode.DECODE).model.no_marker.name
    'POST_REPLAY'
    """

    name: str
    engine: EngineBackend = attrs.field(converter=check_engine)
    mode: ForwardMode = attrs.field(converter=_run_mode)
    model: RunnerModel = attrs.field(factory=RunnerModel)

    @model.validator
    def _check_model(self, _attribute: attrs.Attribute[RunnerModel], value: RunnerModel) -> None:
        if not isinstance(value, RunnerModel):
            raise TypeError(f"phase {self.name!r}: model must be a RunnerModel, got {value!r} ({type(value).__name__})")


def _phases(target: EngineBackend | Sequence[RunnerPhase], mode: ForwardMode,
            model: RunnerModel | None) -> tuple[RunnerPhase, ...]:
    if isinstance(target, EngineBackend):
        return (RunnerPhase(mode.name.lower(), target, mode, RunnerModel() if model is None else model),)
    phases = tuple(target)
    if not phases or not all(isinstance(p, RunnerPhase) for p in phases):
        raise TypeError(f"an engine's step is an adapted backend or a non-empty list of RunnerPhase, got {target!r}")
    names = [p.name for p in phases]
    if len(set(names)) != len(names):
        raise ValueError(f"phase names must differ (each names its runner), got {names}")
    states = {id(p.engine.state) for p in phases}
    if len(states) > 1:
        raise ValueError("every phase's backend must be bound to the same state (adapt(..., state=first.state)): "
                         "the phases read one page table")
    return phases


def _publisher(phases: Sequence[RunnerPhase], publisher: str | None) -> int:
    names = [p.name for p in phases]
    if publisher is None:
        return len(phases) - 1
    if publisher not in names:
        raise ValueError(f"publisher {publisher!r} is not a phase; the phases are {names}")
    return names.index(publisher)


def runner_step(phases: Sequence[RunnerPhase], publisher: str | None = None) -> StepShape:
    """``phases`` as one step of readfence's loops, each replayed by its engine runner, every buffer
    fenced by ``publisher``'s event (default: the last phase's).

    >>> from readfence.engine.reference import triton_engine
    >>> step = runner_step([RunnerPhase("decode", triton_engine(), ForwardMode.DECODE)])
    >>> step.waits_on, [p.mode.name for p in step.phases]
    ('decode', ['DECODE'])
    """
    chosen = _phases(phases, ForwardMode.DECODE, None)
    k = _publisher(chosen, publisher)
    spec = "runner_step(" + ", ".join(f"{p.name}={p.engine.name}:{p.mode.name}" for p in chosen) + \
        f"; waits_on={chosen[k].name})"
    shaped = tuple(Phase(p.name, runner_model(p.engine, p.model), p.mode, p.name) for p in chosen)
    return StepShape("runner_step", shaped, spec, waits_on=chosen[k].name)


@attrs.frozen
class PublishRow:
    """One buffer: the position its last read ends at (``phase``, ``truth``) against the one the
    scheduler's event is recorded at (``publisher``, ``published``: ``UNKNOWN`` when nothing is
    published and the scheduler waits for the whole step)."""

    buffer: str
    phase: str
    truth: ReadEnd
    publisher: str
    declared: ReadEnd
    published: ReadEnd
    sound: bool
    method: str = ""
    op: str = ""
    where: str = ""

    def text(self) -> str:
        at = f"{self.publisher} {self.published.name}" if self.published is not ReadEnd.UNKNOWN else \
            f"nothing ({self.publisher} publishes no event: the whole step)"
        if self.sound:
            return f"{self.buffer}: read until {self.phase} {self.truth.name}; event at {at}: sound"
        by = f" by {self.method}: {self.op}" if self.op else ""
        return (f"{self.buffer}: read until {self.phase} {self.truth.name}{by}; event at {at} (declared "
                f"{self.declared.name}): unsound")


@attrs.frozen
class RunnerAudit:
    """What :func:`audit_runner` found: a row per buffer some phase reads."""

    step: str
    rows: tuple[PublishRow, ...]
    stale: str = ""  # a step whose scheduler is handed an earlier step's event, and why

    @property
    def sound(self) -> bool:
        return all(r.sound for r in self.rows) and not self.stale

    def unsound(self) -> list[PublishRow]:
        return [r for r in self.rows if not r.sound]

    def table(self) -> str:
        head = ["buffer", "last read", "declared", "event at", "verdict"]
        cells = [[r.buffer, f"{r.phase} {r.truth.name}", r.declared.name,
                  f"{r.publisher} {r.published.name}" if r.published is not ReadEnd.UNKNOWN else "the whole step",
                  "sound" if r.sound else "unsound"] for r in self.rows]
        stale = f"\nSTALE: {self.stale}" if self.stale else ""
        return f"{self.step}\n{table(cells, head)}{stale}"

    def __str__(self) -> str:
        return self.table()


@attrs.frozen
class RunnerUnsound:
    """A failed :func:`audit_runner`: the scheduler's event is recorded before a read it guards.
    ``report`` is the whole audit; ``row`` the first unsound buffer, which ``message`` names."""

    report: RunnerAudit

    @property
    def row(self) -> PublishRow | None:
        """The first unsound buffer (``None`` when only :attr:`RunnerAudit.stale` is)."""
        rows = self.report.unsound()
        return rows[0] if rows else None

    @property
    def message(self) -> str:
        r = self.row
        if r is None:
            return f"stale read-done event: {self.report.step}: {self.report.stale}"
        at = f" at {r.where}" if r.where else ""
        return (f"unsound publish point: {self.report.step}: the scheduler's read-done event is recorded in phase "
                f"{r.publisher!r} at {r.published.name} (declared {r.declared.name}), but {r.buffer!r} is read "
                f"until {r.truth.name} in phase {r.phase!r} by {r.method}: {r.op}{at}")

    def __str__(self) -> str:
        return self.message


def _truth(phase: RunnerPhase, batch_size: int, steps: int) -> dict[str, EngineRow]:
    audited = audit_engine(phase.engine, phase.mode, batch_sizes=[batch_size], steps=steps)
    report = audited.unwrap() if isinstance(audited, Success) else audited.failure().report
    node = report.find(phase.engine.name, phase.mode)
    return {r.buffer: r for r in node.rows}


#: How many steps of a runner's switches :func:`audit_runner` follows for a stale event.
SWITCH_STEPS = 8


def _stale(phase: RunnerPhase, batch: dict[str, Tensor], *, marker: bool, graphed: bool, published: ReadEnd) -> str:
    """Whether some step's scheduler is handed an earlier step's event: the runner leaves the event
    in its mailbox when the scheduler takes it, and a later step publishes nothing."""
    model = phase.model
    if model.clear_mailbox:
        return ""
    left = None
    for step in range(SWITCH_STEPS):
        if model.killed(step):
            continue  # the kill switch: the scheduler waits for the whole forward, whatever is left
        end = resolve_end(phase.engine, phase.mode, batch, marker=marker, graphed=graphed,
                          prefill=model.prefill_enabled(step), model=model)
        if end is not ReadEnd.UNKNOWN and published is not ReadEnd.UNKNOWN and end <= published:
            left = step
        elif left is not None:
            return (f"step {step} publishes nothing, and its scheduler is handed step {left}'s event, left in the "
                    f"mailbox (the runner does not clear it when the scheduler takes it): step {step}'s buffers are "
                    f"released before it reads them")
    return ""


def audit_runner(target: EngineBackend | Sequence[RunnerPhase], mode: ForwardMode = ForwardMode.DECODE, *,
                 model: RunnerModel | None = None, publisher: str | None = None, caps: Capabilities | None = None,
                 batch_size: int = 2, steps: int = 1) -> Result[RunnerAudit, RunnerUnsound]:
    """Check where an engine's runner publishes against where its reads end, before anything runs.

    ``target`` is an adapted backend replayed in ``mode`` by a runner that publishes as ``model``
    says, or the phases of an engine's step (:class:`RunnerPhase`), whose scheduler waits on
    ``publisher``'s event (default: the last phase's). Each phase's truth per buffer is
    :func:`audit_engine`'s at ``batch_size`` (``steps`` observed steps where the tracer cannot
    follow); the publish point is the runner's own resolution (:func:`resolve_end`) on a device
    with ``caps`` (default: one with graphs and in-graph events). A runner that leaves its event in
    the mailbox when the scheduler takes it is followed over its switches (the kill switch, prefill
    read-done) for a step that publishes nothing and so hands out an earlier step's event.
    ``Success(report)`` when every read ends by the event the scheduler waits on, else
    ``Failure(RunnerUnsound(report))``.

    >>> from readfence.engine.reference import triton_engine
    >>> engine = triton_engine()
    >>> fallback = RunnerModel(in_graph_marker=False, no_marker=ReadEnd.PRE_REPLAY)
    >>> print(audit_runner(engine, model=fallback).failure().row.text())  # doctest: +ELLIPSIS
    req_to_token: read until decode IN_REPLAY by init_forward_metadata_in_graph: ...; event at decode PRE_REPLAY (declared IN_REPLAY): unsound
    >>> audit_runner(engine, model=RunnerModel(in_graph_marker=False)).unwrap().sound
    True
    """
    phases = _phases(target, check_forward_mode(mode, "audit"), model)
    k = _publisher(phases, publisher)
    positive_int("batch_size", batch_size)
    caps = Capabilities() if caps is None else caps
    truths = [_truth(p, batch_size, steps) for p in phases]
    effects = [ReadEffect.of({b: r.truth for b, r in t.items()}) for t in truths]
    pub = phases[k]
    marker = caps.in_graph_events if pub.model.in_graph_marker is None else pub.model.in_graph_marker
    graphed = pub.engine.replayed(pub.mode) and caps.graphs
    batch = example_step(pub.engine.cfg, pub.mode, batch_size).batch
    # the runner's switches (kill switch, prefill read-done) decide per step: the earliest event
    # any step publishes is the one every read must end by
    ends = [resolve_end(pub.engine, pub.mode, batch, marker=marker, graphed=graphed, model=pub.model,
                        prefill=pub.model.prefill_enabled(step))
            for step in range(SWITCH_STEPS) if not pub.model.killed(step)]
    ends = [e for e in ends if e is not ReadEnd.UNKNOWN]
    published = min(ends, key=lambda e: e.value) if ends else ReadEnd.UNKNOWN
    declared = pub.engine.declared_end(pub.mode)
    stale = _stale(pub, batch, marker=marker, graphed=graphed, published=published)
    event = Position(k, published)
    rows = []
    for buffer, last in publish_positions(effects, SHARED_BUFFERS).items():
        if last.phase < 0:
            continue
        row = truths[last.phase][buffer]
        sound = published is ReadEnd.UNKNOWN or last <= event
        rows.append(PublishRow(buffer, phases[last.phase].name, last.end, pub.name, declared, published, sound,
                               row.method, row.op, row.where))
    name = " -> ".join(f"{p.name} ({p.engine.name}, {p.mode.name})" for p in phases)
    report = RunnerAudit(f"{name}; the scheduler waits on {pub.name}'s event", tuple(rows), stale)
    return Success(report) if report.sound else Failure(RunnerUnsound(report))


__all__ = ["PublishRow", "RunnerAudit", "RunnerPhase", "RunnerUnsound", "audit_runner", "runner_step"]
