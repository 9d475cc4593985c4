"""The overlap limit's two sides (``DecodeLoop.time_forward`` / ``time_scheduler``), the
scheduler's synthetic work, ``Device.stall`` and ``open_device``.

No assertion here depends on how fast the machine is: what a timing method counts is measured
on a clock that only the scheduler's synthetic work advances (a loaded machine cannot move it),
and a real stall is checked by the device's own timestamps, which a sleep never undercuts.
Measured timings belong to ``benchmarks/``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from readfence.backends import hybrid_linear, linear, paged, trtllm_mha
from readfence.graph import CpuDevice, FaultInjector, LoopOptions, Policy, Sanitizer, decode_loop, open_device, run_serial
from readfence.graph.devices import StreamError
from readfence.graph.runtime import synthetic_work

WAIT = 0.05  # seconds of stall per page-table write


class WorkClock:
    """A clock that only the synthetic work moves: ``perf_counter`` for the loop module, and a
    ``sleep`` (the host wait of the serial run) and a ``stall`` (the schedule stream's) that
    advance it by exactly the seconds asked, at once."""

    def __init__(self) -> None:
        self.now, self.lock = 0.0, threading.Lock()

    def perf_counter(self) -> float:
        with self.lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds

    stall = sleep


@pytest.fixture
def clock(monkeypatch):
    """The clock of the loop's modules (the loop, its serial reference) replaced by a :class:`WorkClock`."""
    import readfence.graph.runtime._loop as loop_module
    import readfence.graph.runtime._serial as serial_module

    c = WorkClock()
    monkeypatch.setattr(loop_module, "time", c)
    monkeypatch.setattr(serial_module, "time", c)
    return c


def test_stall_holds_the_stream_on_its_own_thread_without_using_the_cpu(dev):
    s = dev.stream("copy engine")
    before, after = dev.event("before"), dev.event("after")
    seen: dict[str, float | int] = {}

    def stall() -> None:
        seen["thread"], cpu = threading.get_ident(), time.thread_time()
        dev.stall(WAIT)
        seen["cpu"] = time.thread_time() - cpu

    s.record(before)
    s.launch(stall, label="stall")
    s.record(after)
    after.synchronize(timeout=60)
    assert seen["thread"] != threading.get_ident()  # the stream's worker, not the host
    assert after.timestamp - before.timestamp >= WAIT  # held the stream: a sleep never ends early
    assert seen["cpu"] < WAIT / 10  # asleep: a busy wait would use a good part of it, even on a loaded machine


@pytest.mark.parametrize("bad", [-0.1, "1", None, True])
def test_stall_refuses_bad_seconds_at_the_next_wait(dev, bad):
    s = dev.stream("copy engine")
    s.launch(dev.stall, bad, label="bad stall")
    with pytest.raises(StreamError, match=r"stall needs a number of seconds >= 0") as err:
        s.synchronize()
    assert "bad stall" in str(err.value)


def test_each_side_of_the_limit_times_its_own_work_and_nothing_else(dev, clock, monkeypatch):
    # the stall advances the work clock by WAIT at once: each side's time is exactly the work it does
    monkeypatch.setattr(dev, "stall", clock.stall)
    loop = decode_loop(hybrid_linear(trtllm_mha(), linear()), policy=Policy.PER_BUFFER, device=dev,
                       options=LoopOptions(write_wait_s=WAIT))
    assert loop.time_scheduler(5) == pytest.approx(WAIT)  # one page-table stall per step
    assert loop.time_forward(5) == 0.0  # no scheduler work timed (its one write comes before the clock starts)
    assert loop.limit(3) == pytest.approx(1.0 / WAIT)  # 1 / max(forward alone, scheduler alone)
    monkeypatch.setattr(type(loop), "time_forward", lambda self, steps, timeout=None: 2 * WAIT)
    assert loop.limit(3) == pytest.approx(1.0 / (2 * WAIT))  # the slower side bounds it, whichever it is


def test_timing_the_two_sides_leaves_nothing_in_flight():
    # Both drain the device before returning: a run right after them races with nothing.
    san = Sanitizer()
    with CpuDevice(timeout=10.0, faults=FaultInjector(seed=3, max_delay_s=0.002), observers=[san]) as dev:
        loop = decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2,
                           options=LoopOptions(write_wait_s=0.001))
        loop.time_scheduler(3)
        loop.time_forward(3)
        runs, _ = loop.run(8)
    assert len(runs) == 8 and san.violations == []


def test_synthetic_work_kinds(dev):
    assert synthetic_work(dev) is None
    mm = synthetic_work(dev, write_cost=8)
    assert mm().shape == (8, 8)
    with pytest.raises(ValueError, match="not both"):
        synthetic_work(dev, write_cost=8, write_wait_s=0.1)
    with pytest.raises(ValueError, match=">= 0"):
        synthetic_work(dev, write_wait_s=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        decode_loop(paged(), policy=Policy.COARSE, device=dev, options=LoopOptions(write_cost=-3))


def test_the_serial_baseline_does_the_loops_write_work_and_overlaps_none_of_it(clock):
    plain = run_serial(paged(), steps=4, batch_size=2)
    waited = run_serial(paged(), steps=4, batch_size=2, options=LoopOptions(write_wait_s=WAIT))
    assert waited.matches(plain)  # the work changes the time, never the outputs
    assert plain.intervals == (0.0, 0.0, 0.0)  # the work clock: only the write work moves it
    assert waited.intervals == pytest.approx((WAIT, WAIT, WAIT))  # every step waited, all of it, on one thread
    assert waited.steps_per_s == pytest.approx(1.0 / WAIT)
    assert run_serial(paged(), steps=2, batch_size=2, options=LoopOptions(write_cost=8)).steps == 2
    with pytest.raises(ValueError, match="not both"):
        run_serial(paged(), steps=2, options=LoopOptions(write_cost=8, write_wait_s=0.1))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_timing_refuses_bad_step_counts(dev, bad):
    loop = decode_loop(paged(), policy=Policy.COARSE, device=dev, batch_size=2)
    for method in (loop.time_forward, loop.time_scheduler, loop.run):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            method(bad)


def test_open_device_kinds():
    with open_device("cpu", timeout=3) as d:
        assert isinstance(d, CpuDevice) and d.timeout == 3.0
    with open_device("auto") as d:
        assert d.name.split(":")[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"unknown device kind 'gpu'; allowed: auto, cpu, cuda"):
        open_device("gpu")
