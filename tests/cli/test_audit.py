"""``readfence audit``: the table, the POST_REPLAY/UNKNOWN counts, JSON, the exit status."""

from __future__ import annotations

import json
import re

from readfence.backends import paged, redeclare
from readfence.cli import _audit_run, _params
from readfence.effects import ReadEffect, ReadEnd


def test_table_and_counts_for_a_spec(cli):
    result = cli("audit", "tbo(deepseek_v4, paged)", "--mode", "target_verify", "--mode", "extend", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["backend", "mode", "buffer", "declared", "observed", "verdict"]
    row = next(x for x in lines if x.startswith("tbo/primary/deepseek_v4  TARGET_VERIFY  req_to_token"))
    assert "POST_REPLAY" in row and "no metadata snapshot" in row
    assert any(x.startswith("paged") is False and "EXTEND" in x and "not audited" in x for x in lines)
    summary = lines[-1]
    assert "POST_REPLAY (no metadata snapshot yet)" in summary and "UNKNOWN (not audited)" in summary
    assert "0 unsound" in summary


def test_json_rows(cli):
    result = cli("audit", "paged", "--mode", "decode", "--json", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert rows and all({"backend", "mode", "buffer", "declared", "observed", "verdict"} <= set(r) for r in rows)
    assert {(r["buffer"], r["verdict"]) for r in rows} >= {("req_to_token", "exact")}


def test_every_mode_by_default(cli):
    rows = json.loads(cli("audit", "dense", "--json", "--batch-size", "2").output)
    assert {r["mode"] for r in rows} == {"DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "EXTEND", "IDLE"}


def test_reference_backends_by_default(cli, monkeypatch):
    seen = []
    real = _audit_run.audit_all

    def spy(backends, modes, **kw):
        backends = list(backends)
        seen.extend(str(b) for b in backends)
        return real(backends[:1], modes[:1], **kw)  # keep the test fast: audit only the first

    monkeypatch.setattr(_audit_run, "audit_all", spy)
    result = cli("audit")
    assert result.exit_code == 0, result.output
    assert {"paged", "trtllm_mha", "deepseek_v4", "linear", "sparse", "dense",
            "tbo(deepseek_v4, paged)", "minimax(sparse, dense)"} <= set(seen)


def test_unsound_declaration_exits_1_and_is_named(cli, monkeypatch):
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    monkeypatch.setattr(_params, "parse_spec", lambda text: early)
    result = cli("audit", "paged", "--mode", "decode")
    assert result.exit_code == 1
    assert "UNSOUND: paged in DECODE: req_to_token declared PRE_REPLAY but read until IN_REPLAY" in result.output


def test_bad_spec_exits_2(cli):
    result = cli("audit", "paged(window=3)")
    assert result.exit_code == 2
    assert result.output.strip().startswith("Error: invalid SPEC 'paged(window=3)': position")
    assert "Traceback" not in result.output


def test_batch_sizes_are_traced_and_the_late_one_is_named(cli, monkeypatch):
    from tests.adversarial import CASES

    shape_dependent = CASES["branch_on_batch_size"].build(None)  # reads seq_lens in attend if B > 2
    monkeypatch.setattr(_params, "parse_spec", lambda text: shape_dependent)
    monkeypatch.setattr(_params, "check_spec_names", lambda text: None)  # "x" stands for the patched spec
    only_small = cli("audit", "x", "--mode", "decode", "--batch-size", "1", "--batch-size", "2", "--json")
    assert only_small.exit_code == 0, only_small.output
    assert {r["batch_size"] for r in json.loads(only_small.output)} <= {1, 2}
    result = cli("audit", "x", "--mode", "decode")  # default: 1, 2 and the maximum
    assert result.exit_code == 1
    assert ("UNSOUND: branch_on_batch_size in DECODE: seq_lens declared IN_REPLAY but read until POST_REPLAY "
            "(last read by node ") in result.output
    assert re.search(r"adversarial\.py:\d+ in _gather: a traced read", result.output)  # the user's line
    assert "at batch size 16" in result.output


def test_batch_size_beyond_the_model_exits_2(cli):
    result = cli("audit", "paged", "--batch-size", "99")
    assert result.exit_code == 2
    assert result.output.strip() == "Error: invalid --batch-size '99': must be at most 16 (the tiny model serves at most 16 requests)"


def test_step_shapes_are_audited_phase_by_phase_in_their_own_modes(cli):
    # every spec the other commands take: a step shape's phases fix their modes
    rows = json.loads(cli("audit", "eagle(paged, trtllm_mha)", "--json", "--batch-size", "2").output)
    assert {(r["backend"], r["mode"]) for r in rows} == {
        ("paged", "TARGET_VERIFY"), ("trtllm_mha", "DECODE"), ("trtllm_mha", "DRAFT_EXTEND")}
    rows = json.loads(cli("audit", "ngram(paged)", "--json", "--batch-size", "2").output)
    assert {(r["backend"], r["mode"]) for r in rows} == {("paged", "TARGET_VERIFY")}
    narrowed = json.loads(cli("audit", "eagle(paged, trtllm_mha)", "--mode", "decode", "--json",
                              "--batch-size", "2").output)
    assert {(r["backend"], r["mode"]) for r in narrowed} == {("trtllm_mha", "DECODE")}


def test_a_mode_no_phase_of_a_step_shape_runs_in_is_bad_input(cli):
    result = cli("audit", "ngram(paged)", "--mode", "extend")
    assert result.exit_code == 2
    assert "no phase in mode extend" in result.output and "target_verify" in result.output
    assert "Traceback" not in result.output


def test_a_latent_child_is_its_own_line_and_json_key_and_exits_0(cli, monkeypatch):
    from readfence.backends import join, sparse

    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    monkeypatch.setattr(_params, "parse_spec", lambda text: join(early, sparse()))
    result = cli("audit", "paged", "--mode", "decode", "--batch-size", "2")  # parse_spec gives the join
    assert result.exit_code == 0, result.output
    assert ("LATENT: join/children[0]/paged in mode DECODE declares buffer 'req_to_token' ends at PRE_REPLAY but "
            "its own trace reads it until IN_REPLAY") in result.output
    assert "covered by join/children[1]/sparse, which declares POST_REPLAY" in result.output
    assert "0 unsound, 1 latent;" in result.output and "UNSOUND" not in result.output
    rows = json.loads(cli("audit", "paged", "--mode", "decode", "--batch-size", "2", "--json").output)
    (row,) = [r for r in rows if r["latent"] is not None]
    assert (row["backend"], row["buffer"], row["verdict"]) == ("join/children[0]/paged", "req_to_token", "latent")
    assert (row["latent"]["fence"], row["latent"]["covered_by"]) == ("join", "join/children[1]/sparse")
