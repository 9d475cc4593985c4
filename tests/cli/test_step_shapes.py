"""Speculative step shapes on the command line: demo and plan take them."""

import json


def test_demo_runs_an_eagle_step_under_every_policy(cli):
    run = cli("demo", "--spec", "eagle(paged, trtllm_mha)", "--steps", "6", "--batch-size", "2", "--json")
    assert run.exit_code == 0, run.output
    rows = json.loads(run.stdout)
    assert [r["policy"] for r in rows] == ["COARSE", "JOINED", "PER_BUFFER", "EXACT"]
    assert all(r["matches_serial"] and r["violations"] == 0 and r["mode"] == "phases" for r in rows)


def test_demo_text_names_the_phases(cli):
    run = cli("demo", "--spec", "ngram(deepseek_v4)", "--steps", "4", "--batch-size", "2", "--policy", "exact")
    assert run.exit_code == 0, run.output
    assert "phases: target_verify:TARGET_VERIFY" in run.stdout


def test_plan_shows_which_phase_publishes_each_buffer(cli):
    run = cli("plan", "multi_eagle(paged, trtllm_mha, trtllm_mha)")
    assert run.exit_code == 0, run.output
    assert "published by" in run.stdout
    line = next(x for x in run.stdout.splitlines() if x.startswith("req_to_token"))
    assert "draft_extend[1]:POST_REPLAY" in line and line.rstrip().endswith("draft_extend[1]")


def test_plan_json_for_a_step_shape(cli):
    run = cli("plan", "eagle(paged, trtllm_mha, draft_steps=3)", "--json")
    assert run.exit_code == 0, run.output
    doc = json.loads(run.stdout)
    assert doc["publishers"] == {"req_to_token": "draft_extend", "seq_lens": "draft_extend",
                                 "swa_map": "draft_extend"}
    assert doc["effect"]["req_to_token"] == "draft_extend:POST_REPLAY"
    assert [p["phase"] for p in doc["phases"]][:3] == ["draft_decode[0]", "draft_decode[1]", "draft_decode[2]"]
    placements = doc["policies_by_phase"]["draft_extend"]["PER_BUFFER"]["placements"]
    assert {r["buffer"]: r["end"] for r in placements}["seq_lens"] == "PRE_REPLAY"


def test_bad_step_shape_is_one_line(cli):
    run = cli("plan", "eagle(paged)")
    assert run.exit_code == 2
    assert "position 0: eagle needs exactly 2 backend argument(s), got 1; usage: eagle(target, draft, draft_steps=N)" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
