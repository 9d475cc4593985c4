"""``readfence plan``: how a backend's read effect is derived, resolved and fenced (the report
is computed by ``_plan_data``, imported once the options have passed: this module imports no
torch)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from readfence.effects.internal import table

from ._errors import OneLineCommand
from ._params import DeviceName, Mode, Spec, device_caps, echo_json, refuse_mode_for_shape

if TYPE_CHECKING:
    pass


def _ends(effect: dict[str, str]) -> str:
    return " ".join(f"{b}={e}" for b, e in effect.items()) or "(reads no shared buffer)"


def render(report: dict[str, Any]) -> str:
    """The text form of :func:`~readfence.cli._plan_data.plan_report`.

    >>> from readfence.backends import paged
    >>> from readfence.core import ForwardMode
    >>> from readfence.effects import Capabilities
    >>> from readfence.cli._plan_data import plan_report
    >>> text = render(plan_report(paged(), ForwardMode.DECODE, device="cpu", caps=Capabilities()))
    >>> print(text.splitlines()[0])
    spec: paged  mode: DECODE
    """
    caps = report["caps"]
    lines = [
        f"spec: {report['spec']}  mode: {report['mode']}",
        f"device: {report['device']} (in-graph events: {'yes' if caps['in_graph_events'] else 'no'}, "
        f"graphs: {'yes' if caps['graphs'] else 'no'}; this mode "
        f"{'replays a graph' if caps['graphed'] else 'runs eagerly'})",
        "",
        f"derivation: each node's read ends in {report['mode']} (a combinator's are computed from "
        "its children)",
    ]
    tree = report["tree"]
    width = max(2 * n["depth"] + len(n["label"] + n["name"]) + 2 for n in tree)
    for n in tree:
        head = "  " * n["depth"] + (f"{n['label']}: " if n["label"] else "") + n["name"]
        tail = _ends(n["effect"]) if n["active"] else f"(not selected in {report['mode']})"
        lines.append(f"  {head.ljust(width)}  {tail}".rstrip())
    lines += ["", f"per buffer (joined end {report['end']}, resolved for this device: {report['resolved_end']})"]
    rows = [{"buffer": b, "declared": e, "forced by": ", ".join(report["forced_by"][b]) or "-",
             "resolved": report["resolved"][b]} for b, e in report["effect"].items()]
    lines.append(table(rows, ["buffer", "declared", "resolved", "forced by"]) if rows
                 else "  (no shared buffer is read)")
    lines += ["", "fence placement per policy (one event per distinct point)"]
    rows = []
    for policy, plan in report["policies"].items():
        if "refused" in plan:
            rows.append({"policy": policy, "buffer": "*", "end": "-", "placement": plan["refused"]})
            continue
        for i, r in enumerate(plan["placements"]):
            rows.append({"policy": policy if i == 0 else "", "events": plan["events"] if i == 0 else "", **r})
    lines.append(table(rows, ["policy", "events", "buffer", "end", "placement"]))
    return "\n".join(lines)


def render_shape(report: dict[str, Any]) -> str:
    """The text form of :func:`~readfence.cli._plan_data.shape_plan_report`.

    >>> from readfence.graph import parse_step
    >>> from readfence.effects import Capabilities
    >>> from readfence.cli._plan_data import shape_plan_report
    >>> r = shape_plan_report(parse_step("ngram(paged)").unwrap(), device="cpu", caps=Capabilities())
    >>> print(render_shape(r).splitlines()[0])
    spec: ngram(paged)  phases: 1
    """
    lines = [f"spec: {report['spec']}  phases: {len(report['phases'])}", "",
             "phases in step order (each a lowered graph of its runner and mode): declared and traced ends"]
    lines.append(table([{**p, "declared": _ends(p["effect"]), "traced": _ends(p["traced"])} for p in report["phases"]],
                       ["phase", "runner", "mode", "backend", "declared", "traced"]))
    lines += ["", "per buffer: the position (phase, end) of its last read, declared and traced; the phase "
                  "holding it publishes the fence",
              "(JOINED and PER_BUFFER rank the phases by the declarations, EXACT by the trace; COARSE "
              "releases every buffer after the whole step)"]
    buffers = dict.fromkeys([*report["effect"], *report["traced"]])
    rows = [{"buffer": b, "declared last read": report["effect"].get(b, "NONE"),
             "traced last read": report["traced"].get(b, "NONE")} for b in buffers]
    lines.append(table(rows, ["buffer", "declared last read", "traced last read"]) if rows
                 else "  (no shared buffer is read)")
    lines += ["", "fence placement per policy (the phase whose graph records each buffer's event)"]
    rows = []
    for policy, plan in report["policies"].items():
        if "refused" in plan:
            rows.append({"policy": policy, "buffer": "*", "placement": plan["refused"]})
            continue
        for i, r in enumerate(plan["placements"]):
            rows.append({"policy": policy if i == 0 else "", "events": plan["events"] if i == 0 else "",
                         **r, "published by": r["phase"]})
    lines.append(table(rows, ["policy", "events", "buffer", "published by", "end", "placement"]))
    return "\n".join(lines)


@click.command(cls=OneLineCommand)
@click.argument("spec", type=Spec())
@click.option("--mode", type=Mode(), default="decode", show_default=True,
              help="decode, target_verify, draft_extend, extend or idle (not for a step shape: its phases fix "
                   "their own modes).")
@click.option("--device", type=DeviceName(), default="auto", show_default=True,
              help="auto, cpu or cuda: whose capabilities resolve the ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(spec: Any, mode: Any, device: str, as_json: bool) -> None:
    """Show how SPEC's read effect in MODE is derived and where each policy fences it.

    \b
    SPEC is a backend spec, e.g. 'tbo(deepseek_v4, paged)'. For each buffer: its end, the
    leaf that forces it, the end this device can signal, and each policy's event placement.
    For a speculative step shape (eagle, multi_eagle, ngram) it shows which phase publishes
    each buffer (MODE is then given by the phases). Exit status 1 if the declaration is unsound
    (a policy's row says the lowering refuses it), 2 for bad input.
    """
    from readfence.graph import StepShape

    from ._plan_data import plan_report, shape_plan_report
    refuse_mode_for_shape(spec)
    name, caps = device_caps(device)
    if isinstance(spec, StepShape):  # the phases fix the modes
        report = shape_plan_report(spec, device=name, caps=caps)
        echo_json(report) if as_json else click.echo(render_shape(report))
    else:
        report = plan_report(spec, mode, device=name, caps=caps)
        echo_json(report) if as_json else click.echo(render(report))
    if any("refused" in plan for plan in report["policies"].values()):
        sys.exit(1)  # an unsound declaration is a finding, as for audit and verify
