"""``readfence audit``: declared vs traced read ends, for every mode and every node (``_audit_run``,
imported once the options have passed: this module imports no torch)."""

from __future__ import annotations

import sys
from typing import Any

import click

from ._engine_cmd import Engine
from ._errors import InputError, OneLineCommand
from ._params import BATCH_SIZE, Mode, Positive, Spec, echo_json


def _precheck(params: dict[str, Any]) -> None:
    if params.get("engines") is not None and params.get("spec") is not None:
        raise InputError(f"give SPEC or --engine MODULE:FACTORY, not both (got SPEC {params['spec']!r})")


@click.command(cls=OneLineCommand, precheck=_precheck)
@click.argument("spec", type=Spec(), required=False)
@click.option("--mode", "modes", type=Mode(), multiple=True,
              help="Audit only this mode (repeatable): decode, target_verify, draft_extend, extend or idle "
                   "(idle: a spec's declarations only, its steps carry no tokens; --engine takes the other "
                   "four); default: every mode.")
@click.option("--batch-size", "batch_sizes", type=BATCH_SIZE, multiple=True,
              help="Trace this batch size (repeatable); default: 1, 2 and the model's maximum.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per (node, mode, buffer).")
@click.option("--engine", "engines", type=Engine(), default=None,
              help="Audit an engine's own backend object instead of SPEC: MODULE:FACTORY (see readfence.engine).")
@click.option("--jobs", "jobs", type=Positive(), default=None,
              help="Audit the modes in N worker processes (default: one per CPU this process may use; "
                   "1: in this process). The output is the same.")
def audit(spec: Any, modes: tuple[Any, ...], batch_sizes: tuple[int, ...], as_json: bool,
          engines: Any = None, jobs: int | None = None) -> None:
    """Trace SPEC (default: every reference backend) and check its declared read ends.

    \b
    A step shape (eagle, multi_eagle, ngram) is audited phase by phase, each in its own mode.

    \b
    For every mode and every node of the backend tree: per buffer, the declared end, the end
    the traced code really has (the latest over the batch sizes traced: reads can depend on
    the batch size; a read the runtime observer sees that the trace missed counts too: inside a
    kernel reading what an earlier stage kept by reference, a plan/run pair, it is an OBSERVED
    ONLY line, a read only the observer sees; anywhere else an ANALYSIS BUG line), and the
    verdict (exact, conservative, unsound, latent). An UNSOUND line names the reading line of
    code, the kind of read and the fix. Then how many
    declarations are POST_REPLAY (no metadata snapshot yet) and UNKNOWN (not audited).
    Exit status 1 if any declaration a fence is placed from is unsound (earlier than a traced
    read). A node is audited only where the step runs it (a select's selected arm, a tbo child
    at its micro-batch sizes); a child below its own trace whose wrapper's fence covers it is
    latent: a LATENT line names what covers it (the JSON row's "latent" key), exit status 0.

    \b
    --jobs N audits the modes in N worker processes, each mode's nodes in one (they share
    its traces); the reports print in the same order as from one process. (--engine audits
    in this process.)

    \b
    --engine MODULE:FACTORY audits an engine's stateful backend object (SGLang's contract:
    init_forward_metadata_out_graph/in_graph, forward, shared_read_ends) and its wrapper's
    children: its one scalar declaration against each buffer's truth, traced where the tracer
    follows the stages and observed over scheduler steps where it cannot (labelled which).
    FACTORY returns the adapted backend (readfence.engine.adapt), or is the backend class;
    e.g. readfence.engine.reference:minimax_hybrid_engine, or :ENGINES for the reference engine.
    """
    if engines is not None:
        from ._engine_cmd import audit_engines

        sys.exit(audit_engines(engines, modes, batch_sizes, as_json))
    from readfence.core import ForwardMode, ModelConfig, default_batch_sizes
    from readfence.core.internal import format_table, late_read_fix
    from readfence.graph import StepShape

    from . import _audit_run
    from ._audit_pool import available_cpus

    sizes = tuple(batch_sizes) or default_batch_sizes(ModelConfig())
    jobs = available_cpus() if jobs is None else jobs
    if isinstance(spec, StepShape):
        reports = _audit_run.audit_phases(spec, modes, batch_sizes=sizes, progress=not as_json, jobs=jobs)
    else:
        backends = [spec] if spec is not None else _audit_run.reference_backends()
        reports = _audit_run.audit_all(backends, modes or tuple(ForwardMode), progress=not as_json, batch_sizes=sizes,
                                       jobs=jobs)
    counts = _audit_run.totals(reports)
    if as_json:
        echo_json([row for r in reports for row in r.rows(detail=True)])
    else:
        rows = [row for r in reports for row in r.rows(detail=True)]
        click.echo(format_table(rows, counts))
        for r in reports:
            for path, b in r.unsound():
                click.echo(f"UNSOUND: {path} in {r.mode.name}: {b.buffer} declared {b.declared.name} "
                           f"but read until {b.observed.name} ({r.where(path, b.buffer)}); "
                           f"{late_read_fix(b.buffer, b.observed)}")
            for latent in r.latent():
                click.echo(f"LATENT: {latent.message.removeprefix('latent: ')}")
            for n in r.walk():
                for stage, node, why in n.opaque:
                    click.echo(f"OPAQUE: {n.path} in {n.mode.name}: stage {stage}, node {node!r}: {why}")
                for bug in n.disagreements:  # a plan/run kernel's read is no bug: the guide's words for it
                    click.echo(f"{'OBSERVED ONLY' if bug.by_reference else 'ANALYSIS BUG'}: {bug.message}")
    if counts.get("unsound", 0):
        sys.exit(1)
