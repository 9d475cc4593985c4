"""Race cases written outside readfence, as a user writes them for ``--cases``: subjects whose checks
answer at once, so that the scoring, the table, the JSON and the command line are tested in
milliseconds. ``CASES`` holds one of each outcome."""

from __future__ import annotations

import attrs

from readfence.races import Case, Finding, RunOutcome, Source, Story


@attrs.frozen
class Answers:
    """A subject whose checks say what they were told to."""

    name: str
    audit_finds: bool = False
    verify_finds: bool = False
    run_differs: bool = False
    races: bool = False

    def _found(self, check: str, yes: bool) -> Finding | None:
        return Finding(check, "req_to_token", "mine.py:12", f"{check} found it") if yes else None

    def audit(self):
        return self._found("audit", self.audit_finds)

    def verify(self, device):
        return self._found("verify", self.verify_finds)

    def run(self, device):
        return RunOutcome(1 if self.run_differs else None, None)

    def race(self, device):
        return "the poisoned run differs from the serial run at step 0" if self.races else None


SOURCE = Source("example/engine", 1, "engine/runner.py", "Runner.replay")
STORY = Story("it published early", "the scheduler wrote under the replay", "audit_runner says so")

CAUGHT = Case("caught", "a race every check catches", SOURCE, STORY,
              buggy=lambda: Answers("early", audit_finds=True, verify_finds=True, races=True),
              fixed=lambda: Answers("late"), quick=True)
MISSED = Case("missed", "a race no check catches", SOURCE, STORY,
              buggy=lambda: Answers("early", races=True), fixed=lambda: Answers("late"),
              miss="the read is in a kernel no check sees")
ALARM = Case("alarm", "a fixed version a check flags", SOURCE, STORY,
             buggy=lambda: Answers("early", run_differs=True), fixed=lambda: Answers("late", audit_finds=True))
QUIET = Case("quiet", "a buggy version that does not race", SOURCE, STORY,
             buggy=lambda: Answers("early", audit_finds=True), fixed=lambda: Answers("late"))


def broken() -> Answers:
    raise RuntimeError("the engine's class cannot be built here")


BROKEN = Case("broken", "a version that cannot be built", SOURCE, STORY, buggy=broken, fixed=lambda: Answers("late"))

CASES = [CAUGHT, MISSED, ALARM, QUIET, BROKEN]
GOOD = {"caught": CAUGHT}


def cases():
    return [CAUGHT]
