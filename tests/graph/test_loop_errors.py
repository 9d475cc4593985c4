"""A loop that fails part-way settles the device before its error goes on.

The caller handles the error and calls on (another loop on the same engine object, the same
live buffers): a step of the failed loop still running then races that call. Every stream has
run what the failed loop gave it by the time the error reaches the caller.
"""

from __future__ import annotations

import threading

import pytest

from readfence.backends import paged
from readfence.graph import CpuDevice, Policy, decode_loop
from readfence.graph.devices import DeviceTimeout, StreamError
from readfence.graph.runtime.internal import settled_on_error


def test_a_decode_loop_failing_part_way_leaves_no_step_running(dev: CpuDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = decode_loop(paged(), policy=Policy.JOINED, device=dev, batch_size=2)
    forward, done, calls = dev.stream("forward"), [], []
    write = type(loop)._write_state

    def failing_write(self, nxt, wait):  # the scheduler fails writing step 1's state
        calls.append(nxt)
        if len(calls) == 2:  # after step 0 was launched: a slow op queued behind it
            forward.launch(lambda: (dev.stall(0.3), done.append("step 0's stream work")), label="slow")
            raise RuntimeError("the scheduler failed")
        return write(self, nxt, wait)

    monkeypatch.setattr(type(loop), "_write_state", failing_write)
    with pytest.raises(RuntimeError, match="the scheduler failed"):
        loop.run(4)
    assert done == ["step 0's stream work"]  # ran before the error reached the caller


def test_settling_waits_past_a_failed_stream_and_returns_its_error() -> None:
    with CpuDevice() as dev:
        done = []
        dev.stream("a").launch(lambda: 1 / 0, label="broken")
        dev.stream("b").launch(lambda: (dev.stall(0.2), done.append(1)), label="slow")
        errors = dev.settle()
        assert done == [1] and [type(e) for e in errors] == [StreamError]
        assert "ZeroDivisionError" in str(errors[0])


def test_a_device_that_timed_out_is_not_waited_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # its stuck stream would hold the error back by a whole timeout once more
    with CpuDevice() as dev:
        settled: list[float | None] = []
        monkeypatch.setattr(dev, "settle", lambda timeout=None: settled.append(timeout) or ())
        stuck, gate = dev.stream("forward"), threading.Event()
        stuck.launch(gate.wait, 60.0, label="stuck")  # until the test lets it go: the wait below times out
        try:
            with pytest.raises(DeviceTimeout), settled_on_error(dev):
                stuck.synchronize(0.01)
        finally:
            gate.set()
        assert settled == []
        with pytest.raises(RuntimeError, match="the scheduler failed"), settled_on_error(dev, 2.0):
            raise RuntimeError("the scheduler failed")
        assert settled == [2.0]
