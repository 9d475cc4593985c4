"""``readfence audit``: declared vs traced read ends, for every mode and every node."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import click

from readfence.core import ForwardMode, ModelConfig, audit_report, default_batch_sizes
from readfence.core.internal import format_table
from readfence.graph import StepShape

from ._engine_cmd import Engine, audit_engines
from ._errors import InputError, OneLineCommand
from ._params import BATCH_SIZE, Mode, Spec, echo_json

if TYPE_CHECKING:
    from readfence.backends import Backend
    from readfence.core import AuditReport, BackendLike
    from readfence.engine import EngineBackend


def reference_backends() -> list[Backend]:
    """Every reference leaf (default options), then every reference composition.

    >>> [str(b) for b in reference_backends()][:3]
    ['paged', 'trtllm_mha', 'deepseek_v4']
    """
    from readfence.backends import REFERENCE_LEAVES, reference_compositions

    return [make() for make in REFERENCE_LEAVES.values()] + list(reference_compositions().values())


def audit_all(backends: Iterable[BackendLike], modes: Sequence[ForwardMode], *, progress: bool = False,
              batch_sizes: Sequence[int] | None = None) -> list[AuditReport]:
    """One :class:`~readfence.core.AuditReport` per (backend, mode), in that order.

    ``progress`` shows a bar on stderr when it is a terminal (tracing takes a while);
    ``batch_sizes`` are traced for each (default: 1, 2 and the model's maximum).

    >>> from readfence.backends import paged
    >>> [r.sound for r in audit_all([paged()], [ForwardMode.DECODE])]
    [True]
    """
    return _audit_pairs([(b, m) for b in backends for m in modes], progress, batch_sizes)


def audit_phases(shape: StepShape, modes: Sequence[ForwardMode] = (), *, progress: bool = False,
                 batch_sizes: Sequence[int] | None = None) -> list[AuditReport]:
    """One report per distinct (backend, mode) of a step shape's phases (a phase fixes its own
    mode); ``modes``, when given, keeps only the phases in those modes.

    >>> from readfence.graph import parse_step
    >>> [(r.path, r.mode.name) for r in audit_phases(parse_step("ngram(paged)").unwrap(), batch_sizes=[2])]
    [('paged', 'TARGET_VERIFY')]
    """
    pairs = [(b, m) for b, m in dict.fromkeys((p.backend, p.mode) for p in shape.phases) if not modes or m in modes]
    if not pairs:
        have = sorted({p.mode.name.lower() for p in shape.phases})
        raise InputError(f"{shape} has no phase in mode {', '.join(m.name.lower() for m in modes)}; "
                         f"its phases run in: {', '.join(have)}")
    return _audit_pairs(pairs, progress, batch_sizes)


def _audit_pairs(pairs: Sequence[tuple[Any, ForwardMode]], progress: bool,
                 batch_sizes: Sequence[int] | None) -> list[Any]:
    from tqdm import tqdm

    bar = tqdm(pairs, file=sys.stderr, unit="audit", leave=False,
               disable=not (progress and sys.stderr.isatty()))
    return [audit_report(b, m, batch_sizes=batch_sizes) for b, m in bar]


def totals(reports: Iterable[AuditReport]) -> dict[str, int]:
    """Sum of every report's ``counts()``."""
    out: dict[str, int] = {}
    for r in reports:
        for k, v in r.counts().items():
            out[k] = out.get(k, 0) + v
    return out


@click.command(cls=OneLineCommand)
@click.argument("spec", type=Spec(), required=False)
@click.option("--mode", "modes", type=Mode(), multiple=True,
              help="Audit only this mode (repeatable); default: every mode.")
@click.option("--batch-size", "batch_sizes", type=BATCH_SIZE, multiple=True,
              help="Trace this batch size (repeatable); default: 1, 2 and the model's maximum.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per (node, mode, buffer).")
@click.option("--engine", "engines", type=Engine(), default=None,
              help="Audit an engine's own backend object instead of SPEC: MODULE:FACTORY (see readfence.engine).")
def audit(spec: Backend | StepShape | None, modes: tuple[ForwardMode, ...], batch_sizes: tuple[int, ...], as_json: bool,
          engines: list[tuple[str, EngineBackend]] | None = None) -> None:
    """Trace SPEC (default: every reference backend) and check its declared read ends.

    \b
    A step shape (eagle, multi_eagle, ngram) is audited phase by phase, each in its own mode.

    \b
    For every mode and every node of the backend tree: per buffer, the declared end, the end
    the traced code really has (the latest over the batch sizes traced: reads can depend on
    the batch size; a read the runtime observer sees that the trace missed is an ANALYSIS BUG
    line and counts too), and the verdict (exact, conservative, unsound). Then how many
    declarations are POST_REPLAY (no metadata snapshot yet) and UNKNOWN (not audited).
    Exit status 1 if any declaration is unsound (earlier than a traced read).

    \b
    --engine MODULE:FACTORY audits an engine's stateful backend object (SGLang's contract:
    init_forward_metadata_out_graph/in_graph, forward, shared_read_ends) and its wrapper's
    children: its one scalar declaration against each buffer's truth, traced where the tracer
    follows the stages and observed over scheduler steps where it cannot (labelled which).
    FACTORY returns the adapted backend (readfence.engine.adapt), or is the backend class;
    e.g. readfence.engine.reference:minimax_hybrid, or :ENGINES for the reference engine.
    """
    if engines is not None:
        if spec is not None:
            raise InputError(f"give SPEC or --engine MODULE:FACTORY, not both (got SPEC {str(spec)!r})")
        sys.exit(audit_engines(engines, modes, batch_sizes, as_json))
    sizes = tuple(batch_sizes) or default_batch_sizes(ModelConfig())
    if isinstance(spec, StepShape):
        reports = audit_phases(spec, modes, batch_sizes=sizes, progress=not as_json)
    else:
        backends = [spec] if spec is not None else reference_backends()
        reports = audit_all(backends, modes or tuple(ForwardMode), progress=not as_json, batch_sizes=sizes)
    counts = totals(reports)
    if as_json:
        echo_json([row for r in reports for row in r.rows(detail=True)])
    else:
        rows = [row for r in reports for row in r.rows(detail=True)]
        click.echo(format_table(rows, counts))
        for r in reports:
            for path, b in r.unsound():
                click.echo(f"UNSOUND: {path} in {r.mode.name}: {b.buffer} declared {b.declared.name} "
                           f"but read until {b.observed.name}"
                           + (f" by {b.reader[0]}:{b.reader[1]}" if b.reader else "")
                           + (f" at batch size {b.batch_size}" if len(sizes) > 1 else ""))
            for n in r.walk():
                for stage, node, why in n.opaque:
                    click.echo(f"OPAQUE: {n.path} in {n.mode.name}: stage {stage}, node {node!r}: {why}")
                for bug in n.disagreements:
                    click.echo(f"ANALYSIS BUG: {bug.message}")
    if counts.get("unsound", 0):
        sys.exit(1)
