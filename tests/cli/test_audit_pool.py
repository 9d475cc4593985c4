"""``readfence audit --jobs N``: worker processes give the reports one process gives, in its order."""

from __future__ import annotations

import threading

import pytest
import torch

from readfence.backends import paged, per_stream, redeclare, tbo, trtllm_mha
from readfence.cli import _audit_pool, _audit_run, _torch_threads
from readfence.core import ForwardMode, clear_trace_cache
from readfence.effects import ReadEffect
from tests.core.test_runs_as import findings

M = ForwardMode
BACKENDS = [tbo(trtllm_mha(), paged()), per_stream(paged(), trtllm_mha())]
MODES = [M.IDLE, M.DECODE]


def test_workers_give_the_reports_of_one_process_in_its_order():
    clear_trace_cache()  # the workers fork from here: let them trace for themselves
    pairs = [(b, m) for b in BACKENDS for m in MODES]
    ready: list[int] = []
    parallel = _audit_pool.audit_in_workers(pairs, jobs=2, batch_sizes=[2], done=ready.append)
    assert parallel is not None and sorted(ready) == [2, 2]
    alone = _audit_run.audit_all(BACKENDS, MODES, batch_sizes=[2], jobs=1)
    assert [(r.path, r.mode) for r in parallel] == [(str(b).split("(")[0], m) for b, m in pairs]
    assert [findings(r) for r in parallel] == [findings(r) for r in alone]


@pytest.mark.slow
def test_the_command_prints_the_same_with_and_without_workers(cli):
    args = ["audit", "tbo(trtllm_mha, paged)", "--mode", "idle", "--mode", "decode", "--batch-size", "2"]
    assert cli(*args, "--jobs", "2").output == cli(*args, "--jobs", "1").output


def test_a_backend_its_spec_does_not_give_back_is_audited_here(cli):
    early = redeclare(paged(), lambda m: ReadEffect.unknown())
    assert not _audit_pool.sendable([paged(), early])
    assert _audit_pool.audit_in_workers([(early, M.DECODE), (early, M.IDLE)], jobs=2, batch_sizes=[1]) is None
    reports = _audit_run.audit_all([early], [M.DECODE, M.IDLE], batch_sizes=[1], jobs=2)  # here instead
    assert [r.declared for r in reports] == [ReadEffect.unknown()] * 2


def _fails(specs, mode, batch_sizes):
    raise RuntimeError("a worker failed")


def test_a_failed_worker_leaves_the_audit_to_this_process(monkeypatch):
    monkeypatch.setattr(_audit_pool, "_audit_mode", _fails)  # the forked workers run it too
    pairs = [(paged(), M.DECODE), (paged(), M.IDLE)]
    assert _audit_pool.audit_in_workers(pairs, jobs=2, batch_sizes=[1]) is None
    assert [r.sound for r in _audit_run.audit_all([paged()], [M.DECODE, M.IDLE], batch_sizes=[1], jobs=2)] == [True] * 2


def test_one_thread_is_undone():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs on one: another count, for the context to restore
    try:
        with _torch_threads.one_intra_op_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_jobs_must_be_a_positive_integer(cli):
    result = cli("audit", "paged", "--jobs", "0")
    assert result.exit_code == 2
    assert result.output.strip() == "Error: invalid --jobs '0': must be a positive integer (1, 2, 3, ...)"


def test_the_progress_bar_leaves_the_workers_forked(monkeypatch):
    # tqdm starts a monitor thread with its first bar, shown or not; with it alive the pool
    # would start its workers from a fork server, each importing torch and readfence again
    alive: list[list[str]] = []

    def workers(pairs, **kwargs):
        alive.append([t.name for t in threading.enumerate()])
        return []

    monkeypatch.setattr(_audit_pool, "audit_in_workers", workers)
    before = {t.name for t in threading.enumerate()}
    assert _audit_run.audit_all(BACKENDS, MODES, progress=True, jobs=2) == []
    assert alive and set(alive[0]) <= before, alive


def test_beside_another_thread_the_workers_fork_from_a_server_that_imported_readfence():
    # a spawned worker, or one a bare fork server starts, imports torch and readfence again (3 s each)
    import multiprocessing.forkserver

    waiting = threading.Event()
    other = threading.Thread(target=waiting.wait, daemon=True)
    other.start()
    try:
        context = _audit_pool._context()
    finally:
        waiting.set()
        other.join(timeout=10)
    assert context.get_start_method() == "forkserver"
    assert _audit_pool.__name__ in multiprocessing.forkserver._forkserver._preload_modules
