"""``readfence bench races``: scores cases written outside readfence (``--cases``), prints the table
or the JSON document, exits 1 unless the suite holds, and refuses bad input in one line."""

from __future__ import annotations

import json

import pytest


def test_bench_races_scores_cases_from_outside_and_exits_1_unless_the_suite_holds(cli):
    result = cli("bench", "races", "--cases", "tests.races.fake_cases:GOOD")
    assert result.exit_code == 0, result.output
    assert "caught: buggy caught by audit, verify; fixed accepted" in result.stdout
    assert "detected / racy: 1/1" in result.stdout and "false alarms / fixed: 0/1" in result.stdout
    result = cli("bench", "races", "--cases", "tests.races.fake_cases:CASES", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["false_alarms"] == 1 and doc["schema_version"] == 1 and len(doc["cases"]) == 10


@pytest.mark.parametrize("args, message", [
    (["races", "effects"], "Error: races is scored on its own: run `readfence bench races`, then `readfence bench "
                           "effects`"),
    (["effects", "--json"], "Error: --json goes with `readfence bench races`"),
    (["--cases", "x:Y"], "Error: --cases goes with `readfence bench races`"),
    (["races", "--cases", "tests.races.fake_cases:NOPE"], "Error: module 'tests.races.fake_cases' has no attribute"),
])
def test_bench_races_refuses_bad_input_in_one_line(cli, args, message):
    result = cli("bench", *args)
    assert result.exit_code == 2 and result.output.strip().startswith(message), result.output
    assert len(result.output.strip().splitlines()) == 1
