"""The overlap limit's two sides (``DecodeLoop.time_forward`` / ``time_scheduler``), the
scheduler's synthetic work, ``Device.stall`` and ``open_device``."""

from __future__ import annotations

import time

import pytest
import torch

from readfence.backends import hybrid_linear, linear, paged, trtllm_mha
from readfence.graph import CpuDevice, FaultInjector, Policy, Sanitizer, decode_loop, open_device, run_serial
from readfence.graph.devices import StreamError
from readfence.graph.runtime import synthetic_work

WAIT = 0.05  # seconds of stall per page-table write: far above the tiny forward


def test_stall_holds_the_stream_without_the_host(dev):
    s = dev.stream("copy engine")
    t0 = time.perf_counter()
    s.launch(dev.stall, 0.3, label="stall")
    enqueued = time.perf_counter() - t0
    s.synchronize()
    assert enqueued < 0.3  # the host did not wait
    assert time.perf_counter() - t0 >= 0.3  # the stream did


@pytest.mark.parametrize("bad", [-0.1, "1", None, True])
def test_stall_refuses_bad_seconds_at_the_next_wait(dev, bad):
    s = dev.stream("copy engine")
    s.launch(dev.stall, bad, label="bad stall")
    with pytest.raises(StreamError, match=r"stall needs a number of seconds >= 0") as err:
        s.synchronize()
    assert "bad stall" in str(err.value)


def test_scheduler_alone_takes_at_least_its_stalls_and_forward_alone_does_not(dev):
    loop = decode_loop(hybrid_linear(trtllm_mha(), linear()), policy=Policy.PER_BUFFER, device=dev,
                       write_wait_s=WAIT)
    scheduler = loop.time_scheduler(5)
    forward = loop.time_forward(5)
    assert scheduler >= WAIT  # one stall per step, on the schedule stream
    assert forward < WAIT  # the tiny model's forward, with no scheduler work in it
    assert loop.limit(3) == pytest.approx(1.0 / loop.time_scheduler(3), rel=0.5)


def test_timing_the_two_sides_leaves_nothing_in_flight():
    # Both drain the device before returning: a run right after them races with nothing.
    san = Sanitizer()
    with CpuDevice(timeout=10.0, faults=FaultInjector(seed=3, max_delay_s=0.002), observers=[san]) as dev:
        loop = decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2, write_wait_s=0.001)
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
        decode_loop(paged(), policy=Policy.COARSE, device=dev, write_cost=-3)


def test_the_serial_baseline_does_the_loops_write_work_and_overlaps_none_of_it():
    plain = run_serial(paged(), steps=4, batch_size=2)
    waited = run_serial(paged(), steps=4, batch_size=2, write_wait_s=WAIT)
    assert waited.matches(plain)  # the work changes the time, never the outputs
    assert len(waited.intervals) == 3 and min(waited.intervals) >= WAIT  # every step waited, on one thread
    assert waited.steps_per_s <= 1.0 / WAIT < plain.steps_per_s
    assert run_serial(paged(), steps=2, batch_size=2, write_cost=8).steps == 2
    with pytest.raises(ValueError, match="not both"):
        run_serial(paged(), steps=2, write_cost=8, write_wait_s=0.1)


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
