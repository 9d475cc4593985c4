"""What ``readfence serve`` measures: the serving loop per policy, against its serial reference.

>>> from readfence.backends import paged
>>> from readfence.graph import Policy, Traffic
>>> result = run_serve_policies(paged(), policies=(Policy.EXACT,), device="cpu", steps=12,
...                             traffic=Traffic(rate=1.0, prompt=(4, 8), output=(2, 6)), capture_sizes=(1, 2, 4))
>>> [(r["policy"], r["matches_serial"], r["violations"]) for r in result.rows]
[('COARSE', True, 0), ('EXACT', True, 0)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from readfence.core import ModelConfig
from readfence.graph import (
    Policy,
    Timeline,
    Traffic,
    UnsoundLowering,
    open_device,
    run_serve,
    run_serve_serial,
    torch_device,
    verify,
)
from readfence.graph.runtime import internal as runtime_internal
from readfence.graph.runtime.internal import CappedTimeline, WaitRecorder, add_step_replays, add_waits

from ._demo_run import with_baseline
from ._torch_threads import one_intra_op_thread

__all__ = ["ServeReport", "check_serving", "run_serve_policies"]


@attrs.frozen
class ServeReport:
    """One row per policy (COARSE first), the timelines (if traced), the serial reference's
    figures, and ``verify``'s verdict on the loop (if asked)."""

    device: str
    rows: list[dict[str, Any]]
    timelines: dict[str, Timeline]
    serial: dict[str, Any]
    verified: str | None = None  # verify's report, or its finding
    verify_ok: bool = True

    @property
    def ok(self) -> bool:
        """Every policy matched the serial run, the sanitizer found nothing, verify was clean."""
        return self.verify_ok and all(r["matches_serial"] and not r["violations"] and not r["error"] for r in self.rows)


def check_serving(target: Any, traffic: Traffic, capture_sizes: Sequence[int], cfg: ModelConfig | None = None) -> None:
    """``ValueError`` (saying why) unless ``target`` can serve ``traffic`` with ``capture_sizes``
    on the model: the sizes fit it (and a ``per_stream`` group's members), the requests fit its
    context.

    >>> from readfence.graph import eagle
    >>> from readfence.backends import paged
    >>> check_serving(eagle(paged(), paged()), Traffic(prompt=(4, 40)), (1, 2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: a request of the traffic may need 40 prompt positions ... the model holds cfg.max_ctx=64: ...
    """
    from readfence.graph import serve_scheduler

    serve_scheduler(target, traffic, capture_sizes, cfg)


def _counts(sizes: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sizes.items()}


@one_intra_op_thread()
def run_serve_policies(
    target: Any,
    *,
    policies: Sequence[Policy],
    device: str = "auto",
    steps: int = 200,
    traffic: Traffic | None = None,
    capture_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    write_wait_s: float = 0.0,
    trace: bool = False,
    check: bool = False,
    cfg: ModelConfig | None = None,
    progress: Callable[[int], None] | None = None,
    on_policy: Callable[[str], None] | None = None,
) -> ServeReport:
    """Run the serial reference, then the serving loop for COARSE and each of ``policies``
    (sanitizer on); with ``check``, ``verify`` on the serving loop too (poison, guard,
    observer). Each row has the ``--json`` keys of ``readfence serve``."""
    traffic = Traffic() if traffic is None else traffic
    with open_device(device) as dev:
        kind = torch_device(dev)
    if on_policy:
        on_policy("serial reference")
    common: dict[str, Any] = dict(steps=steps, traffic=traffic, capture_sizes=capture_sizes, cfg=cfg)
    reference = run_serve_serial(target, device=kind, write_wait_s=write_wait_s, progress=progress, **common)
    serial = {"tokens_per_s": reference.tokens_per_s, "steps": reference.steps}
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Timeline] = {}
    name = kind
    for policy in with_baseline(policies):
        if on_policy:
            on_policy(policy.name)
        row: dict[str, Any] = {"policy": policy.name, "steps": steps, "prefill_steps": None, "decode_steps": None,
                               "batch_sizes": None, "prefill_batch_sizes": None, "tokens": None, "tokens_per_s": None,
                               "serial_tokens_per_s": reference.tokens_per_s, "speedup_vs_serial": None,
                               "speedup_vs_coarse": None, "mean_slack_ms": None, "host_ms_per_step": None,
                               "matches_serial": False, "first_difference": None, "violations": 0, "findings": [],
                               "error": None}
        timeline = CappedTimeline(runtime_internal.TRACE_STEPS) if trace else None
        recorder = WaitRecorder(timeline)
        try:
            with open_device(kind) as dev:
                name = dev.name
                if timeline is not None:
                    dev.add_observer(recorder)
                res = run_serve(target, policy=policy, device=dev, timeline=timeline, write_wait_s=write_wait_s,
                                progress=progress, **common)
        except UnsoundLowering as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        if timeline is not None:
            timeline.trim()
            add_waits(timeline, recorder)
            add_step_replays(timeline, res.records)
            timelines[policy.name] = timeline
        diff = res.first_difference(reference)
        row.update(prefill_steps=res.prefill_steps, decode_steps=res.decode_steps, batch_sizes=_counts(res.batch_sizes),
                   prefill_batch_sizes=_counts(res.prefill_sizes), tokens=res.tokens, tokens_per_s=res.tokens_per_s,
                   speedup_vs_serial=res.tokens_per_s / reference.tokens_per_s,
                   mean_slack_ms=None if res.mean_slack is None else res.mean_slack * 1e3,
                   host_ms_per_step=None if res.host_per_step is None else res.host_per_step * 1e3,
                   matches_serial=diff is None,
                   first_difference=None if diff is None else {"step": diff[0], "request": diff[1]},
                   violations=len(res.violations), findings=[str(v) for v in res.violations])
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        if base and row["tokens_per_s"] is not None:
            row["speedup_vs_coarse"] = row["tokens_per_s"] / base
    verified, verify_ok = None, True
    if check:
        if on_policy:
            on_policy("verify")
        with open_device(kind) as dev:
            result = verify(target, policy=tuple(with_baseline(policies)), steps=steps, device=dev, cfg=cfg,
                            traffic=traffic, capture_sizes=capture_sizes)
        verify_ok = _ok(result)
        verified = str(result.unwrap()) if verify_ok else str(result.failure())
        clean = {c.policy.name for c in result.unwrap().checks} if verify_ok else set()
        failed = None if verify_ok else result.failure().policy.name
        for row in rows:
            row["verify"] = "clean" if row["policy"] in clean else verified if row["policy"] == failed else None
    return ServeReport(name, rows, timelines, serial, verified, verify_ok)


def _ok(result: Any) -> bool:
    from returns.pipeline import is_successful

    return bool(is_successful(result))
