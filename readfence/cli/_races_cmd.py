"""``readfence bench races``: score readfence on the races engines shipped (``readfence.races``).

Every case's buggy and fixed version runs through the audit, verify and the overlapped run
against the serial one; the table says, per version, what caught it, the buffer and the line
it names, and whether the buggy version raced on the CPU device; then *detected / racy* and
*false alarms / fixed*. ``--json`` prints the same as a document; ``--cases MODULE:ATTR`` scores
cases written elsewhere (see ``readfence.races.Case``). Exit status 1 when the suite does not hold
(a false alarm, a miss its case does not explain, a buggy version that did not race, an error).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from ._errors import InputError
from ._params import echo_json, importable_here


def bench_races(*, quick: bool, as_json: bool, refs: Sequence[str]) -> None:
    """Score the suite (or the cases ``refs`` name), print it, exit 1 unless it holds."""
    from readfence.races import CASES, load_cases, score

    if refs:
        cases = []
        for ref in refs:
            try:
                with importable_here():
                    cases += load_cases(ref)
            except ValueError as e:
                raise InputError(str(e)) from None
        if quick:
            cases = [c for c in cases if c.quick] or cases
    else:
        cases = [c for c in CASES if c.quick] if quick else list(CASES)

    def progress(case: object, scored: object) -> None:
        if not as_json:
            from readfence.races import CaseScore

            assert isinstance(scored, CaseScore)
            seen = "caught by " + ", ".join(scored.buggy.caught_by) if scored.buggy.detected else "MISSED"
            click.echo(f"{scored.case.name}: buggy {seen}; fixed "
                       f"{'FALSE ALARM' if scored.fixed.detected else 'accepted'} "
                       f"({scored.buggy.seconds + scored.fixed.seconds:.1f} s)")
            sys.stdout.flush()

    if not as_json:
        click.echo(f"scoring {len(cases)} race case(s), each a buggy and a fixed version: the audit, verify and the "
                   f"overlapped run against the serial run, on the CPU device")
    suite = score(cases, progress=progress)
    if as_json:
        echo_json(suite.as_json())
    else:
        click.echo("")
        click.echo(suite.table())
    if not suite.ok:
        sys.exit(1)
