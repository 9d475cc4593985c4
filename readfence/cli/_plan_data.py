"""What ``readfence plan`` reports: the effect's derivation, its resolution, fence placements.

>>> from readfence.backends import hybrid_linear, trtllm_mha, linear
>>> from readfence.core import ForwardMode
>>> b = hybrid_linear(trtllm_mha(), linear())
>>> [(n["path"], n["effect"].get("state_slots")) for n in derivation(b, ForwardMode.DECODE)]
[('hybrid_linear', 'IN_REPLAY'), ('hybrid_linear/children[0]/trtllm_mha', None), ('hybrid_linear/children[1]/linear', 'IN_REPLAY')]
>>> forced_by(b, ForwardMode.DECODE)["state_slots"]
['hybrid_linear/children[1]/linear']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from readfence.core import SHARED_BUFFERS, ForwardMode
from readfence.core.internal import late_read_fix, replayed
from readfence.effects import Capabilities, ReadEffect, ReadEnd, degrade, publish_positions, resolve
from readfence.graph import Policy
from readfence.graph.lowering import last_reads, plan_fences, torch_device

if TYPE_CHECKING:
    from readfence.backends import Backend
    from readfence.core import BackendLike
    from readfence.graph import StepShape


def effect_names(effect: ReadEffect) -> dict[str, str]:
    """``{buffer: end name}`` for the shared buffers (and any other named buffer) not NONE.

    >>> effect_names(ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY}))
    {'seq_lens': 'IN_REPLAY'}
    """
    names = list(SHARED_BUFFERS) + [b for b in effect.buffers if b not in SHARED_BUFFERS]
    return {b: effect[b].name for b in names if effect[b] is not ReadEnd.NONE}


def derivation(backend: Backend, mode: ForwardMode) -> list[dict[str, Any]]:
    """Every node, pre-order: ``path``, ``depth``, ``label``, ``name``, ``leaf``, ``active``
    (whether it contributes to the root's effect in ``mode``) and ``effect``."""
    out: list[dict[str, Any]] = []
    stack: list[tuple[str, str, Any, int, bool]] = [(backend.name, "", backend, 0, True)]
    while stack:
        path, label, node, depth, active = stack.pop()
        kids = node.children()
        out.append({"path": path, "depth": depth, "label": label, "name": node.name, "leaf": not kids,
                    "active": active, "effect": effect_names(node.read_effect(mode))})
        live = {lab for lab, _ in node.active_children(mode)} if active else set()
        for lab, child in reversed(kids):
            stack.append((f"{path}/{lab}/{child.name}", lab, child, depth + 1, lab in live))
    return out


def forced_by(backend: Backend, mode: ForwardMode) -> dict[str, list[str]]:
    """Per buffer the root reads, the active leaves whose declared end equals the root's."""
    root = backend.read_effect(mode)
    nodes = [n for n in derivation(backend, mode) if n["leaf"] and n["active"]]
    out = {}
    for buffer, end in effect_names(root).items():
        out[buffer] = [n["path"] for n in nodes if n["effect"].get(buffer, "NONE") == end]
    return out


def phase_caps(caps: Capabilities, backend: BackendLike, mode: ForwardMode) -> Capabilities:
    """The capabilities ``backend``'s step in ``mode`` runs with: a step the engine does not replay
    (``core.internal.replayed``: EXTEND, or a backend it never graph-replays) has no graph.

    >>> from readfence.backends import paged
    >>> phase_caps(Capabilities(), paged(), ForwardMode.EXTEND)
    Capabilities(in_graph_events=True, graphs=False)
    """
    return caps if replayed(backend, mode) and caps.graphs else attrs.evolve(caps, graphs=False)


def _read_at(program: Any, buffer: str) -> str:
    """`` at file:line in function`` of the traced code's last read of ``buffer`` ("" if unknown)."""
    reader = program.last_reader(buffer)
    source = "?" if reader is None else program.stage(reader[0]).graph.source(reader[1])
    return "" if source == "?" else f" at {source}"


def placements(backend: BackendLike, mode: ForwardMode, caps: Capabilities, *, trace_device: str = "cpu",
               batch_size: int = 2) -> dict[str, dict[str, Any]]:
    """Per policy: ``{"events": n, "placements": [{buffer, end, placement}]}``, or
    ``{"refused": why}`` when the declaration is earlier than the traced reads.

    Traces the step once (``readfence.core.trace``) and plans every policy from it, as
    ``readfence.graph.lower`` does.
    """
    from readfence.core import trace

    program = trace(backend, mode, batch_size=batch_size, device=trace_device)
    declared, observed = backend.read_effect(mode), program.traced()
    early = [b for b in SHARED_BUFFERS if declared[b] < observed[b]]
    out: dict[str, dict[str, Any]] = {}
    for policy in Policy:
        if policy is not Policy.COARSE and early:
            why = "; ".join(f"{b} declared {declared[b].name} but read until {observed[b].name}{_read_at(program, b)}"
                            for b in early)
            out[policy.name] = {"refused": f"unsound declaration ({why}): lowering refuses it; "
                                           f"{late_read_fix(early[0], observed[early[0]])}"}
            continue
        plan = plan_fences(buffers=SHARED_BUFFERS, declared=declared, caps=caps, policy=policy,
                           last_reads=last_reads(program), observed=observed,
                           graphed=phase_caps(caps, backend, mode).graphs)
        out[policy.name] = {"events": len(plan.points()), "placements": plan.describe()}
    return out


def plan_report(backend: Backend, mode: ForwardMode, *, device: str, caps: Capabilities) -> dict[str, Any]:
    """Everything ``readfence plan`` prints, as plain data (its ``--json`` output).

    >>> from readfence.backends import paged
    >>> r = plan_report(paged(), ForwardMode.DECODE, device="cpu", caps=Capabilities())
    >>> r["end"], r["resolved_end"], r["policies"]["PER_BUFFER"]["events"]
    ('IN_REPLAY', 'IN_REPLAY', 1)
    """
    effect = backend.read_effect(mode)
    run_caps = phase_caps(caps, backend, mode)
    degraded = degrade(effect, run_caps)
    return {
        "spec": str(backend),
        "mode": mode.name,
        "device": device,
        "caps": {"in_graph_events": caps.in_graph_events, "graphs": caps.graphs,
                 "graphed": run_caps.graphs},
        "effect": effect_names(effect),
        "end": effect.end.name,
        "tree": derivation(backend, mode),
        "forced_by": forced_by(backend, mode),
        "resolved": {b: degraded[b].name for b in effect_names(effect)},
        "resolved_end": resolve(effect, owns_publish=True, caps=run_caps).name,
        "policies": placements(backend, mode, caps, trace_device=torch_device(device)),
    }


def shape_plan_report(shape: StepShape, *, device: str, caps: Capabilities, batch_size: int = 2) -> dict[str, Any]:
    """``readfence plan`` for a multi-phase step shape: per policy, the phase that publishes each
    buffer and where that phase's graph records its event, as ``lower_step`` places them.

    A buffer's last read is the maximum (phase, end) position over the phases, ranked by the
    effect each policy places from: the declarations for JOINED and PER_BUFFER, the trace for
    EXACT (a phase that only declares a read does not publish it), none for COARSE (every
    buffer waits for the whole step). ``publishers`` are the declarations' publishers.

    >>> from readfence.graph import parse_step
    >>> r = shape_plan_report(parse_step("eagle(trtllm_mha, paged)").unwrap(), device="cpu", caps=Capabilities())
    >>> r["publishers"]["swa_map"], r["traced"]["swa_map"]
    ('draft_extend', 'target_verify:IN_REPLAY')
    >>> [(row["phase"], row["end"]) for row in r["policies"]["EXACT"]["placements"] if row["buffer"] == "swa_map"]
    [('target_verify', 'IN_REPLAY')]
    """
    from readfence.core import trace

    trace_device = torch_device(device)
    phases = shape.phases
    observed = [trace(ph.backend, ph.mode, batch_size=batch_size, device=trace_device).traced() for ph in phases]
    graph_plans: dict[Any, dict[str, dict[str, Any]]] = {}  # one plan per lowered graph (runner, mode)
    for ph in phases:
        if ph.graph_key not in graph_plans:
            graph_plans[ph.graph_key] = placements(ph.backend, ph.mode, caps, trace_device=trace_device,
                                                   batch_size=batch_size)

    def position(pos: Any) -> str:
        return "NONE" if pos.phase < 0 else f"{phases[pos.phase].name}:{pos.end.name}"

    policies: dict[str, dict[str, Any]] = {}
    for policy in Policy:
        refused = [f"{ph.name}: {graph_plans[ph.graph_key][policy.name]['refused']}" for ph in dict.fromkeys(phases)
                   if "refused" in graph_plans[ph.graph_key][policy.name]]
        if refused:  # lower_step lowers every phase's graph: one refusal refuses the step
            policies[policy.name] = {"refused": refused[0]}
            continue
        rows = []
        for buffer, pos in shape.positions_under(policy, observed).items():
            if pos.phase < 0:
                rows.append({"buffer": buffer, "phase": "-", "end": "NONE",
                             "placement": "never (no phase reads it: no wait)"})
                continue
            ph = phases[pos.phase]
            row = next(r for r in graph_plans[ph.graph_key][policy.name]["placements"] if r["buffer"] == buffer)
            rows.append({"buffer": buffer, "phase": ph.name, "end": row["end"], "placement": row["placement"]})
        # every phase's graph records the events of its own plan; the owner's are waited on
        events = sum(graph_plans[key][policy.name]["events"] for key in dict.fromkeys(ph.graph_key for ph in phases))
        policies[policy.name] = {"events": events, "placements": rows}
    by_phase: dict[str, dict[str, Any]] = {}
    for name, plan in policies.items():
        if "refused" in plan:
            continue
        for row in plan["placements"]:
            if row["phase"] != "-":
                entry = by_phase.setdefault(row["phase"], {}).setdefault(name, {"events": 0, "placements": []})
                entry["placements"].append({k: row[k] for k in ("buffer", "end", "placement")})
    for plans in by_phase.values():
        for entry in plans.values():
            entry["events"] = len({(r["end"], r["placement"]) for r in entry["placements"] if r["end"] != "NONE"})
    declared = shape.positions()
    read = {b: p for b, p in declared.items() if p.phase >= 0}
    end = max(read.values(), default=None)
    return {
        "spec": str(shape),
        "mode": "phases",
        "device": device,
        "caps": {"in_graph_events": caps.in_graph_events, "graphs": caps.graphs},
        "phases": [{"phase": ph.name, "runner": ph.runner, "mode": ph.mode.name, "backend": str(ph.backend),
                    "effect": effect_names(ph.backend.read_effect(ph.mode)),
                    "traced": effect_names(seen)} for ph, seen in zip(phases, observed)],
        "effect": {b: position(p) for b, p in read.items()},
        "traced": {b: position(p) for b, p in publish_positions(observed, SHARED_BUFFERS).items()},
        "end": "NONE" if end is None else position(end),
        "publishers": {b: phases[p.phase].name for b, p in read.items()},
        "policies": policies,
        "policies_by_phase": by_phase,
    }
