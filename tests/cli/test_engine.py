"""``readfence audit --engine`` and ``readfence verify --engine``: an engine's own backend object."""

from __future__ import annotations

import json

import pytest

SMALL = "tests.engine.cli_engines"


def test_audit_names_the_unsound_child_by_method_buffer_and_op(cli):
    result = cli("audit", "--engine", f"{SMALL}:minimax_hybrid", "--mode", "decode", "--batch-size", "2")
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"engine: {SMALL}:minimax_hybrid"
    assert lines[1].split() == ["backend", "mode", "buffer", "declared", "truth", "source", "verdict"]
    assert any(x.startswith("UNSOUND: MiniMaxHybridAttnBackend/attn_backend_list[0]/MiniMaxSparseBackend in DECODE: "
                            "req_to_token declared IN_REPLAY but read until POST_REPLAY by forward: "
                            "aten.index_select.default") for x in lines), result.output
    assert "2 unsound" in result.output


def test_audit_json_labels_traced_and_observed_rows(cli):
    result = cli("audit", "--engine", f"{SMALL}:PAIR", "--mode", "decode", "--batch-size", "2", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    sources = {(r["engine"].rsplit("'", 2)[-2], r["buffer"]): (r["source"], r["truth"], r["verdict"]) for r in rows}
    assert sources[("triton", "req_to_token")] == ("traced", "IN_REPLAY", "exact")
    assert sources[("host_bounds", "req_to_token")] == ("observed", "POST_REPLAY", "exact")
    assert all(r["schema_version"] == 1 and r["declared"] for r in rows)


def test_the_reference_engine_is_reachable_by_name(cli):
    result = cli("audit", "--engine", "readfence.engine.reference:minimax_sparse_engine", "--mode", "decode",
                 "--batch-size", "2")
    assert result.exit_code == 1
    assert "MiniMaxSparseBackend  DECODE  req_to_token  IN_REPLAY  POST_REPLAY  traced  unsound" in result.output


def test_verify_runs_each_policy_and_the_engine_runner(cli):
    result = cli("verify", "--engine", f"{SMALL}:triton", "--steps", "2", "--batch-size", "2", "--policy",
                 "per_buffer,exact")
    assert result.exit_code == 0, result.output
    assert [x.split()[0] for x in result.output.splitlines() if x.startswith("  ")] == ["PER_BUFFER", "EXACT", "ENGINE"]
    assert "every fence matched the serial run bit for bit" in result.output
    bad = cli("verify", "--engine", f"{SMALL}:minimax_hybrid", "--steps", "2", "--batch-size", "2", "--policy", "exact",
              "--json")
    assert bad.exit_code == 1
    rows = {r["fence"]: r for r in json.loads(bad.output)}
    assert (rows["EXACT"]["verdict"], rows["EXACT"]["evidence"]) == ("unsound declaration", "audit")
    assert (rows["ENGINE RUNNER"]["verdict"], rows["ENGINE RUNNER"]["buffer"]) == ("late read", "req_to_token")


@pytest.mark.parametrize("args, message", [
    (["audit", "--engine", "tests.engine"], "Error: --engine takes MODULE:FACTORY"),
    (["audit", "--engine", "no_such_module_here:x"], "Error: cannot import module 'no_such_module_here'"),
    (["audit", "--engine", f"{SMALL}:nope"], f"Error: module '{SMALL}' has no attribute 'nope'"),
    (["audit", "--engine", f"{SMALL}:raises"], f"Error: {SMALL}:raises() raised RuntimeError: no GPU"),
    (["audit", "--engine", f"{SMALL}:not_an_engine"], f"Error: {SMALL}:not_an_engine() returned 42 (int)"),
    (["audit", "--engine", f"{SMALL}:two_arguments"], "Error: tests.engine.cli_engines:two_arguments takes 2 required"),
    (["audit", "--engine", f"{SMALL}:factory_raising"], "Error: tests.engine.cli_engines:factory_raising: the factory "
                                                        "factory_raising(runner) raised KeyError: 'kv pool'"),
    (["audit", "paged", "--engine", f"{SMALL}:triton"], "Error: give SPEC or --engine MODULE:FACTORY, not both"),
    (["audit", "--engine", f"{SMALL}:triton", "--mode", "idle"], "Error: invalid --mode 'idle'"),
    (["audit", "--engine", f"{SMALL}:triton", "--batch-size", "5"], "Error: invalid --batch-size 5: "
                                                                      f"{SMALL}:triton serves at most 4 requests"),
    (["verify"], "Error: give SPEC (a backend spec or step shape) or --engine MODULE:FACTORY"),
    (["verify", "--engine", f"{SMALL}:triton", "--unsafe-skip-soundness-check"],
     "Error: --unsafe-skip-soundness-check is for SPEC"),
])
def test_bad_engine_input_exits_2_with_one_line(cli, args, message):
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith(message), result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("factory", ["nothing", "EMPTY"])
@pytest.mark.parametrize("command", ["audit", "verify"])
def test_a_factory_that_gives_no_backend_is_bad_input(cli, command, factory):
    result = cli(command, "--engine", f"{SMALL}:{factory}")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"Error: --engine {SMALL}:{factory}: the factory gave no backend (an empty list "
                                     "or mapping); return at least one adapted backend")


def test_an_engine_module_in_the_current_folder_is_found_as_python_m_finds_it(script, cli, tmp_path, monkeypatch):
    (tmp_path / "mymodule.py").write_text(
        "from tests.engine.cli_engines import triton\n\ndef factory():\n    return triton()\n")
    (tmp_path / "tests").symlink_to(__import__("pathlib").Path(__file__).resolve().parents[1])
    # the installed script: its sys.path starts at the script's folder, not the current one
    run = script("audit", "--engine", "mymodule:factory", "--mode", "decode", "--batch-size", "2", cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("engine: mymodule:factory")
    # what the error names is the same in any process: this one's
    monkeypatch.chdir(tmp_path)
    missing = cli("audit", "--engine", "not_here:factory")
    assert missing.exit_code == 2
    assert missing.stderr.strip().endswith(f"(looked in the current folder, {tmp_path}, and on sys.path)")


def test_verify_json_names_each_row_policy_as_spec_verify_does(cli):
    rows = json.loads(cli("verify", "--engine", f"{SMALL}:triton", "--steps", "2", "--batch-size", "2", "--policy",
                          "exact", "--json").output)
    assert [r["policy"] for r in rows] == ["EXACT", "ENGINE RUNNER"]
    assert all(r["policy"] == r["fence"] for r in rows)  # the schema-1 name, kept


def test_verify_header_names_the_observer_that_produced_a_rows_evidence(cli):
    result = cli("verify", "--engine", f"{SMALL}:minimax_hybrid", "--steps", "2", "--batch-size", "2", "--policy",
                 "exact")
    assert result.exit_code == 1
    header = next(x for x in result.output.splitlines() if x.startswith("verified "))
    assert header.endswith("checks: poison, guard and the runtime read observer")
    assert "(evidence: observer)" in result.output


def test_several_engines_end_with_a_summary_and_a_total(cli):
    audited = cli("audit", "--engine", f"{SMALL}:PAIR", "--mode", "decode", "--batch-size", "2")
    assert audited.exit_code == 0, audited.output
    lines = audited.output.splitlines()
    start = lines.index("summary: each engine backend's one declaration against each buffer's truth (* observed, "
                        "not traced)")
    assert lines[start + 1].split() == ["backend", "mode", "declares", "truth", "verdict"]
    rows = {x.split()[0]: x for x in lines[start + 2:start + 4]}
    assert "r2t, lens IN" in rows["TritonBackend"] and "sound, conservative +" in rows["TritonBackend"]
    assert "POST*" in rows["HostBounds"]  # observed, not traced
    assert lines[-1] == "2 engine backends: 2 sound, 0 unsound"
    verified = cli("verify", "--engine", f"{SMALL}:PAIR", "--steps", "2", "--batch-size", "2", "--policy", "exact")
    assert verified.exit_code == 0, verified.output
    assert verified.output.splitlines()[-1] == "2 engine backends: 2 clean, 0 with findings"
