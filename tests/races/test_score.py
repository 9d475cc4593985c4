"""Scoring the race suite: what counts as detected, missed, a false alarm, racing; the table, the
JSON document, cases written outside readfence (``load_cases``)."""

from __future__ import annotations

import json
import re

import pytest

from readfence.races import CASES, Case, load_cases, score

from . import fake_cases as fake


@pytest.fixture(scope="module")
def suite():
    return score(fake.CASES)


def test_each_version_is_scored_by_what_its_checks_found(suite):
    by = {c.case.name: c for c in suite.cases}
    assert by["caught"].buggy.caught_by == ("audit", "verify") and not by["caught"].fixed.detected
    assert by["missed"].buggy.caught_by == () and by["missed"].races
    assert by["alarm"].buggy.caught_by == ("run",) and by["alarm"].fixed.caught_by == ("audit",)
    assert by["alarm"].races  # its overlapped run differs from the serial one
    assert by["quiet"].buggy.detected and not by["quiet"].races
    assert by["broken"].buggy.errors and "the engine's class cannot be built here" in by["broken"].buggy.errors[0]
    assert (suite.racy, suite.detected(), suite.fixed, suite.false_alarms) == (5, 3, 5, 1)
    assert (suite.detected("audit"), suite.detected("verify"), suite.detected("run")) == (2, 1, 1)


def test_the_suite_holds_only_with_no_false_alarm_no_unexplained_miss_every_race_shown_and_no_error(suite):
    assert not suite.ok
    assert score([fake.CAUGHT, fake.MISSED]).ok  # a miss its case explains stays in the table
    for bad in (fake.ALARM, fake.QUIET, fake.BROKEN):
        assert not score([fake.CAUGHT, bad]).ok, bad.name


def test_the_table_names_each_finding_and_says_what_is_wrong(suite):
    text = suite.table()
    rows = [re.split(r"\s{2,}", line) for line in text.splitlines()]
    assert ["caught", "buggy", "yes", "audit, verify", "req_to_token", "mine.py:12",
            "the poisoned run differs from the serial run at step 0"] in rows
    assert ["alarm", "buggy", "yes", "run", "-", "-", "the overlapped run differs from the serial run at step 1"] in rows
    assert "detected / racy: 3/5 (by audit 2/5, by verify 1/5, by run 1/5)" in text
    assert "false alarms / fixed: 1/5" in text
    assert "MISSED: missed: the read is in a kernel no check sees" in text
    assert "FALSE ALARM: alarm (late): audit found it" in text
    assert "NOT SHOWN: quiet: the buggy version did not race on the device" in text
    assert "ERROR: broken (?): building the version raised RuntimeError" in text


def test_the_json_document_has_a_row_per_version_and_the_totals(suite):
    doc = json.loads(json.dumps(suite.as_json()))
    assert {"cases", "racy", "detected", "fixed", "false_alarms"} <= set(doc)
    assert (doc["racy"], doc["detected"], doc["fixed"], doc["false_alarms"]) == (5, 3, 5, 1)
    row = doc["cases"][0]
    assert {"name", "source", "racy", "detected", "caught_by", "buffer", "line"} <= set(row)
    assert (row["name"], row["racy"], row["detected"], row["caught_by"], row["buffer"], row["line"]) == (
        "caught", True, True, ["audit", "verify"], "req_to_token", "mine.py:12")
    assert row["source"] == "example/engine#1 (engine/runner.py: Runner.replay)"
    assert doc["cases"][1]["racy"] is False and doc["cases"][1]["buffer"] is None


@pytest.mark.parametrize("ref, names", [("tests.races.fake_cases:CASES", ["caught", "missed", "alarm", "quiet", "broken"]),
                                        ("tests.races.fake_cases:GOOD", ["caught"]),
                                        ("tests.races.fake_cases:cases", ["caught"]),
                                        ("tests.races.fake_cases:CAUGHT", ["caught"])])
def test_load_cases_takes_a_case_a_list_a_mapping_or_a_function(ref, names):
    assert [c.name for c in load_cases(ref)] == names


@pytest.mark.parametrize("ref, message", [
    ("tests.races.fake_cases", "--cases takes MODULE:ATTR (e.g. mycases:CASES), got 'tests.races.fake_cases'"),
    ("tests.races.fake_cases:SOURCE", "tests.races.fake_cases:SOURCE is Source("),
    ("tests.races.fake_cases:NOPE", "module 'tests.races.fake_cases' has no attribute 'NOPE'"),
    ("tests.races.fake_cases:broken", "tests.races.fake_cases:broken() raised"),
])
def test_load_cases_says_what_is_wrong(ref, message):
    with pytest.raises(ValueError, match=None) as caught:
        load_cases(ref)
    assert message in str(caught.value)


def test_a_case_of_the_suite_is_a_case_with_its_source_and_story():
    assert len(CASES) >= 12 and len({c.name for c in CASES}) == len(CASES)
    for case in CASES:
        assert isinstance(case, Case) and callable(case.buggy) and callable(case.fixed)
        assert case.source.repository and case.source.file and case.source.function, case.name
        assert case.story.did and case.story.wrong and case.story.says, case.name
    assert {c.source.repository for c in CASES} >= {"sgl-project/sglang", "vllm-project/vllm", "NVIDIA/TensorRT-LLM"}
    assert any(c.quick for c in CASES) and not all(c.quick for c in CASES)


def test_a_case_is_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="a case's name is one word"):
        Case("two words", "t", fake.SOURCE, fake.STORY, buggy=fake.broken, fixed=fake.broken)
    with pytest.raises(TypeError, match="case 'x': fixed must be a function of no argument"):
        Case("x", "t", fake.SOURCE, fake.STORY, buggy=fake.broken, fixed=3)
    with pytest.raises(TypeError, match="a race case must be a readfence.races.Case, got 'x'"):
        score(["x"])
