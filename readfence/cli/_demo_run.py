"""The demo's measurements: the overlapped decode loop per policy, checked against serial.

>>> from readfence.backends import paged
>>> from readfence.graph import Policy
>>> result = run_demo(paged(), policies=(Policy.PER_BUFFER,), device="cpu", steps=3, batch_size=2)
>>> [(r["policy"], r["matches_serial"], r["violations"]) for r in result.rows]
[('COARSE', True, 0), ('PER_BUFFER', True, 0)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from readfence.core import ForwardMode
from readfence.graph import (
    Policy,
    Timeline,
    UnsoundLowering,
    open_device,
    run_overlapped,
    run_serial,
    torch_device,
)

from ._trace import WaitRecorder, add_replays, add_waits

#: A composition whose buffers end at different stages: trtllm_mha snapshots its page-table
#: metadata out of graph (PRE_REPLAY), linear reads its state-slot map in graph (IN_REPLAY).
DEFAULT_SPEC = "hybrid_linear(trtllm_mha, linear)"

#: The forward stream the lowering replays on (``lower``'s default).
FORWARD = "forward"


@attrs.frozen
class DemoResult:
    """What ``run_demo`` measured: the device, one row per policy, the timelines (if traced)."""

    device: str
    caps: Any
    mode: ForwardMode
    rows: list[dict[str, Any]]
    timelines: dict[str, Timeline]

    @property
    def ok(self) -> bool:
        """Every policy matched the serial run and the sanitizer found nothing."""
        return all(r["matches_serial"] and not r["violations"] and not r["error"] for r in self.rows)


def with_baseline(policies: Sequence[Policy]) -> tuple[Policy, ...]:
    """``policies`` with COARSE first (it is the speedup baseline), no duplicates.

    >>> with_baseline([Policy.EXACT, Policy.COARSE])
    (<Policy.COARSE: 'coarse'>, <Policy.EXACT: 'exact'>)
    """
    return (Policy.COARSE,) + tuple(p for p in dict.fromkeys(policies) if p is not Policy.COARSE)


def _run_one(backend: Any, policy: Policy, *, device: str, mode: ForwardMode, trace: bool,
             progress: Callable[[int], None] | None, **kw: Any) -> tuple[Any, Timeline | None, str, Any]:
    timeline = Timeline() if trace else None
    recorder = WaitRecorder()
    with open_device(device) as dev:
        if trace:
            dev.add_observer(recorder)
        try:
            res = run_overlapped(backend, mode, policy=policy, device=dev, sanitize=True,
                                 progress=progress, timeline=timeline, **kw)
        finally:
            if trace:
                dev.remove_observer(recorder)
        if timeline is not None:
            add_waits(timeline, recorder)
            add_replays(timeline, FORWARD, graphed=mode.uses_graph and dev.caps.graphs)
        return res, timeline, dev.name, dev.caps


def run_demo(
    backend: Any,
    *,
    policies: Sequence[Policy],
    device: str = "auto",
    steps: int = 100,
    batch_size: int = 4,
    seed: int = 0,
    write_cost: int = 0,
    write_wait_s: float = 0.0,
    mode: ForwardMode = ForwardMode.DECODE,
    trace: bool = False,
    progress: Callable[[int], None] | None = None,
    on_policy: Callable[[str], None] | None = None,
) -> DemoResult:
    """Run the serial reference, then the overlapped loop for COARSE and each of ``policies``.

    Each row has ``policy``, ``steps_per_s``, ``speedup_vs_coarse``, ``mean_slack_ms``,
    ``matches_serial``, ``violations`` (how many sanitizer findings), ``findings`` (their
    messages) and ``error`` (why lowering was refused, else ``None``). ``write_wait_s`` makes each page-table write take that long without using
    the CPU (a stand-in for a copy engine, so overlap shows on a CPU device); ``write_cost`` adds
    synthetic scheduler work to each page-table write (see ``decode_loop``). ``progress(i)`` is
    called after every overlapped step; ``on_policy(name)`` before each run.
    """
    if on_policy:
        on_policy("serial reference")
    kw: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "seed": seed}
    with open_device(device) as dev:  # resolve ``auto`` once: the reference runs where the loop runs
        device = torch_device(dev)
    reference = run_serial(backend, mode, device=device, **kw)
    rows, timelines = [], {}
    dev_name, caps = device, None
    for policy in with_baseline(policies):
        if on_policy:
            on_policy(policy.name)
        row: dict[str, Any] = {"policy": policy.name, "steps_per_s": None, "speedup_vs_coarse": None,
                               "mean_slack_ms": None, "matches_serial": False, "violations": 0,
                               "findings": [], "error": None}
        try:
            res, timeline, dev_name, caps = _run_one(backend, policy, device=device, mode=mode,
                                                     trace=trace, progress=progress,
                                                     write_cost=write_cost, write_wait_s=write_wait_s, **kw)
        except UnsoundLowering as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        if timeline is not None:
            timelines[policy.name] = timeline
        row.update(
            steps_per_s=res.steps_per_s,
            mean_slack_ms=None if res.mean_slack is None else res.mean_slack * 1e3,
            matches_serial=res.matches(reference),
            violations=len(res.violations),
            findings=[str(v) for v in res.violations],
        )
        rows.append(row)
    base = rows[0]["steps_per_s"]
    for row in rows:
        if base and row["steps_per_s"] is not None:
            row["speedup_vs_coarse"] = row["steps_per_s"] / base
    return DemoResult(dev_name, caps, mode, rows, timelines)
