"""The demo's measurements: the overlapped decode loop per policy, checked against serial.

>>> from readfence.backends import paged
>>> from readfence.graph import Policy
>>> result = run_demo(paged(), policies=(Policy.PER_BUFFER,), device="cpu", steps=3, batch_size=2)
>>> [(r["policy"], r["matches_serial"], r["violations"]) for r in result.rows]
[('COARSE', True, 0), ('PER_BUFFER', True, 0)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from readfence.core import ForwardMode
from readfence.graph import LoopOptions, Policy, Timeline, UnsoundLowering, open_device, run_overlapped, run_serial, run_traced
from readfence.graph.lowering import torch_device
from readfence.graph.runtime import CappedTimeline
from readfence.graph.runtime import internal as runtime_internal

from ._params import DEFAULT_SPEC
from ._torch_threads import one_intra_op_thread

if TYPE_CHECKING:
    from readfence.effects import Capabilities
    from readfence.graph.steps import Target
    from readfence.parallel import Rank

__all__ = ["DEFAULT_SPEC", "DemoResult", "run_demo", "with_baseline"]


@attrs.frozen
class DemoResult:
    """What ``run_demo`` measured: the device, one row per policy, the timelines (if traced),
    and the steps/s of the serial reference (no overlap: the baseline the loop must beat)."""

    device: str
    caps: Capabilities | None
    mode: ForwardMode
    rows: list[dict[str, Any]]
    timelines: dict[str, Timeline]
    serial_steps_per_s: float | None = None

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


def _run_one(backend: Any, policy: Policy, *, device: str, trace: bool, device_options: Mapping[str, Any],
             **kw: Any) -> tuple[Any, Timeline | None, str, Any]:
    with open_device(device, **device_options) as dev:
        if trace:  # each run its own timeline, of the first steps the trace keeps
            options = attrs.evolve(kw.pop("options"), timeline=CappedTimeline(runtime_internal.TRACE_STEPS))
            traced = run_traced(backend, policy=policy, device=dev, options=options, **kw)
            return traced.result, traced.timeline, dev.name, dev.caps
        res = run_overlapped(backend, policy=policy, device=dev, **kw)
        return res, None, dev.name, dev.caps


@one_intra_op_thread()
def run_demo(
    backend: Target,
    *,
    policies: Sequence[Policy],
    device: str = "auto",
    steps: int = 100,
    batch_size: int = 4,
    options: LoopOptions | None = None,
    trace: bool = False,
    progress: Callable[[int], None] | None = None,
    on_policy: Callable[[str], None] | None = None,
    rank: Rank | None = None,
) -> DemoResult:
    """Run the serial reference, then the overlapped loop for COARSE and each of ``policies``.

    Each row has ``policy``, ``steps_per_s``, ``speedup_vs_coarse``, ``speedup_vs_serial``,
    ``serial_steps_per_s``, ``mean_slack_ms``, ``matches_serial``, ``violations`` (how many
    sanitizer findings), ``findings`` (their messages) and ``error`` (why lowering was refused,
    else ``None``). ``options`` (a ``LoopOptions``: the seed, the synthetic work on each
    page-table write) goes to the serial reference and to every run alike: ``write_wait_s`` makes
    each page-table write take that long without using the CPU (a stand-in for a copy engine, so
    overlap shows on a CPU device), ``write_cost`` adds synthetic scheduler work to each
    page-table write (see ``decode_loop``); the serial reference does the same work before each
    step's writes, on one thread: it is the no-overlap baseline. Torch runs on one intra-op
    thread meanwhile. ``progress(i)`` is called after every step; ``on_policy(name)`` before
    each run. ``rank`` (a ``readfence.parallel.Rank``) runs one tensor-parallel rank: its shard
    of the model and its device's options (a timeout, a GPU index).
    """
    if on_policy:
        on_policy("serial reference")
    mode = ForwardMode.DECODE
    device_options: dict[str, Any] = {} if rank is None else dict(rank.device_options())
    cfg = None if rank is None else rank.cfg
    opts = attrs.evolve(LoopOptions() if options is None else options, progress=progress, sanitize=True)
    kw: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "cfg": cfg, "options": opts}
    with open_device(device, **device_options) as dev:  # resolve ``auto`` once: the reference runs where the loop runs
        device = torch_device(dev)
    reference = run_serial(backend, mode, device=device, **kw)
    serial = reference.steps_per_s
    rows, timelines = [], {}
    dev_name, caps = device, None
    for policy in with_baseline(policies):
        if on_policy:
            on_policy(policy.name)
        row: dict[str, Any] = {"policy": policy.name, "steps_per_s": None, "speedup_vs_coarse": None,
                               "speedup_vs_serial": None, "serial_steps_per_s": serial, "mean_slack_ms": None,
                               "matches_serial": False, "violations": 0, "findings": [], "error": None}
        try:
            res, timeline, dev_name, caps = _run_one(backend, policy, device=device, trace=trace,
                                                     device_options=device_options, **kw)
        except UnsoundLowering as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        if timeline is not None:
            timelines[policy.name] = timeline
        row.update(
            steps_per_s=res.steps_per_s,
            speedup_vs_serial=res.steps_per_s / serial,
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
    return DemoResult(dev_name, caps, mode, rows, timelines, serial)
