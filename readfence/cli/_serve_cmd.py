"""``readfence serve``: the serving loop per fence policy, checked against its serial reference.

The command imports no torch: the options are checked, and ``--help`` answered, before the run
(``_serve_run``) is imported.
"""

from __future__ import annotations

import pathlib
import sys
from typing import TYPE_CHECKING, Any

import attrs
import click

from readfence.effects.internal import table

from ._demo_cmd import SERIAL, _need_matplotlib, _Progress
from ._errors import InputError, OneLineCommand
from ._params import MAX_BATCH, MAX_STEPS, Amount, DeviceName, Integer, OutputFile, Policies, Positive, Rate, Sizes, Spec, echo_json, merge_policies

if TYPE_CHECKING:
    from ._serve_run import ServeReport

MAX_RATE = float(MAX_BATCH)  # requests per step: past the most the model serves, the queue only grows
MAX_WRITE_WAIT_MS = 1000.0
DEFAULT_REPEATS, MAX_REPEATS = 3, 20  # medians of three, as the benchmarks take them

COLUMNS = {
    "policy": "policy",
    "tokens_per_s": "tokens/s",
    "speedup_vs_coarse": "speedup vs COARSE",
    "speedup_vs_serial": "vs serial",
    "mean_slack_ms": "mean fence slack (ms)",
    "host_ms_per_step": "host ms/step",
    "matches_serial": "matches serial",
    "violations": "sanitizer findings",
}


def _cell(key: str, value: Any, row: dict[str, Any]) -> str:
    if row.get("error") is not None and key != "policy":
        return "refused" if key == "tokens_per_s" else "-"
    if value is None:
        return "-"
    if key == "tokens_per_s":
        return f"{value:.0f}"
    if key in ("speedup_vs_coarse", "speedup_vs_serial"):
        return f"{value:.2f}x"
    if key in ("mean_slack_ms", "host_ms_per_step"):
        return f"{value:.3f}"
    if key == "matches_serial":
        return "yes" if value else "no"
    if key == "violations":
        return "none" if value == 0 else f"{value} race(s)"
    return str(value)


def _sizes(counts: dict[str, int] | None) -> str:
    return ", ".join(f"b{k}: {v}" for k, v in (counts or {}).items()) or "none"


def render(report: ServeReport, *, spec: str, steps: int, rate: float, seed: int, capture_sizes: tuple[int, ...]) -> str:
    """The text report: the run, one table, the steps' mix, then any problems in full.

    >>> from readfence.cli._serve_run import ServeReport
    >>> row = {"policy": "COARSE", "tokens_per_s": 900.0, "speedup_vs_coarse": 1.0, "speedup_vs_serial": 0.9,
    ...        "mean_slack_ms": 2.5, "host_ms_per_step": 0.4, "matches_serial": True, "violations": 0,
    ...        "findings": [], "error": None, "prefill_steps": 4, "decode_steps": 6, "batch_sizes": {"2": 1, "4": 5},
    ...        "prefill_batch_sizes": {"1": 4}, "first_difference": None}
    >>> print(render(ServeReport("cpu", [row], {}, {"tokens_per_s": 1000.0}), spec="paged", steps=10, rate=0.5,
    ...              seed=0, capture_sizes=(1, 2, 4)))  # doctest: +NORMALIZE_WHITESPACE
    device: cpu
    spec: paged  steps: 10  rate: 0.5 requests/step  seed: 0  capture sizes: 1,2,4
    steps run: 4 prefill (eager; by batch size b1: 4), 6 decode (by captured graph b2: 1, b4: 5)
    <BLANKLINE>
    policy               tokens/s  speedup vs COARSE  vs serial  mean fence slack (ms)  host ms/step  matches serial  sanitizer findings
    serial (no overlap)  1000      1.11x              1.00x      -                      -             -               -
    COARSE               900       1.00x              0.90x      2.500                  0.400         yes             none
    <BLANKLINE>
    tokens/s and speedups: one run per policy, which on a shared machine can differ by 2x from one run to the next:
    noise; --repeat N takes medians over N repetitions
    every policy matched the serial run bit for bit, request by request; the sanitizer found no race
    """
    rows = report.rows
    lines = [f"device: {report.device}",
             f"spec: {spec}  steps: {steps}  rate: {rate:g} requests/step  seed: {seed}  "
             f"capture sizes: {','.join(map(str, capture_sizes))}"]
    done = next((r for r in rows if r.get("prefill_steps") is not None), None)
    if done is not None:
        lines.append(f"steps run: {done['prefill_steps']} prefill (eager; by batch size "
                     f"{_sizes(done['prefill_batch_sizes'])}), {done['decode_steps']} decode (by captured graph "
                     f"{_sizes(done['batch_sizes'])})")
    serial = report.serial.get("tokens_per_s")
    coarse = next((r["tokens_per_s"] for r in rows if r["policy"] == "COARSE" and r["tokens_per_s"]), None)
    base = [{"policy": SERIAL, "tokens_per_s": serial, "speedup_vs_coarse": serial / coarse if coarse and serial else None,
             "speedup_vs_serial": 1.0}] if serial else []
    cells = [{k: _cell(k, r.get(k), r) for k in COLUMNS} for r in base + rows]
    lines += ["", table(cells, COLUMNS), ""]
    for r in rows:
        if r["error"]:
            lines.append(f"{r['policy']}: {r['error']}")
        elif not r["matches_serial"]:
            where = r.get("first_difference") or {}
            lines.append(f"{r['policy']}: outputs differ from the serial run at step {where.get('step')}, "
                         f"request {where.get('request')}")
        for finding in r["findings"][:3]:
            lines.append(f"{r['policy']}: {finding}")
        if len(r["findings"]) > 3:
            lines.append(f"{r['policy']}: ... and {len(r['findings']) - 3} more")
    lines.append(noise_note(report))
    if report.verified is not None:
        lines.append(report.verified if report.verify_ok else f"verify found: {report.verified}")
    if report.ok:
        lines.append("every policy matched the serial run bit for bit, request by request; the sanitizer found no race")
    return "\n".join(lines)


def noise_note(report: ServeReport) -> str:
    """What the throughput figures are worth: with one repetition, noise; with several, medians,
    and how far each policy's speedup over COARSE ranged across them (a difference inside that
    range is noise).

    >>> from readfence.cli._serve_run import ServeReport
    >>> rows = [{"policy": "COARSE", "error": None, "speedup_vs_coarse_runs": [1.0, 1.0, 1.0]},
    ...         {"policy": "EXACT", "error": None, "speedup_vs_coarse_runs": [0.9, 1.4, 1.1]}]
    >>> print(noise_note(ServeReport("cpu", rows, {}, {"tokens_per_s_runs": [1.0, 1.0, 1.0]})))  # doctest: +NORMALIZE_WHITESPACE
    tokens/s and speedups: medians of 3 repetitions, the policies in a rotated order; across them, speedup vs
    COARSE ranged EXACT 0.90-1.40x: a difference within a range is noise
    """
    repeats = len(report.serial.get("tokens_per_s_runs") or ()) or 1
    if repeats == 1:
        return ("tokens/s and speedups: one run per policy, which on a shared machine can differ by 2x from one run "
                "to the next: noise; --repeat N takes medians over N repetitions")
    ranges = [f"{r['policy']} {min(r['speedup_vs_coarse_runs']):.2f}-{max(r['speedup_vs_coarse_runs']):.2f}x"
              for r in report.rows if r["policy"] != "COARSE" and r["error"] is None and r["speedup_vs_coarse_runs"]]
    spread = f"; across them, speedup vs COARSE ranged {', '.join(ranges)}: a difference within a range is noise" \
        if ranges else ""
    return f"tokens/s and speedups: medians of {repeats} repetitions, the policies in a rotated order{spread}"


def json_rows(report: ServeReport, *, spec: str, rate: float, seed: int, capture_sizes: tuple[int, ...],
              write_wait_ms: float) -> list[dict[str, Any]]:
    """The ``--json`` objects: one per policy, each with what the run was."""
    return [{"spec": spec, **r, "device": report.device, "rate": rate, "seed": seed,
             "capture_sizes": list(capture_sizes), "write_wait_ms": write_wait_ms} for r in report.rows]


def _precheck(params: dict[str, Any]) -> None:
    if params.get("plot_path") is not None:
        _need_matplotlib()


@attrs.frozen(kw_only=True)
class ServeArgs:
    """What ``readfence serve`` was given, one field per option, as click hands them to the
    command (an option added to the command and not here fails its first run)."""

    spec: Any
    steps: int
    policies: tuple[Any, ...]
    rate: float
    capture_sizes: tuple[int, ...]
    seed: int
    device: str
    write_wait_ms: float
    check: bool
    trace_path: pathlib.Path | None
    plot_path: pathlib.Path | None
    as_json: bool
    repeats: int = 1


@click.command("serve", cls=OneLineCommand, precheck=_precheck)
@click.argument("spec", type=Spec())
@click.option("--steps", type=Positive(at_most=MAX_STEPS), default=200, show_default=True,
              help="Steps per policy (prefill and decode; ticks with nothing to run do not count).")
@click.option("--policy", "policies", type=Policies(), default=("all",), multiple=True, callback=merge_policies,
              show_default=True,
              help="coarse, joined, per_buffer, exact or all; a comma list or repeated (COARSE always runs: it is the baseline).")
@click.option("--rate", type=Rate(MAX_RATE), default=0.5, show_default=True,
              help="Mean requests arriving per step (a seeded Poisson process).")
@click.option("--capture-sizes", type=Sizes(), default="1,2,4,8,16", show_default=True,
              help="Batch sizes with a captured decode graph; a decode step runs in the smallest that fits, padded.")
@click.option("--seed", type=Integer(), default=0, show_default=True,
              help="Traffic seed (arrivals, prompt and output lengths).")
@click.option("--device", type=DeviceName(), default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--write-wait-ms", type=Amount(MAX_WRITE_WAIT_MS, unit=" ms"), default=2.0, show_default=True,
              help="How long each page-table write takes without using the CPU (a copy engine's stand-in): the work a "
                   "fence lets overlap the forward; the serial baseline waits as long per step (0..1000).")
@click.option("--verify", "check", is_flag=True,
              help="Also run verify on the serving loop: poison on release, the write guard and the read observer.")
@click.option("--trace", "trace_path", type=OutputFile(".json"),
              help="Write a Chrome trace-event JSON of every run's first 200 steps, each step named after its graph.")
@click.option("--plot", "plot_path", type=OutputFile(".png"),
              help="Draw each run's first steps after its warm-up as a PNG, each step named after its graph (needs "
                   "matplotlib).")
@click.option("--repeat", "repeats", type=Positive(at_most=MAX_REPEATS), default=DEFAULT_REPEATS, show_default=True,
              help="Run the serial reference and every policy this many times, in a rotated order, and report medians "
                   "(and the spread of the speedups): one run's throughput is noise on a shared machine.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per policy.")
def serve(**given: Any) -> None:
    """Run SPEC's serving loop: arrivals, changing batches, prefill between decodes.

    \b
    Requests arrive at --rate per step (seeded Poisson; prompts of 4..24 tokens, prefilled eagerly
    in chunks of 4; outputs of 1..12 decode steps) and are admitted up to the model's limits; each
    decode step replays the graph captured for the smallest of --capture-sizes that fits, padded.
    Every policy is checked request by request against the serial run of the same schedule and
    watched by the sanitizer (--verify adds poison, the guard and the read observer).
    Throughput is the median of --repeat runs, the policies in a rotated order, with the spread.
    Exit status 1 if any run is wrong, 2 for bad input.
    """
    from readfence.graph import Policy, ServeOptions, Traffic

    from ._serve_run import check_serving, run_serve_policies, verify_serving

    a = ServeArgs(**given)
    spec, steps, capture_sizes = a.spec, a.steps, a.capture_sizes
    traffic = Traffic(rate=a.rate, seed=a.seed)
    try:
        check_serving(spec, traffic, capture_sizes)
    except ValueError as e:  # the traffic or the capture sizes do not fit the model or the spec
        raise InputError(str(e)) from None
    progress = _Progress(steps * a.repeats * (2 + len(set(a.policies) - {Policy.COARSE})), enabled=not a.as_json)
    try:
        report = run_serve_policies(spec, policies=a.policies, device=a.device, steps=steps, traffic=traffic,
                                    capture_sizes=capture_sizes,
                                    options=ServeOptions(write_wait_s=a.write_wait_ms / 1e3, progress=progress.step),
                                    trace=a.trace_path is not None or a.plot_path is not None,
                                    repeats=a.repeats, on_policy=progress.phase)
        if a.check:
            progress.phase("verify")
            report = verify_serving(report, spec, policies=a.policies, device=a.device, steps=steps, traffic=traffic,
                                    capture_sizes=capture_sizes)
    finally:
        progress.close()
    if a.trace_path is not None:
        from readfence.graph import write_trace

        write_trace(a.trace_path, report.timelines, spec=str(spec), device=report.device, steps=steps,
                    rate=a.rate, seed=a.seed, capture_sizes=list(capture_sizes))
    if a.plot_path is not None:
        from readfence.graph import plot_timelines

        plot_timelines(report.timelines, a.plot_path, steps=8, title=f"{spec} serving on {report.device}")
    if a.as_json:
        echo_json(json_rows(report, spec=str(spec), rate=a.rate, seed=a.seed, capture_sizes=capture_sizes,
                            write_wait_ms=a.write_wait_ms))
    else:
        click.echo(render(report, spec=str(spec), steps=steps, rate=a.rate, seed=a.seed, capture_sizes=capture_sizes))
        if a.trace_path is not None:
            click.echo(f"trace written to {a.trace_path}")
        if a.plot_path is not None:
            click.echo(f"plot written to {a.plot_path}")
    if not report.ok:
        sys.exit(1)
