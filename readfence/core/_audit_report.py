"""What an audit found, and how it is shown: a :class:`Verdict` per buffer (:class:`BufferAudit`),
the report of a backend and its children (:class:`AuditReport`), and the two ways an audit fails:
a traced read past the declared end (:class:`Unsound`) and a read no trace saw (:class:`Latent`).

>>> Verdict("latent") is Verdict.LATENT, str(Verdict.EXACT)
(True, 'exact')
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from typing import Any

import attrs

from readfence.effects import (
    ReadEffect,
    ReadEnd,  # neither is a bool
)
from readfence.effects.internal import table

from ._late_reads import ReadKind, late_read_fix
from ._modes import ForwardMode
from ._observe import Disagreement
from ._program import ESCAPE
from ._step import stage_named


class Verdict(enum.StrEnum):
    """What the audit says of one declared end against the end the code reads until.

    A ``str`` enum: rows and JSON carry its value (``"exact"``), and it compares equal to it.

    >>> Verdict.of(ReadEnd.POST_REPLAY, ReadEnd.PRE_REPLAY), Verdict.of(ReadEnd.NONE, ReadEnd.IN_REPLAY)
    (<Verdict.CONSERVATIVE: 'conservative'>, <Verdict.UNSOUND: 'unsound'>)
    >>> Verdict.EXACT == "exact", str(Verdict.LATENT)
    (True, 'latent')
    """

    EXACT = "exact"  # declared at the end the code reads until
    CONSERVATIVE = "conservative"  # declared later than needed: sound, the fence could be earlier
    UNSOUND = "unsound"  # declared before a read: a fence placed from it is early (refused)
    LATENT = "latent"  # below its node's own trace, but no fence is placed from it (:class:`Latent`)

    @classmethod
    def of(cls, declared: ReadEnd, observed: ReadEnd) -> Verdict:
        """The verdict of ``declared`` against ``observed``: the one rule every audit applies."""
        steps = declared.rank - observed.rank
        return cls.EXACT if steps == 0 else cls.CONSERVATIVE if steps > 0 else cls.UNSOUND


EXACT, CONSERVATIVE, UNSOUND, LATENT = Verdict.EXACT, Verdict.CONSERVATIVE, Verdict.UNSOUND, Verdict.LATENT


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
    (<Verdict.CONSERVATIVE: 'conservative'>, 2, 'no metadata snapshot yet')
    """

    buffer: str
    declared: ReadEnd
    observed: ReadEnd
    reader: tuple[str, str] | None  # (stage, node) of the last traced read
    batch_size: int | None = None  # the batch size whose trace reads it latest
    # the latest read was seen only on a generated state, where the Python of a stage that runs it
    # took a path the trace's example did not (``reader``: its stage, as the observer saw it)
    varied: bool = False
    # the kind of run that saw the latest read where the trace does not show it ("": the trace's):
    # "observer", "rehearsal", "varied", "validation", "check" (``core.internal.RunKind``)
    seen_by: str = ""
    source: str = ""  # ``file:line in function`` of the latest read, where it is known
    # the latest read was seen only by the runtime read observer, inside a kernel that reads what an
    # earlier stage kept by reference (``reader``: its stage and ``kernel/op``)
    observer: bool = False

    @property
    def steps(self) -> int:
        """``declared - observed`` in lattice steps (> 0 conservative, < 0 unsound)."""
        return self.declared.rank - self.observed.rank

    @property
    def verdict(self) -> Verdict:
        return Verdict.of(self.declared, self.observed)

    @property
    def note(self) -> str:
        return NOTES.get(self.declared, "")


@attrs.frozen
class AuditReport:
    """The audit of one backend in one mode; a tree that mirrors a combinator's children.

    ``path`` names the node (``tbo/children[0]/deepseek_v4``); ``children`` are the reports
    of the children its step runs, each traced and audited alone in the same mode at the batch
    sizes it is handed (``not_run`` lists the others); ``placed`` says a fence is placed from
    this node's own declaration (the root; a ``per_stream`` member). :meth:`unsound` is what the
    fences refuse, :meth:`latent` what they do not depend on. Printing gives a table.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode, audit
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
    opaque: tuple[tuple[str, str, str], ...] = ()  # (stage, node, why), why naming the source line
    batch_sizes: tuple[int, ...] = ()  # the batch sizes traced
    # observed accesses the trace does not cover: bugs in readfence's static analysis
    disagreements: tuple[Disagreement, ...] = ()
    # a fence is placed from this node's own declaration: the root, or a ``per_stream`` member
    placed: bool = True
    # children the step does not run where this node runs: (path, why); not traced nor judged
    not_run: tuple[tuple[str, str], ...] = ()

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

    def fenced(self) -> Iterator[tuple[AuditReport, AuditReport, tuple[AuditReport, ...]]]:
        """``(node, fence, ancestors)`` for every node, pre-order: ``fence`` is the node whose
        declaration places the fence covering it (the nearest of itself and its ancestors that
        is the root or ``placed``), ``ancestors`` the nodes from the root down to its parent."""
        stack: list[tuple[AuditReport, AuditReport | None, tuple[AuditReport, ...]]] = [(self, None, ())]
        while stack:
            node, above, ancestors = stack.pop()
            fence = node if above is None or node.placed else above
            yield node, fence, ancestors
            stack.extend((child, fence, (*ancestors, node)) for child in reversed(node.children))

    def judged(self) -> tuple[list[tuple[str, BufferAudit, str]], list[Latent]]:
        """What the fences make of every entry below its node's trace: ``(refusals, latent)``.

        A fence is placed from the root's declaration (a wrapper's is the join of its
        children's, or its selected child's), and from each ``placed`` node's own (a
        ``per_stream`` member). An entry below its trace is a refusal, ``(path, entry, fence)``,
        at such a node, or below one whose own entry for the buffer is below its trace, when
        the node reads past that fence (it is then named as the reader that makes the fence
        early). Any other is :class:`Latent`: the node's own declaration is below its reads,
        but no fence is placed from it and the one that covers it is sound.
        """
        refusals: list[tuple[str, BufferAudit, str]] = []
        latent: list[Latent] = []
        for node, fence, ancestors in self.fenced():
            for b in node.buffers:
                if b.verdict is not UNSOUND:
                    continue
                if fence is node:
                    refusals.append((node.path, b, node.path))
                    continue
                name = b.buffer
                early = fence.declared[name] < fence.observed[name]
                if early and b.observed > fence.declared[name]:
                    refusals.append((node.path, b, fence.path))
                    continue
                chain = (*ancestors[next(i for i, a in enumerate(ancestors) if a is fence):], node)
                latent.append(Latent(node.path, node.mode, b, fence.path, fence.declared[name], fence.observed[name],
                                     _cover(chain, name, b.observed), _where(node, b)))
        return sorted(refusals, key=lambda r: -r[0].count("/")), sorted(latent, key=lambda x: -x.path.count("/"))

    @property
    def sound(self) -> bool:
        """No fence is placed from a declaration earlier than what it covers reads
        (:meth:`unsound` is empty; :meth:`latent` findings may remain)."""
        return not self.unsound()

    def unsound(self) -> list[tuple[str, BufferAudit]]:
        """``(path, buffer audit)`` of every entry a fence makes unsound, deepest nodes first: a
        node whose declaration places a fence (the root, a ``per_stream`` member) below its
        reads, and each node below it reading past that fence."""
        return [(path, b) for path, b, _ in self.judged()[0]]

    def latent(self) -> list[Latent]:
        """Every node whose own declaration is below its trace where no fence depends on it (the
        fence covering it is sound: a sibling's declaration covers the read, or the tree never
        reads that late), deepest first: a bug that races wherever that node places a fence.

        >>> from readfence.backends import join, paged, redeclare, sparse
        >>> from readfence.core import ForwardMode, audit
        >>> from readfence.effects import ReadEffect
        >>> early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
        ...                                                      "seq_lens": ReadEnd.IN_REPLAY}))
        >>> report = audit(join(early, sparse()), ForwardMode.DECODE, batch_sizes=[2]).unwrap()
        >>> [(x.path, x.buffer, x.covered_by) for x in report.latent()]
        [('join/children[0]/paged', 'req_to_token', 'join/children[1]/sparse')]
        """
        return self.judged()[1]

    def where(self, path: str, buffer: str) -> str:
        """What reads ``buffer`` of node ``path`` until its observed end, in words: the user's
        ``file:line in function``, the kind of read, the node and stage, the batch size."""
        node = self.find(path)
        return _where(node, next(b for b in node.buffers if b.buffer == buffer))

    def post_replay(self) -> list[tuple[str, str]]:
        """``(path, buffer)`` declared ``POST_REPLAY``: no metadata snapshot yet."""
        return [(r.path, b.buffer) for r, b in self.entries() if b.declared is ReadEnd.POST_REPLAY]

    def not_audited(self) -> list[tuple[str, str]]:
        """``(path, buffer)`` declared ``UNKNOWN``: nothing to audit against."""
        return [(r.path, b.buffer) for r, b in self.entries() if b.declared is ReadEnd.UNKNOWN]

    def counts(self) -> dict[str, int]:
        """How many entries per verdict (``unsound``: refused; ``latent``: below its node's own
        trace, covered by a sound fence), plus ``post_replay`` and ``not_audited``; every key a
        plain ``str``.

        >>> from readfence.backends import paged
        >>> from readfence.core import ForwardMode, audit
        >>> audit(paged(), ForwardMode.DECODE).unwrap().counts()
        {'exact': 4, 'conservative': 0, 'unsound': 0, 'latent': 0, 'post_replay': 0, 'not_audited': 0}
        """
        out = {EXACT.value: 0, CONSERVATIVE.value: 0, UNSOUND.value: 0}
        for _, b in self.entries():
            out[b.verdict.value] += 1
        out[LATENT.value] = len(self.latent())
        out[UNSOUND.value] -= out[LATENT.value]
        out["post_replay"] = len(self.post_replay())
        out["not_audited"] = len(self.not_audited())
        return out

    # -- output ------------------------------------------------------------------------------
    def rows(self, *, detail: bool = False) -> list[dict[str, Any]]:
        """One dict per (node, buffer): keys backend, mode, buffer, declared, observed, verdict
        (names as strings); with ``detail`` also steps, note, reader (``stage:node``), batch size,
        ``varied`` (the latest read was seen only on a varied state, by a stage's Python that took a
        path the trace's example did not) and ``latent`` (``None``, or the :class:`Latent` finding as a dict). A latent
        entry's verdict is ``latent``, not ``unsound``: no fence is placed from its node's
        declaration."""
        latent = {(x.path, x.buffer): x for x in self.latent()}
        out = []
        for r, b in self.entries():
            finding = latent.get((r.path, b.buffer))
            row: dict[str, Any] = {
                "backend": r.path,
                "mode": r.mode.name,
                "buffer": b.buffer,
                "declared": b.declared.name,
                "observed": b.observed.name,
                "verdict": (LATENT if finding is not None else b.verdict).value,
            }
            if detail:
                row["steps"] = b.steps
                row["note"] = b.note
                row["reader"] = f"{b.reader[0]}:{b.reader[1]}" if b.reader else ""
                row["source"] = b.source
                row["batch_size"] = b.batch_size
                row["varied"] = b.varied
                row["latent"] = None if finding is None else finding.as_json()
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
            if row.get("varied"):
                by = f"{row['reader'].partition(':')[0]}'s Python on a varied state"
            elif row.get("source"):
                by = f"{_short(row['source'])} ({row['reader']})"
            else:
                by = row["reader"]
            verdict = f"{verdict}: read by {by}"
        if verdict == LATENT and row.get("latent"):
            cover = row["latent"]["covered_by"]
            verdict = f"latent ({'covered by ' + cover if cover else 'not read that late here'})"
        cells.append([str(row[c]) for c in cols[:-1]] + [verdict])
    lines = [table(cells, cols)]
    if counts is not None:
        latent = f", {counts[LATENT]} latent" if counts.get(LATENT) else ""
        lines.append(
            f"{counts[EXACT]} exact, {counts[CONSERVATIVE]} conservative, {counts[UNSOUND]} unsound{latent}; "
            f"{counts['post_replay']} POST_REPLAY (no metadata snapshot yet), "
            f"{counts['not_audited']} UNKNOWN (not audited)"
        )
    return "\n".join(lines)


@attrs.frozen(repr=False)
class Unsound:
    """An audit failure: a buffer declared to end earlier than a traced read of it.

    ``report`` is the whole tree; ``path`` names the guilty node (the deepest one); the repr is
    one line (``message`` says it all, ``report`` has every row).
    """

    report: AuditReport
    path: str
    mode: ForwardMode
    buffer: str
    declared: ReadEnd
    observed: ReadEnd
    reader: tuple[str, str] | None
    batch_size: int | None = None
    fence: str | None = None  # the node whose declaration places the refused fence (None: ``path``)

    @property
    def message(self) -> str:
        node = self.report.find(self.path)
        entry = next(b for b in node.buffers if b.buffer == self.buffer)
        varied = entry.varied
        where = _where(node, entry)
        placed = ""
        if self.fence is not None and self.fence != self.path:
            placed = (f"; the fence of {self.fence} is placed from its declaration, "
                      f"{self.report.find(self.fence).declared[self.buffer].name}")
        return (
            f"unsound declaration: {self.path} in mode {self.mode.name} declares buffer "
            f"{self.buffer!r} ends at {self.declared.name} but "
            f"{'its Python' if varied else 'a kernel' if entry.observer else 'its code' if entry.seen_by else 'the traced code'} "
            f"reads it until {self.observed.name} ({where}){placed}; {late_read_fix(self.buffer, self.observed)}"
        )

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (f"<Unsound {self.path} in {self.mode.name}: {self.buffer!r} declared {self.declared.name}, "
                f"read until {self.observed.name}>")


def _short(source: str) -> str:
    """``function at file:line``, the file by its name alone, from ``/path/file:line in function``.

    >>> _short("/work/mybackend.py:12 in attend"), _short("?")
    ('attend at mybackend.py:12', '?')
    """
    place, sep, function = source.rpartition(" in ")
    if not sep:
        return source
    file, _, line = place.rpartition(":")
    return f"{function} at {os.path.basename(file)}:{line}"


def _where(node: AuditReport, entry: BufferAudit) -> str:
    """What reads ``entry``'s buffer of ``node`` until its observed end, in words: the user's
    ``file:line in function`` and the kind of read (a traced node, a kernel's read only the
    observer sees, the stage's Python on a generated state, an op a run saw read it where the trace
    does not show it, the escape or captured tensor that gives its stage every buffer), the batch
    size."""
    observed, reader, at = entry.observed, entry.reader, f" at {entry.source}" if entry.source else ""
    parts = []
    if entry.observer and reader:
        kernel = reader[1].partition("/")[0]
        parts.append(f"read{at} inside kernel {kernel} in stage {reader[0]}: {ReadKind.OBSERVER_ONLY} (a reference "
                     f"an earlier stage or the backend kept: a plan/run pair, the live buffer)")
    elif entry.varied and reader:
        parts.append(f"stage {reader[0]}'s Python read it on a varied state{at}: a path the trace's example did "
                     f"not take")
    elif entry.seen_by and reader:
        parts.append(f"{reader[1]} in stage {reader[0]} read it{at}, as the {entry.seen_by} saw on the state it ran "
                     f"on (with the live buffers): the trace does not show it")
    elif observed is ReadEnd.UNKNOWN and node.opaque:
        # a reference escaping, an op the tracer cannot see through, a captured tensor
        stage, name, why = next((o for o in node.opaque if stage_named(o[0]).in_graph), node.opaque[0])
        parts.append(f"stage {stage}, node {name!r}: {why}")
    else:
        # an escape gives every buffer its stage's escape end: name the one that reaches it
        escape = next((o for o in node.opaque if o[2].startswith(ESCAPE) and stage_named(o[0]).escape_end is observed),
                      None)
        if reader and (escape is None or reader != escape[:2]):
            parts.append(f"last read by node {reader[1]!r} in stage {reader[0]}{at}: {ReadKind.TRACED}")
        if escape is not None:
            parts.append(f"stage {escape[0]}, node {escape[1]!r}: {escape[2]}")
    where = "; ".join(parts) or f"read by {ReadKind.OPAQUE}"
    if entry.batch_size is not None and len(node.batch_sizes) > 1:
        where += f"; at batch size {entry.batch_size}"
    return where


@attrs.frozen
class Cover:
    """What covers a latent entry's read in its tree: ``by`` (a sibling whose declaration is at or
    after the read, or the fence's own node), with ``end``, its declaration; ``by`` ``None``: no
    declaration covers it, but the tree never reads the buffer that late (its fence is sound)."""

    by: str | None
    end: ReadEnd | None


def _cover(chain: tuple[AuditReport, ...], buffer: str, observed: ReadEnd) -> Cover:
    """The nearest sibling whose declaration covers ``observed``: up ``chain`` (the fence, ...,
    the node), at each ancestor a child off the path; else the fence's own declaration."""
    for i in range(len(chain) - 2, -1, -1):
        on_path = chain[i + 1]
        for sibling in chain[i].children:
            if sibling is not on_path and observed <= sibling.declared[buffer]:
                return Cover(sibling.path, sibling.declared[buffer])
    fence = chain[0]
    if observed <= fence.declared[buffer]:
        return Cover(fence.path, fence.declared[buffer])
    return Cover(None, None)


@attrs.frozen
class Latent:
    """A node whose own declaration is below its trace, where no fence is placed from it and the
    fence that covers it is sound: a latent bug, shown, not refused.

    ``entry`` is the node's audit of the buffer; ``fence`` the node whose declaration places the
    covering fence (``fence_declared``, ``fence_observed``: that node's ends for the buffer);
    ``cover`` what covers the read (a sibling's declaration, or none: the tree never reads it
    that late, as when a ``tbo`` primary whose own body reads late only prepares there).
    """

    path: str
    mode: ForwardMode
    entry: BufferAudit
    fence: str
    fence_declared: ReadEnd
    fence_observed: ReadEnd
    cover: Cover
    where: str = ""  # what reads it that late, in words (the reading node, the batch size)

    @property
    def buffer(self) -> str:
        return self.entry.buffer

    @property
    def covered_by(self) -> str | None:
        """The sibling (or the fence's node) whose declaration covers the read; ``None``: none."""
        return self.cover.by

    @property
    def message(self) -> str:
        """The finding in words."""
        e = self.entry
        head = (f"latent: {self.path} in mode {self.mode.name} declares buffer {self.buffer!r} ends at "
                f"{e.declared.name} but its own trace reads it until {e.observed.name} ({self.where})")
        if self.cover.by is None:
            why = (f"this tree never reads it that late: the fence of {self.fence} ({self.fence_declared.name}) "
                   f"covers every read here ({self.fence_observed.name})")
        elif self.cover.by == self.fence:
            why = f"covered by the declaration of {self.fence} ({self.fence_declared.name}), whose fence is sound"
        else:
            why = (f"covered by {self.cover.by}, which declares {self.cover.end.name if self.cover.end else '?'}: "
                   f"the fence of {self.fence} ({self.fence_declared.name}) is sound")
        return (f"{head}; {why}; wherever its own declaration places a fence, it races; "
                f"{late_read_fix(self.buffer, e.observed)}")

    def as_json(self) -> dict[str, Any]:
        """The finding as JSON-ready values."""
        return {"backend": self.path, "mode": self.mode.name, "buffer": self.buffer,
                "declared": self.entry.declared.name, "observed": self.entry.observed.name,
                "fence": self.fence, "fence_declared": self.fence_declared.name, "covered_by": self.cover.by,
                "covered_end": None if self.cover.end is None else self.cover.end.name, "message": self.message}

    def __str__(self) -> str:
        return self.message
