"""What ``readfence serve`` measures: the serving loop per policy, against its serial reference.

>>> from readfence.backends import paged
>>> from readfence.graph import Policy, Traffic
>>> result = run_serve_policies(paged(), policies=(Policy.EXACT,), device="cpu", steps=12,
...                             traffic=Traffic(rate=1.0, prompt=(4, 8), output=(2, 6)), capture_sizes=(1, 2, 4))
>>> [(r["policy"], r["matches_serial"], r["violations"]) for r in result.rows]
[('COARSE', True, 0), ('EXACT', True, 0)]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from readfence.core import ModelConfig
from readfence.graph import Policy, ServeOptions, Timeline, Traffic, UnsoundLowering, open_device, run_serve, run_serve_serial, verify_serve
from readfence.graph.lowering import torch_device
from readfence.graph.runtime import CappedTimeline
from readfence.graph.runtime import internal as runtime_internal
from readfence.graph.runtime.internal import WaitRecorder, add_step_replays, add_waits

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
    from readfence.graph.runtime import serve_scheduler

    serve_scheduler(target, traffic, capture_sizes, cfg)


def _counts(sizes: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sizes.items()}


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _run_policy(target: Any, policy: Policy, kind: str, *, trace: bool, options: ServeOptions,
                common: dict[str, Any]) -> tuple[Any, str, Timeline | None]:
    """One run of the serving loop under ``policy``: its result, the device's name, its timeline."""
    timeline = CappedTimeline(runtime_internal.TRACE_STEPS) if trace else None
    recorder = WaitRecorder(timeline)
    with open_device(kind) as dev:
        if timeline is not None:
            dev.add_observer(recorder)
        res = run_serve(target, policy=policy, device=dev, options=attrs.evolve(options, timeline=timeline), **common)
        name = dev.name
    if timeline is not None:
        timeline.trim()
        add_waits(timeline, recorder)
        add_step_replays(timeline, res.records)
    return res, name, timeline


@one_intra_op_thread()
def run_serve_policies(
    target: Any,
    *,
    policies: Sequence[Policy],
    device: str = "auto",
    steps: int = 200,
    traffic: Traffic | None = None,
    capture_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    options: ServeOptions | None = None,
    trace: bool = False,
    repeats: int = 1,
    on_policy: Callable[[str], None] | None = None,
) -> ServeReport:
    """Run the serial reference, then the serving loop for COARSE and each of ``policies``
    (sanitizer on), ``repeats`` times, the policies in a rotated order each time. ``options``
    (a ``ServeOptions``: the write work, ``progress``) goes to the reference and to every run
    alike; ``on_policy(name)`` is called before each run. Each row has the ``--json`` keys of
    ``readfence serve``: its figures are medians over the repetitions (a ratio: the median of
    each repetition's ratio, side by side), ``tokens_per_s_runs`` and ``speedup_vs_coarse_runs``
    each repetition's; the correctness keys hold for every one. The timelines are the first
    repetition's. :func:`verify_serving` adds ``verify``'s finding (``--verify``)."""
    traffic = Traffic() if traffic is None else traffic
    opts = attrs.evolve(ServeOptions() if options is None else options, sanitize=True)
    with open_device(device) as dev:
        kind = torch_device(dev)
    common: dict[str, Any] = dict(steps=steps, traffic=traffic, capture_sizes=capture_sizes)
    order = with_baseline(policies)
    rows: dict[str, dict[str, Any]] = {
        p.name: {"policy": p.name, "steps": steps, "prefill_steps": None, "decode_steps": None, "batch_sizes": None,
                 "prefill_batch_sizes": None, "tokens": None, "tokens_per_s": None, "serial_tokens_per_s": None,
                 "speedup_vs_serial": None, "speedup_vs_coarse": None, "mean_slack_ms": None, "host_ms_per_step": None,
                 "matches_serial": True, "first_difference": None, "violations": 0, "findings": [], "error": None,
                 "repeats": repeats, "tokens_per_s_runs": [], "speedup_vs_coarse_runs": []} for p in order}
    runs: dict[str, dict[str, list[float]]] = {p.name: {"serial": [], "slack": [], "host": []} for p in order}
    serial_runs: list[float] = []
    timelines: dict[str, Timeline] = {}
    name = kind
    for rep in range(repeats):
        if on_policy:
            on_policy("serial reference" + (f" (repetition {rep + 1} of {repeats})" if repeats > 1 else ""))
        reference = run_serve_serial(target, device=kind, options=opts, **common)
        serial_runs.append(reference.tokens_per_s)
        turn = order[rep % len(order):] + order[:rep % len(order)]  # each policy runs first in turn
        tps: dict[str, float] = {}
        for policy in turn:
            row = rows[policy.name]
            if row["error"] is not None:
                continue  # refused once, refused every time
            if on_policy:
                on_policy(policy.name)
            try:
                res, name, timeline = _run_policy(target, policy, kind, trace=trace and rep == 0, options=opts,
                                                  common=common)
            except UnsoundLowering as e:
                row["error"] = str(e)
                row["matches_serial"] = False
                continue
            if timeline is not None:
                timelines[policy.name] = timeline
            diff = res.first_difference(reference)
            tps[policy.name] = res.tokens_per_s
            row["tokens_per_s_runs"].append(res.tokens_per_s)
            runs[policy.name]["serial"].append(res.tokens_per_s / reference.tokens_per_s)
            if res.mean_slack is not None:
                runs[policy.name]["slack"].append(res.mean_slack * 1e3)
            if res.host_per_step is not None:
                runs[policy.name]["host"].append(res.host_per_step * 1e3)
            row.update(prefill_steps=res.prefill_steps, decode_steps=res.decode_steps,
                       batch_sizes=_counts(res.batch_sizes), prefill_batch_sizes=_counts(res.prefill_sizes),
                       tokens=res.tokens)
            if diff is not None and row["first_difference"] is None:
                row["first_difference"] = {"step": diff[0], "request": diff[1]}
            row["matches_serial"] = row["matches_serial"] and diff is None
            row["violations"] += len(res.violations)
            row["findings"] += [str(v) for v in res.violations]
        for policy_name, value in tps.items():
            if "COARSE" in tps and tps["COARSE"]:
                rows[policy_name]["speedup_vs_coarse_runs"].append(value / tps["COARSE"])
    serial_tps = _median(serial_runs)
    for policy_name, row in rows.items():
        if row["error"] is not None:
            continue
        row.update(tokens_per_s=_median(row["tokens_per_s_runs"]), serial_tokens_per_s=serial_tps,
                   speedup_vs_serial=_median(runs[policy_name]["serial"]),
                   speedup_vs_coarse=_median(row["speedup_vs_coarse_runs"]),
                   mean_slack_ms=_median(runs[policy_name]["slack"]), host_ms_per_step=_median(runs[policy_name]["host"]))
    serial = {"tokens_per_s": serial_tps, "steps": steps, "tokens_per_s_runs": serial_runs}
    return ServeReport(name, list(rows.values()), timelines, serial)


def verify_serving(report: ServeReport, target: Any, *, policies: Sequence[Policy], device: str, steps: int,
                   traffic: Traffic, capture_sizes: Sequence[int]) -> ServeReport:
    """``report`` with what ``verify`` finds on the serving loop (poison, guard, observer) for
    COARSE and each of ``policies``: its report or its finding, and each row's ``verify``."""
    with open_device(device) as dev:
        result = verify_serve(target, policy=tuple(with_baseline(policies)), steps=steps, device=dev, traffic=traffic,
                              capture_sizes=capture_sizes)
    verify_ok = _ok(result)
    verified = str(result.unwrap()) if verify_ok else str(result.failure())
    clean = {c.policy.name for c in result.unwrap().checks} if verify_ok else set()
    failed = None if verify_ok else result.failure().policy.name
    for row in report.rows:
        row["verify"] = "clean" if row["policy"] in clean else verified if row["policy"] == failed else None
    return attrs.evolve(report, verified=verified, verify_ok=verify_ok)


def _ok(result: Any) -> bool:
    from returns.pipeline import is_successful

    return bool(is_successful(result))
