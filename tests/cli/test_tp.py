"""``readfence demo --tp N`` and ``readfence verify --tp N``: each rank's report, exit status,
bad input; the launch under torchrun's environment."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

import readfence.parallel
from readfence.parallel import RankFailure, TensorParallelError, launch
from tests.command_runs import ROOT, run_readfence

from ..parallel import jobs

pytestmark = pytest.mark.slow  # end to end (the README, the scripts, worker processes): the full suite

SMALL = ("--steps", "3", "--batch-size", "2")


@pytest.fixture(scope="module")
def demo_tp_json():
    """``readfence demo --tp 2 --policy exact ... --json``, run once (two rank processes) for the
    tests that read its rows."""
    from click.testing import CliRunner

    from readfence.cli import main

    return CliRunner().invoke(main, ["demo", "--tp", "2", "--policy", "exact", *SMALL, "--json"],
                              catch_exceptions=False)


def test_demo_runs_every_rank_against_its_serial_run(demo_tp_json):
    result = demo_tp_json
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["rank"], r["policy"]) for r in rows] == [(0, "COARSE"), (0, "EXACT"), (1, "COARSE"), (1, "EXACT")]
    assert all(r["tp"] == 2 and r["matches_serial"] and r["violations"] == 0 for r in rows), rows
    assert all(r["steps_per_s"] > 0 and r["schema_version"] == 1 for r in rows)


def test_verify_prints_each_rank_report():
    # the run docs/guide/tensor-parallel.md shows (tests/cli/test_readme_commands.py): run once for both
    code, out, err = run_readfence(["verify", "paged", "--tp", "2", "--steps", "4", "--batch-size", "2"], str(ROOT))
    assert code == 0, out + err
    assert out.startswith("tensor parallel: 2 ranks (gloo on cpu), each with its own scheduler")
    assert "reference: on every rank, a serial run with the same sharding" in out
    blocks = out.split("[rank ")[1:]
    assert [b[0] for b in blocks] == ["0", "1"]
    for block in blocks:
        assert "audit: every declaration sound at batch sizes 1, 2, 16" in block
        for policy in ("COARSE    ", "JOINED    ", "PER_BUFFER", "EXACT     "):
            assert f"  {policy} clean; poisoned on release: " in block, block
        assert "  PER_BUFFER clean; poisoned on release: req_to_token, seq_lens" in block
    assert out.rstrip().splitlines()[-1].startswith("every rank: clean under every policy")


@pytest.mark.parametrize(("args", "says"), [
    (("demo", "--tp", "3"), "invalid --tp 3: the tiny model has 2 attention heads and 64 MLP columns"),
    (("demo", "--tp", "2", "--trace", "run.json"), "--trace and --plot draw one process's streams"),
    (("verify", "paged", "--tp", "0"), "invalid --tp '0'"),
])
def test_bad_input_is_one_error_line_before_any_rank_starts(cli, args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli(*args)
    assert result.exit_code == 2 and says in result.output, result.output


def test_a_failed_rank_is_named_and_the_command_exits_1(cli, monkeypatch):
    failures = [RankFailure(0, "collective", "Timed out waiting 60000ms", 20),
                RankFailure(1, "stalled", "timed out after 90 s waiting for event 'done'", 19)]

    def failing(*args, **kwargs):
        raise TensorParallelError(failures, 2)

    monkeypatch.setattr(readfence.parallel, "launch", failing)
    result = cli("demo", "--tp", "2", *SMALL)
    assert result.exit_code == 1
    assert result.output.startswith("Error: tensor-parallel run of 2 ranks failed on rank 1: rank 1 stalled")


@pytest.fixture
def torchrun_env(monkeypatch):
    """This process as rank 0 of a group of one, the way torchrun starts a rank (the store is
    hosted here, as torchrun's agent hosts it)."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left a process group initialised in this process"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    del store


def test_under_torchrun_only_this_rank_runs(torchrun_env):
    import torch.distributed as dist

    assert readfence.parallel.under_torchrun()
    assert launch(jobs.nothing, tp=1) == {0: 0}
    assert not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="rank 0 raised an error after 0 collective"):
        launch(jobs.fails, tp=1)
    assert not dist.is_initialized()  # destroyed whatever the job did
    with pytest.raises(TensorParallelError, match=r"started in a group of 1 ranks \(WORLD_SIZE\), but --tp is 2"):
        launch(jobs.nothing, tp=2)


def _as_torchrun_rank(rank: int, world: int) -> dict[str, str]:
    import os

    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("world", "args", "says"), [
    (1, ("--tp", "2"), "Error: invalid --tp 2: torchrun started this process in a group of 1 rank (WORLD_SIZE=1); "
                       "give --tp 1, or start torchrun with --nproc-per-node 2"),
    (2, ("--tp", "1"), "Error: invalid --tp 1: torchrun started this process in a group of 2 ranks (WORLD_SIZE=2); "
                       "give --tp 2, or start torchrun with --nproc-per-node 1"),
    (2, (), "Error: torchrun started 2 ranks (WORLD_SIZE=2), but --tp is not given: each rank would run its own "
            "unsharded model; add --tp 2, or run without torchrun"),
])
@pytest.mark.parametrize("command", [("demo",), ("verify", "paged")])
def test_a_torchrun_group_that_does_not_match_tp_is_bad_input(command, world, args, says):
    import subprocess

    from .conftest import readfence_script

    run = subprocess.run([readfence_script(), *command, *args], capture_output=True, text=True, timeout=120,
                         env=_as_torchrun_rank(0, world))
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [says] and run.stdout == ""
    if world > 1:
        other = subprocess.run([readfence_script(), *command, *args], capture_output=True, text=True, timeout=120,
                               env=_as_torchrun_rank(1, world))
        assert other.returncode == 2 and other.stderr == ""  # rank 0 alone says why


def test_under_real_torchrun_the_mismatch_is_our_one_line(tmp_path):
    import shutil
    import subprocess
    import sys

    from .conftest import readfence_script

    torchrun = shutil.which("torchrun", path=str(__import__("pathlib").Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    # the installed script by its path, as every other test runs it: torchrun's --no-python looks a bare
    # name up on PATH, where it is only when the environment is activated
    run = subprocess.run([torchrun, "--nproc-per-node", "1", "--no-python", readfence_script(), "demo", "--tp", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    ours = [line for line in run.stderr.splitlines() if line.startswith("Error: ")]
    assert ours == ["Error: invalid --tp 2: torchrun started this process in a group of 1 rank (WORLD_SIZE=1); "
                    "give --tp 1, or start torchrun with --nproc-per-node 2"], run.stderr
    assert "exitcode  : 2" in run.stderr  # torchrun reports the rank's status 2 (and exits 1 itself)


def test_demo_tp_json_rows_carry_what_the_plain_demo_rows_do(cli, demo_tp_json):
    plain = json.loads(cli("demo", "--policy", "exact", *SMALL, "--json").output)
    sharded = json.loads(demo_tp_json.output)
    assert set(plain[0]) | {"rank", "tp"} == set(sharded[0])
    for row in sharded:
        assert (row["spec"], row["device"], row["mode"], row["steps"], row["batch_size"], row["seed"],
                row["write_cost"], row["write_wait_ms"]) == ("hybrid_linear(trtllm_mha, linear)", "cpu", "DECODE", 3,
                                                             2, 0, 0, 5.0)
