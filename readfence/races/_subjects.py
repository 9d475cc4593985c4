"""The kinds of :class:`~readfence.races.Subject` a case is built from, one per part of the protocol.

* :class:`EngineSubject`: an adapted backend in one mode, replayed by its engine's runner
  (``readfence.engine.RunnerModel``: its declaration, its publish points, its mailbox);
* :class:`StepSubject`: an engine's step of several phases on several runners, whose scheduler
  waits on one runner's event (``readfence.engine.runner_step``);
* :class:`StagingSubject`: a backend whose scheduler stages each step's shared state in host
  buffers read by an asynchronous copy (``readfence.graph.runtime.Staging`` or an engine's ring).

Each checks itself three independent ways: the audit (``audit_runner``, ``check_staging``: nothing
runs), verify (poison on release, the write guard and the read observer; for staging, the copies
held as late as the host's own waits allow) and the overlapped run against the serial run with
the race sanitizer. ``race`` is the deterministic evidence that a version races: the poisoned
run (or the held one) differs from the serial run.
"""

from __future__ import annotations

import inspect
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from returns.pipeline import is_successful
from returns.result import Result

from readfence.backends import Backend
from readfence.core import ForwardMode, ModelConfig
from readfence.engine import (
    EngineBackend,
    RunnerAudit,
    RunnerModel,
    RunnerPhase,
    RunnerUnsound,
    audit_runner,
    runner_model,
    runner_step,
)
from readfence.graph import Device, DeviceError, LateRead, LoopOptions, LoopResult, Policy, Violation, make_state, run_overlapped, run_serial, verify
from readfence.graph.lowering.internal import preserved
from readfence.graph.runtime import StagingRing, check_staging
from readfence.graph.runtime.internal import same_logits
from readfence.graph.verification import WORKLOAD

from ._case import Finding, RunOutcome

#: The loops' size: two requests, a few steps (the suite runs in minutes on two cores).
STEPS, BATCH_SIZE = 2, 2


def short_path(text: str) -> str:
    """``text`` with its absolute path cut to the path's package folder on (``readfence/...``,
    ``sglang/...``), so that a line reads the same on every machine.

    >>> short_path("/x/site-packages/sglang/srt/a.py:3 in f"), short_path(f"{_PACKAGE_HOME}readfence/core/b.py:9")
    ('sglang/srt/a.py:3 in f', 'readfence/core/b.py:9')
    """
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in text:
            head, _, tail = text.rpartition(marker)
            return head[: head.rfind(" ") + 1] + tail if " " in head else tail
    # the folder that holds the package (a checkout, whatever its name: a clone is ``readfence/``
    # too), not the first folder of that name on the path
    return text.replace(_PACKAGE_HOME, "")


#: The folder that holds the ``readfence`` package, with its trailing separator.
_PACKAGE_HOME = str(pathlib.Path(__file__).resolve().parents[2]) + "/"


def _audited(result: Result[RunnerAudit, RunnerUnsound]) -> Finding | None:
    """What ``audit_runner`` found, as a finding naming the buffer and the reading op's line."""
    if is_successful(result):
        return None
    failed = result.failure()
    row = failed.row
    if row is None:  # a stale event: every buffer the step reads is released before it runs
        read = [r.buffer for r in failed.report.rows]
        return Finding("audit", read[0] if read else None, "the runner's mailbox", failed.message)
    return Finding("audit", row.buffer, short_path(row.where) or f"{row.method}: {row.op}", short_path(failed.message))


def _late(check: str, found: LateRead) -> Finding:
    line = f"{found.stage}: {found.op}" if found.op else (found.stage or "")
    return Finding(check, found.buffer, line, str(found))


def _violation(found: Violation) -> Finding:
    return Finding("run", found.buffer, found.reading_node, str(found))


def _first_difference(run: LoopResult, serial: LoopResult) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(run.logits, serial.logits)) if not same_logits(a, b)), None)


def _poisoned(differs: int | None) -> str | None:
    return None if differs is None else f"the poisoned run differs from the serial run at step {differs}"


class EngineSubject:
    """An adapted backend (``make()`` builds it) in ``mode``, replayed by its engine's runner as
    ``model`` says (a :class:`~readfence.engine.RunnerModel`, or a function of the adapted
    backend giving one: a runner whose publish point depends on what the backend says of
    itself); ``name`` says which version it is."""

    def __init__(self, name: str, make: Callable[[], EngineBackend], mode: ForwardMode = ForwardMode.DECODE,
                 model: RunnerModel | Callable[[EngineBackend], RunnerModel] | None = None, *, steps: int = STEPS,
                 batch_size: int = BATCH_SIZE) -> None:
        self.name, self.make, self.mode = name, make, mode
        self._model = RunnerModel() if model is None else model
        self.steps, self.batch_size = steps, batch_size
        self._engine: EngineBackend | None = None
        self._serial: LoopResult | None = None

    @property
    def engine(self) -> EngineBackend:
        if self._engine is None:
            self._engine = self.make()
        return self._engine

    @property
    def model(self) -> RunnerModel:
        return self._model if isinstance(self._model, RunnerModel) else self._model(self.engine)

    def _common(self) -> dict[str, Any]:
        e = self.engine
        return dict(steps=self.steps, batch_size=self.batch_size, cfg=e.cfg, state=e.state)

    def audit(self) -> Finding | None:
        return _audited(audit_runner(self.engine, self.mode, model=self.model, batch_size=self.batch_size))

    def verify(self, device: Device) -> Finding | None:
        result = verify(runner_model(self.engine, self.model), self.mode, policy=Policy.JOINED, device=device,
                        **self._common())
        return None if is_successful(result) else _late("verify", result.failure())

    def serial(self) -> LoopResult:
        """The serial reference on the engine's state (run once)."""
        if self._serial is None:
            with preserved(self.engine.state):
                self._serial = run_serial(self.engine, self.mode, **self._common())
        return self._serial

    def run(self, device: Device) -> RunOutcome:
        e, common, serial = self.engine, self._common(), self.serial()
        with preserved(e.state):
            try:
                run = run_overlapped(runner_model(e, self.model), self.mode, policy=Policy.JOINED, device=device,
                                     **common)
            except DeviceError as refused:  # a wait readfence refuses to bind (a generation recorded again)
                return RunOutcome(None, Finding("run", None, "the scheduler's wait", f"refused: {refused}"))
        found = _violation(run.violations[0]) if run.violations else None
        return RunOutcome(_first_difference(run, serial), found)

    def race(self, device: Device) -> str | None:
        with preserved(self.engine.state):
            poisoned = run_overlapped(runner_model(self.engine, self.model), self.mode, policy=Policy.JOINED,
                                      device=device, options=LoopOptions(check=True, sanitize=False), **self._common())
        return _poisoned(_first_difference(poisoned, self.serial()))


class StepSubject:
    """An engine's step of several phases (``make()`` builds them, bound to one state), whose
    scheduler waits on phase ``waits_on``'s event."""

    def __init__(self, name: str, make: Callable[[], Sequence[RunnerPhase]], waits_on: str, *, steps: int = STEPS,
                 batch_size: int = BATCH_SIZE) -> None:
        self.name, self.make, self.waits_on = name, make, waits_on
        self.steps, self.batch_size = steps, batch_size
        self._phases: tuple[RunnerPhase, ...] | None = None
        self._serial: LoopResult | None = None

    @property
    def phases(self) -> tuple[RunnerPhase, ...]:
        if self._phases is None:
            self._phases = tuple(self.make())
        return self._phases

    def _common(self) -> dict[str, Any]:
        first = self.phases[0].engine
        return dict(steps=self.steps, batch_size=self.batch_size, cfg=first.cfg, state=first.state)

    def audit(self) -> Finding | None:
        return _audited(audit_runner(self.phases, publisher=self.waits_on, batch_size=self.batch_size))

    def verify(self, device: Device) -> Finding | None:
        result = verify(runner_step(self.phases, self.waits_on), policy=Policy.JOINED, device=device,
                        options=attrs.evolve(WORKLOAD, UNSAFE_skip_soundness_check=True), **self._common())
        return None if is_successful(result) else _late("verify", result.failure())

    def serial(self) -> LoopResult:
        """The serial reference of the step (run once)."""
        if self._serial is None:
            common = self._common()
            with preserved(common["state"]):
                self._serial = run_serial(runner_step(self.phases, self.waits_on), **common)
        return self._serial

    def _overlapped(self, device: Device, options: LoopOptions | None = None) -> LoopResult:
        common = self._common()
        with preserved(common["state"]):
            return run_overlapped(runner_step(self.phases, self.waits_on), policy=Policy.JOINED, device=device,
                                  options=attrs.evolve(options or LoopOptions(), UNSAFE_skip_soundness_check=True), **common)

    def run(self, device: Device) -> RunOutcome:
        serial, run = self.serial(), self._overlapped(device)
        found = _violation(run.violations[0]) if run.violations else None
        return RunOutcome(_first_difference(run, serial), found)

    def race(self, device: Device) -> str | None:
        return _poisoned(_first_difference(self._overlapped(device, LoopOptions(check=True, sanitize=False)), self.serial()))


@attrs.frozen
class _Held:
    """``ring`` with its copies held (see ``readfence.graph.runtime.Staging``)."""

    ring: StagingRing

    @property
    def slots(self) -> int | None:
        return self.ring.slots

    @property
    def held(self) -> bool:
        return True

    def slot(self, step: int) -> int:
        return self.ring.slot(step)

    def waited(self, step: int) -> int | None:
        return self.ring.waited(step)


def source_line(fn: Callable[..., Any]) -> str:
    """``file:line`` of ``fn``'s definition (what a finding names as the user's line), the file
    from its package's folder on.

    >>> source_line(source_line) == f"readfence/races/_subjects.py:{source_line.__code__.co_firstlineno}"
    True
    """
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", repr(fn))
    return short_path(f"{code.co_filename}:{code.co_firstlineno}")


class StagingSubject:
    """``backend`` (readfence's, over a fresh state) with its scheduler staging each step's shared
    state in the host buffers of ``ring``; ``buffer`` names what the engine stages there and
    ``filled_by`` is the engine's method that fills it (the user's line)."""

    def __init__(self, name: str, backend: Callable[[], Backend], ring: Callable[[], StagingRing], *, buffer: str,
                 filled_by: Callable[..., Any], steps: int = 6, batch_size: int = BATCH_SIZE,
                 cfg: ModelConfig | None = None) -> None:
        self.name, self.backend, self.ring, self.buffer = name, backend, ring, buffer
        self.line = source_line(filled_by)
        self.steps, self.batch_size = steps, batch_size
        self.cfg = ModelConfig(layers=2, max_reqs=4, max_ctx=16) if cfg is None else cfg
        self._serial: LoopResult | None = None

    def audit(self) -> Finding | None:
        found = check_staging(self.ring(), steps=max(self.steps, 8))
        return None if found is None else Finding("audit", self.buffer, self.line, str(found))

    def _run(self, device: Device, ring: StagingRing) -> tuple[LoopResult, LoopResult]:
        common = dict(steps=self.steps, batch_size=self.batch_size, cfg=self.cfg)
        if self._serial is None:
            self._serial = run_serial(self.backend(), **common)  # type: ignore[arg-type]
        serial = self._serial
        run = run_overlapped(self.backend(), policy=Policy.PER_BUFFER, device=device, state=make_state(self.cfg),
                             options=LoopOptions(staging=ring, UNSAFE_skip_soundness_check=True),
                             **common)  # type: ignore[arg-type]
        return run, serial

    def _held(self, device: Device) -> int | None:
        run, serial = self._run(device, _Held(self.ring()))
        return _first_difference(run, serial)

    def verify(self, device: Device) -> Finding | None:
        differs = self._held(device)
        if differs is None:
            return None
        return Finding("verify", self.buffer, self.line,
                       f"with each step's copy held until the host waits on that step, the outputs differ from the "
                       f"serial run at step {differs}: a refill of {self.buffer} overtook the copy of an earlier step")

    def run(self, device: Device) -> RunOutcome:
        run, serial = self._run(device, self.ring())
        found = None
        if run.violations:
            v = run.violations[0]
            found = Finding("run", self.buffer, self.line, str(v))
        return RunOutcome(_first_difference(run, serial), found)

    def race(self, device: Device) -> str | None:
        differs = self._held(device)
        return None if differs is None else f"the held run differs from the serial run at step {differs}"


__all__ = ["BATCH_SIZE", "STEPS", "EngineSubject", "StagingSubject", "StepSubject", "short_path", "source_line"]
