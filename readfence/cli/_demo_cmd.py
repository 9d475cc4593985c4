"""``readfence demo``: the overlapped decode loop per fence policy, checked against serial.

The command and its report import no torch: the options are checked, and ``--help``
answered, before the run (``_demo_run``) is imported.
"""

from __future__ import annotations

import pathlib
import sys
from typing import TYPE_CHECKING, Any

import attrs
import click

from readfence.effects.internal import table

from ._errors import InputError, OneLineCommand
from ._params import (
    BATCH_SIZE,
    DEFAULT_SPEC,
    MAX_BATCH,
    MAX_STEPS,
    Amount,
    DeviceName,
    Integer,
    OutputFile,
    Policies,
    Positive,
    Spec,
    check_shares,
    echo_json,
    merge_policies,
    spec_text,
)

if TYPE_CHECKING:
    from ._demo_run import DemoResult


if TYPE_CHECKING:
    pass

MAX_WRITE_COST = 4096  # an N x N matmul per write: past this, seconds per write on a CPU
MAX_WRITE_WAIT_MS = 1000.0  # per write: longer stalls only slow the run down

COLUMNS = {
    "policy": "policy",
    "steps_per_s": "steps/s",
    "speedup_vs_coarse": "speedup vs COARSE",
    "speedup_vs_serial": "vs serial",
    "mean_slack_ms": "mean fence slack (ms)",
    "matches_serial": "matches serial",
    "violations": "sanitizer findings",
}


def _cell(key: str, value: Any, row: dict[str, Any]) -> str:
    if row.get("error") is not None and key != "policy":
        return "refused" if key == "steps_per_s" else "-"
    if value is None:
        return "-"
    if key == "steps_per_s":
        return f"{value:.1f}"
    if key in ("speedup_vs_coarse", "speedup_vs_serial"):
        return f"{value:.2f}x"
    if key == "mean_slack_ms":
        return f"{value:.3f}"
    if key == "matches_serial":
        return "yes" if value else "no"
    if key == "violations":
        return "none" if value == 0 else f"{value} race(s)"
    return str(value)


SERIAL = "serial (no overlap)"
"""The table's baseline row: the serial reference, writes then forward on one thread."""


def render(result: DemoResult, *, spec: str, steps: int, batch_size: int, seed: int,
           phases: str | None = None, write_wait_ms: float = 0.0) -> str:
    """The demo's text report: the device, one table, then any problems in full.

    >>> from readfence.core import ForwardMode
    >>> from readfence.cli._demo_run import DemoResult
    >>> row = {"policy": "COARSE", "steps_per_s": 50.0, "speedup_vs_coarse": 1.0, "speedup_vs_serial": 0.8,
    ...        "mean_slack_ms": 2.5, "matches_serial": True, "violations": 0, "findings": [], "error": None}
    >>> print(render(DemoResult("cpu", None, ForwardMode.DECODE, [row], {}, 62.5),
    ...              spec="paged", steps=10, batch_size=2, seed=0))  # doctest: +NORMALIZE_WHITESPACE
    device: cpu
    spec: paged  mode: DECODE  steps: 10  batch size: 2  seed: 0
    <BLANKLINE>
    policy               steps/s  speedup vs COARSE  vs serial  mean fence slack (ms)  matches serial  sanitizer findings
    serial (no overlap)  62.5     1.25x              1.00x      -                      -               -
    COARSE               50.0     1.00x              0.80x      2.500                  yes             none
    <BLANKLINE>
    every policy matched the serial run bit for bit; the sanitizer found no race
    """
    caps = result.caps
    where = result.device
    if caps is not None:
        where += (f" (in-graph events: {'yes' if caps.in_graph_events else 'no'}, "
                  f"graphs: {'yes' if caps.graphs else 'no'})")
    cells = [{k: _cell(k, r.get(k), r) for k in COLUMNS} for r in _serial_row(result) + result.rows]
    lines = [f"device: {where}",
             f"spec: {spec}  mode: {result.mode.name}  steps: {steps}  batch size: {batch_size}  seed: {seed}"
             if phases is None else
             f"spec: {spec}  phases: {phases}  steps: {steps}  batch size: {batch_size}  seed: {seed}",
             *([f"each page-table write takes {write_wait_ms:g} ms (CPU-free): what a fence lets "
                "overlap the forward"] if write_wait_ms else []),
             "", table(cells, COLUMNS), ""]
    for r in result.rows:
        if r["error"]:
            lines.append(f"{r['policy']}: {r['error']}")
        if not r["error"] and not r["matches_serial"]:
            lines.append(f"{r['policy']}: outputs differ from the serial run")
        for finding in r["findings"][:3]:
            lines.append(f"{r['policy']}: {finding}")
        if len(r["findings"]) > 3:
            lines.append(f"{r['policy']}: ... and {len(r['findings']) - 3} more")
    if result.ok:
        lines.append("every policy matched the serial run bit for bit; the sanitizer found no race")
    return "\n".join(lines)


def _serial_row(result: DemoResult) -> list[dict[str, Any]]:
    serial = result.serial_steps_per_s
    if serial is None:
        return []
    coarse = next((r["steps_per_s"] for r in result.rows if r["policy"] == "COARSE" and r["steps_per_s"]), None)
    return [{"policy": SERIAL, "steps_per_s": serial, "speedup_vs_coarse": serial / coarse if coarse else None,
             "speedup_vs_serial": 1.0}]


def json_rows(result: DemoResult, *, spec: str, phases: str | None, steps: int, batch_size: int, seed: int,
              write_cost: int, write_wait_ms: float) -> list[dict[str, Any]]:
    """The ``--json`` objects: one per policy, each with what the run was (with and without ``--tp``).

    >>> from readfence.core import ForwardMode
    >>> from readfence.cli._demo_run import DemoResult
    >>> rows = json_rows(DemoResult("cpu", None, ForwardMode.DECODE, [{"policy": "COARSE"}], {}, 62.5), spec="paged",
    ...                  phases=None, steps=10, batch_size=2, seed=0, write_cost=0, write_wait_ms=5.0)
    >>> sorted(rows[0])  # doctest: +NORMALIZE_WHITESPACE
    ['batch_size', 'device', 'mode', 'policy', 'seed', 'spec', 'steps', 'write_cost', 'write_wait_ms']
    """
    mode = {"mode": "phases", "phases": phases} if phases else {"mode": result.mode.name}
    return [{**r, "spec": spec, "device": result.device, **mode, "steps": steps, "batch_size": batch_size,
             "seed": seed, "write_cost": write_cost, "write_wait_ms": write_wait_ms} for r in result.rows]


def _tp_rank(rank: Any, spec: str, policies: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """The demo on one tensor-parallel rank (``readfence.parallel.Rank``): its report and rows."""
    from readfence.graph import LoopOptions, Policy
    from readfence.graph.runtime.internal import as_record
    from readfence.graph.verification import phase_modes

    from ._demo_run import run_demo
    from ._params import parse_spec

    backend = parse_spec(spec)
    result = run_demo(backend, policies=[Policy[p] for p in policies], device=rank.device, steps=options["steps"],
                      batch_size=options["batch_size"], options=as_record(options, LoopOptions), rank=rank)
    phases = phase_modes(backend) or None
    wait_ms = options["write_wait_s"] * 1e3
    text = render(result, spec=str(backend), steps=options["steps"], batch_size=options["batch_size"],
                  seed=options["seed"], phases=phases, write_wait_ms=wait_ms)
    rows = json_rows(result, spec=str(backend), phases=phases, steps=options["steps"], batch_size=options["batch_size"],
                     seed=options["seed"], write_cost=options["write_cost"], write_wait_ms=wait_ms)
    return {"ok": result.ok, "text": text, "rows": rows}


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed; "
                         "install it with: pip install 'readfence[plot]'") from None


def _precheck(params: dict[str, Any]) -> None:
    """What ``demo`` refuses before it imports anything heavy: option combinations."""
    from ._tp_cmd import check_tp, check_world

    tp = params.get("tp")
    check_world(tp)
    if tp is not None:
        check_tp(tp)
        if params.get("trace_path") is not None or params.get("plot_path") is not None:
            raise InputError("--trace and --plot draw one process's streams: run them without --tp")
    if params.get("plot_path") is not None:
        _need_matplotlib()


class _Progress:
    """A tqdm bar on stderr, shown only on a terminal (and never with --json)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="step", leave=False)

    def step(self, _i: int) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def phase(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@attrs.frozen(kw_only=True)
class DemoArgs:
    """What ``readfence demo`` was given, one field per option, as click hands them to the
    command (an option added to the command and not here fails its first run)."""

    spec: Any
    steps: int
    policies: tuple[Any, ...]
    device: str
    seed: int
    batch_size: int
    write_cost: int
    write_wait_ms: float | None
    trace_path: pathlib.Path | None
    plot_path: pathlib.Path | None
    tp: int | None
    as_json: bool


@click.command(cls=OneLineCommand, precheck=_precheck)
@click.option("--spec", type=Spec(), default=DEFAULT_SPEC, show_default=True,
              help="Backend to run, e.g. 'tbo(deepseek_v4, paged)', or a speculative step shape: "
                   "'eagle(TARGET, DRAFT)', 'multi_eagle(TARGET, D1, D2)', 'ngram(TARGET)'.")
@click.option("--steps", type=Positive(at_most=MAX_STEPS), default=100, show_default=True, help="Decode steps per policy.")
@click.option("--policy", "policies", type=Policies(), default=("all",), multiple=True,
              callback=merge_policies, show_default=True,
              help="coarse, joined, per_buffer, exact or all; a comma list or repeated (COARSE always runs: it is the baseline).")
@click.option("--device", type=DeviceName(), default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--seed", type=Integer(), default=0, show_default=True, help="Scheduler seed (request churn).")
@click.option("--batch-size", type=BATCH_SIZE, default=4, show_default=True, help=f"Requests per step (1..{MAX_BATCH}).")
@click.option("--write-cost", type=Amount(MAX_WRITE_COST, integer=True), default=0, show_default=True,
              help="Synthetic scheduler work per page-table write (an NxN matmul after the fence): "
                   "makes the overlap measurable (0..4096).")
@click.option("--write-wait-ms", type=Amount(MAX_WRITE_WAIT_MS, unit=" ms"), default=None,
              help="How long each page-table write takes, without using the CPU (a stand-in for the "
                   "copy engine of a GPU): the work a fence lets overlap the forward. 0: writes are free (0..1000; "
                   "default 5, or 0 with --write-cost: one kind of write work at a time).")
@click.option("--trace", "trace_path", type=OutputFile(".json"),
              help="Write a Chrome trace-event JSON of every run's first 200 steps (open it in https://ui.perfetto.dev).")
@click.option("--plot", "plot_path", type=OutputFile(".png"),
              help="Draw each run's first steps after its warm-up step as a PNG (needs matplotlib).")
@click.option("--tp", type=Positive(), default=None,
              help="Tensor parallelism: run on N ranks (torch.distributed: gloo on CPU, NCCL on CUDA), each with its "
                   "own scheduler, shared buffers and lowered step of its shard of the model.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per policy.")
def demo(**given: Any) -> None:
    """Run the tiny model's overlapped decode loop under each fence policy.

    Each run is checked bit for bit against a serial run and watched by the sanitizer; the
    table shows throughput, speedup over the COARSE fence and over the serial run (no
    overlap, the same write work), and the mean fence slack (time from a buffer's last read to
    its release). Exit status 1 if any run is wrong.
    """
    from readfence.graph import LoopOptions, Policy, StepShape
    from readfence.graph.verification import phase_modes

    a = DemoArgs(**given)
    spec, steps, batch_size, seed = a.spec, a.steps, a.batch_size, a.seed
    check_shares(spec, batch_size)
    wait_ms = a.write_wait_ms if a.write_wait_ms is not None else (0.0 if a.write_cost else 5.0)
    if a.write_cost and wait_ms:
        raise InputError("give --write-cost (scheduler work on the CPU) or --write-wait-ms (a wait), not both")
    if a.tp is not None:
        from ._tp_cmd import run_on_ranks

        options = dict(steps=steps, batch_size=batch_size, seed=seed, write_cost=a.write_cost,
                       write_wait_s=wait_ms / 1e3)
        run_on_ranks(_tp_rank, spec_text(spec), [p.name for p in a.policies], options, tp=a.tp, device=a.device,
                     as_json=a.as_json, what="every policy matched the serial run with the same sharding bit for bit; "
                                             "the sanitizer found no race")
        return
    from ._demo_run import run_demo

    # the serial reference counts as one run of the bar
    progress = _Progress(steps * (1 + len(set(a.policies) | {Policy.COARSE})), enabled=not a.as_json)
    try:
        result = run_demo(spec, policies=a.policies, device=a.device, steps=steps, batch_size=batch_size,
                          options=LoopOptions(seed=seed, write_cost=a.write_cost, write_wait_s=wait_ms / 1e3),
                          trace=a.trace_path is not None or a.plot_path is not None,
                          progress=progress.step, on_policy=progress.phase)
    finally:
        progress.close()
    if a.trace_path is not None:
        from readfence.graph import write_trace
        from readfence.graph.runtime import internal

        write_trace(a.trace_path, result.timelines, spec=str(spec), device=result.device, steps=steps,
                    batch_size=batch_size, seed=seed, traced_steps=min(steps, internal.TRACE_STEPS))
    if a.plot_path is not None:
        from readfence.graph import plot_timelines

        plot_timelines(result.timelines, a.plot_path, title=f"{spec} on {result.device}",
                       phases=len(spec.phases) if isinstance(spec, StepShape) else 1)
    phases = phase_modes(spec) or None
    if a.as_json:
        echo_json(json_rows(result, spec=str(spec), phases=phases, steps=steps, batch_size=batch_size, seed=seed,
                            write_cost=a.write_cost, write_wait_ms=wait_ms))
    else:
        click.echo(render(result, spec=str(spec), steps=steps, batch_size=batch_size, seed=seed, phases=phases,
                          write_wait_ms=wait_ms))
        from readfence.graph.runtime.internal import TRACE_STEPS

        kept = f" (the first {TRACE_STEPS} steps of each run)" if steps > TRACE_STEPS else ""
        if a.trace_path is not None:
            click.echo(f"trace written to {a.trace_path}{kept}")
        if a.plot_path is not None:
            click.echo(f"plot written to {a.plot_path}")
    if not result.ok:
        sys.exit(1)
