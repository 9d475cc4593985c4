"""What the engine audit found: a row per buffer (:class:`EngineRow`: its declared and true last
read, and where the truth came from), a node's rows (:class:`NodeAudit`), the whole tree's
(:class:`EngineAudit`) and the failure (:class:`EngineUnsound`).

>>> ForwardMode.IDLE in ENGINE_MODES, ForwardMode.DECODE in ENGINE_MODES
(False, True)
"""

from __future__ import annotations

from typing import Any

import attrs

from readfence.core import (
    ForwardMode,
    Latent,
    Stage,
    Verdict,
)
from readfence.core.internal import (
    BufferAudit,
    ReadKind,
    escape_note,
    late_read_fix,
)
from readfence.effects import ReadEffect, ReadEnd
from readfence.effects.internal import table

from ._contract import STAGE_METHODS

#: The modes an engine runs (IDLE reads nothing).
ENGINE_MODES: tuple[ForwardMode, ...] = tuple(m for m in ForwardMode if m is not ForwardMode.IDLE)
TRACED, OBSERVED = "traced", "observed"
_VARIED_OP = "its Python, on a varied state"  # an observed row's op where a varied state's run read it


@attrs.frozen
class EngineRow:
    """One buffer of one node in one mode: the scalar declaration against the per-buffer truth.

    ``source`` says where the truth comes from (``traced`` or ``observed``); ``method`` and
    ``op`` name the last read (``where`` is its source line when traced); ``batch_size`` is the
    batch size whose run reads it latest (the one declared for, in a per-batch prefill row).
    """

    backend: str
    mode: ForwardMode
    buffer: str
    declared: ReadEnd
    truth: ReadEnd
    source: str
    method: str = ""
    op: str = ""
    where: str = ""
    batch_size: int | None = None
    per_batch: bool = False  # the declaration is resolve_prefill_shared_read_ends's for this batch size
    why: str = ""  # why the truth is observed rather than traced
    used: bool = True  # whether the engine ever publishes a fence from this declaration
    # below its truth, but no fence is placed from this declaration and the one covering it is sound
    latent: Latent | None = None

    @property
    def audit(self) -> BufferAudit:
        return BufferAudit(self.buffer, self.declared, self.truth, None, self.batch_size)

    @property
    def verdict(self) -> Verdict:
        """Exact, conservative, unsound, or latent: below its truth where no fence depends on it."""
        return Verdict.LATENT if self.latent is not None else self.audit.verdict

    @property
    def steps(self) -> int:
        """``declared - truth`` in lattice steps: what a per-buffer fence gains (> 0), or how early
        the declaration is (< 0)."""
        return self.audit.steps

    @property
    def kind(self) -> ReadKind:
        """What kind of read the truth comes from, in the guide's words."""
        if self.source == TRACED:
            return ReadKind.TRACED
        if self.op == _VARIED_OP:
            return ReadKind.VARIED
        return ReadKind.OBSERVER_ONLY if self.why.endswith(str(ReadKind.OBSERVER_ONLY)) else ReadKind.OBSERVED

    def text(self) -> str:
        """The verdict in words: ``exact``, ``conservative +2``, ``unsound: forward_decode (aten.index_select...)``."""
        if self.verdict is Verdict.CONSERVATIVE:
            return f"conservative +{self.steps}"
        if self.verdict is Verdict.UNSOUND:
            text = f"unsound: {self.method} reads it ({self.op})" if self.method else "unsound"
            return text if self.used else f"{text}; declaration unused"
        if self.latent is not None:
            cover = self.latent.covered_by
            return f"latent ({'covered by ' + cover if cover else 'not read that late here'})"
        return self.verdict.value

    def as_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "mode": self.mode.name, "buffer": self.buffer,
                "declared": self.declared.name, "truth": self.truth.name, "source": self.source,
                "verdict": self.verdict.value, "steps": self.steps, "method": self.method, "op": self.op,
                "where": self.where, "batch_size": self.batch_size, "per_batch": self.per_batch, "why": self.why,
                "used": self.used, "latent": None if self.latent is None else self.latent.as_json()}


@attrs.frozen
class NodeAudit:
    """One node in one mode: its rows, why some are observed, what readfence's lowering makes of it."""

    path: str
    mode: ForwardMode
    declared: ReadEnd  # the scalar declaration (shared_read_ends)
    rows: tuple[EngineRow, ...]
    untraceable: tuple[tuple[Stage, str, str], ...]  # (stage, why, source line)
    lowering: str  # "" when readfence's policies lower it, else why only COARSE does
    prefill: tuple[tuple[int, ReadEnd], ...] = ()  # per batch size, the resolved prefill end
    unused: str = ""  # why the engine never publishes a fence from this declaration ("": it does)
    delegation: str = ""  # a wrapper's declaration against its children's ("": a leaf)
    error: str = ""  # the engine's own code raised in this mode: what, and where (nothing audited)
    batch_sizes: tuple[int, ...] = ()  # the batch sizes it was audited at: those the engine hands it

    @property
    def truth(self) -> ReadEffect:
        return ReadEffect.of({r.buffer: r.truth for r in self.rows})


@attrs.frozen
class EngineAudit:
    """The audit of an adapted backend: one :class:`NodeAudit` per (node, mode)."""

    backend: str
    nodes: tuple[NodeAudit, ...]
    steps: int
    batch_sizes: tuple[int, ...]

    def rows(self) -> list[EngineRow]:
        return [r for n in self.nodes for r in n.rows]

    @property
    def sound(self) -> bool:
        return not self.unsound()

    def unsound(self) -> list[EngineRow]:
        """The unsound rows whose declaration the engine uses, deepest nodes first."""
        return sorted((r for r in self.rows() if r.verdict is Verdict.UNSOUND and r.used), key=lambda r: -r.backend.count("/"))

    def unused(self) -> list[EngineRow]:
        """The unsound rows of declarations the engine never uses (a backend it never graph-replays)."""
        return [r for r in self.rows() if r.verdict is Verdict.UNSOUND and not r.used]

    def latent(self) -> list[Latent]:
        """Every node whose own declaration is below its truth where the engine places no fence
        from it and the fence covering it is sound (as ``readfence.core.AuditReport.latent``),
        deepest first: a bug that races wherever that declaration is used alone."""
        found = [r.latent for r in self.rows() if r.latent is not None]
        return sorted(found, key=lambda x: -x.path.count("/"))

    def errors(self) -> list[NodeAudit]:
        """The (node, mode) pairs whose engine code raised (``audit_engine(..., errors="report")``):
        nothing was audited there. They do not make the audit a failure: check them too."""
        return [n for n in self.nodes if n.error]

    def find(self, path: str, mode: ForwardMode) -> NodeAudit:
        for n in self.nodes:
            if (n.path, n.mode) == (path, mode):
                return n
        raise KeyError(f"no node {path!r} in {mode.name}; nodes: {sorted({n.path for n in self.nodes})}")

    def counts(self) -> dict[str, int]:
        out = {"exact": 0, "conservative": 0, "unsound": 0, "latent": 0, "observed": 0, "gain": 0}
        for r in self.rows():
            out[r.verdict.value] += 1
            out["observed"] += r.source == OBSERVED
            out["gain"] += max(r.steps, 0)
        return out

    def table(self) -> str:
        """The rows as a table, a summary line, then a line per finding and per untraceable stage."""
        head = ["backend", "mode", "buffer", "declared", "truth", "source", "verdict"]
        cells = []
        for n in self.nodes:
            if n.error:
                cells.append([n.path, n.mode.name, "-", n.declared.name, "-", "error", "not audited: its code raised "
                              "(ERROR below)"])
            cells += [[r.backend, r.mode.name + (f" b={r.batch_size}" if r.per_batch else ""), r.buffer,
                       r.declared.name, r.truth.name, r.source, r.text()] for r in n.rows]
        lines = [table(cells, head)]
        c = self.counts()
        latent = f", {c['latent']} latent" if c["latent"] else ""
        lines.append(f"{c['exact']} exact, {c['conservative']} conservative, {c['unsound']} unsound{latent}; a "
                     f"per-buffer fence gains {c['gain']} lattice step(s) over the scalar declarations")
        if c["observed"]:
            lines.append(f"observed rows cover only the paths that ran: {self.steps} scheduler step(s) at each "
                         f"batch size in {self.batch_sizes}")
        for r in self.unsound():
            at = f" at {r.where}" if r.where else ""
            lines.append(f"UNSOUND: {r.backend} in {r.mode.name}: {r.buffer} declared {r.declared.name} but read "
                         f"until {r.truth.name} by {r.method}: {r.op}{at} ({r.kind}"
                         f"{': ' + r.why if r.why else ''}; batch size {r.batch_size}); "
                         f"{late_read_fix(r.buffer, r.truth)}")
        for x in self.latent():
            lines.append(f"LATENT: {x.message.removeprefix('latent: ')}")
        for r in self.unused():
            lines.append(f"UNSOUND, UNUSED: {r.backend} in {r.mode.name}: {r.buffer} declared {r.declared.name} but "
                         f"read until {r.truth.name} by {r.method}: {r.op}; the engine never publishes a fence from "
                         f"this declaration")
        for n in self.errors():
            lines.append(f"ERROR: {n.path} in {n.mode.name}: {n.error}; nothing was audited in this mode")
        for n in self.nodes:
            if n.unused:
                lines.append(f"UNUSED: {n.path} in {n.mode.name}: {n.unused}")
            if n.delegation:
                lines.append(f"DELEGATION: {n.path} in {n.mode.name}: {n.delegation}")
            for stage, why, source in n.untraceable:
                lines.append(f"UNTRACEABLE: {n.path} in {n.mode.name}: {STAGE_METHODS[stage]} "
                             f"({stage}) escapes the tracer ({why} at {source}): its reads are observed; "
                             f"{escape_note(stage, n.mode.uses_graph)}")
            if n.lowering:
                lines.append(f"LOWERING: {n.path} in {n.mode.name}: {n.lowering}")
            if n.prefill:
                shown = ", ".join(f"batch size {b}: {e.name}" for b, e in n.prefill)
                lines.append(f"PREFILL: {n.path}: resolve_prefill_shared_read_ends per batch: {shown}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@attrs.frozen
class EngineUnsound:
    """An engine audit's failure: a declaration the engine publishes a fence from ends before a read.

    ``report`` is the whole :class:`EngineAudit` (every row, latent findings, errors); ``rows``
    are its unsound rows, deepest node first, and ``row`` the deepest guilty one, which
    ``message`` names with its mode, buffer, declared and true end, and what reads it late.

    >>> from readfence.engine import audit_engine
    >>> from readfence.engine.reference import minimax_sparse_engine
    >>> failed = audit_engine(minimax_sparse_engine(), ForwardMode.DECODE, batch_sizes=[2], steps=1).failure()
    >>> print(failed.message)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    unsound declaration: MiniMaxSparseBackend in mode DECODE declares buffer 'req_to_token' ends at
    IN_REPLAY but it is read until POST_REPLAY: forward reads it (aten.index_select.default) at ...
    >>> failed.report.sound, [r.buffer for r in failed.rows]
    (False, ['req_to_token'])
    """

    report: EngineAudit = attrs.field()

    @report.validator
    def _has_unsound_rows(self, _attribute: attrs.Attribute[EngineAudit], report: EngineAudit) -> None:
        if not isinstance(report, EngineAudit):
            raise TypeError(f"EngineUnsound.report must be an EngineAudit, got {report!r} ({type(report).__name__})")
        if report.sound:
            raise ValueError(f"EngineUnsound.report must have an unsound row; the audit of {report.backend} is sound")

    @property
    def rows(self) -> tuple[EngineRow, ...]:
        """The unsound rows whose declaration the engine uses, deepest nodes first."""
        return tuple(self.report.unsound())

    @property
    def row(self) -> EngineRow:
        """The deepest guilty row: the one :attr:`message` names."""
        return self.rows[0]

    @property
    def message(self) -> str:
        r = self.row
        at = f" at {r.where}" if r.where else ""
        size = f", batch size {r.batch_size}" if r.batch_size is not None else ""
        more = f"; {len(self.rows) - 1} more unsound row(s) in the report" if len(self.rows) > 1 else ""
        return (f"unsound declaration: {r.backend} in mode {r.mode.name} declares buffer {r.buffer!r} ends at "
                f"{r.declared.name} but it is read until {r.truth.name}: {r.text().removeprefix('unsound: ')}{at} "
                f"({r.kind}{size}){more}; {late_read_fix(r.buffer, r.truth)}")

    def __str__(self) -> str:
        return self.message
