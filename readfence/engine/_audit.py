"""The engine audit: an adapted backend's scalar declaration against its per-buffer truth.

For every node of the wrapper tree, every mode and every batch size, each shared buffer's
last read comes from one of two independent sources, and the report says which:

* ``traced``: the stages ``make_fx`` follows (``readfence.core.trace``, bound to the engine's
  state), every path of their code;
* ``observed``: the runtime read observer over real scheduler steps on the engine's state
  (:func:`~readfence.engine.observe_engine`), for what the tracer cannot follow: a stage with
  host reads or data-dependent shapes, or a kernel reading what an earlier stage kept (no
  static analysis sees that). It covers only the paths those steps took; in a step the engine
  does not replay (EXTEND), whose Python may take a path neither took, it also covers the
  Python's runs on the varied states ``readfence.core.audit`` and ``lower`` run it on.

The truth is the later of the two. Next to it, the declaration: the object's one
``shared_read_ends`` value, the same for every buffer (in EXTEND, what
``resolve_prefill_shared_read_ends`` says for that batch, when the object has it); the verdict
is exact, conservative by k lattice steps (the gain of a per-buffer fence for that buffer),
or unsound, naming the method, the buffer and the op that reads late.

Each node is audited where the engine runs it: a wrapper's child at the batch sizes the
wrapper's own code hands it (a two-batch-overlap child gets micro-batches), as recorded while
the wrapper's step runs. The verdict is ``readfence.core``'s, where the fences are decided
(``AuditReport.judged``): the engine publishes its fence from the root's declaration, so a
child whose own declaration is below its truth, under a root whose fence covers it, is a
*latent* finding (a ``LATENT:`` line, the JSON row's ``latent`` key), not an unsound one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
from returns.result import Result

from readfence.core import (
    SHARED_BUFFERS,
    AuditReport,
    ForwardMode,
    Latent,
    Program,
    Stage,
    StageWriteError,
    bind,
    default_batch_sizes,
    trace,
)
from readfence.core.internal import (
    ReadKind,
    RunKind,
    check_forward_mode,
    example_step,
    ledger_of,
    positive_int,
    refuse_writes,
    stage_named,
)
from readfence.effects import Failure, ReadEffect, ReadEnd, Success

from ._adapter import EAGER, EngineBackend, check_engine
from ._contract import PREFILL, STAGE_METHODS, EngineError, stage_of_method, traced_failure
from ._engine_report import _VARIED_OP, OBSERVED, TRACED
from ._engine_report import ENGINE_MODES as ENGINE_MODES
from ._engine_report import EngineAudit as EngineAudit
from ._engine_report import EngineRow as EngineRow
from ._engine_report import EngineUnsound as EngineUnsound
from ._engine_report import NodeAudit as NodeAudit
from ._observe import observe_engine
from ._view import ForwardBatch, absent

# ------------------------------------------------------------------------------------------


def _escapes(program: Program) -> dict[Stage, list[tuple[str, str]]]:
    """Per stage, its escapes other than the adapter's own eager marker: ``(why, source)``."""
    out: dict[Stage, list[tuple[str, str]]] = {}
    for stage, _node, why, source in program.unfaithful():
        if EAGER not in why:
            out.setdefault(stage, []).append((why.removeprefix("escape: "), source))
    return out


def _traced(program: Program, untraceable: Iterable[Stage]) -> tuple[dict[str, ReadEnd], dict[str, tuple[Stage, str]]]:
    """Per buffer, the end of its last read in the stages the tracer follows, and that reader."""
    ends: dict[str, ReadEnd] = {}
    readers: dict[str, tuple[Stage, str]] = {}
    skip = set(untraceable)
    if program.aborted is not None:
        return ends, readers
    for s in program.stages:
        if s.stage in skip:
            continue
        for b in s.analysis.buffers_read():
            ends[b] = ends.get(b, ReadEnd.NONE) | s.end
            node = s.analysis.last_reader(b)
            if node is not None:
                readers[b] = (s.stage, node)
        for b in s.analysis.unknown:
            ends[b] = ReadEnd.UNKNOWN
    return ends, readers


def _node_op(program: Program, stage: Stage, node: str) -> tuple[str, str, str]:
    """``(method, op, source line)`` of a traced node."""
    graph = program.stage(stage).graph
    op = next((str(n.target) for n in graph.gm.graph.nodes if n.name == node), node)
    return STAGE_METHODS[stage], op, graph.source(node)


@attrs.frozen
class _Run:
    size: int
    program: Program | None  # None: make_fx could not trace the step at all
    traced: dict[str, ReadEnd]
    readers: dict[str, tuple[Stage, str]]
    observed: ReadEffect
    observation: Any
    escapes: dict[Stage, list[tuple[str, str]]]
    declared: ReadEnd
    resolved: ReadEnd | None
    # buffer -> the stage whose Python read it latest on a varied state, where that is later than
    # the trace and the scheduler steps read it (``observed`` includes it)
    varied: dict[str, Stage] = attrs.Factory(dict)


def _run(node: EngineBackend, mode: ForwardMode, size: int, steps: int, seed: int, path: str) -> _Run:
    cfg = node.cfg
    program: Program | None
    traced: dict[str, ReadEnd] = {}
    readers: dict[str, tuple[Stage, str]] = {}
    try:
        program = bind(trace(node, mode, cfg=cfg, batch_size=size), node.state)
    except StageWriteError as e:
        raise e.at(path) from None
    except EngineError as e:
        if not traced_failure(e):  # the engine's own code raised: a bug to report, not a tracer limit
            raise
        # torch refused to trace the engine's code (control flow on a value it cannot know): that
        # stage's reads are observed, and nothing of the step can be lowered
        program = None
        why = " ".join(str(e.__cause__).split())
        escapes = {stage_of_method(e.method): [(f"make_fx cannot trace it: {type(e.__cause__).__name__}: {why}",
                                          e.where or "?")]}
    if program is not None:
        escapes = _escapes(program)
        traced, readers = _traced(program, escapes)
    observation = observe_engine(node, mode, batch_sizes=[size], steps=steps, seed=seed)
    refuse_writes(path, (("the scheduler steps' read observer", a) for a in observation.accesses))
    observed, varied = observation.observed(), {}
    if program is not None:  # the Python of the stages that run it, on the generated states, as core's audit
        ledger = ledger_of(program, cfg, size, node.state)
        ledger.observe_varied()
        refuse_writes(path, ledger.writes())
        generated = (RunKind.VARIED, RunKind.VALIDATION)
        effect = ledger.effect(*generated, traced=False)
        for b in effect.buffers:
            reader = ledger.last_reader(b, *generated)
            if reader is not None and effect[b] > observed[b] | traced.get(b, ReadEnd.NONE):
                varied[b] = reader.stage
        observed = observed | effect
    resolved = None
    if mode is ForwardMode.EXTEND and hasattr(node.object, PREFILL):
        resolved = node.prefill_end(example_step(cfg, mode, size).batch)
    return _Run(size, program, traced, readers, observed, observation, escapes, node.read_effect(mode).end, resolved,
                varied)


def _row(node: EngineBackend, path: str, mode: ForwardMode, buffer: str, runs: Sequence[_Run], per_batch: bool) -> EngineRow:
    if buffer in node.reads:
        declared = (runs[0].resolved if per_batch else runs[0].declared) or ReadEnd.UNKNOWN
    else:  # outside what the declaration covers: a read of it is undeclared
        declared = node.read_effect(mode)[buffer]
    truth = ReadEnd.join_all(r.traced.get(buffer, ReadEnd.NONE) | r.observed[buffer] for r in runs)
    run = next((r for r in runs if (r.traced.get(buffer, ReadEnd.NONE) | r.observed[buffer]) is truth), runs[0])
    traced = run.traced.get(buffer, ReadEnd.NONE)
    if run.program is not None and traced is truth and (truth is not ReadEnd.NONE or not run.escapes):
        reader = run.readers.get(buffer)
        method, op, where = _node_op(run.program, *reader) if reader else ("", "", "")
        return EngineRow(path, mode, buffer, declared, truth, TRACED, method, op, where, run.size, per_batch,
                         used=_used(node, mode) == "")
    last = run.observation.last_reader(buffer)
    method = op = why = ""
    if buffer in run.varied:
        method, op = STAGE_METHODS[run.varied[buffer]], _VARIED_OP
        python = (f"{method} runs its Python every step, on what it read on the host" if node.replayed(mode) else
                  "a step the engine does not replay runs its Python")
        why = f"{python}, which took a path there that the trace did not"
    elif last is not None:
        label, op = last
        stage = stage_named(label)
        method = STAGE_METHODS[stage]
        why = (f"{method} escapes the tracer" if stage in run.escapes else
               f"a kernel reads what an earlier stage kept: {ReadKind.OBSERVER_ONLY}")
    access = run.observation.last_read(buffer)
    where = access.source if access is not None else ""
    return EngineRow(path, mode, buffer, declared, truth, OBSERVED, method, op, where, run.size, per_batch, why,
                     used=_used(node, mode) == "")


def _used(node: EngineBackend, mode: ForwardMode) -> str:
    """Why the engine never publishes a fence from ``node``'s declaration in ``mode`` ("" if it does)."""
    if mode is ForwardMode.EXTEND or node.replayed(mode):
        return ""
    return (f"the engine never graph-replays this backend: its {mode.name} steps run eagerly and the scheduler "
            f"waits for the whole forward (the coarse barrier), so its declaration ({node.declared_end(mode).name}) "
            f"is never used")


def _delegation(node: EngineBackend, mode: ForwardMode) -> str:
    """A wrapper's declaration in ``mode`` against its children's ("" for a leaf)."""
    if not node.kids:
        return ""
    own = node.read_effect(mode).end
    ends = {name: kid.read_effect(mode).end for name, kid in node.kids}
    latest = ReadEnd.join_all(ends.values())
    forcing = ", ".join(f"{name} ({kid.name})" for name, kid in node.kids if ends[name] is latest)
    if own is latest:
        return f"delegates: declares {own.name}, the latest of its children (forced by {forcing})"
    chosen = [name for name, end in ends.items() if end is own]
    if own < latest and chosen:
        return (f"selects {', '.join(chosen)}: declares {own.name} as that child does (the latest child, "
                f"{forcing}, declares {latest.name}: sound only if no other child runs in this mode)")
    if own > latest:
        return f"declares {own.name}, later than every child (the latest, {forcing}, declares {latest.name})"
    return (f"does not delegate: declares {own.name}, earlier than its children (the latest, {forcing}, "
            f"declares {latest.name})")


def _audit_node(path: str, node: EngineBackend, mode: ForwardMode, sizes: tuple[int, ...], steps: int,
                seed: int) -> NodeAudit:
    runs = [_run(node, mode, n, steps, seed, path) for n in sizes]
    per_batch = runs[0].resolved is not None
    rows = []
    lacks = absent(node.binding.layout)
    # a buffer outside the declaration's reads is a row only where it is read: an undeclared read
    others = tuple(b for b in SHARED_BUFFERS if b not in node.reads and b not in lacks
                   and any(r.traced.get(b, ReadEnd.NONE) is not ReadEnd.NONE or r.observed[b] is not ReadEnd.NONE
                           for r in runs))
    for b in node.reads + others:
        if per_batch:
            rows += [_row(node, path, mode, b, [r], True) for r in runs]
        else:
            rows.append(_row(node, path, mode, b, runs, False))
    untraceable = tuple(dict.fromkeys((stage, why, source) for r in runs for stage, found in r.escapes.items()
                                      for why, source in found))
    lowering = ""
    declared = node.read_effect(mode)
    failed = [r for r in runs if r.program is None]
    lowered = [(r, r.program.traced() | ReadEffect.of({b: r.observed[b] for b in r.varied}))
               for r in runs if r.program is not None]
    refused = [(r, effect) for r, effect in lowered if not effect <= declared]
    if failed:
        (stage, [(why, source), *_]), *_ = failed[0].escapes.items()
        lowering = (f"readfence cannot lower it with any policy: {STAGE_METHODS[stage]} ({stage}): "
                    f"{why} at {source}")
    elif refused:
        late, effect = refused[0]
        worst = max((b for b in effect.buffers if not effect[b] <= declared[b]), key=lambda b: effect[b].rank)
        what = "its Python reads" if worst in late.varied else "its traced effect reads"
        where = " on a varied state" if worst in late.varied else ""
        lowering = (f"readfence's lowering fences it COARSE only: {what} {worst} until "
                    f"{effect[worst].name}{where}, later than declared ({declared[worst].name})")
        if untraceable:
            lowering += (" (a stage the tracer cannot follow reads, before the replay, what its host reads reach "
                         "and its runs on varied states saw; every buffer until POST_REPLAY in it)")
    prefill = tuple((r.size, r.resolved) for r in runs if r.resolved is not None)
    return NodeAudit(path, mode, runs[0].declared, tuple(rows), untraceable, lowering, prefill, _used(node, mode),
                     _delegation(node, mode))


#: The contract methods through which a wrapper hands a child its batch.
_HANDING = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph", "forward",
            "forward_decode", "forward_extend")


@contextlib.contextmanager
def _handed(node: EngineBackend) -> Iterator[dict[str, set[int]]]:
    """Per child label of ``node``, the batch sizes the wrapper's own code hands that child while
    the block runs (each call's ``forward_batch``; an empty micro-batch is no run): the child's
    contract methods are wrapped on the instance, and put back after."""
    got: dict[str, set[int]] = {label: set() for label, _ in node.kids}
    patched: list[tuple[Any, str]] = []

    def recording(label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if isinstance(a, ForwardBatch) and a.batch_size > 0:
                got[label].add(a.batch_size)
        return fn(*args, **kwargs)

    try:
        for label, kid in node.kids:
            obj = kid.object
            for name in _HANDING:
                fn = getattr(obj, name, None)
                if callable(fn) and hasattr(obj, "__dict__") and name not in vars(obj):
                    setattr(obj, name, functools.partial(recording, label, fn))
                    patched.append((obj, name))
        yield got
    finally:
        for obj, name in patched:
            delattr(obj, name)


def _audit_or_error(path: str, node: EngineBackend, mode: ForwardMode, sizes: tuple[int, ...], steps: int, seed: int,
                    errors: str) -> NodeAudit:
    try:
        return attrs.evolve(_audit_node(path, node, mode, sizes, steps, seed), batch_sizes=sizes)
    except EngineError as e:
        if errors == "raise":
            raise
        try:
            declared = node.read_effect(mode).end
        except EngineError:  # shared_read_ends itself raised
            declared = ReadEnd.UNKNOWN
        at = f" (at {e.where})" if e.where else ""
        return NodeAudit(path, mode, declared, (), (), "", error=f"{e}{at}", batch_sizes=sizes)


def _audit_tree(path: str, node: EngineBackend, mode: ForwardMode, sizes: tuple[int, ...], steps: int, seed: int,
                errors: str) -> Iterator[NodeAudit]:
    """``node`` at ``sizes``, then each child at the sizes ``node``'s step handed it (a child it
    never called in this mode, as a hybrid's unselected backend: at ``node``'s sizes), pre-order."""
    with _handed(node) as got:
        audited = _audit_or_error(path, node, mode, sizes, steps, seed, errors)
    yield audited
    for label, kid in node.kids:
        at = tuple(sorted(got[label])) or sizes
        yield from _audit_tree(f"{path}/{label}/{kid.name}", kid, mode, at, steps, seed, errors)


def _report(path: str, node: EngineBackend, mode: ForwardMode, audited: dict[tuple[str, ForwardMode], NodeAudit]
            ) -> AuditReport:
    """The engine audit of ``node``'s tree in ``mode`` as core's audit tree, for its one verdict
    function: per buffer, the declaration and the truth (a per-batch prefill row is judged alone,
    against the end resolved for that batch); the fence is the root's (the engine publishes it)."""
    n = audited[(path, mode)]
    rows = [r for r in n.rows if not r.per_batch]
    kids = tuple(_report(f"{path}/{label}/{kid.name}", kid, mode, audited) for label, kid in node.kids)
    return AuditReport(path, mode, ReadEffect.of({r.buffer: r.declared for r in rows}),
                       ReadEffect.of({r.buffer: r.truth for r in rows}), tuple(r.audit for r in rows), kids,
                       batch_sizes=n.batch_sizes, placed="/" not in path)


def _judged(engine: EngineBackend, nodes: Sequence[NodeAudit], modes: Sequence[ForwardMode]) -> list[NodeAudit]:
    """``nodes`` with each row below its truth that no fence depends on marked latent
    (``AuditReport.judged``: what ``readfence.core.audit`` refuses, this refuses)."""
    audited = {(n.path, n.mode): n for n in nodes}
    latent: dict[tuple[str, ForwardMode, str], Latent] = {}
    for mode in modes:
        for x in _report(engine.name, engine, mode, audited).judged()[1]:
            latent[(x.path, mode, x.buffer)] = x
    return [attrs.evolve(n, rows=tuple(attrs.evolve(r, latent=latent.get((r.backend, r.mode, r.buffer)))
                                       if r.used and not r.per_batch else r for r in n.rows)) for n in nodes]


#: What ``audit_engine`` does when the engine's own code raises in a mode.
ON_ERROR = ("raise", "report")


def audit_engine(engine: EngineBackend, modes: ForwardMode | Iterable[ForwardMode] | None = None, *,
                 batch_sizes: Iterable[int] | None = None, steps: int = 2, seed: int = 0,
                 errors: str = "raise") -> Result[EngineAudit, EngineUnsound]:
    """Audit ``engine`` and every node of its wrapper tree in each of ``modes`` (default: every
    mode but IDLE), traced where the tracer follows the stages, observed where it cannot.

    The root is traced at each of ``batch_sizes`` (default: 1, 2 and the model's maximum), each
    child at the sizes its wrapper hands it there (a two-batch-overlap child: its micro-batches),
    and observed over ``steps`` scheduler steps at each (``seed`` seeds the request churn), on the
    engine's own state (put back afterwards). Nothing is run overlapped: see
    :func:`~readfence.engine.verify_engine` for that.

    ``Success(report)`` when no declaration the engine publishes a fence from is unsound
    (:meth:`EngineAudit.unsound` is empty), else ``Failure(EngineUnsound(report))`` naming the
    deepest guilty node; either way the report is the whole audit (``.failure().report``). Latent
    rows and unsound declarations the engine never uses (a backend it never graph-replays) are
    findings in the report, not failures.

    The engine's own code raising is an :class:`~readfence.engine.EngineError` (``errors="raise"``);
    with ``errors="report"`` the other nodes and modes are still audited, and each (node, mode)
    whose code raised is a :class:`NodeAudit` whose ``error`` says what and where
    (:meth:`EngineAudit.errors`; its table prints an ``error`` row and an ``ERROR:`` line). Such a
    node is reported, not a failure: the result is ``Success`` when nothing else is unsound, so
    check ``report.errors()`` too (the CLI exits 1 on either).

    >>> from readfence.engine.reference import minimax_hybrid_engine, trtllm_mha_engine
    >>> audit_engine(trtllm_mha_engine(), ForwardMode.DECODE, batch_sizes=[2], steps=1).map(lambda r: r.sound)
    <Success: True>
    >>> failed = audit_engine(minimax_hybrid_engine(), ForwardMode.DECODE, batch_sizes=[2], steps=1).failure()
    >>> [(r.backend.rsplit("/", 1)[-1], r.text()) for r in failed.rows]  # doctest: +NORMALIZE_WHITESPACE
    [('MiniMaxSparseBackend', 'unsound: forward reads it (aten.index_select.default)'),
     ('MiniMaxHybridAttnBackend', 'unsound: forward reads it (aten.index_select.default)')]
    """
    engine = check_engine(engine)
    if modes is None:
        chosen = ENGINE_MODES
    else:
        one = isinstance(modes, (ForwardMode, str))  # a string is one (wrong) mode, not its letters
        chosen = tuple(check_forward_mode(m, "audit") for m in ((modes,) if one else modes))  # type: ignore[union-attr]
    positive_int("steps", steps)
    if errors not in ON_ERROR:
        raise ValueError(f"errors must be one of {', '.join(map(repr, ON_ERROR))}, got {errors!r}")
    cfg = engine.cfg
    sizes = default_batch_sizes(cfg) if batch_sizes is None else tuple(sorted({
        positive_int("batch_size", n, at_most=cfg.max_reqs, limit="cfg.max_reqs") for n in batch_sizes}))
    if not sizes or not chosen:
        raise ValueError("audit_engine needs at least one mode and one batch size")
    found = {(n.path, n.mode): n for mode in chosen for n in _audit_tree(engine.name, engine, mode, sizes, steps, seed,
                                                                          errors)}
    nodes = [found[(path, mode)] for path, _ in engine.walk() for mode in chosen]
    report = EngineAudit(engine.name, tuple(_judged(engine, nodes, chosen)), steps, sizes)
    return Success(report) if report.sound else Failure(EngineUnsound(report))
