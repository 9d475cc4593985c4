"""Audit declared read effects against the effects traced code really has.

Like JAX's ``check_jaxpr``: recompute (trace) and compare. Per buffer, the declaration must
be at or after the observed end: ``exact`` (equal), ``conservative`` (later: a fence that
fires later than needed, by ``steps`` lattice steps) or ``unsound`` (earlier than a traced
read: the scheduler could overwrite the buffer while the step still reads it).

Reads can depend on the batch size (a branch on ``q.shape[0]``), so the step is traced at
every batch size that will run, by default 1, 2 and the model's maximum; a buffer's observed
end is the latest over them, and the report names the batch size that reads it latest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
from returns.result import Result, Success
from torch import Tensor

from readfence.effects import (
    Failure,  # unwrap() says why
    ReadEffect,
    ReadEnd,
)

from ._checks import check_backend, check_mode, positive_int
from ._modes import ForwardMode
from ._observe import Disagreement, Observation, cross_check, observe
from ._program import ESCAPE, Program
from ._protocol import BackendLike, runs_as
from ._state import ModelConfig
from ._step import PREPARE_IN_GRAPH, stage_named
from ._trace import StageWriteError, bind, trace

EXACT, CONSERVATIVE, UNSOUND = "exact", "conservative", "unsound"

_R = TypeVar("_R", Program, Observation)

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
    batch_size: int | None = None  # the batch size whose trace reads it latest

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
    opaque: tuple[tuple[str, str, str], ...] = ()  # (stage, node, why), why naming the source line
    batch_sizes: tuple[int, ...] = ()  # the batch sizes traced
    # observed accesses the trace does not cover: bugs in readfence's static analysis
    disagreements: tuple[Disagreement, ...] = ()

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
                row["batch_size"] = b.batch_size
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
    batch_size: int | None = None

    @property
    def message(self) -> str:
        node = self.report.find(self.path)
        parts = []
        if self.observed is ReadEnd.UNKNOWN and node.opaque:
            # a reference escaping, an op the tracer cannot see through, a captured tensor
            stage, name, why = next((o for o in node.opaque if stage_named(o[0]).in_graph), node.opaque[0])
            parts.append(f"stage {stage}, node {name!r}: {why}")
        else:
            # an escape gives every buffer its stage's escape end: name the one that reaches it
            escape = next((o for o in node.opaque if o[2].startswith(ESCAPE) and stage_named(o[0]).escape_end is self.observed),
                          None)
            if self.reader and (escape is None or self.reader != escape[:2]):
                parts.append(f"last read by node {self.reader[1]!r} in stage {self.reader[0]}")
            if escape is not None:
                parts.append(f"stage {escape[0]}, node {escape[1]!r}: {escape[2]}")
        where = "; ".join(parts) or "read by an op the tracer cannot see"
        if self.batch_size is not None and len(node.batch_sizes) > 1:
            where += f"; at batch size {self.batch_size}"
        return (
            f"unsound declaration: {self.path} in mode {self.mode.name} declares buffer "
            f"{self.buffer!r} ends at {self.declared.name} but the traced code reads it until "
            f"{self.observed.name} ({where})"
        )

    def __str__(self) -> str:
        return self.message


def escape_note(stage: str) -> str:
    """What an escape means for its stage (the ``OPAQUE:`` lines of ``readfence audit`` end with it).

    >>> escape_note("body")  # doctest: +NORMALIZE_WHITESPACE
    'the stage runs as Python in the step: every buffer is read until POST_REPLAY; a CUDA graph
     cannot capture it (lower refuses it on CUDA: UncapturableStage)'
    """
    end = stage_named(stage).escape_end
    if not stage_named(stage).in_graph:
        return f"the stage runs as Python before the replay: every buffer is read until {end.name}"
    returns = " (what it returns may be a view of any)" if stage == PREPARE_IN_GRAPH.name else ""
    return (f"the stage runs as Python in the step: every buffer is read until {end.name}{returns}; "
            f"a CUDA graph cannot capture it (lower refuses it on CUDA: UncapturableStage)")


def _why_opaque(program: Program) -> tuple[tuple[str, str, str], ...]:
    out = [(s.name, node, f"{why} at {source}" + (f"; {escape_note(s.name)}" if why.startswith(ESCAPE) else ""))
           for s in program.stages for node, why, source in s.escapes()]
    out += [(c.stage, c.node, c.why()) for c in program.captured() if not c.usable and c.matches[0] == "none"]
    if program.aborted is not None and program.aborted_stage is not None:  # fake tensors: no value to go on with
        why = program.aborted.removeprefix(f"stage {program.aborted_stage}: ")
        out.append((program.aborted_stage, "(trace stopped)",
                    f"{why}: the trace cannot follow the stage past it, every buffer is UNKNOWN; lower refuses it "
                    f"on CUDA (UncapturableStage)"))
    return tuple(out)


def _named(result: _R, name: str) -> _R:
    """A trace or an observation of the backend another runs as, under that other's name."""
    return result if result.backend == name else attrs.evolve(result, backend=name)


def _audit_node(path: str, backend: BackendLike, mode: ForwardMode, kw: dict[str, Any],
                batch_sizes: tuple[int, ...], state: Mapping[str, Any] | None, observe_steps: int) -> AuditReport:
    # per batch size: the traced program and, independently, what running it really reads;
    # both of the backend the step runs as (a wrapper's is its child's: traced and observed once)
    runner = runs_as(backend, mode)
    runs: list[tuple[int, Any, ReadEffect]] = []
    disagreements: list[Disagreement] = []
    for n in batch_sizes:
        try:
            program = _named(trace(runner, mode, batch_size=n, **kw), backend.name)
        except StageWriteError as e:
            raise e.at(path) from None
        program = program if state is None else bind(program, state)
        effect = program.traced()
        if observe_steps:
            seen = _named(observe(runner, mode, batch_size=n, steps=observe_steps, cfg=kw["cfg"]), backend.name)
            disagreements += cross_check(program, seen)
            effect = effect | seen.observed()  # a read the trace missed still counts
        runs.append((n, program, effect))
    declared = backend.read_effect(mode)
    observed = ReadEffect.none()
    for _, _, effect in runs:
        observed = observed | effect
    first = runs[0][1]
    names = list(first.buffers) + [b for b in declared.buffers + observed.buffers if b not in first.buffers]
    entries = []
    for b in dict.fromkeys(names):
        n, latest, _ = next(r for r in runs if r[2][b] is observed[b])
        entries.append(BufferAudit(b, declared[b], observed[b], latest.last_reader(b), n))
    opaque = tuple(dict.fromkeys(o for _, program, _ in runs for o in _why_opaque(program)))
    return AuditReport(path, mode, declared, observed, tuple(entries), (), opaque, batch_sizes,
                       tuple(dict.fromkeys(disagreements)))


def default_batch_sizes(cfg: ModelConfig) -> tuple[int, ...]:
    """The batch sizes audited by default: 1, 2 and the model's maximum.

    >>> default_batch_sizes(ModelConfig(max_reqs=8))
    (1, 2, 8)
    """
    return tuple(sorted({1, min(2, cfg.max_reqs), cfg.max_reqs}))


def _batch_sizes(cfg: ModelConfig, batch_sizes: Iterable[int] | None) -> tuple[int, ...]:
    if batch_sizes is None:
        return default_batch_sizes(cfg)
    if isinstance(batch_sizes, (int, str, bytes)) or not isinstance(batch_sizes, Iterable):
        raise TypeError(f"batch_sizes must be a non-empty list of ints in 1..{cfg.max_reqs} (cfg.max_reqs), "
                        f"got {batch_sizes!r} ({type(batch_sizes).__name__}); for one size write [n]")
    sizes = tuple(batch_sizes)
    if not sizes:
        raise ValueError("batch_sizes must be a non-empty list of ints; omit it for the default (1, 2, max_reqs)")
    for i, n in enumerate(sizes):
        positive_int(f"batch_sizes[{i}]", n, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    return tuple(sorted(set(sizes)))


_STATE_PARTS = ("shared", "pools", "params")


def _check_state(state: object) -> None:
    """``state`` is ``None`` or the live tensors: a mapping with ``shared`` (and optionally
    ``pools`` and ``params``), each a mapping of name -> tensor; else an error naming it.

    >>> _check_state("x")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: state must be None or a mapping {'shared': ..., 'pools': ..., 'params': ...} of the live
    tensors (readfence.graph.make_state(cfg) makes one), got 'x' (str)
    """
    if state is None:
        return
    how = ("a mapping {'shared': ..., 'pools': ..., 'params': ...} of the live tensors "
           "(readfence.graph.make_state(cfg) makes one)")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be None or {how}, got {state!r} ({type(state).__name__})")
    unknown = [k for k in state if k not in _STATE_PARTS]
    if unknown or "shared" not in state:
        what = f"has unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "has no 'shared'"
        raise ValueError(f"state {what}: it must be {how}")
    for part in _STATE_PARTS:
        if part in state and not isinstance(state[part], Mapping):
            value = state[part]
            raise TypeError(f"state[{part!r}] must be a mapping of name -> tensor, got {value!r} "
                            f"({type(value).__name__})")


def audit_report(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_sizes: Iterable[int] | None = None,
    device: str = "cpu",
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    observe_steps: int = 1,
) -> AuditReport:
    """The audit tree of ``backend`` in ``mode``, whatever its verdicts (see ``audit``)."""
    check_backend(backend)
    check_mode(mode)
    _check_state(state)
    if observe_steps != 0 or isinstance(observe_steps, bool):
        positive_int("observe_steps (0 turns the observer off)", observe_steps)
    cfg = ModelConfig() if cfg is None else cfg
    sizes = _batch_sizes(cfg, batch_sizes)
    kw = {"cfg": cfg, "device": device}
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
        report = _audit_node(path, node, mode, kw, sizes, state, observe_steps if device == "cpu" else 0)
        done.append(attrs.evolve(report, children=kids_reports))
    (root,) = done
    return root


def audit(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_sizes: Iterable[int] | None = None,
    device: str = "cpu",
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    observe_steps: int = 1,
) -> Result[AuditReport, Unsound]:
    """Trace ``backend`` (and, for a combinator, every node below it) and compare effects.

    ``Success(report)`` when every declaration is at or after its observed end, else
    ``Failure(Unsound)`` naming the deepest guilty node's path, the mode, the buffer, both
    ends, the reading node and the batch size. A stage writing a shared buffer raises
    ``StageWriteError``. The step is traced at each of ``batch_sizes`` (a non-empty list of
    ints in ``1..cfg.max_reqs``; default: 1, 2 and ``cfg.max_reqs``). ``backend`` must be a
    backend value (parse a spec string with ``readfence.backends.parse``). ``state`` (``shared``, ``pools``, ``params``: the live tensors) lets
    tensors a stage captured by reference be matched against them (see ``bind``); without it
    a captured tensor that is not part of the example makes every buffer ``UNKNOWN``.

    Independently of the trace, each batch size is also run eagerly for ``observe_steps``
    example steps under the runtime read observer (``observe``; on a CPU trace, ``0``
    disables it): a read it sees that a faithful stage's trace does not cover is a bug in
    readfence's analysis, listed in ``report.disagreements``, and counts in the verdict.

    >>> from readfence.backends import paged, redeclare
    >>> from readfence.effects import ReadEffect
    >>> audit(paged(), ForwardMode.DECODE).map(lambda r: r.sound)
    <Success: True>
    >>> early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY}))
    >>> print(audit(early, ForwardMode.DECODE).failure().message)  # doctest: +ELLIPSIS
    unsound declaration: paged in mode DECODE declares buffer 'req_to_token' ends at PRE_REPLAY but ...
    """
    report = audit_report(backend, mode, cfg=cfg, batch_sizes=batch_sizes, device=device, state=state,
                          observe_steps=observe_steps)
    bad = report.unsound()
    if not bad:
        return Success(report)
    path, entry = bad[0]
    return Failure(Unsound(report, path, mode, entry.buffer, entry.declared, entry.observed, entry.reader,
                           entry.batch_size))
