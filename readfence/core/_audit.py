"""Audit declared read effects against the effects traced code really has.

Like JAX's ``check_jaxpr``: recompute (trace) and compare. Per buffer, the declaration must
be at or after the observed end: ``exact`` (equal), ``conservative`` (later: a fence that
fires later than needed, by ``steps`` lattice steps) or ``unsound`` (earlier than a traced
read: the scheduler could overwrite the buffer while the step still reads it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
from returns.result import Failure, Result, Success

from readfence.effects import ReadEffect, ReadEnd

from ._modes import ForwardMode
from ._protocol import BackendLike
from ._trace import StageWriteError, trace

EXACT, CONSERVATIVE, UNSOUND = "exact", "conservative", "unsound"

#: Notes on declarations that are sound but leave work to do.
NOTES: dict[ReadEnd, str] = {
    ReadEnd.POST_REPLAY: "no metadata snapshot yet",
    ReadEnd.UNKNOWN: "not audited",
}


@attrs.frozen
class BufferAudit:
    """One buffer of one backend in one mode: declared vs observed end.

    >>> b = BufferAudit("seq_lens", ReadEnd.POST_REPLAY, ReadEnd.PRE_REPLAY, None)
    >>> b.verdict, b.steps, b.note
    ('conservative', 2, 'no metadata snapshot yet')
    """

    buffer: str
    declared: ReadEnd
    observed: ReadEnd
    reader: tuple[str, str] | None  # (stage, node) of the last traced read

    @property
    def steps(self) -> int:
        """``declared - observed`` in lattice steps (> 0 conservative, < 0 unsound)."""
        return self.declared.rank - self.observed.rank

    @property
    def verdict(self) -> str:
        if self.steps == 0:
            return EXACT
        return CONSERVATIVE if self.steps > 0 else UNSOUND

    @property
    def note(self) -> str:
        return NOTES.get(self.declared, "")


@attrs.frozen
class AuditReport:
    """The audit of one backend in one mode; a tree that mirrors a combinator's children.

    ``path`` names the node (``tbo/children[0]/deepseek_v4``); ``children`` are the reports
    of its children, each traced and audited alone in the same mode. Printing gives a table.

    >>> from readfence.backends import paged
    >>> report = audit(paged(), ForwardMode.DECODE).unwrap()
    >>> [(r["buffer"], r["declared"], r["observed"], r["verdict"]) for r in report.rows()][:2]
    [('req_to_token', 'IN_REPLAY', 'IN_REPLAY', 'exact'), ('seq_lens', 'IN_REPLAY', 'IN_REPLAY', 'exact')]
    """

    path: str
    mode: ForwardMode
    declared: ReadEffect
    observed: ReadEffect
    buffers: tuple[BufferAudit, ...]
    children: tuple[AuditReport, ...] = ()
    opaque: tuple[tuple[str, str, str], ...] = ()  # (stage, node, why)

    # -- queries -----------------------------------------------------------------------------
    def walk(self) -> Iterator[AuditReport]:
        """This report and every descendant, pre-order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def find(self, path: str) -> AuditReport:
        for r in self.walk():
            if r.path == path:
                return r
        raise KeyError(f"no node {path!r} in the report; paths: {[r.path for r in self.walk()]}")

    def entries(self) -> Iterator[tuple[AuditReport, BufferAudit]]:
        for r in self.walk():
            for b in r.buffers:
                yield r, b

    @property
    def sound(self) -> bool:
        """No buffer of any node is declared earlier than observed."""
        return not self.unsound()

    def unsound(self) -> list[tuple[str, BufferAudit]]:
        """``(path, buffer audit)`` of every unsound entry, deepest nodes first."""
        found = [(r.path, b) for r, b in self.entries() if b.verdict == UNSOUND]
        return sorted(found, key=lambda pb: -pb[0].count("/"))

    def post_replay(self) -> list[tuple[str, str]]:
        """``(path, buffer)`` declared ``POST_REPLAY``: no metadata snapshot yet."""
        return [(r.path, b.buffer) for r, b in self.entries() if b.declared is ReadEnd.POST_REPLAY]

    def not_audited(self) -> list[tuple[str, str]]:
        """``(path, buffer)`` declared ``UNKNOWN``: nothing to audit against."""
        return [(r.path, b.buffer) for r, b in self.entries() if b.declared is ReadEnd.UNKNOWN]

    def counts(self) -> dict[str, int]:
        """How many entries per verdict, plus ``post_replay`` and ``not_audited``."""
        out = {EXACT: 0, CONSERVATIVE: 0, UNSOUND: 0}
        for _, b in self.entries():
            out[b.verdict] += 1
        out["post_replay"] = len(self.post_replay())
        out["not_audited"] = len(self.not_audited())
        return out

    # -- output ------------------------------------------------------------------------------
    def rows(self, *, detail: bool = False) -> list[dict[str, Any]]:
        """One dict per (node, buffer): keys backend, mode, buffer, declared, observed, verdict
        (names as strings); with ``detail`` also steps, note and reader (``stage:node``)."""
        out = []
        for r, b in self.entries():
            row: dict[str, Any] = {
                "backend": r.path,
                "mode": r.mode.name,
                "buffer": b.buffer,
                "declared": b.declared.name,
                "observed": b.observed.name,
                "verdict": b.verdict,
            }
            if detail:
                row["steps"] = b.steps
                row["note"] = b.note
                row["reader"] = f"{b.reader[0]}:{b.reader[1]}" if b.reader else ""
            out.append(row)
        return out

    def table(self) -> str:
        """A fixed-width table of every row and a summary line (what the CLI prints)."""
        return format_table(self.rows(detail=True), self.counts())

    def __str__(self) -> str:
        return self.table()


def format_table(rows: list[dict[str, Any]], counts: dict[str, int] | None = None) -> str:
    """Render detailed rows (``AuditReport.rows(detail=True)``) as a table.

    >>> print(format_table([{"backend": "paged", "mode": "DECODE", "buffer": "seq_lens",
    ...     "declared": "IN_REPLAY", "observed": "IN_REPLAY", "verdict": "exact"}]))
    backend  mode    buffer    declared   observed   verdict
    paged    DECODE  seq_lens  IN_REPLAY  IN_REPLAY  exact
    """
    cols = ["backend", "mode", "buffer", "declared", "observed", "verdict"]
    cells = []
    for row in rows:
        verdict = row["verdict"]
        if verdict == CONSERVATIVE and "steps" in row:
            verdict = f"conservative +{row['steps']}"
        if row.get("note"):
            verdict = f"{verdict} ({row['note']})"
        if verdict.startswith(UNSOUND) and row.get("reader"):
            verdict = f"{verdict}: read by {row['reader']}"
        cells.append([str(row[c]) for c in cols[:-1]] + [verdict])
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    if counts is not None:
        lines.append(
            f"{counts[EXACT]} exact, {counts[CONSERVATIVE]} conservative, {counts[UNSOUND]} unsound; "
            f"{counts['post_replay']} POST_REPLAY (no metadata snapshot yet), "
            f"{counts['not_audited']} UNKNOWN (not audited)"
        )
    return "\n".join(lines)


@attrs.frozen
class Unsound:
    """An audit failure: a buffer declared to end earlier than a traced read of it.

    ``report`` is the whole tree; ``path`` names the guilty node (the deepest one).
    """

    report: AuditReport
    path: str
    mode: ForwardMode
    buffer: str
    declared: ReadEnd
    observed: ReadEnd
    reader: tuple[str, str] | None

    @property
    def message(self) -> str:
        where = (
            f"last read by node {self.reader[1]!r} in stage {self.reader[0]}"
            if self.reader
            else "read by an op the tracer cannot see"
        )
        return (
            f"unsound declaration: {self.path} in mode {self.mode.name} declares buffer "
            f"{self.buffer!r} ends at {self.declared.name} but the traced code reads it until "
            f"{self.observed.name} ({where})"
        )

    def __str__(self) -> str:
        return self.message


def _audit_node(path: str, backend: BackendLike, mode: ForwardMode, kw: dict[str, Any]) -> AuditReport:
    try:
        program = trace(backend, mode, **kw)
    except StageWriteError as e:
        raise e.at(path) from None
    declared = backend.read_effect(mode)
    observed = program.observed()
    names = list(program.buffers) + [b for b in declared.buffers + observed.buffers if b not in program.buffers]
    entries = tuple(
        BufferAudit(b, declared[b], observed[b], program.last_reader(b)) for b in dict.fromkeys(names)
    )
    opaque = tuple((stage, node, why) for stage, nodes in program.opaque().items() for node, why in nodes.items())
    return AuditReport(path, mode, declared, observed, entries, (), opaque)


def audit_report(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: Any = None,
    batch_size: int = 2,
    device: str = "cpu",
) -> AuditReport:
    """The audit tree of ``backend`` in ``mode``, whatever its verdicts (see ``audit``)."""
    kw = {"cfg": cfg, "batch_size": batch_size, "device": device}
    # iterative post-order: children's reports are built before their parent's
    order: list[tuple[str, BackendLike, int]] = []  # (path, node, number of children)
    stack: list[tuple[str, BackendLike]] = [(backend.name, backend)]
    while stack:
        path, node = stack.pop()
        kids = node.children()
        order.append((path, node, len(kids)))
        for label, child in kids:
            stack.append((f"{path}/{label}/{child.name}", child))
    done: list[AuditReport] = []
    for path, node, n in reversed(order):
        kids_reports = tuple(done[len(done) - n :]) if n else ()
        if n:
            del done[len(done) - n :]
        report = _audit_node(path, node, mode, kw)
        done.append(attrs.evolve(report, children=kids_reports))
    (root,) = done
    return root


def audit(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: Any = None,
    batch_size: int = 2,
    device: str = "cpu",
) -> Result[AuditReport, Unsound]:
    """Trace ``backend`` (and, for a combinator, every node below it) and compare effects.

    ``Success(report)`` when every declaration is at or after its observed end, else
    ``Failure(Unsound)`` naming the deepest guilty node's path, the mode, the buffer, both
    ends and the reading node. A stage writing a shared buffer raises ``StageWriteError``.

    >>> from readfence.backends import paged, redeclare
    >>> from readfence.effects import ReadEffect
    >>> audit(paged(), ForwardMode.DECODE).map(lambda r: r.sound)
    <Success: True>
    >>> early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY}))
    >>> print(audit(early, ForwardMode.DECODE).failure().message)  # doctest: +ELLIPSIS
    unsound declaration: paged in mode DECODE declares buffer 'req_to_token' ends at PRE_REPLAY but ...
    """
    report = audit_report(backend, mode, cfg=cfg, batch_size=batch_size, device=device)
    bad = report.unsound()
    if not bad:
        return Success(report)
    path, entry = bad[0]
    return Failure(Unsound(report, path, mode, entry.buffer, entry.declared, entry.observed, entry.reader))
