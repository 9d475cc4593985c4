"""Tensor-parallel runs on two processes: every rank checked against its serial run with the
same sharding, and failures that stop every rank, name the rank, and leave no process behind.

Each test spawns two ranks (seconds each): the checks of a healthy run share one launch.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from readfence.backends import hybrid_linear, linear, trtllm_mha
from readfence.graph import Policy, run_serial
from readfence.parallel import TensorParallelError, launch

from . import jobs

pytestmark = pytest.mark.slow  # end to end (the README, the scripts, worker processes): the full suite


@pytest.fixture(scope="module")
def healthy():
    return launch(jobs.every_check, tp=2, deadline_s=240)


def test_every_policy_matches_the_serial_run_with_the_same_sharding_on_every_rank(healthy):
    # verify compares each policy's overlapped run with the serial run bit for bit, under poison
    # on release and the runtime read observer
    assert sorted(healthy) == [0, 1]
    for rank, out in healthy.items():
        assert out["shard"] == (rank, 2, 1, 32)
        assert out["verified"] == [p.name for p in Policy], rank


def test_a_declaration_one_step_early_is_caught_on_every_rank(healthy):
    for out in healthy.values():
        assert tuple(out["caught"]) == ("late read", "req_to_token", 0, "prepare_in_graph", "observer")


def test_the_all_reduces_leave_every_rank_with_the_same_logits(healthy):
    assert healthy[0]["digest"] == healthy[1]["digest"]
    assert healthy[0]["collectives"] == healthy[1]["collectives"] > 0


def test_the_shards_compute_the_unsharded_model_up_to_the_order_of_the_sums(healthy):
    whole = run_serial(hybrid_linear(trtllm_mha(), linear()), steps=jobs.STEPS, batch_size=jobs.BATCH).logits
    sharded = [torch.tensor(t) for t in healthy[0]["reference"]]
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(sharded, whole, strict=True))


def _ended(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


# A rank that fails reports at once (raise), or when its own timeout ends its wait (stall: rank 0's
# all-reduce gives up at 4 s, rank 1's device wait at 6 s): a grace far above those costs nothing
# when they report; a rank that never does (hang) is what the grace is for, and the message says it.
@pytest.mark.parametrize(("action", "grace_s", "kind", "says"), [
    ("raise", 120, "raised", "injected failure in the model body"),
    ("stall", 120, "stalled", "timed out after 6 s"),
    ("hang", 2, "unfinished", "still running 2 s after another rank failed"),
])
def test_a_failing_rank_stops_every_rank_and_is_named(action, grace_s, kind, says):
    # the deadline only keeps a broken launcher from hanging the suite: no outcome above depends on it
    with pytest.raises(TensorParallelError) as caught:
        launch(jobs.faulty_loop, 1, action, tp=2, collective_timeout_s=4, device_timeout_s=6, grace_s=grace_s,
               deadline_s=600)
    error = caught.value
    assert error.culprits == (1,), str(error)
    assert error.failures[1].kind == kind and says in error.failures[1].message, str(error)
    assert error.failures[0].kind == "collective", str(error)  # rank 0 was left waiting in an all-reduce
    assert str(error).startswith("tensor-parallel run of 2 ranks failed on rank 1: rank 1 ")
    assert _ended(error.pids) and not multiprocessing.active_children()


def test_a_rank_that_returns_while_the_others_wait_in_a_collective_is_the_one_named():
    # the rank that left is not a failure of its own, but the all-reduce the others stopped in is
    # one it never joined: it started fewer collectives than they did
    with pytest.raises(TensorParallelError) as caught:
        launch(jobs.returns_early, 0, tp=2, collective_timeout_s=4, device_timeout_s=6, grace_s=120, deadline_s=600)
    error = caught.value
    assert error.culprits == (0,), str(error)
    assert error.failures[0].kind == "returned" and "'skipped'" in error.failures[0].message, str(error)
    assert error.failures[1].kind == "collective", str(error)
    assert str(error).startswith("tensor-parallel run of 2 ranks failed on rank 0: rank 0 returned while the others")
    assert _ended(error.pids) and not multiprocessing.active_children()


def test_bad_arguments_are_named_before_any_process_starts():
    with pytest.raises(ValueError, match=r"tp=3 cannot shard the model: it has heads=2.*allowed: 1, 2"):
        launch(jobs.faulty_loop, tp=3)
    with pytest.raises(ValueError, match="collective_timeout_s"):
        launch(jobs.faulty_loop, tp=2, collective_timeout_s=0)
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda'"):
        launch(jobs.faulty_loop, tp=2, device="tpu")
    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'forkserver', got 'fork'"):
        launch(jobs.faulty_loop, tp=2, start_method="fork")


def test_each_launch_hands_its_ranks_the_environment_as_it_is_then(monkeypatch):
    # the second launch's ranks fork from the server the first one started, with the first one's
    # environment: they still see a variable set, and not one removed, in between
    monkeypatch.setenv("READFENCE_TEST_LAUNCH_ENV", "first")
    monkeypatch.setenv("READFENCE_TEST_LAUNCH_GONE", "there")
    assert launch(jobs.environment, "READFENCE_TEST_LAUNCH_ENV", tp=2) == {0: "first", 1: "first"}
    monkeypatch.setenv("READFENCE_TEST_LAUNCH_ENV", "second")
    monkeypatch.delenv("READFENCE_TEST_LAUNCH_GONE")
    assert launch(jobs.environment, "READFENCE_TEST_LAUNCH_ENV", tp=2) == {0: "second", 1: "second"}
    assert launch(jobs.environment, "READFENCE_TEST_LAUNCH_GONE", tp=1) == {0: None}
