"""Speculative step shapes on the command line: demo, plan and verify take them."""

import json

import pytest

from readfence.backends import paged, redeclare
from readfence.cli import _params
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, lower_step, make_state, ngram, parse_step


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
    run = cli("plan", "multi_eagle(paged, trtllm_mha, trtllm_mha)", "--device", "cpu")
    assert run.exit_code == 0, run.output
    line = next(x for x in run.stdout.splitlines() if x.startswith("req_to_token"))
    assert line.split() == ["req_to_token", "draft_extend[1]:POST_REPLAY", "draft_extend[1]:POST_REPLAY"]
    header = next(x for x in run.stdout.splitlines() if x.startswith("policy"))
    assert header.split() == ["policy", "events", "buffer", "published", "by", "end", "placement"]
    exact = run.stdout.split("\nEXACT")[1].splitlines()
    assert exact[0].split()[1:3] == ["req_to_token", "draft_extend[1]"]


@pytest.mark.parametrize("spec", [
    "eagle(trtllm_mha, paged)",  # paged's draft extend declares UNKNOWN for all: EXACT publishes swa_map earlier
    "multi_eagle(paged, trtllm_mha, trtllm_mha)",  # two drafts, one graph per (runner, mode)
])
def test_plan_says_what_lower_step_places_under_each_policy(cli, spec):
    run = cli("plan", spec, "--device", "cpu", "--json")
    assert run.exit_code == 0, run.output
    doc = json.loads(run.stdout)
    shape = parse_step(spec).unwrap()
    cfg = ModelConfig()
    with CpuDevice() as dev:
        for policy in Policy:
            step = lower_step(shape, ForwardMode.DECODE, device=dev, policy=policy, batch_size=2, cfg=cfg,
                              state=make_state(cfg, dev))
            expected = []
            for b in SHARED_BUFFERS:
                k = step.owner.get(b)
                if k is None:
                    expected.append((b, "-", "NONE"))
                    continue
                placed = step.graphs[shape.phases[k].graph_key].plan.placements[b]
                expected.append((b, shape.phases[k].name, placed.end.name, str(placed)))
            plan = doc["policies"][policy.name]
            got = [(r["buffer"], r["phase"], r["end"]) + ((r["placement"],) if r["phase"] != "-" else ())
                   for r in plan["placements"]]
            assert got == expected, policy
            assert plan["events"] == sum(len(low.plan.points()) for low in step.graphs.values()), policy
            for b, phase, *rest in expected:  # the per-phase view says the same
                if phase != "-":
                    rows = doc["policies_by_phase"][phase][policy.name]["placements"]
                    assert {r["buffer"]: r["end"] for r in rows}[b] == rest[0]
    if spec.startswith("eagle(trtllm_mha"):
        assert doc["publishers"]["swa_map"] == "draft_extend"  # by the declarations
        exact = {r["buffer"]: r["phase"] for r in doc["policies"]["EXACT"]["placements"]}
        assert exact["swa_map"] == "target_verify" and exact["state_slots"] == "-"


def test_verify_names_the_phases_and_reports_every_policy(cli, monkeypatch):
    # the only phase declares its page table released before the replay that reads it
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    monkeypatch.setattr(_params, "parse_spec", lambda text: ngram(early))
    args = ("verify", "ngram(paged)", "--steps", "2", "--batch-size", "2", "--device", "cpu",
            "--unsafe-skip-soundness-check")
    run = cli(*args)
    assert run.exit_code == 1
    verified = next(x for x in run.stdout.splitlines() if x.startswith("verified "))
    assert verified.startswith("verified ngram(paged) in phases target_verify:TARGET_VERIFY on cpu")
    verdicts = {r["policy"]: r for r in json.loads(cli(*args, "--json").stdout)}
    assert list(verdicts) == [p.name for p in Policy]
    assert verdicts["COARSE"]["verdict"] == "clean"
    assert verdicts["PER_BUFFER"]["verdict"] == "late read" and verdicts["PER_BUFFER"]["buffer"] == "req_to_token"
    assert {verdicts[p]["verdict"] for p in ("JOINED", "EXACT")} == {"unsound declaration"}
    assert all(r["mode"] == "phases" and r["phases"] == "target_verify:TARGET_VERIFY" for r in verdicts.values())


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
