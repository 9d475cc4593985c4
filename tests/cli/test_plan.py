"""``readfence plan``: derivation tree, forcing leaves, resolved ends, placements per policy."""

from __future__ import annotations

import json

import pytest

from readfence.backends import parse, redeclare, trtllm_mha
from readfence.cli._plan_data import plan_report
from readfence.core import ForwardMode
from readfence.effects import Capabilities, ReadEffect, ReadEnd

SPEC = "hybrid_linear(trtllm_mha, linear)"


def test_text_shows_tree_forcing_leaf_resolution_and_policies(cli):
    result = cli("plan", SPEC, "--mode", "decode", "--device", "cpu")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "spec: hybrid_linear(trtllm_mha, linear)  mode: DECODE" in out
    assert "children[0]: trtllm_mha  req_to_token=PRE_REPLAY" in out
    assert "children[1]: linear      state_slots=IN_REPLAY" in out
    line = next(x for x in out.splitlines() if x.startswith("state_slots"))
    assert line.split() == ["state_slots", "IN_REPLAY", "IN_REPLAY", "hybrid_linear/children[1]/linear"]
    assert "PER_BUFFER  2       req_to_token  PRE_REPLAY  after prepare_out_graph, before replay" in out
    assert "after node prepare_in_graph:" in out  # EXACT names the last-reading node


def test_json_keys_and_values(cli):
    result = cli("plan", "tbo(deepseek_v4, paged)", "--mode", "target_verify", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {"spec", "mode", "effect", "end", "policies", "forced_by", "resolved", "tree"} <= set(report)
    assert report["spec"] == "tbo(deepseek_v4, paged)" and report["mode"] == "TARGET_VERIFY"
    assert report["end"] == "POST_REPLAY"
    # deepseek_v4 re-reads the page table in the body for TARGET_VERIFY: it forces POST_REPLAY.
    assert report["effect"]["req_to_token"] == "POST_REPLAY"
    assert report["forced_by"]["req_to_token"] == ["tbo/primary/deepseek_v4"]
    assert set(report["policies"]) == {"COARSE", "JOINED", "PER_BUFFER", "EXACT"}
    ends = {r["buffer"]: r["end"] for r in report["policies"]["JOINED"]["placements"]}
    assert set(ends.values()) == {"POST_REPLAY"}


def test_a_select_shows_the_arm_that_is_not_taken(cli):
    result = cli("plan", "hybrid(decode=trtllm_mha, prefill=deepseek_v4)")
    assert result.exit_code == 0, result.output
    assert "(not selected in DECODE)" in result.output
    report = json.loads(cli("plan", "hybrid(decode=trtllm_mha, prefill=deepseek_v4)", "--json").output)
    inactive = [n["name"] for n in report["tree"] if not n["active"]]
    assert inactive == ["deepseek_v4"]


def test_resolution_follows_the_device_capabilities():
    backend = parse(SPEC).unwrap()
    plain = plan_report(backend, ForwardMode.DECODE, device="cpu", caps=Capabilities())
    no_events = plan_report(backend, ForwardMode.DECODE, device="cpu",
                            caps=Capabilities(in_graph_events=False))
    assert plain["resolved"]["state_slots"] == "IN_REPLAY"
    assert no_events["resolved"]["state_slots"] == "POST_REPLAY"  # later, never earlier
    assert no_events["resolved"]["req_to_token"] == "PRE_REPLAY"
    placed = {r["buffer"]: r["end"] for r in no_events["policies"]["PER_BUFFER"]["placements"]}
    assert placed["state_slots"] == "POST_REPLAY"


@pytest.mark.parametrize("args, expected", [
    (["plan", "tbo(paged,"], "invalid SPEC 'tbo(paged,': position 10: expected a backend name"),
    (["plan", "paged", "--mode", "warp"], "invalid --mode 'warp': unknown forward mode; allowed: decode, "
                                          "target_verify, draft_extend, extend, idle"),
    (["plan", "paged", "--device", "gpu0"], "invalid --device 'gpu0'"),
])
def test_bad_input_exits_2_with_one_line(cli, args, expected):
    result = cli(*args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.output
    assert "Traceback" not in result.output


#: trtllm_mha declaring that it reads nothing: its traced reads make that unsound in every mode.
EARLY = redeclare(trtllm_mha(), lambda mode: ReadEffect.of({}, default=ReadEnd.NONE))


def test_an_unsound_declaration_exits_1_after_the_plan_that_shows_it(cli):
    result = cli("plan", "tests.cli.test_plan:EARLY", "--mode", "decode")
    assert result.exit_code == 1, result.output
    assert "lowering refuses it" in result.output and "Error:" not in result.output
    assert cli("plan", "trtllm_mha", "--mode", "decode").exit_code == 0  # its own declaration: sound
