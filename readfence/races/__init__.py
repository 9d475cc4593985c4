"""The races engines shipped: a suite of real fence bugs, each a buggy and a fixed version, scored.

Each :class:`Case` is a race an engine shipped, from a public thread (:class:`Source`), written in
the shape the engine had: SGLang's own classes where they run on the CPU, elsewhere an
engine-style class that follows the engine's code. :func:`score` checks every version three
independent ways (the audit, verify, the overlapped run against the serial run) and totals
*detected / racy* and *false alarms / fixed*; ``readfence bench races`` prints it.

>>> from readfence.races import CASES, score
>>> len(CASES) >= 12
True
"""

from ._case import Case, Finding, RunOutcome, Source, Story, Subject
from ._load import load_cases
from ._runner_cases import CASES as _RUNNERS
from ._score import CHECKS, CaseScore, SuiteScore, VersionScore, score
from ._sglang_cases import CASES as _SGLANG
from ._staging_cases import CASES as _STAGING
from ._subjects import EngineSubject, StagingSubject, StepSubject

#: The suite, in the order ``readfence bench races`` runs it.
CASES: tuple[Case, ...] = (*_SGLANG, *_RUNNERS, *_STAGING)

__all__ = [
    "CASES",
    "CHECKS",
    "Case",
    "CaseScore",
    "EngineSubject",
    "Finding",
    "RunOutcome",
    "Source",
    "StagingSubject",
    "StepSubject",
    "Story",
    "Subject",
    "SuiteScore",
    "VersionScore",
    "load_cases",
    "score",
]
