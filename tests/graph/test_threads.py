"""Work a stage hands to another thread: no fence covers it, so readfence refuses it.

The tracer and the read observer follow the stage's own thread only: a thread the stage starts
(joined or not), or a job it submits to a thread pool, is refused while the stage is traced or
observed, naming backend, stage, the thread and the user's line. A stage whose Python runs in
the step (it escapes the tracer) may start one on a path the trace did not take: the step then
fails when such work is still running as the stage returns, and ``verify`` reports it. The
late reader each case hides is real: the thread copies the live lengths after a sleep, or, in a
stage's Python run in the step, once the test lets it go: it is then still running when the stage
returns however late the machine schedules anything.

The backends are written through the public ``leaf`` API.
"""

from __future__ import annotations

import _thread
import concurrent.futures
import threading
import time

import pytest
import torch

from readfence.core import ForwardMode, StageThreadError, audit, observe
from readfence.effects import ReadEnd
from readfence.graph import CpuDevice, DeviceError, Policy, decode_loop, lower, run_overlapped, run_serial, verify
from tests.adversarial import _every, _gather, body_reader
from tests.conftest import SMALL as CFG

M = ForwardMode
STEPS, BATCH = 6, 4
SEEN: dict[str, torch.Tensor] = {}  # what the late readers copied


def _late_copy(shared) -> None:
    time.sleep(0.002)
    SEEN["lens"] = shared["seq_lens"].clone()


RELEASED = threading.Event()  # lets a held reader go: set when a test that armed one ends


def _held_copy(shared) -> None:
    RELEASED.wait(60.0)
    SEEN["lens"] = shared["seq_lens"].clone()


def _thread_left_running(s, b, m, layer, q):
    threading.Thread(target=_late_copy, args=(s,), name="late-reader").start()
    return _gather(s["seq_lens"], b)


def _thread_joined(s, b, m, layer, q):
    t = threading.Thread(target=_late_copy, args=(s,), name="joined-reader")
    t.start()
    t.join()
    return _gather(s["seq_lens"], b)


def _timer(s, b, m, layer, q):
    threading.Timer(0.001, _late_copy, args=(s,)).start()
    return _gather(s["seq_lens"], b)


def _raw_thread(s, b, m, layer, q):
    _thread.start_new_thread(_late_copy, (s,))  # the primitive under Thread.start
    return _gather(s["seq_lens"], b)


POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool")
POOL.submit(lambda: None).result()  # its worker already runs: a submit starts no thread


def _pool_job(s, b, m, layer, q):
    POOL.submit(_late_copy, s)
    return _gather(s["seq_lens"], b)


CASES = {
    "thread_left_running": (_thread_left_running, "a thread 'late-reader' running _late_copy"),
    "thread_joined": (_thread_joined, "a thread 'joined-reader' running _late_copy"),
    "timer": (_timer, "running _late_copy"),
    "raw_thread": (_raw_thread, "a thread running _late_copy"),
    "pool_job": (_pool_job, "a thread-pool job running _late_copy"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stage_that_hands_work_to_another_thread_is_refused_by_the_trace_naming_it(name, dev) -> None:
    fn, what = CASES[name]
    backend = body_reader(name, fn)
    for attempt in (lambda: audit(backend, M.DECODE, cfg=CFG),
                    lambda: lower(backend, M.DECODE, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)):
        with pytest.raises(StageThreadError) as info:
            attempt()
        e = info.value
        assert (e.backend, e.stage, e.watcher) == (name, "body", "the trace"), str(e)
        assert what in e.what and e.source.startswith(__file__) and e.source.endswith(f" in {fn.__name__}"), str(e)
        assert "covered by no fence (COARSE included)" in str(e)
    found = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG).failure()
    assert (found.kind, found.evidence, found.stage) == ("thread", "audit", "body") and what in found.op, str(found)


def test_the_read_observer_refuses_a_thread_too() -> None:
    backend = body_reader("joined", _thread_joined)
    with pytest.raises(StageThreadError) as info:
        observe(backend, M.DECODE, cfg=CFG)
    assert (info.value.stage, info.value.watcher) == ("body", "the read observer")


# A stage that runs its Python in the step (a host read escapes the tracer) and starts its late
# reader only once armed: the trace, the audit and the rehearsal never see it.
ARMED = threading.Event()


def _armed_thread(s, b, m, layer, q):
    int(s["seq_lens"].max())  # a host read: the stage runs as Python in every step
    if ARMED.is_set() and layer == 0:
        threading.Thread(target=_held_copy, args=(s,), name="armed-reader", daemon=True).start()
    return _gather(s["seq_lens"], b)


@pytest.fixture
def armed():
    ARMED.clear()
    RELEASED.clear()
    yield ARMED
    ARMED.clear()
    RELEASED.set()  # the readers the armed stage left running end


def test_a_python_stage_that_leaves_a_thread_running_fails_the_step(armed, dev) -> None:
    backend = body_reader("armed", _armed_thread, declare=_every(ReadEnd.POST_REPLAY))
    report = audit(backend, M.DECODE, cfg=CFG).unwrap()  # the traced path starts nothing: sound
    assert report.observed["seq_lens"] is ReadEnd.POST_REPLAY
    clean = run_overlapped(backend, steps=STEPS, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=CFG)
    assert clean.matches(run_serial(backend, steps=STEPS, batch_size=BATCH, cfg=CFG)) and not clean.violations
    with CpuDevice(timeout=30.0) as fresh:
        loop = decode_loop(backend, policy=Policy.PER_BUFFER, device=fresh, batch_size=BATCH, cfg=CFG)
        armed.set()  # lowered and rehearsed: only the steps meet the thread
        with pytest.raises(DeviceError) as info:
            loop.run(STEPS)
    cause = info.value.__cause__
    assert isinstance(cause, StageThreadError) and cause.watcher is None, repr(info.value)
    assert (cause.backend, cause.stage) == ("armed", "body") and "armed-reader" in cause.what
    assert "still running when the stage returned" in str(info.value)


def test_lowering_refuses_a_thread_its_rehearsal_meets(armed) -> None:
    backend = body_reader("armed", _armed_thread, declare=_every(ReadEnd.POST_REPLAY))
    with CpuDevice(timeout=30.0) as fresh:  # the failed rehearsal leaves its stream failed
        lower(backend, M.DECODE, batch_size=BATCH, device=fresh, policy=Policy.PER_BUFFER, cfg=CFG)  # traced, cached
        armed.set()
        with pytest.raises(StageThreadError) as info:  # the backend's error, not a stream's
            lower(backend, M.DECODE, batch_size=BATCH, device=fresh, policy=Policy.PER_BUFFER, cfg=CFG)
    assert (info.value.stage, info.value.watcher) == ("body", "the read observer")


def test_verify_reports_a_thread_a_python_stage_starts(armed) -> None:
    backend = body_reader("armed", _armed_thread, declare=_every(ReadEnd.POST_REPLAY))
    with CpuDevice(timeout=30.0) as fresh:
        lower(backend, M.DECODE, batch_size=BATCH, device=fresh, policy=Policy.PER_BUFFER, cfg=CFG)  # traced, cached
        armed.set()  # the lowering's rehearsal, under the read observer, meets it
        found = verify(backend, M.DECODE, steps=STEPS, batch_size=BATCH, device=fresh, cfg=CFG,
                       policy=[Policy.PER_BUFFER]).failure()
    assert (found.kind, found.evidence, found.policy, found.stage) == ("thread", "observer", Policy.PER_BUFFER, "body")
    assert "armed-reader" in found.op


def _armed_joined(s, b, m, layer, q):
    int(s["seq_lens"].max())  # a host read: the stage runs as Python in every step
    lens = _gather(s["seq_lens"], b)
    if ARMED.is_set():  # work done in another thread and joined: within the stage's own reads
        box: list[torch.Tensor] = []
        t = threading.Thread(target=lambda: box.append(lens * 1), name="joined-helper")
        t.start()
        t.join()
        lens = box[0]
    return lens


def test_threads_outside_a_stage_and_a_thread_a_python_stage_joins_are_left_alone(armed, dev) -> None:
    # the wrappers only look at a thread running a watched stage
    out: list[int] = []
    t = threading.Thread(target=out.append, args=(1,))
    t.start()
    t.join()
    assert out == [1] and POOL.submit(sum, [1, 2]).result() == 3
    backend = body_reader("joined_python", _armed_joined, declare=_every(ReadEnd.POST_REPLAY))
    loop = decode_loop(backend, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG)
    armed.set()  # after the rehearsal: the read observer would refuse even a joined thread
    runs, _ = loop.run(STEPS)
    serial = run_serial(backend, steps=STEPS, batch_size=BATCH, cfg=CFG)
    assert len(runs) == STEPS and all(torch.equal(r.result(30), s) for r, s in zip(runs, serial.logits))


# A stage's Python runs under its own watch (no watcher: work still running when it returns is
# refused) and, in a rehearsal, inside the read observer's (any work refused). Which refused
# must not depend on whether the thread is still running when the stage returns.
def _slow_thread(release: threading.Event) -> threading.Thread:
    t = threading.Thread(target=release.wait, args=(10.0,), name="slow")
    t.start()
    return t


def test_a_watch_inside_a_watched_one_leaves_the_refusal_to_the_watcher_whatever_the_timing() -> None:
    from readfence.core._threads import watch_threads

    release = threading.Event()
    try:
        with pytest.raises(StageThreadError) as info:
            with watch_threads("toy", "body", "the read observer"):
                with watch_threads("toy", "body"):
                    t = _slow_thread(release)  # still running when the inner watch ends
    finally:
        release.set()
        t.join()
    assert (info.value.watcher, info.value.what) == ("the read observer", "a thread 'slow' running Event.wait")


def test_a_watch_inside_an_unwatched_one_still_refuses_work_left_running() -> None:
    from readfence.core._threads import watch_threads

    release = threading.Event()
    try:
        with pytest.raises(StageThreadError) as info:
            with watch_threads("toy", "outer"):
                with watch_threads("toy", "body"):
                    t = _slow_thread(release)
                release.set()  # finished before the outer watch ends: only the inner one can see it
                t.join()
    finally:
        release.set()
    assert (info.value.stage, info.value.watcher) == ("body", None)


def test_the_thread_primitives_are_wrapped_only_while_a_stage_is_watched() -> None:
    from readfence.core._threads import installed, watch_threads

    originals = (threading.Thread.start, concurrent.futures.ThreadPoolExecutor.submit, _thread.start_new_thread)
    assert not installed()
    with watch_threads("toy", "body"):
        assert installed() and threading.Thread.start is not originals[0]
        inner_done = threading.Event()

        def watched_elsewhere() -> None:  # a second watch, on another thread, ending first
            with watch_threads("toy", "body"):
                pass
            inner_done.set()

        t = threading.Thread(target=watched_elsewhere)
        t.start()
        t.join()
        assert inner_done.is_set() and installed()  # still wrapped: this watch has not ended
    assert not installed()
    assert (threading.Thread.start, concurrent.futures.ThreadPoolExecutor.submit, _thread.start_new_thread) == originals
    with CpuDevice(timeout=10.0) as dev:  # a whole audit and lowered run leave nothing behind
        from readfence.backends import paged

        run_overlapped(paged(), M.DECODE, steps=2, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG)
    assert not installed() and threading.Thread.start is originals[0]
