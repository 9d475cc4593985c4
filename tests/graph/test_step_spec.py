"""Step shapes are specs of the one grammar: ``parse_step`` and ``parse_target`` are the backend
parser with the step shapes' call forms on top, and fail with the same ``SpecError`` (a position
and what was expected), never a string or an exception."""

from __future__ import annotations

import pytest
from returns.result import Failure, Success

from readfence.backends import SpecError, hybrid_linear, linear, paged, parse, tbo, trtllm_mha
from readfence.graph import eagle, multi_eagle, ngram, parse_step, parse_target
from readfence.graph.steps import STEP_SHAPES


@pytest.mark.parametrize("shape", [
    eagle(paged(), trtllm_mha()),
    eagle(hybrid_linear(trtllm_mha(), linear(decay=0.5), pattern="01"), paged(), draft_steps=64),
    multi_eagle(paged(), trtllm_mha(), tbo(paged(), linear())),
    ngram(trtllm_mha(window=4)),
])
def test_a_shape_parses_back_from_its_spec(shape):
    assert parse_step(shape.spec) == Success(shape)
    assert parse_target(shape.spec) == Success(shape)


def test_good_specs_with_free_whitespace_and_a_trailing_comma():
    assert parse_step(" eagle( paged , trtllm_mha , draft_steps = 3 , ) ") == Success(
        eagle(paged(), trtllm_mha(), draft_steps=3))
    assert parse_target("ngram").failure().message.startswith("ngram needs exactly 1 backend argument(s), got 0")


def _failure(result, spec: str) -> SpecError:
    assert isinstance(result, Failure), f"{spec!r} parsed to {result}"
    err = result.failure()
    assert isinstance(err, SpecError) and err.spec == spec, err
    return err


STEP = "eagle(paged, paged, draft_steps="


@pytest.mark.parametrize("spec,position,needles", [
    # names
    ("medusa(paged)", 0, ["unknown step shape 'medusa'", "step shapes: eagle, multi_eagle, ngram"]),
    ("paged", 0, ["expected a step shape (eagle, multi_eagle, ngram), found the backend 'paged'"]),
    ("eagle(ngram(paged), paged)", 6, ["ngram is a step shape: it can only be the whole spec"]),
    ("eagle(paged, nosuch)", 13, ["unknown backend 'nosuch'; known leaves:", "combinators:"]),
    ("eagle(paged(x=1), paged)", 12, ["paged has no keyword 'x'"]),
    # how many backends
    ("eagle(paged)", 0, ["eagle needs exactly 2 backend argument(s), got 1", "usage: eagle(target, draft, draft_steps=N)"]),
    ("ngram(paged, paged)", 0, ["ngram needs exactly 1 backend argument(s), got 2", "usage: ngram(target)"]),
    ("multi_eagle(paged)", 0, ["multi_eagle needs at least 2 backend argument(s), got 1"]),
    # draft_steps: every bad value is the same kind of error, at the value, with the range
    (STEP + "-1)", 32, ["eagle(draft_steps=...) expects an int in 1..64, got -1"]),
    (STEP + "0)", 32, ["eagle(draft_steps=...) expects an int in 1..64, got 0"]),
    (STEP + "65)", 32, ["eagle(draft_steps=...) expects an int in 1..64, got 65"]),
    (STEP + "2.5)", 32, ["expects an int in 1..64, got 2.5"]),
    (STEP + "true)", 32, ["expects an int in 1..64, got true"]),
    (STEP + '"2")', 32, ["expects an int in 1..64, got '2'"]),
    (STEP + "paged)", 32, ["expects an int in 1..64, got the backend paged"]),
    # keywords and punctuation
    ("eagle(paged, paged, steps=2)", 20, ["eagle has no keyword 'steps'; allowed keywords: draft_steps"]),
    ("ngram(paged, draft_steps=2)", 13, ["ngram has no keyword 'draft_steps'; allowed keywords: (none)"]),
    (STEP + "2, draft_steps=3)", 35, ["keyword 'draft_steps' given twice"]),
    ("eagle(draft_steps=2, paged, paged)", 21, ["positional argument after keyword arguments"]),
    ("eagle(paged, paged", 18, ["expected ',' or ')' in eagle(...)", "end of spec"]),
    ("eagle(paged, paged) x", 20, ["expected end of spec, found 'x'"]),
    ("eagle(paged;paged)", 11, ["unexpected character ';'"]),
    ("", 0, ["empty spec: expected a step shape name"]),
])
def test_bad_step_specs_name_position_and_expectation(spec, position, needles):
    err = _failure(parse_step(spec), spec)
    assert err.position == position, err
    for needle in needles:
        assert needle in err.message, (needle, err.message)
    assert "^" in str(err)


def test_a_target_is_a_backend_or_a_step_shape_and_its_errors_say_which_names_exist():
    assert parse_target("tbo(paged, linear)") == parse("tbo(paged, linear)")
    err = _failure(parse_target("medusa(paged)"), "medusa(paged)")
    assert err.position == 0 and err.message.startswith("unknown backend 'medusa'; known leaves: ")
    assert err.message.endswith("; step shapes: eagle, multi_eagle, ngram")
    for spec in ("eagle(paged)", STEP + "0)", "eagle(paged, ngram(paged))"):
        assert _failure(parse_target(spec), spec) == _failure(parse_step(spec), spec)
    nested = _failure(parse_target("tbo(ngram(paged))"), "tbo(ngram(paged))")
    assert nested.position == 4 and nested.message.startswith("ngram is a step shape")
    assert _failure(parse_target(""), "").message == "empty spec: expected a backend name"


def test_backend_specs_do_not_know_step_shapes():
    err = _failure(parse("eagle(paged, paged)"), "eagle(paged, paged)")
    assert err.position == 0 and err.message.startswith("unknown backend 'eagle'")


def test_non_string_specs_are_failures():
    assert isinstance(parse_step(None).failure(), SpecError)  # type: ignore[arg-type]
    assert isinstance(parse_target(3).failure(), SpecError)  # type: ignore[arg-type]


def test_the_step_shape_forms_call_their_constructors_with_the_same_checks():
    assert STEP_SHAPES["eagle"](paged(), trtllm_mha(), draft_steps=3) == eagle(paged(), trtllm_mha(), draft_steps=3)
    for bad in (-1, 0, 65):  # the Python API refuses what the spec refuses, in one validator's words
        with pytest.raises(ValueError, match=r"eagle: draft_steps must be an int in 1\.\.64, got -?\d+ \(int\)"):
            eagle(paged(), paged(), draft_steps=bad)
