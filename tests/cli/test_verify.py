"""``readfence verify``: the audit, then poison, guard and observer per policy; text, JSON, exit status."""

from __future__ import annotations

import json

import pytest

from readfence.backends import paged, redeclare
from readfence.cli import _params
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import Policy

SMALL = ("--steps", "2", "--batch-size", "2")
POLICIES = [p.name for p in Policy]


def _rows(result) -> list[dict]:
    rows = json.loads(result.output)
    assert [r["policy"] for r in rows] == POLICIES
    assert all({"spec", "mode", "policy", "verdict", "buffer", "step", "stage", "op", "evidence"} <= set(r)
               for r in rows)
    return rows


def test_a_reference_spec_is_clean_under_every_policy(cli):
    result = cli("verify", "hybrid_linear(trtllm_mha, linear)", *SMALL, "--json")
    assert result.exit_code == 0, result.output
    rows = _rows(result)
    assert {r["verdict"] for r in rows} == {"clean"}
    assert all(r["spec"] == "hybrid_linear(trtllm_mha, linear)" and r["mode"] == "DECODE" for r in rows)
    assert all(r[k] is None for r in rows for k in ("buffer", "step", "stage", "op", "evidence"))
    assert rows[0]["poisoned"] == [] and "req_to_token" in rows[-1]["poisoned"]


def test_the_text_report_says_what_ran(cli):
    result = cli("verify", "paged", "--policy", "per_buffer", *SMALL)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "spec: paged  mode: DECODE  steps: 2  batch size: 2  seed: 0"
    assert lines[1] == "audit: every declaration sound at batch sizes 1, 2, 16"
    assert "checks: poison, guard and the runtime read observer" in lines[2]
    assert lines[3].split()[:2] == ["PER_BUFFER", "clean;"]
    assert lines[-1].startswith("every policy matched the serial run bit for bit")


@pytest.fixture
def too_early(monkeypatch):
    """``paged`` declaring its page table released before the replay: it is read in the graph."""
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    monkeypatch.setattr(_params, "parse_spec", lambda text: early)


def test_an_early_declaration_is_refused_by_the_audit_and_not_run(cli, too_early):
    result = cli("verify", "paged", *SMALL)
    assert result.exit_code == 1
    out = result.output
    assert ("audit: unsound declaration: paged in mode DECODE declares buffer 'req_to_token' ends at "
            "PRE_REPLAY but the traced code reads it until IN_REPLAY") in out
    assert ("PER_BUFFER: unsound declaration of 'req_to_token' in stage prepare_in_graph, op index_select "
            "(evidence: audit; not run)") in out
    assert "what to do: paged: fix: declare 'req_to_token' ending at IN_REPLAY (or later)" in out
    assert "--unsafe-skip-soundness-check" in out
    assert "  COARSE     clean" in out  # COARSE does not depend on the declaration: it runs
    rows = _rows(cli("verify", "paged", *SMALL, "--json"))
    assert rows[0]["verdict"] == "clean"
    assert {(r["verdict"], r["evidence"], r["buffer"]) for r in rows[1:]} == {
        ("unsound declaration", "audit", "req_to_token")}


def test_the_unsafe_flag_shows_the_race_caught_at_run_time(cli, too_early):
    assert "--unsafe-skip-soundness-check" in cli("verify", "--help").output
    result = cli("verify", "paged", *SMALL, "--unsafe-skip-soundness-check")
    assert result.exit_code == 1
    out = result.output
    assert "UNSAFE: --unsafe-skip-soundness-check" in out
    line = next(x for x in out.splitlines() if x.startswith("PER_BUFFER: "))
    assert line.startswith("PER_BUFFER: late read of 'req_to_token' at step 0 in stage prepare_in_graph, op ")
    assert "index_select" in line and line.endswith("(evidence: observer)")
    assert "the race the audit predicted, caught at run time" in out
    rows = {r["policy"]: r for r in _rows(cli("verify", "paged", *SMALL, "--unsafe-skip-soundness-check",
                                              "--json"))}
    late = rows["PER_BUFFER"]
    assert (late["verdict"], late["buffer"], late["step"], late["stage"]) == ("late read", "req_to_token", 0,
                                                                              "prepare_in_graph")
    assert "index_select" in late["op"] and late["evidence"] in ("observer", "poison")
    assert rows["COARSE"]["verdict"] == "clean"
    # a policy whose run was clean still carries the audit's finding: the declaration is wrong
    assert all(r["verdict"] != "clean" for p, r in rows.items() if p != "COARSE")


@pytest.mark.parametrize("spec", ["eagle(paged, trtllm_mha)", "per_stream(paged, trtllm_mha)"])
def test_step_shapes_and_per_stream_groups_run_clean(cli, spec):
    result = cli("verify", spec, *SMALL, "--json")
    assert result.exit_code == 0, result.output
    rows = _rows(result)
    assert {r["verdict"] for r in rows} == {"clean"}
    assert {r["mode"] for r in rows} == ({"phases"} if spec.startswith("eagle") else {"DECODE"})


@pytest.mark.parametrize(("args", "message"), [
    (["paged(window=3)"], "Error: invalid SPEC 'paged(window=3)': position"),
    (["paged", "--mode", "sideways"], "Error: invalid --mode 'sideways': unknown forward mode"),
    (["paged", "--mode", "idle"], "Error: invalid --mode 'idle': its steps carry no tokens"),
    (["paged", "--steps", "0"], "Error: invalid --steps '0': must be a positive integer"),
    (["paged", "--batch-size", "99"], "Error: invalid --batch-size '99': must be at most 16 (the tiny model serves at most 16 requests)"),
    (["paged", "--policy", "fast"], "Error: invalid --policy 'fast': unknown policy"),
    (["per_stream(paged, linear)", "--batch-size", "1"], "Error: per_stream(paged, linear) runs 2 forward streams"),
])
def test_bad_input_exits_2_with_one_line(cli, args, message):
    result = cli("verify", *args)
    assert result.exit_code == 2
    assert result.output.strip().startswith(message), result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_cuda_without_cuda_exits_2(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = cli("verify", "paged", "--device", "cuda")
    assert result.exit_code == 2
    assert result.output.strip().startswith("Error: invalid --device 'cuda': CUDA is not available here")
