"""CudaDevice on a real GPU (marked ``cuda``; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from readfence.graph import DeviceTimeout, Sanitizer, default_device
from readfence.graph.devices import CaptureError, EventNeverRecorded, Read, Record, StreamError, Write

pytestmark = pytest.mark.cuda

T = 10.0
SPIN = 200_000_000  # torch.cuda._sleep cycles: ~0.1-0.2 s on current GPUs


@pytest.fixture
def dev():
    from readfence.graph import CudaDevice

    with CudaDevice(timeout=T) as d:
        yield d
        torch.cuda.synchronize()


def test_default_device_is_cuda():
    d = default_device()
    assert d.name.startswith("cuda") and d.caps.in_graph_events


def test_wait_orders_work_across_streams(dev):
    sched, fwd = dev.stream("schedule"), dev.stream("forward")
    ready = dev.event("ready")
    x = torch.zeros(1024, device="cuda")
    y = torch.zeros(1024, device="cuda")

    def slow_write():
        torch.cuda._sleep(SPIN)
        x.fill_(3.0)

    sched.launch(slow_write, label="write x")
    sched.record(ready)
    fwd.wait(ready)
    fwd.launch(y.copy_, x, label="read x")
    dev.synchronize(timeout=T)
    assert y.sum().item() == 3.0 * 1024


def test_in_graph_event_fires_before_the_replay_ends(dev):
    fwd = dev.stream("forward")
    mid, end = dev.event("mid"), dev.event("end")
    x = torch.zeros(1, device="cuda")

    def body():
        x.add_(1)
        dev.record_here(mid)
        torch.cuda._sleep(SPIN)
        x.add_(1)

    with dev.capture(fwd, label="step") as g:
        fwd.launch(body, label="body", ops=[Read("x", "add0"), Record(mid)])
    assert g.records == (mid,) and mid.generation == 0
    g.replay(step=0)
    fwd.record(end)
    assert mid.generation == 1
    mid.synchronize(timeout=T)
    assert not end.query(), "the in-graph event must fire while the graph still runs"
    end.synchronize(timeout=T)
    assert x.item() == 2.0


def test_stream_record_inside_capture_is_in_graph(dev):
    fwd = dev.stream("forward")
    mid, end = dev.event("mid"), dev.event("end")
    with dev.capture(fwd, label="step") as g:
        fwd.record(mid)
        fwd.launch(torch.cuda._sleep, SPIN, label="spin")
    g.replay()
    fwd.record(end)
    mid.synchronize(timeout=T)
    assert not end.query()
    end.synchronize(timeout=T)


def test_replay_twice_gives_two_generations_and_wait_binds_to_latest(dev):
    fwd, sched = dev.stream("forward"), dev.stream("schedule")
    fence = dev.event("fence")
    x = torch.zeros(1, device="cuda")
    seen = torch.zeros(1, device="cuda")

    def body():
        x.add_(1)
        dev.record_here(fence)
        torch.cuda._sleep(SPIN)

    with dev.capture(fwd) as g:
        fwd.launch(body, label="body", ops=[Record(fence)])
    g.replay()
    g.replay()
    assert fence.generation == 2
    sched.wait(fence)  # binds to the second replay's record
    sched.launch(seen.copy_, x, label="snapshot")
    dev.synchronize(timeout=T)
    assert seen.item() == 2.0


def test_host_wait_times_out_naming_event_and_stream(dev):
    fwd = dev.stream("forward")
    fence = dev.event("fence")
    fwd.launch(torch.cuda._sleep, 20 * SPIN, label="long")
    fwd.record(fence)
    with pytest.raises(DeviceTimeout, match="'fence'.*'forward'"):
        fence.synchronize(timeout=0.05)
    fence.synchronize(timeout=60)


def test_never_recorded_and_exceptions(dev):
    fwd, sched = dev.stream("forward"), dev.stream("schedule")
    ev = dev.event("fence")
    with pytest.raises(EventNeverRecorded):
        sched.wait(ev)

    def boom():
        raise ValueError("bad")

    fwd.launch(boom, label="attend")
    fwd.record(ev)
    with pytest.raises(StreamError, match="'forward'.*'attend'") as info:
        ev.synchronize(timeout=T)
    assert isinstance(info.value.__cause__, ValueError)


def test_no_in_graph_events_refuses_records_in_capture():
    from readfence.graph import CudaDevice

    dev = CudaDevice(in_graph_events=False)
    fwd = dev.stream("forward")
    with pytest.raises(CaptureError, match="in_graph_events=False"), dev.capture(fwd):
        fwd.record(dev.event("fence"))


def test_sanitizer_sees_inside_cuda_graph_replay(dev):
    san = Sanitizer()
    dev.add_observer(san)
    fwd, sched = dev.stream("forward"), dev.stream("schedule")
    fence = dev.event("fence")
    table = torch.zeros(8, device="cuda")
    out = torch.zeros(8, device="cuda")

    def body():
        out.copy_(table)
        dev.record_here(fence)  # one node too early: "attend" reads after it
        out.add_(table)

    with dev.capture(fwd) as g:
        fwd.launch(body, ops=[Read("table", "prepare"), Record(fence), Read("table", "attend")])
    written = dev.event("written")
    sched.launch(table.fill_, 0.0, ops=[Write("table", 0, "sched")])
    sched.record(written)
    for i in range(3):
        fwd.wait(written)
        g.replay(step=i)
        sched.wait(fence)
        sched.launch(table.fill_, float(i + 1), ops=[Write("table", i + 1, "sched")])
        sched.record(written)
    dev.synchronize(timeout=T)
    assert [(v.reading_node, v.read_step) for v in san.violations] == [("attend", 0), ("attend", 1), ("attend", 2)]


def test_stall_holds_the_stream_not_the_host(dev):
    import time

    s = dev.stream("copy engine")
    done = dev.event("stalled")
    t0 = time.perf_counter()
    s.launch(dev.stall, 1.0, label="stall")  # long enough for a loaded host to reach the query below
    s.record(done)
    assert not done.query()  # enqueued, not waited for: the stream still spins
    done.synchronize(timeout=T)
    assert time.perf_counter() - t0 >= 0.75  # calibrated cycles: about the asked time (a lower bound)
