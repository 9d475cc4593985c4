"""Scoring the suite: every case's buggy and fixed version through the audit, verify and the run.

A version is *detected* when any check finds something; a detected buggy version counts towards
*detected / racy*, a detected fixed version is a *false alarm*. Each version is built fresh by its
case's factory and checked on one CPU device; a check that raises is that version's error (not a
detection, and said). A buggy version must also *race* on the device: its overlapped run differs
from the serial one, or its poisoned (held) run does, unless its case says why it cannot.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from readfence.effects.internal import table
from readfence.graph import CpuDevice, Device

from ._case import Case, Finding, Subject

#: The checks a case is scored by, in the order they run: the audit, verify (poison), the overlapped run
#: against the serial one.
CHECKS = ("audit", "verify", "run")


@attrs.frozen
class VersionScore:
    """One version of a case, checked: what each check found (``None``: nothing), the overlapped
    run's first differing step, the evidence that it races, errors, and the time it took."""

    name: str
    racy: bool
    audit: Finding | None = None
    verify: Finding | None = None
    run: Finding | None = None
    differs: int | None = None
    race: str | None = None
    errors: tuple[str, ...] = ()
    seconds: float = 0.0

    def found(self, check: str) -> Finding | None:
        return {"audit": self.audit, "verify": self.verify, "run": self.run}[check]

    @property
    def caught_by(self) -> tuple[str, ...]:
        """The checks that found something, in the order audit, verify, run."""
        return tuple(c for c in CHECKS if self.found(c) is not None)

    @property
    def detected(self) -> bool:
        return bool(self.caught_by)

    @property
    def first(self) -> Finding | None:
        """The finding the table names: the first that names a buffer, else the first."""
        found = [f for c in CHECKS if (f := self.found(c)) is not None]
        return next((f for f in found if f.buffer), found[0] if found else None)


@attrs.frozen
class CaseScore:
    """A case with its two versions scored."""

    case: Case
    buggy: VersionScore
    fixed: VersionScore

    @property
    def races(self) -> bool:
        """Whether the buggy version raced on the device (or its case says why it cannot)."""
        return self.buggy.race is not None or bool(self.case.cpu)

    def rows(self) -> list[dict[str, Any]]:
        """The two versions as ``--json`` rows."""
        out = []
        for version, score in (("buggy", self.buggy), ("fixed", self.fixed)):
            first = score.first
            out.append({
                "name": self.case.name, "version": version, "title": self.case.title, "source": str(self.case.source),
                "racy": score.racy, "detected": score.detected, "caught_by": list(score.caught_by),
                "buffer": None if first is None else first.buffer, "line": None if first is None else first.line,
                "findings": {c: None if (f := score.found(c)) is None else f.detail for c in CHECKS},
                "differs_at_step": score.differs, "races": score.race if score.racy else None,
                "cpu": self.case.cpu or None, "miss": self.case.miss or None, "errors": list(score.errors),
                "seconds": round(score.seconds, 2),
            })
        return out


@attrs.frozen
class SuiteScore:
    """Every case scored, with the totals and the suite's wall time."""

    cases: tuple[CaseScore, ...]
    seconds: float

    @property
    def racy(self) -> int:
        return len(self.cases)

    def detected(self, check: str | None = None) -> int:
        """Buggy versions detected (by ``check`` alone, or by any)."""
        return sum(1 for c in self.cases if (c.buggy.found(check) is not None if check else c.buggy.detected))

    @property
    def fixed(self) -> int:
        return len(self.cases)

    @property
    def false_alarms(self) -> int:
        return sum(1 for c in self.cases if c.fixed.detected)

    @property
    def ok(self) -> bool:
        """Whether the suite holds: no error, no false alarm, every racy version detected (or its case
        says why readfence misses it) and racing on the device (or its case says why it cannot)."""
        return (not self.errors and not self.false_alarms
                and all((c.buggy.detected or c.case.miss) and c.races for c in self.cases))

    @property
    def errors(self) -> list[str]:
        return [f"{c.case.name} ({v.name}): {e}" for c in self.cases for v in (c.buggy, c.fixed) for e in v.errors]

    def as_json(self) -> dict[str, Any]:
        """What ``readfence bench races --json`` prints."""
        return {
            "cases": [row for c in self.cases for row in c.rows()],
            "racy": self.racy, "detected": self.detected(), "fixed": self.fixed, "false_alarms": self.false_alarms,
            "detected_by": {check: self.detected(check) for check in CHECKS},
            "errors": self.errors, "ok": self.ok, "seconds": round(self.seconds, 1),
        }

    def table(self) -> str:
        """The scored table, then the totals."""
        head = ["case", "version", "racy", "caught by", "buffer", "line", "races on the CPU device"]
        cells = []
        for c in self.cases:
            for version, score in (("buggy", c.buggy), ("fixed", c.fixed)):
                first = score.first
                caught = ", ".join(score.caught_by) or ("MISSED" if score.racy else "-")
                if score.errors:
                    caught += " (error)"
                evidence = "-" if not score.racy else score.race or (f"no: {c.case.cpu}" if c.case.cpu else "NOT SHOWN")
                cells.append([c.case.name, version, "yes" if score.racy else "no", caught,
                              "-" if first is None or first.buffer is None else first.buffer,
                              "-" if first is None or not first.line else _short(first.line), evidence])
        lines = [table(cells, head), ""]
        by = ", ".join(f"by {check} {self.detected(check)}/{self.racy}" for check in CHECKS)
        lines.append(f"detected / racy: {self.detected()}/{self.racy} ({by})")
        lines.append(f"false alarms / fixed: {self.false_alarms}/{self.fixed}")
        for c in self.cases:
            if not c.buggy.detected:
                lines.append(f"MISSED: {c.case.name}: {c.case.miss or 'no check found the race'}")
            if not c.races:
                lines.append(f"NOT SHOWN: {c.case.name}: the buggy version did not race on the device")
            if c.fixed.detected:
                lines.append(f"FALSE ALARM: {c.case.name} ({c.fixed.name}): {c.fixed.first.detail}")  # type: ignore[union-attr]
        lines += [f"ERROR: {e}" for e in self.errors]
        lines.append(f"({len(self.cases)} cases in {self.seconds:.1f} s)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _short(line: str, width: int = 60) -> str:
    if len(line) <= width:
        return line
    return "..." + line[-(width - 3):]


def _checked(errors: list[str], what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # a check that raises is the version's error, reported, not a verdict
        errors.append(f"{what} raised {type(e).__name__}: {e} ({traceback.extract_tb(e.__traceback__)[-1].line})")
        return None


def score_version(make: Callable[[], Subject], device: Device, *, racy: bool) -> VersionScore:
    """Build one version and check it three ways on ``device``; for a buggy (``racy``) version,
    find the evidence that it races too."""
    t0 = time.perf_counter()
    errors: list[str] = []
    subject = _checked(errors, "building the version", make)
    if subject is None:
        return VersionScore("?", racy, errors=tuple(errors), seconds=time.perf_counter() - t0)
    audit = _checked(errors, "the audit", subject.audit)
    verify = _checked(errors, "verify", lambda: subject.verify(device))
    outcome = _checked(errors, "the run", lambda: subject.run(device))
    run, differs = (None, None) if outcome is None else (outcome.finding, outcome.differs)
    if run is None and differs is not None:
        run = Finding("run", None, "", f"the overlapped run differs from the serial run at step {differs}")
    race = None
    if racy:
        race = (f"the overlapped run differs from the serial run at step {differs}" if differs is not None
                else _checked(errors, "the race check", lambda: subject.race(device)))
    return VersionScore(subject.name, racy, audit, verify, run, differs, race, tuple(errors),
                        time.perf_counter() - t0)


def score(cases: Iterable[Case], *, device: Device | None = None,
          progress: Callable[[Case, CaseScore], None] | None = None) -> SuiteScore:
    """Score ``cases`` (each version built fresh) on ``device`` (default: a CPU device of its own for
    each version); ``progress(case, score)`` is called after each case.

    >>> from readfence.races import CASES
    >>> suite = score([c for c in CASES if c.name == "trtllm-block-offsets"])
    >>> suite.detected(), suite.false_alarms
    (1, 0)
    """
    chosen: Sequence[Case] = list(cases)
    for c in chosen:
        if not isinstance(c, Case):
            raise TypeError(f"a race case must be a readfence.races.Case, got {c!r} ({type(c).__name__})")
    t0 = time.perf_counter()
    out = []
    for case in chosen:
        scored = CaseScore(case, _on(device, case.buggy, racy=True), _on(device, case.fixed, racy=False))
        out.append(scored)
        if progress is not None:
            progress(case, scored)
    return SuiteScore(tuple(out), time.perf_counter() - t0)


def _on(device: Device | None, make: Callable[[], Subject], *, racy: bool) -> VersionScore:
    # a device of its own per version (by default): a version whose step fails leaves its stream
    # failed, and the next version must not inherit that
    if device is not None:
        return score_version(make, device, racy=racy)
    with CpuDevice() as dev:
        return score_version(make, dev, racy=racy)


__all__ = ["CHECKS", "CaseScore", "SuiteScore", "VersionScore", "score", "score_version"]
