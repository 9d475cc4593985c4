"""Every command that takes a spec reads it with the one grammar and reports a bad one the same
way: exit status 2, one ``Error:`` line naming the option, the spec, the position and what was
expected, whether the spec is a backend or a step shape."""

from __future__ import annotations

import pytest

from readfence.graph import parse_target

COMMANDS = {
    "plan": lambda spec: ["plan", spec],
    "audit": lambda spec: ["audit", spec],
    "verify": lambda spec: ["verify", spec],
    "demo": lambda spec: ["demo", "--spec", spec],
}

BAD_SPECS = [
    ("tbo(", 4),                                    # a backend cut short
    ("tbo(paged,,)", 10),                           # punctuation
    ("paged(x=1)", 6),                              # a keyword a leaf does not take
    ("medusa(paged)", 0),                           # no such backend or step shape
    ("eagle(paged)", 0),                            # too few backends
    ("eagle(paged, paged, draft_steps=-1)", 32),    # draft_steps below the range ...
    ("eagle(paged, paged, draft_steps=0)", 32),     # ... the same kind of error at 0
    ("eagle(paged, paged, draft_steps=65)", 32),    # ... and above it
    ("eagle(ngram(paged), paged)", 6),              # a step shape is not an argument
]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("spec,position", BAD_SPECS)
def test_a_bad_spec_is_one_error_line_with_its_position(cli, command, spec, position):
    result = cli(*COMMANDS[command](spec))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    message = parse_target(spec).failure().message
    assert lines[0].startswith("Error: invalid ") and f"{spec!r}: position {position}: {message}" in lines[0], lines[0]
