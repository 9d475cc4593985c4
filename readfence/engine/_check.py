"""Running an adapted backend: verified with poison (``verify_engine``), and measured side by side
(``compare``), under readfence's policies and under the engine's own runner model.

Both run on the engine's own state (``engine.state``, put back after each run) and model
config, so the engine object reads what the loop writes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import attrs
from returns.pipeline import is_successful
from returns.result import Result

from readfence.core import CapturedStateError, ForwardMode, StageThreadError, StageWriteError
from readfence.core.internal import check_forward_mode, positive_int
from readfence.effects import Failure, Success
from readfence.effects.internal import table
from readfence.graph import Device, LateRead, LoopOptions, LoopResult, Policy, UncapturableStage, UnsoundLowering, run_overlapped, run_serial, verify
from readfence.graph.lowering import torch_device
from readfence.graph.lowering.internal import preserved
from readfence.graph.verification import WORKLOAD

from ._adapter import EngineBackend, check_engine
from ._contract import EngineError
from ._runner import RunnerModel, runner_model

#: The name of the engine runner's row, next to readfence's policies.
RUNNER = "ENGINE RUNNER"

#: The runner model as SGLang configures it by default (no kill switch, prefill read-done on).
SGLANG = RunnerModel()


def _policies(policies: Policy | Iterable[Policy] | None) -> tuple[Policy, ...]:
    if policies is None:
        return tuple(Policy)
    chosen = (policies,) if isinstance(policies, Policy) else tuple(policies)
    if not all(isinstance(p, Policy) for p in chosen):
        raise TypeError(f"policies must be readfence.graph.Policy values, got {policies!r}")
    return chosen


@attrs.frozen
class VerifyRow:
    """One fence of :func:`verify_engine`: readfence's policy or the engine runner, clean or its finding."""

    name: str
    finding: LateRead | None
    poisoned: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return self.finding is None

    def text(self) -> str:
        if self.finding is None:
            return f"clean; poisoned on release: {', '.join(self.poisoned) or 'nothing (released after the whole forward)'}"
        f = self.finding
        if f.kind == "refused":  # nothing ran: say why, not only that the audit refused it
            return f"refused (evidence: {f.evidence}): {f.detail}"
        what = f"{f.kind}" + (f" of {f.buffer!r}" if f.buffer else "") + (f" at step {f.step}" if f.step is not None else "")
        by = f" by {f.stage}: {f.op}" if f.op else ""
        return f"{what}{by} (evidence: {f.evidence})"

    def as_json(self) -> dict[str, Any]:
        out = {"fence": self.name, "verdict": "clean" if self.clean else self.finding.kind,  # type: ignore[union-attr]
               "poisoned": list(self.poisoned), "seconds": round(self.seconds, 3)}
        if self.finding is not None:
            out.update({k: v for k, v in self.finding.as_json().items() if k in ("evidence", "buffer", "step", "stage",
                                                                                 "op", "detail")})
        return out


@attrs.frozen
class EngineVerification:
    """What :func:`verify_engine` found, per fence."""

    backend: str
    mode: ForwardMode
    device: str
    steps: int
    batch_size: int
    rows: tuple[VerifyRow, ...]
    observer: bool

    @property
    def ok(self) -> bool:
        return all(r.clean for r in self.rows)

    def row(self, name: str) -> VerifyRow:
        return next(r for r in self.rows if r.name == name)

    def __str__(self) -> str:
        watch = "poison, guard and the runtime read observer" if self.observer else "poison and guard"
        lines = [f"verified {self.backend} in {self.mode.name} on {self.device}: {self.steps} steps, batch size "
                 f"{self.batch_size}, against the serial run; checks: {watch}"]
        width = max(len(r.name) for r in self.rows)
        lines += [f"  {r.name:<{width}}  {r.text()}" for r in self.rows]
        return "\n".join(lines)


@attrs.frozen
class EngineFindings:
    """A failed :func:`verify_engine`: at least one fence (a policy or the engine's runner) has a finding.

    ``report`` is the whole :class:`EngineVerification`, clean rows included; ``rows`` are the
    fences with a finding, in the order they ran, and ``row`` the first, which ``message`` names.
    Plural, unlike ``readfence.graph.LateRead`` (one finding of one policy): each fence verified
    may have its own, and of every kind ``LateRead`` has (a late read, a write, a refusal...).

    >>> from readfence.engine.reference import minimax_sparse_engine
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     failed = verify_engine(minimax_sparse_engine(), device=dev, policies=[Policy.EXACT], steps=2, batch_size=2).failure()
    >>> print(failed.message)  # doctest: +ELLIPSIS
    MiniMaxSparseBackend in DECODE: 2 of 2 fences with findings; first EXACT: unsound declaration of 'req_to_token' ...
    >>> [r.name for r in failed.rows], failed.report.ok
    (['EXACT', 'ENGINE RUNNER'], False)
    """

    report: EngineVerification = attrs.field()

    @report.validator
    def _has_findings(self, _attribute: attrs.Attribute[EngineVerification], report: EngineVerification) -> None:
        if not isinstance(report, EngineVerification):
            raise TypeError(f"EngineFindings.report must be an EngineVerification, got {report!r} "
                            f"({type(report).__name__})")
        if report.ok:
            raise ValueError(f"EngineFindings.report must have a finding; every fence of {report.backend} is clean")

    @property
    def rows(self) -> tuple[VerifyRow, ...]:
        """The fences with a finding, in the order they ran."""
        return tuple(r for r in self.report.rows if not r.clean)

    @property
    def row(self) -> VerifyRow:
        """The first fence with a finding: the one :attr:`message` names."""
        return self.rows[0]

    @property
    def message(self) -> str:
        r = self.report
        return (f"{r.backend} in {r.mode.name}: {len(self.rows)} of {len(r.rows)} fences with findings; first "
                f"{self.row.name}: {self.row.text()}")

    def __str__(self) -> str:
        return self.message


def verify_engine(engine: EngineBackend, mode: ForwardMode = ForwardMode.DECODE, *, device: Device,
                  policies: Policy | Iterable[Policy] | None = None, runner: RunnerModel | None = SGLANG,
                  steps: int = 8, batch_size: int = 4, seed: int = 0
                  ) -> Result[EngineVerification, EngineFindings]:
    """``readfence.graph.verify`` of ``engine`` under each of ``policies`` (default: all) and under
    the engine's runner model (``runner``; ``None`` leaves it out), on the engine's own state.

    ``Success(verification)`` when every fence ran clean, else ``Failure(EngineFindings(verification))``
    naming the first fence with a finding; either way the verification is the whole table
    (``.failure().report``). A policy the lowering refuses (an unsound declaration) is a finding
    with evidence ``audit``; the runner trusts the declaration as the engine does, so an unsound
    one is caught at run time (poison, the observer).

    >>> from readfence.engine.reference import minimax_sparse_engine
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     result = verify_engine(minimax_sparse_engine(), device=dev, policies=[Policy.PER_BUFFER], steps=2, batch_size=2)
    >>> [(r.name, r.finding.kind, r.finding.evidence) for r in result.failure().report.rows]
    [('PER_BUFFER', 'unsound declaration', 'audit'), ('ENGINE RUNNER', 'late read', 'observer')]
    """
    engine = check_engine(engine)
    mode = check_forward_mode(mode, "verify")
    positive_int("steps", steps)
    common = dict(steps=steps, batch_size=batch_size, device=device, cfg=engine.cfg, state=engine.state,
                  options=attrs.evolve(WORKLOAD, seed=seed))
    targets: list[tuple[str, Any, Policy]] = [(p.name, engine, p) for p in _policies(policies)]
    if runner is not None:
        targets.append((RUNNER, runner_model(engine, runner), Policy.JOINED))
    rows: list[VerifyRow] = []
    observer = torch_device(device) == "cpu"  # the runtime read observer watches every fence there
    for name, target, policy in targets:
        t0 = time.perf_counter()
        with preserved(engine.state):
            try:
                result = verify(target, mode, policy=policy, **common)  # type: ignore[arg-type]
            except EngineError as e:  # the tracer cannot follow the step: nothing to lower
                rows.append(VerifyRow(name, LateRead(engine.name, mode, policy, "refused", "audit", detail=str(e)),
                                      (), time.perf_counter() - t0))
                continue
        if is_successful(result):
            check = result.unwrap()
            rows.append(VerifyRow(name, None, check.checks[0].poisoned, time.perf_counter() - t0))
        else:
            rows.append(VerifyRow(name, result.failure(), (), time.perf_counter() - t0))
    report = EngineVerification(engine.name, mode, device.name, steps, batch_size, tuple(rows), observer)
    return Success(report) if report.ok else Failure(EngineFindings(report))


# ------------------------------------------------------------------------------------------


@attrs.frozen
class CompareRow:
    """One fence of :func:`compare`: throughput, fence slack and correctness, or why it did not run."""

    name: str
    steps_per_s: float | None = None
    slack_ms: float | None = None
    matches_serial: bool | None = None
    violations: int = 0
    refused: str = ""

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Comparison:
    """The engine's runner and readfence's policies on the same loop (:func:`compare`)."""

    backend: str
    mode: ForwardMode
    steps: int
    batch_size: int
    rows: tuple[CompareRow, ...]

    def row(self, name: str) -> CompareRow:
        return next(r for r in self.rows if r.name == name)

    def speedup(self, name: str) -> float | None:
        """Steps/s of ``name`` over COARSE's, measured side by side."""
        base, row = self.row(Policy.COARSE.name).steps_per_s, self.row(name).steps_per_s
        return None if not base or row is None else row / base

    def __str__(self) -> str:
        head = ["fence", "steps/s", "speedup vs COARSE", "mean fence slack (ms)", "matches serial",
                "sanitizer findings"]
        cells = []
        for r in self.rows:
            if r.refused:
                cells.append([r.name, "-", "-", "-", "-", f"not run: {r.refused}"])
                continue
            speed = self.speedup(r.name) if any(x.name == Policy.COARSE.name for x in self.rows) else None
            cells.append([r.name, f"{r.steps_per_s:.1f}", "-" if speed is None else f"{speed:.2f}x",
                          "-" if r.slack_ms is None else f"{r.slack_ms:.3f}", "yes" if r.matches_serial else "NO",
                          str(r.violations) if r.violations else "none"])
        return f"{self.backend} in {self.mode.name}: {self.steps} steps, batch size {self.batch_size}\n" + table(cells, head)


def compare(engine: EngineBackend, mode: ForwardMode = ForwardMode.DECODE, *, device: Device,
            policies: Policy | Iterable[Policy] | None = None, runner: RunnerModel | None = SGLANG,
            steps: int = 20, batch_size: int = 4, seed: int = 0, write_wait_s: float = 0.005,
            repeats: int = 1) -> Comparison:
    """Run ``engine`` overlapped under the engine's runner model and each of ``policies``
    (default: all), side by side on one device: steps/s (1 / the median time between two steps'
    ends), mean fence slack, whether the outputs match the serial run bit for bit, sanitizer
    findings. ``write_wait_s`` is the scheduler's page-table write time (what a fence lets
    overlap the forward). Each fence runs ``repeats`` times, in turn, and its row reports the
    median steps/s and slack (a noisy machine slows one run, not the median). A policy the
    lowering refuses is a row saying why.

    >>> from readfence.engine.reference import trtllm_mha_engine
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     table = compare(trtllm_mha_engine(), device=dev, steps=4, batch_size=2, write_wait_s=0.0)
    >>> [(r.name, r.matches_serial, r.violations) for r in table.rows][:2]
    [('ENGINE RUNNER', True, 0), ('COARSE', True, 0)]
    """
    engine = check_engine(engine)
    mode = check_forward_mode(mode, "run")
    positive_int("steps", steps)
    cfg, state = engine.cfg, engine.state
    common: dict[str, Any] = dict(steps=steps, batch_size=batch_size, cfg=cfg)
    with preserved(state):
        reference = run_serial(engine, mode, state=state, options=LoopOptions(seed=seed), **common)
    targets: list[tuple[str, Any, Policy]] = []
    if runner is not None:
        targets.append((RUNNER, runner_model(engine, runner), Policy.JOINED))
    targets += [(p.name, engine, p) for p in _policies(policies)]
    positive_int("repeats", repeats)
    runs: dict[str, list[LoopResult]] = {name: [] for name, _, _ in targets}
    refused: dict[str, str] = {}
    for _ in range(repeats):  # interleaved: every fence sees the same machine, run by run
        for name, target, policy in targets:
            if name in refused:
                continue
            with preserved(state):
                try:
                    runs[name].append(run_overlapped(target, mode, policy=policy, device=device, state=state,
                                                     options=LoopOptions(seed=seed, write_wait_s=write_wait_s),
                                                     **common))
                except (UnsoundLowering, CapturedStateError, UncapturableStage, StageWriteError, StageThreadError,
                        EngineError) as e:
                    refused[name] = str(e).split(": ", 1)[-1][:160]
    rows = []
    for name, _, _ in targets:
        if name in refused:
            rows.append(CompareRow(name, refused=refused[name]))
            continue
        done = runs[name]
        slacks = [statistics.fmean(r.slack.values()) * 1e3 for r in done if r.slack]
        rows.append(CompareRow(name, statistics.median(r.steps_per_s for r in done),
                               statistics.median(slacks) if slacks else None,
                               all(r.matches(reference) for r in done), sum(len(r.violations) for r in done)))
    return Comparison(engine.name, mode, steps, batch_size, tuple(rows))
