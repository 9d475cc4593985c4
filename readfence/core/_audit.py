"""Audit declared read effects against the effects traced code really has.

Like JAX's ``check_jaxpr``: recompute (trace) and compare. Per buffer, the declaration must
be at or after the observed end: ``exact`` (equal), ``conservative`` (later: a fence that
fires later than needed, by ``steps`` lattice steps) or ``unsound`` (earlier than a traced
read: the scheduler could overwrite the buffer while the step still reads it).

Reads can depend on the batch size (a branch on ``q.shape[0]``), so the step is traced at
every batch size that will run, by default 1, 2 and the model's maximum; a buffer's observed
end is the latest over them, and the report names the batch size that reads it latest.

What a node reads is its ledger's (``core.internal.Ledger``, one per bound program and batch
size): the trace, joined with every run of its code readfence made. The audit adds two kinds of
run: its observer, the stages' Python on example steps, on the state it is given (the live
buffers too: a kernel reading a buffer it keeps by reference); and the Python of every stage
that runs it in the step (the out-of-graph stage always, every stage of a step that is not
replayed) on the generated states traffic has (``core.varied_step``), where it may take a path
the trace's example did not. A lowering's rehearsal and validation add theirs to the same
ledger. A read any of them saw counts, and the report says which run saw it.

The verdict is where the fences are decided. A fence is placed from the root's declaration (a
wrapper's is computed from its children's) and from each node that places one of its own (a
``per_stream`` member); every node is traced alone too, but only where the step runs it (a
``select``'s selected arm; a ``tbo`` child at the sizes of its micro-batches). A node below its
own trace is refused when a fence placed from it, or placed above it and below what it reads,
is early; otherwise it is a *latent* finding (:class:`Latent`): shown with what covers it, not
refused, since no fence the step publishes depends on its declaration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from returns.result import Result
from torch import Tensor

from readfence.effects import (
    Failure,  # unwrap() says why
    ReadEffect,
    ReadEnd,
    Success,  # neither is a bool
)

from ._audit_report import NOTES as NOTES
from ._audit_report import AuditReport as AuditReport
from ._audit_report import BufferAudit as BufferAudit
from ._audit_report import Cover as Cover
from ._audit_report import Latent as Latent
from ._audit_report import Unsound as Unsound
from ._audit_report import Verdict as Verdict
from ._audit_report import format_table as format_table
from ._backend_trace import trace
from ._checks import check_backend, check_mode, check_state, positive_int
from ._ledger import Ledger, RunKind, ledger_of
from ._model import step_functions
from ._modes import ForwardMode
from ._observe import Access
from ._program import ESCAPE, Program, Unmatched
from ._protocol import BackendLike, child_runs, runs_as
from ._state import ModelConfig, model_config
from ._step import PREPARE_IN_GRAPH, Stage
from .tracing import StageWriteError, bind, collection_paused, random_kept


def escape_note(stage: Stage, replayed: bool = True) -> str:
    """What an escape means for its stage (the ``OPAQUE:`` lines of ``readfence audit`` end with it),
    in a step that is ``replayed`` from a capture or not (which no graph captures).

    >>> from readfence.core import BODY, PREPARE_OUT_GRAPH
    >>> escape_note(PREPARE_OUT_GRAPH)  # doctest: +NORMALIZE_WHITESPACE
    'the stage runs as Python before the replay: it reads what the value escaping was computed from and what
     its runs on varied states saw, until PRE_REPLAY'
    >>> escape_note(BODY)  # doctest: +NORMALIZE_WHITESPACE
    'the stage runs as Python in the step: every buffer is read until POST_REPLAY; a CUDA graph
     cannot capture it (lower refuses it on CUDA: UncapturableStage)'
    >>> escape_note(BODY, replayed=False)
    'the stage runs as Python in the step: every buffer is read until POST_REPLAY; no graph captures this mode'
    """
    end = stage.escape_end
    if end is ReadEnd.NONE:
        return (f"the stage runs as Python before the replay: it reads what the value escaping was computed from "
                f"and what its runs on varied states saw, until {stage.end.name}")
    returns = " (what it returns may be a view of any)" if stage == PREPARE_IN_GRAPH else ""
    capture = ("a CUDA graph cannot capture it (lower refuses it on CUDA: UncapturableStage)" if replayed else
               "no graph captures this mode")
    return f"the stage runs as Python in the step: every buffer is read until {end.name}{returns}; {capture}"


def _why_opaque(program: Program) -> tuple[tuple[str, str, str], ...]:
    out = [(s.stage.name, node, f"{why} at {source}" + (f"; {escape_note(s.stage, program.replayed)}"
                                                          if why.startswith(ESCAPE) else ""))
           for s in program.stages for node, why, source in s.escapes()]
    out += [(c.stage.name, c.node, c.why()) for c in program.captured() if not c.usable and isinstance(c.matches, Unmatched)]
    if program.aborted is not None and program.aborted_stage is not None:  # fake tensors: no value to go on with
        why = program.aborted.removeprefix(f"stage {program.aborted_stage}: ")
        out.append((program.aborted_stage.name, "(trace stopped)",
                    f"{why}: the trace cannot follow the stage past it, every buffer is UNKNOWN; lower refuses it "
                    f"on CUDA (UncapturableStage)"))
    return tuple(out)


def _audit_node(path: str, backend: BackendLike, mode: ForwardMode, kw: dict[str, Any],
                batch_sizes: tuple[int, ...], state: Mapping[str, Any] | None, observe_steps: int,
                varied: bool, given: Ledger | None = None) -> AuditReport:
    # per batch size, the ledger of the traced program bound to the state (of the backend the step
    # runs as: a wrapper's is its child's, traced and run once): the audit's observer on example
    # steps, and the Python of the stages that run it on the generated states, when ``varied``,
    # add to what any other run of it saw; the verdict is the ledger's. ``given`` is a lowering's
    # ledger of this node's step (its program, at its batch size), whose runs count too.
    runner = runs_as(backend, mode)
    cfg = kw["cfg"]
    books: list[tuple[int, Ledger]] = []
    for n in batch_sizes:
        if given is not None and given.batch_size == n:
            book = given
        else:
            try:
                program = trace(runner, mode, batch_size=n, **kw)
            except StageWriteError as e:
                raise e.at(path) from None
            book = ledger_of(program if state is None else bind(program, state), cfg, n, state)
        if observe_steps:
            book.observe_examples(step_functions(runner, mode, cfg), observe_steps)
        if varied:
            book.observe_varied()
        books.append((n, book))
    return judge(path, backend, mode, books)


def judge(path: str, backend: BackendLike, mode: ForwardMode, books: Sequence[tuple[int, Ledger]]) -> AuditReport:
    """The audit of ``backend`` (at ``path``) in ``mode``: its declaration against what its ledgers,
    one per batch size audited, say it reads (``core.internal.Ledger``): per buffer the latest
    end over them, the reader (the trace's, or the run that saw it) and the batch size."""
    refuse_writes(path, (w for _, book in books for w in book.writes()))
    declared = backend.read_effect(mode)
    effects = [(n, book, book.effect()) for n, book in books]
    observed = ReadEffect.none()
    for _, _, effect in effects:
        observed = observed | effect
    first = books[0][1].program
    names = list(first.buffers) + [b for b in declared.buffers + observed.buffers if b not in first.buffers]
    entries = []
    for b in dict.fromkeys(names):
        n, book, _ = next(e for e in effects if e[2][b] is observed[b])
        seen = book.last_reader(b)  # a report names the stage: its rows and JSON hold text
        run = None if seen is None else seen.run
        # read that late only inside a kernel, by a reference the trace cannot see (a plan/run pair):
        # the observer's reader, ``kernel/op``
        kept = run is not None and run.kind is RunKind.OBSERVER and seen is not None and "/" in seen.node
        entries.append(BufferAudit(b, declared[b], observed[b], None if seen is None else (seen.stage.name, seen.node),
                                   n, varied=run is not None and run.kind.on_generated_state,
                                   seen_by="" if run is None else run.kind.value,
                                   source="" if seen is None else seen.source, observer=kept))
    opaque = tuple(dict.fromkeys(o for _, book in books for o in _why_opaque(book.program)))
    disagreements = (d if d.backend == backend.name else attrs.evolve(d, backend=backend.name)
                     for _, book in books for d in book.disagreements())
    return AuditReport(path, mode, declared, observed, tuple(entries), (), opaque, tuple(n for n, _ in books),
                       tuple(dict.fromkeys(disagreements)))


def refuse_writes(path: str, seen: Iterable[tuple[str, Access]]) -> None:
    """Raise :class:`StageWriteError` for the first write of a shared buffer in ``seen`` (each
    ``(the run that saw it, the access)``): a write a run of the step's code saw counts whatever the
    trace says (an op whose schema declares none, a kernel writing memory it keeps a reference to).

    >>> refuse_writes("paged", [("observer run 'example 0'", Access("seq_lens", "body", "aten.sum.default", "read"))])
    >>> write = Access("seq_lens", "body", "my.op/aten.add_.Tensor", "write")
    >>> try:
    ...     refuse_writes("paged", [("observer run 'example 0'", write)])
    ... except StageWriteError as e:
    ...     print(e.stage, e.buffer, e.node)
    body seq_lens my.op
    """
    for run, w in seen:
        if w.kind != "write":
            continue
        stage, _, node = w.stage.partition(":")
        kernel, _, inner = w.op.rpartition("/")
        by = f"inside kernel {kernel} ({inner})" if kernel else f"by {w.op}"
        why = f"{run} saw it written {by}"
        raise StageWriteError(path, stage, w.buffer, node or kernel or w.op, w.op, why, w.source or "?")


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


@attrs.frozen
class _Plan:
    """An audit's arguments, checked, and the nodes it audits: ``order`` is ``(path, node, batch
    sizes, placed, number of children run, children not run)`` in pre-order, the root first."""

    kw: dict[str, Any]
    sizes: tuple[int, ...]
    steps: int
    varied: bool
    order: tuple[tuple[str, BackendLike, tuple[int, ...], bool, int, tuple[tuple[str, str], ...]], ...]

    @property
    def placed_below(self) -> bool:
        """Whether a node below the root places a fence of its own (a ``per_stream`` member)."""
        return any(placed for _, _, _, placed, _, _ in self.order[1:])


def _plan(backend: BackendLike, mode: ForwardMode, cfg: ModelConfig | None, batch_sizes: Iterable[int] | None,
          device: str, state: Mapping[str, Mapping[str, Tensor]] | None, observe_steps: int) -> _Plan:
    check_backend(backend)
    check_mode(mode)
    check_state(state)
    if observe_steps != 0 or isinstance(observe_steps, bool):
        positive_int("observe_steps (0 turns the observer off)", observe_steps)
    cfg = model_config(cfg)
    sizes = _batch_sizes(cfg, batch_sizes)
    # stages whose Python may take another path run on the varied states where it can run: on the CPU,
    # or on the live state (traced on another device, the example holds fake tensors)
    varied = observe_steps > 0 and (device == "cpu" or state is not None)
    # each node only where the step runs it (a select's selected arm; a tbo child at its micro-batch sizes)
    order: list[tuple[str, BackendLike, tuple[int, ...], bool, int, tuple[tuple[str, str], ...]]] = []
    stack: list[tuple[str, BackendLike, tuple[int, ...], bool]] = [(backend.name, backend, sizes, True)]
    while stack:
        path, node, at, placed = stack.pop()
        kids, idle = _children_run(path, node, mode, at)
        order.append((path, node, at, placed, len(kids), idle))
        stack.extend(kids)
    return _Plan({"cfg": cfg, "device": device}, sizes, observe_steps if device == "cpu" else 0, varied, tuple(order))


@random_kept()  # (the user's program draws next what it would have drawn without the audit)
@collection_paused()  # (its traces and runs keep what they make: a collection in between walks it all for nothing)
def audit_report(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_sizes: Iterable[int] | None = None,
    device: str = "cpu",
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    observe_steps: int = 1,
    ledger: Ledger | None = None,
) -> AuditReport:
    """The audit tree of ``backend`` in ``mode``, whatever its verdicts (see ``audit``)."""
    return _tree(_plan(backend, mode, cfg, batch_sizes, device, state, observe_steps), backend, mode, state, ledger)


def _tree(plan: _Plan, backend: BackendLike, mode: ForwardMode, state: Mapping[str, Mapping[str, Tensor]] | None,
          ledger: Ledger | None, root: AuditReport | None = None) -> AuditReport:
    """Every node of ``plan`` audited, children's reports built before their parent's (post-order);
    ``root``: the root's own report, already made."""
    done: list[AuditReport] = []
    for path, node, at, placed, n, idle in reversed(plan.order):
        kids_reports = tuple(done[len(done) - n :]) if n else ()
        if n:
            del done[len(done) - n :]
        is_root = node is backend and path == backend.name
        if is_root and root is not None:
            report = root
        else:
            report = _audit_node(path, node, mode, plan.kw, at, state, plan.steps, plan.varied,
                                 ledger if is_root else None)
        done.append(attrs.evolve(report, children=kids_reports, placed=placed, not_run=idle))
    (top,) = done
    return top


@random_kept()
@collection_paused()
def audit_failure(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_sizes: Iterable[int] | None = None,
    device: str = "cpu",
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    observe_steps: int = 1,
    ledger: Ledger | None = None,
) -> Unsound | None:
    """``audit(...)``'s failure, ``None`` where it succeeds: the verdict ``lower`` refuses by,
    computed from what it depends on. A node below the root is refused only where a fence placed
    above it is early, which that fence's own entry says, or where it places a fence itself
    (:meth:`AuditReport.judged`). So the root is audited first, alone: sound, with no node below
    it placing a fence, that is the verdict, and the nodes below it are not traced (what they read
    where the step runs them is in the root's trace and runs). Else the whole tree is audited, and
    its refusal names the deepest reader.

    >>> from readfence.backends import hybrid_linear, linear, paged
    >>> from readfence.core import clear_trace_cache
    >>> from readfence.core.tracing import trace_cache_size
    >>> clear_trace_cache()
    >>> print(audit_failure(hybrid_linear(paged(), linear()), ForwardMode.DECODE, batch_sizes=[2]))
    None
    >>> trace_cache_size()  # the root's step alone
    1
    """
    plan = _plan(backend, mode, cfg, batch_sizes, device, state, observe_steps)
    root = None
    if not plan.placed_below:
        path, node, at, *_ = plan.order[0]
        root = _audit_node(path, node, mode, plan.kw, at, state, plan.steps, plan.varied, ledger)
        if not root.judged()[0]:  # (alone, the root is its own fence)
            return None
    return _failure(_tree(plan, backend, mode, state, ledger, root))


def verdict_nodes(backend: BackendLike, mode: ForwardMode, *, cfg: ModelConfig | None = None,
                  batch_sizes: Iterable[int] | None = None) -> tuple[BackendLike, ...]:
    """The nodes whose steps :func:`audit_failure` runs where the root is sound: the root alone,
    unless a node below it places a fence of its own (then every node the audit judges).

    >>> from readfence.backends import hybrid_linear, linear, paged, per_stream
    >>> [b.name for b in verdict_nodes(hybrid_linear(paged(), linear()), ForwardMode.DECODE)]
    ['hybrid_linear']
    >>> [b.name for b in verdict_nodes(per_stream(paged(), linear()), ForwardMode.DECODE, batch_sizes=[2])]
    ['per_stream', 'linear', 'paged']
    """
    plan = _plan(backend, mode, cfg, batch_sizes, "cpu", None, 1)
    return tuple(node for _, node, *_ in (plan.order if plan.placed_below else plan.order[:1]))


def _children_run(path: str, node: BackendLike, mode: ForwardMode, sizes: tuple[int, ...]
                  ) -> tuple[list[tuple[str, BackendLike, tuple[int, ...], bool]], tuple[tuple[str, str], ...]]:
    """The children ``node``'s step runs at ``sizes``, each with the batch sizes it is handed (and
    whether a fence is placed from it), in order; and ``(path, why)`` of those it never runs."""
    runs: dict[str, tuple[BackendLike, set[int], bool]] = {}
    for n in sizes:
        for r in child_runs(node, mode, n):
            child, got, placed = runs.setdefault(r.label, (r.backend, set(), r.placed))
            if r.batch_size > 0:
                got.add(r.batch_size)
    kids, idle = [], []
    for label, child in node.children():
        child_path = f"{path}/{label}/{child.name}"
        if label not in runs:
            idle.append((child_path, f"not run in {mode.name}"))
        elif not runs[label][1]:
            idle.append((child_path, f"handed no request at batch size{'s' if len(sizes) > 1 else ''} "
                                     f"{', '.join(map(str, sizes))}"))
        else:
            run, got, placed = runs[label]
            kids.append((f"{path}/{label}/{run.name}", run, tuple(sorted(got)), placed))
    return kids, tuple(idle)


def audit(
    backend: BackendLike,
    mode: ForwardMode,
    *,
    cfg: ModelConfig | None = None,
    batch_sizes: Iterable[int] | None = None,
    device: str = "cpu",
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    observe_steps: int = 1,
    ledger: Ledger | None = None,
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
    example steps under the runtime read observer, watching the example's buffers and, given
    ``state``, the live ones (on a CPU trace; ``0`` disables it): a read it sees that a faithful
    stage's trace does not cover is a bug in readfence's analysis, listed in
    ``report.disagreements``, and counts in the verdict. The stages that run their Python in the
    step (the out-of-graph stage; every stage in EXTEND) are also run on the generated states
    (``core.internal.REPLAY_SEEDS``: first tokens, the longest context, a mixed batch; on the CPU
    or on ``state``; ``observe_steps=0`` skips them too): a read there, on a path the trace's
    example did not take, counts in the verdict as ``lower`` counts it, and its entry says so
    (``varied``). Every run is recorded in the step's ledger (``core.internal.Ledger``); the
    verdict is the ledger's, so a read any earlier run of the step saw counts too. ``ledger``
    (internal) is a lowering's ledger of the root's step at its batch size.

    >>> from readfence.backends import paged, redeclare
    >>> from readfence.effects import ReadEffect
    >>> audit(paged(), ForwardMode.DECODE).map(lambda r: r.sound)
    <Success: True>
    >>> early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY}))
    >>> print(audit(early, ForwardMode.DECODE).failure().message)  # doctest: +ELLIPSIS
    unsound declaration: paged in mode DECODE declares buffer 'req_to_token' ends at PRE_REPLAY but ...
    """
    report = audit_report(backend, mode, cfg=cfg, batch_sizes=batch_sizes, device=device, state=state,
                          observe_steps=observe_steps, ledger=ledger)
    failure = _failure(report)
    return Success(report) if failure is None else Failure(failure)


def _failure(report: AuditReport) -> Unsound | None:
    """The refusal of the deepest reader ``report`` judges (:meth:`AuditReport.judged`), if any."""
    bad = report.judged()[0]
    if not bad:
        return None
    path, entry, fence = bad[0]
    return Unsound(report, path, report.mode, entry.buffer, entry.declared, entry.observed, entry.reader,
                   entry.batch_size, fence)
