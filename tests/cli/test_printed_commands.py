"""Every command an error message or a finding prints runs as printed, pasted into a shell: its
names parse back (``MODULE:FACTORY['key']``) and its quoting survives the shell. An engine whose
own code raises in one mode is that mode's error row: the other modes are still audited."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from readfence.engine import adapt
from readfence.engine import reference as ref
from tests.engine.classes import KeptCopies
from tests.engine.conftest import CFG

HERE = "tests.cli.test_printed_commands"


def minimax_hybrid():
    return ref.minimax_hybrid_engine(CFG)


#: ``--engine tests.cli.test_printed_commands:ENGINES``: one sound backend, one unsound.
ENGINES = {"kept": lambda: adapt(KeptCopies, cfg=CFG), "minimax_hybrid": minimax_hybrid}


class RaisesInDraftExtend(KeptCopies):
    """Sound in every mode but DRAFT_EXTEND, where its own code raises (as SGLang's TBO does)."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if forward_batch.forward_mode.name == "DRAFT_EXTEND":
            raise TypeError("unsupported operand type(s) for *: 'int' and 'NoneType'")
        super().init_forward_metadata_out_graph(forward_batch, in_capture)


def raises_in_draft_extend():
    return adapt(RaisesInDraftExtend, cfg=CFG)


def printed_commands(output: str) -> list[str]:
    """The ``readfence ...`` commands an output shows between backticks."""
    return re.findall(r"`(readfence [^`]+)`", output)


def _run_as_pasted(cli, command: str):
    argv = shlex.split(command)  # what a shell hands the program
    assert argv[0] == "readfence"
    return cli(*argv[1:])


def test_verifys_advice_names_each_member_of_a_mapping_by_a_command_that_runs(cli):
    result = cli("verify", "--engine", f"{HERE}:ENGINES", "--steps", "2", "--batch-size", "2", "--policy", "exact")
    assert result.exit_code == 1, result.output
    commands = printed_commands(result.output)
    assert commands == [f"readfence audit --engine \"{HERE}:ENGINES['minimax_hybrid']\""], result.output
    audit = _run_as_pasted(cli, commands[0])
    assert audit.exit_code == 1, audit.output  # unsound: a finding, not bad input
    assert audit.output.startswith(f"engine: {HERE}:ENGINES['minimax_hybrid']\n")
    assert "UNSOUND: MiniMaxHybridAttnBackend" in audit.output


@pytest.mark.parametrize("reference", [f"{HERE}:ENGINES[minimax_hybrid]", f"{HERE}:ENGINES[\"minimax_hybrid\"]"])
def test_a_key_whose_quotes_a_shell_took_or_changed_still_loads(cli, reference):
    result = cli("audit", "--engine", reference, "--mode", "decode", "--batch-size", "2")
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"engine: {HERE}:ENGINES['minimax_hybrid']\n")


@pytest.mark.parametrize("reference,message", [
    (f"{HERE}:ENGINES['nope']", f"Error: {HERE}:ENGINES has no ['nope'] (from --engine \"{HERE}:ENGINES['nope']\"); "
                                "its keys: 'kept', 'minimax_hybrid'"),
    (f"{HERE}:ENGINES[1 + 1]", f"Error: --engine '{HERE}:ENGINES[1 + 1]': [1 + 1] is not a key"),
    ("tests/cli/test_printed_commands.py:ENGINES", "Error: --engine takes MODULE:FACTORY (e.g. "
                                                   "readfence.engine.reference:triton_engine), got "
                                                   "'tests/cli/test_printed_commands.py:ENGINES'; MODULE is a dotted "
                                                   "module name as `import` takes it, not a file: write "
                                                   "'tests.cli.test_printed_commands' (run from the folder that holds "
                                                   "'tests')"),
])
def test_a_bad_engine_reference_is_one_line_saying_what_to_write(cli, reference, message):
    result = cli("audit", "--engine", reference)
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith(message), line


def test_a_mode_whose_engine_code_raises_is_its_own_row_and_the_rest_is_audited(cli):
    result = cli("audit", "--engine", f"{HERE}:raises_in_draft_extend", "--batch-size", "2")
    assert result.exit_code == 1, result.output  # a mode not audited is a finding, not bad input
    lines = result.output.splitlines()
    assert any(re.match(r"RaisesInDraftExtend\s+DECODE\s+req_to_token\s+PRE_REPLAY\s+PRE_REPLAY\s+traced\s+exact", line)
               for line in lines), result.output
    assert any(re.match(r"RaisesInDraftExtend\s+DRAFT_EXTEND\s+-\s+PRE_REPLAY\s+-\s+error\s+not audited", line)
               for line in lines), result.output
    (error,) = [line for line in lines if line.startswith("ERROR:")]
    assert error.startswith("ERROR: RaisesInDraftExtend in DRAFT_EXTEND: RaisesInDraftExtend.init_forward_metadata_"
                            "out_graph raised TypeError in DRAFT_EXTEND: unsupported operand type(s) for *: 'int' "
                            "and 'NoneType' (at ")
    assert "test_printed_commands.py" in error and error.endswith("nothing was audited in this mode")
    # one mode alone: its error is the one Error: line, as before
    alone = cli("audit", "--engine", f"{HERE}:raises_in_draft_extend", "--batch-size", "2", "--mode", "draft_extend")
    assert alone.exit_code == 2 and alone.output.startswith("Error: RaisesInDraftExtend.init_forward_metadata_out_graph")


def test_the_json_of_an_error_row_says_what_raised(cli):
    import json

    rows = json.loads(cli("audit", "--engine", f"{HERE}:raises_in_draft_extend", "--batch-size", "2", "--mode",
                          "decode", "--mode", "draft_extend", "--json").output)
    (error,) = [r for r in rows if r["verdict"] == "error"]
    assert (error["mode"], error["source"], error["buffer"]) == ("DRAFT_EXTEND", "error", None)
    assert "raised TypeError in DRAFT_EXTEND" in error["error"]
    assert {r["mode"] for r in rows if r["verdict"] != "error"} == {"DECODE"}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_the_readmes_forgetful_tbo_audit_runs_as_printed():
    from tests.command_runs import ROOT, run_readfence

    # the run the docs' prose shows (tests/cli/test_readme_inline_commands.py): run once for both
    code, out, err = run_readfence(shlex.split("audit --engine tests.engine.sglang_engines:forgetful_tbo"), str(ROOT))
    assert code == 1, out + err  # unsound (it does not delegate), and DRAFT_EXTEND raises inside SGLang
    assert "UNSOUND: forgetful_tbo in DECODE: req_to_token declared IN_REPLAY" in out
    assert "ERROR: forgetful_tbo in DRAFT_EXTEND" in out and "Traceback" not in err
