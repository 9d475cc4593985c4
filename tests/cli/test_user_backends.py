"""A backend of the user's own, written in Python, on the command line: ``MODULE:ATTR`` wherever a
spec is taken (a backend value, or a function with no required argument returning one)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.command_runs import run_readfence

MINE = "examples.my_backend:mine"        # README section 3's leaf
MODEL = "examples.my_backend:model"      # a factory: hybrid_linear(mine, linear())
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_plan_and_audit_take_a_backend_value(cli):
    plan = cli("plan", MINE, "--mode", "decode")
    assert plan.exit_code == 0, plan.output
    assert plan.output.startswith("spec: mine  mode: DECODE")
    audit = cli("audit", MODEL, "--mode", "decode", "--batch-size", "2", "--json")
    assert audit.exit_code == 0, audit.output
    rows = json.loads(audit.output)
    assert {r["backend"] for r in rows} >= {"hybrid_linear", "hybrid_linear/children[0]/mine"}
    assert {r["verdict"] for r in rows} == {"exact"}


@pytest.mark.slow
def test_verify_and_demo_take_a_factory_and_write_a_trace_and_a_plot(cli, tmp_path):
    verify = cli("verify", MODEL, "--steps", "2", "--batch-size", "2", "--policy", "exact")
    assert verify.exit_code == 0, verify.output
    assert "verified hybrid_linear(mine, linear) in DECODE" in verify.output
    trace, plot = tmp_path / "run.json", tmp_path / "run.png"
    demo = cli("demo", "--spec", MODEL, "--steps", "3", "--batch-size", "2", "--policy", "exact",
               "--trace", str(trace), "--plot", str(plot))
    assert demo.exit_code == 0, demo.output
    assert "spec: hybrid_linear(mine, linear)" in demo.output
    assert json.loads(trace.read_text())["otherData"]["spec"] == "hybrid_linear(mine, linear)"
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_serve_and_tensor_parallel_ranks_take_it_too(tmp_path):
    # one repetition over two graphs: what is tested is that serve takes the user's backend
    code, out, err = run_readfence(["serve", MODEL, "--steps", "6", "--policy", "exact", "--capture-sizes", "1,2",
                                    "--repeat", "1"], str(tmp_path))
    assert code == 0, out + err
    # each rank imports the module again: run where it is importable (the repository's root)
    code, out, err = run_readfence(["verify", MINE, "--tp", "2", "--steps", "2", "--batch-size", "2", "--policy",
                                    "exact"], str(ROOT))
    assert code == 0, out + err
    assert "[rank 1]" in out and "verified mine in DECODE" in out


def test_a_module_in_the_current_folder_is_found_as_python_m_finds_it(tmp_path):
    (tmp_path / "backend_in_cwd.py").write_text("from readfence.backends import paged\n\nmine = paged()\n")
    code, out, err = run_readfence(["plan", "backend_in_cwd:mine", "--mode", "decode"], str(tmp_path))
    assert code == 0, out + err
    assert out.startswith("spec: paged  mode: DECODE")


@pytest.mark.parametrize("spec,message", [
    ("examples.my_backend:nope", "Error: invalid SPEC 'examples.my_backend:nope': module 'examples.my_backend' has no "
                                 "attribute 'nope' (from SPEC 'examples.my_backend:nope'); its backends: mine; other "
                                 "names: attend, model, snapshot"),
    ("examples.my_backend:mien", "Error: invalid SPEC 'examples.my_backend:mien': module 'examples.my_backend' has no "
                                 "attribute 'mien' (from SPEC 'examples.my_backend:mien') (did you mean 'mine'?); its "
                                 "backends: mine; other names: attend, model, snapshot"),
    ("examples.my_backend:pre", "Error: invalid SPEC 'examples.my_backend:pre': examples.my_backend:pre is a "
                                "ReadEffect, not a backend: name a backend value"),
    ("examples.my_backend:attend", "Error: invalid SPEC 'examples.my_backend:attend': examples.my_backend:attend takes "
                                   "9 required argument(s)"),
    ("examples/my_backend.py:mine", "Error: invalid SPEC 'examples/my_backend.py:mine': SPEC takes MODULE:ATTR (e.g. "
                                    "mypkg.backends:mine), got 'examples/my_backend.py:mine'; MODULE is a dotted module "
                                    "name as `import` takes it, not a file: write 'examples.my_backend'"),
    ("no_such_module_anywhere:mine", "Error: invalid SPEC 'no_such_module_anywhere:mine': cannot import module "
                                     "'no_such_module_anywhere'"),
    ("tests.engine.cli_engines:triton", "Error: invalid SPEC 'tests.engine.cli_engines:triton': "
                                        "tests.engine.cli_engines:triton() is an adapted engine backend (bound to the "
                                        "state it was built over): audit or verify it with --engine "
                                        "tests.engine.cli_engines:triton"),
])
def test_a_bad_reference_is_one_error_line_naming_what_it_found(cli, spec, message):
    result = cli("plan", spec)
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith(message), result.output
    assert len(result.output.strip().splitlines()) == 1


def test_demo_names_the_option_it_was_given_to(cli):
    result = cli("demo", "--spec", "examples.my_backend:nope")
    assert result.exit_code == 2
    assert result.output.startswith("Error: invalid --spec 'examples.my_backend:nope': module")
