"""parse: good specs build equal backends; bad specs fail with a useful message, never raise."""

from __future__ import annotations

import sys

import pytest
from returns.result import Failure, Success

from readfence.backends import (
    REFERENCE_LEAVES,
    CallForm,
    SpecError,
    deepseek_v4,
    hybrid,
    hybrid_linear,
    leaf,
    linear,
    minimax,
    paged,
    parse,
    parse_call,
    select,
    sparse,
    tbo,
    trtllm_mha,
)
from readfence.core import ForwardMode


@pytest.mark.parametrize("spec,want", [
    ("tbo(deepseek_v4(dspark=false), paged)", tbo(deepseek_v4(), paged())),
    ("tbo(deepseek_v4(dspark=true), paged())", tbo(deepseek_v4(dspark=True), paged())),
    (" hybrid( decode = trtllm_mha(window=4) , prefill=deepseek_v4, ) ",
     hybrid(decode=trtllm_mha(window=4), prefill=deepseek_v4())),
    ('hybrid_linear(trtllm_mha, linear(decay=0.5), pattern="0111")',
     hybrid_linear(trtllm_mha(), linear(decay=0.5), pattern="0111")),
    ("minimax(sparse(top_k=3), dense)", minimax(sparse(top_k=3), REFERENCE_LEAVES["dense"]())),
    ("select(decode=paged, extend=linear, default=sparse)",
     select({ForwardMode.EXTEND: linear(), ForwardMode.DECODE: paged()}, default=sparse())),
    ("linear(decay=1)", linear(decay=1.0)),
])
def test_good_specs(spec, want):
    got = parse(spec)
    assert got == Success(want)
    assert parse(str(want)) == Success(want)


def _failure(spec: str) -> SpecError:
    result = parse(spec)
    assert isinstance(result, Failure), f"{spec!r} parsed to {result}"
    err = result.failure()
    assert isinstance(err, SpecError) and err.spec == spec
    return err


@pytest.mark.parametrize("spec,position,needles", [
    ("tbo(", 4, ["expected a backend name", "end of spec"]),
    ("nosuch", 0, ["unknown backend 'nosuch'", "paged", "deepseek_v4", "tbo"]),
    ("paged(x=1)", 6, ["paged has no keyword 'x'", "(none)"]),
    ("sparse(x=1)", 7, ["no keyword 'x'", "page_size, top_k"]),
    ("", 0, ["empty spec"]),
    ("   ", 3, ["empty spec"]),
    ("deepseek_v4(dspark=1)", 19, ["expects true or false", "got 1"]),
    ("trtllm_mha(window=0)", 0, ["bad arguments for trtllm_mha", "positive int"]),
    ("tbo", 0, ["tbo needs at least 1 backend"]),
    ("hybrid(decode=paged)", 0, ["hybrid needs prefill="]),
    ("paged(linear)", 6, ["paged takes no positional arguments"]),
    ("tbo(paged,,)", 10, ["expected a backend name", "','"]),
    ("tbo(paged) extra", 11, ["expected end of spec", "'extra'"]),
    ("tbo(paged linear)", 10, ["expected ',' or ')'", "tbo(...)"]),
    ("tbo(paged, decode=linear)", 11, ["tbo has no keyword 'decode'"]),
    ("hybrid(decode=paged, decode=paged, prefill=paged)", 21, ["given twice"]),
    ("hybrid(decode=1, prefill=paged)", 14, ["expects a backend", "got 1"]),
    ("tbo(paged$)", 9, ["unexpected character '$'"]),
    ('hybrid_linear(paged, pattern="01', 29, ["unterminated string"]),
    ("select(decode=paged)", 0, ["no backend for modes", "default"]),
])
def test_bad_specs_name_position_and_expectation(spec, position, needles):
    err = _failure(spec)
    assert err.position == position, err
    for needle in needles:
        assert needle in err.message, (needle, err.message)
    assert "^" in str(err)


@pytest.mark.parametrize("spec", [
    "(" * 10_000,
    "tbo(" * 10_000,
    "tbo(" * 10_000 + "paged" + ")" * 10_000,
    ")" * 10_000,
    "paged(" + "(" * 10_000,
])
def test_deep_nesting_fails_without_recursion(spec):
    # a recursion limit far below the nesting depth: a parser recursing per level would raise
    # RecursionError instead of returning its SpecError (no wall-clock bound: the machine may be loaded)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        err = _failure(spec)
    finally:
        sys.setrecursionlimit(limit)
    assert "nesting deeper" in err.message or "expected" in err.message


def test_nesting_limit_is_configurable():
    spec = "tbo(" * 50 + "paged" + ")" * 50
    assert "nesting deeper than 10" in _failure_with(spec, max_depth=10).message
    assert isinstance(parse(spec, max_depth=50), Success)


def _failure_with(spec, **kw):
    result = parse(spec, **kw)
    assert isinstance(result, Failure)
    return result.failure()


def test_non_string_spec_is_a_failure():
    assert isinstance(parse(None), Failure)  # type: ignore[arg-type]


def test_user_leaves_can_be_registered():
    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        return q

    mine = leaf("mine", attend, declare={ForwardMode.DECODE: paged().read_effect(ForwardMode.DECODE)})
    got = parse("tbo(mine, paged)", leaves={"mine": lambda: mine})
    assert got == Success(tbo(mine, paged()))
    assert _failure("mine").message.startswith("unknown backend 'mine'")  # not known by default


# -- call forms: what other layers add to the one grammar -------------------------------------
def _wrap(*backends, times=1):
    return ("wrap", tuple(str(b) for b in backends), times)


WRAP = {"wrap": CallForm(_wrap, 1, 2, {"times": range(1, 4)}, usage="wrap(backend, [backend], times=N)")}


def test_outer_forms_take_backend_arguments_and_checked_keywords():
    assert parse_call("wrap(tbo(paged, linear), times=3)", WRAP, what="wrapper") == Success(
        ("wrap", ("tbo(paged, linear)",), 3))
    assert parse_call("paged", WRAP, what="wrapper", or_backend=True) == Success(paged())


@pytest.mark.parametrize("spec,position,message", [
    ("wrap(paged, times=0)", 18, "wrap(times=...) expects an int in 1..3, got 0"),
    ("wrap(paged, times=-2)", 18, "wrap(times=...) expects an int in 1..3, got -2"),
    ("wrap(paged, times=false)", 18, "wrap(times=...) expects an int in 1..3, got false"),
    ("wrap(paged, paged, paged)", 0, "wrap needs 1 to 2 backend argument(s), got 3; usage: wrap(backend, [backend], times=N)"),
    ("tbo(wrap(paged))", 0, "expected a wrapper (wrap), found the backend 'tbo'"),
    ("wrap(wrap(paged))", 5, "wrap is a wrapper: it can only be the whole spec, not an argument (its arguments are backends)"),
    ("paged", 0, "expected a wrapper (wrap), found the backend 'paged'"),
    ("nosuch(paged)", 0, "unknown wrapper 'nosuch'; wrappers: wrap"),
    ("   ", 3, "empty spec: expected a wrapper name"),
])
def test_outer_forms_fail_like_backends(spec, position, message):
    err = parse_call(spec, WRAP, what="wrapper").failure()
    assert isinstance(err, SpecError) and (err.position, err.message, err.spec) == (position, message, spec)


def test_an_outer_form_inside_a_backend_is_refused_at_its_name():
    err = parse_call("tbo(paged, wrap(paged))", WRAP, what="wrapper", or_backend=True).failure()
    assert (err.position, err.message) == (11, "wrap is a wrapper: it can only be the whole spec, not an argument "
                                               "(its arguments are backends)")


def test_a_leaf_cannot_take_the_name_of_an_outer_form():
    err = parse_call("wrap(paged)", WRAP, what="wrapper", leaves={"wrap": paged}).failure()
    assert (err.position, err.message) == (0, "leaf name 'wrap' is a wrapper")
