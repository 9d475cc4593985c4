"""CpuDevice: FIFO streams, cross-stream events with generations, graphs with in-graph
records, timeouts, sticky stream errors, fault injection and real overlap."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from readfence.effects import Capabilities
from readfence.graph import CpuDevice, Device, DeviceError, DeviceTimeout, FaultInjector, default_device
from readfence.graph.devices import (
    CaptureError,
    DeviceClosed,
    DeviceObserver,
    Event,
    EventNeverRecorded,
    Graph,
    Read,
    Record,
    Stream,
    StreamError,
    Write,
    delay_point,
    record_here,
)

from ._gates import make_gate

T = 60.0  # generous timeout for waits that must succeed (a loaded machine is slow, never wrong)


@pytest.fixture
def dev():
    with CpuDevice(timeout=T) as d:
        yield d


def test_the_cpu_device_and_its_parts_implement_the_protocol(dev):
    # at run time, every member of each protocol is there (mypy checks the signatures: see the
    # _IMPLEMENTS assignments in readfence/graph/devices/_cpu.py and _cuda.py)
    stream, event = dev.stream("forward"), dev.event("e")
    with dev.capture(stream) as graph:
        stream.launch(lambda: None, label="noop")
    assert isinstance(dev, Device) and isinstance(stream, Stream) and isinstance(event, Event)
    assert isinstance(graph, Graph) and event.device is dev
    observer = DeviceObserver()
    dev.add_observer(observer)
    dev.remove_observer(observer)
    assert dev.observers == []
    with pytest.raises(ValueError):
        dev.remove_observer(observer)
    with CpuDevice() as other:
        assert isinstance(other, CpuDevice)  # __enter__ gives the device itself
    with pytest.raises(DeviceClosed):
        other.stream("forward")


def test_stream_is_fifo(dev):
    s = dev.stream("forward")
    out: list[int] = []
    for i in range(200):
        s.launch(out.append, i, label=f"op{i}")
    s.synchronize(timeout=T)
    assert out == list(range(200))


def test_stream_by_name_is_shared_and_events_are_distinct(dev):
    assert dev.stream("a") is dev.stream("a")
    assert dev.event("e") is not dev.event("e")


def test_wait_orders_work_across_streams(dev):
    sched, fwd = dev.stream("schedule"), dev.stream("forward")
    ready = dev.event("ready")
    x = torch.zeros(4)
    seen: list[float] = []
    started = dev.event("started")
    gate, block = make_gate(T)

    sched.launch(block, label="held")
    sched.launch(x.fill_, 2.0, label="write x")
    sched.record(ready)
    fwd.wait(ready)
    fwd.record(started)
    fwd.launch(lambda: seen.append(x.sum().item()), label="read x")
    with pytest.raises(DeviceTimeout):  # the forward waits for the held write, however long
        fwd.synchronize(timeout=0.2)
    assert seen == []
    gate.set()
    dev.synchronize(timeout=T)
    assert seen == [8.0]
    assert ready.timestamp is not None and started.timestamp is not None
    assert started.timestamp >= ready.timestamp


def test_without_wait_there_is_no_order(dev):
    """Broken counterpart of the test above: with no wait, the forward reads before the write."""
    sched, fwd = dev.stream("schedule"), dev.stream("forward")
    gate, block = make_gate(T)
    x = torch.zeros(4)
    seen: list[float] = []
    sched.launch(block, label="slow")
    sched.launch(x.fill_, 2.0, label="write x")
    fwd.launch(lambda: seen.append(x.sum().item()), label="read x")
    fwd.synchronize(timeout=T)
    gate.set()
    dev.synchronize(timeout=T)
    assert seen == [0.0]


def test_wait_binds_to_latest_record_at_call_time(dev):
    a, b = dev.stream("a"), dev.stream("b")
    ev = dev.event("fence")
    gate1, block1 = make_gate(T)
    gate2, block2 = make_gate(T)
    ran = threading.Event()
    a.launch(block1, label="block1")
    a.record(ev)  # generation 1
    b.wait(ev)  # binds to generation 1
    b.launch(ran.set, label="after gen 1")
    a.launch(block2, label="block2")
    a.record(ev)  # generation 2, enqueued after the wait
    assert ev.generation == 2
    gate1.set()
    assert ran.wait(T), "the wait must be satisfied by generation 1 alone"
    assert not ev.query(), "generation 2 is still blocked"
    gate2.set()
    ev.synchronize(timeout=T)
    assert ev.latest is not None and ev.latest.index == 2 and ev.latest.fired


def test_in_graph_record_fires_mid_replay(dev):
    fwd = dev.stream("forward")
    mid, end = dev.event("mid"), dev.event("end")
    gate, block = make_gate(T)
    trace: list[str] = []
    with dev.capture(fwd, label="step") as g:
        fwd.launch(trace.append, "prepare", label="prepare")
        fwd.record(mid)
        fwd.launch(block, label="body")
        fwd.launch(trace.append, "body done", label="tail")
    assert trace == [] and mid.generation == 0
    assert [type(op) for op in g.ops] == [Record] and g.records == (mid,)
    g.replay(step=0)
    fwd.record(end)
    mid.synchronize(timeout=T)  # returns while the replay is still blocked in "body"
    assert trace == ["prepare"]
    assert not end.query()
    gate.set()
    end.synchronize(timeout=T)
    assert trace == ["prepare", "body done"]
    assert mid.timestamp < end.timestamp


def test_record_here_fires_at_that_point_of_a_launch(dev):
    fwd, other = dev.stream("forward"), dev.stream("other")
    ev = dev.event("last read")
    gate, block = make_gate(T)
    order: list[str] = []

    def body():
        order.append("read")
        dev.record_here(ev)
        block()
        order.append("rest")

    with dev.capture(fwd, label="g") as g:
        fwd.launch(body, label="body", ops=[Read("req_to_token", "attend", None), Record(ev)])
    g.replay(step=3)
    other.wait(ev)
    other.launch(order.append, "scheduler", label="sched")
    other.synchronize(timeout=T)  # the other stream proceeds while the graph is blocked
    assert order == ["read", "scheduler"]
    gate.set()
    fwd.synchronize(timeout=T)
    assert order == ["read", "scheduler", "rest"]


def test_several_events_at_different_points_of_one_replay(dev):
    fwd = dev.stream("forward")
    e1, e2 = dev.event("e1"), dev.event("e2")

    gate, block = make_gate(T)

    def body():  # the module-level helpers are what an FX call_function node targets
        record_here(e1)
        delay_point("between")
        block()
        record_here(e2)

    with dev.capture(fwd) as g:
        fwd.launch(body, label="body", ops=[Record(e1), Record(e2)])
    g.replay()
    e1.synchronize(timeout=T)  # fired while the replay is held between the two
    assert not e2.query()
    gate.set()
    fwd.synchronize(timeout=T)
    assert e1.timestamp <= e2.timestamp


def test_replay_twice_gives_two_generations_and_waits_bind_per_replay(dev):
    fwd, s1, s2 = dev.stream("forward"), dev.stream("sched1"), dev.stream("sched2")
    ev, after1, after2 = dev.event("fence"), dev.event("after1"), dev.event("after2")
    gate, block = make_gate(T)
    calls = iter(range(2))
    seen: list[int] = []

    def body():
        i = next(calls)
        if i == 1:
            block()  # replay 1 is held before its record
        dev.record_here(ev)
        seen.append(i)

    with dev.capture(fwd, label="step") as g:
        fwd.launch(body, label="body", ops=[Record(ev)])
    g.replay(step=0)
    s1.wait(ev)  # binds to replay 0's record
    s1.record(after1)
    g.replay(step=1)
    s2.wait(ev)  # binds to replay 1's record
    s2.record(after2)
    assert ev.generation == 2
    after1.synchronize(timeout=T)  # satisfied while replay 1 is still held
    assert seen == [0]
    assert not after2.query()
    gate.set()
    after2.synchronize(timeout=T)
    assert seen == [0, 1] and ev.latest.index == 2
    assert after2.timestamp >= ev.latest.timestamp


def test_waiting_on_a_never_recorded_event_is_an_error(dev):
    ev = dev.event("fence")
    with pytest.raises(EventNeverRecorded, match="'fence'.*never recorded"):
        dev.stream("schedule").wait(ev)
    with pytest.raises(EventNeverRecorded, match="'fence'"):
        ev.synchronize(timeout=0.1)
    with pytest.raises(EventNeverRecorded):
        ev.query()


def test_host_wait_times_out_quickly_naming_event_and_stream(dev):
    fwd = dev.stream("forward")
    gate, block = make_gate(T)
    fence = dev.event("fence")
    fwd.launch(block, label="stuck body")
    fwd.record(fence)
    with pytest.raises(DeviceTimeout) as info:  # the wait's own timeout, not the device's T
        fence.synchronize(timeout=0.2)
    msg = str(info.value)
    assert "'fence'" in msg and "'forward'" in msg and "0.2" in msg and info.value.timeout == 0.2
    with pytest.raises(DeviceTimeout, match="stream 'forward'.*'stuck body'"):
        fwd.synchronize(timeout=0.1)
    with pytest.raises(TimeoutError):  # DeviceTimeout is a TimeoutError
        dev.synchronize(timeout=0.1)
    gate.set()
    fence.synchronize(timeout=T)


def test_device_side_wait_times_out_and_fails_the_waiting_stream():
    with CpuDevice(timeout=0.2) as dev:
        fwd, sched = dev.stream("forward"), dev.stream("schedule")
        gate, block = make_gate(T)
        fence = dev.event("fence")
        fwd.launch(block, label="stuck")
        fwd.record(fence)
        sched.wait(fence)
        sched.launch(lambda: None, label="write")
        with pytest.raises(StreamError) as info:
            sched.synchronize(timeout=T)
        assert info.value.stream == "schedule"
        assert isinstance(info.value.__cause__, DeviceTimeout)
        assert "'fence'" in str(info.value)
        gate.set()
        fwd.synchronize(timeout=T)


def test_exception_surfaces_at_next_wait_with_context(dev):
    fwd, sched = dev.stream("forward"), dev.stream("schedule")
    fence, done = dev.event("fence"), dev.event("done")
    later: list[str] = []

    def boom():
        raise ValueError("bad index")

    fwd.launch(boom, label="attend[3]")  # enqueue does not raise
    fwd.launch(later.append, "skipped", label="after")
    fwd.record(fence)
    with pytest.raises(StreamError) as info:
        fence.synchronize(timeout=T)
    err = info.value
    assert err.stream == "forward" and err.label == "attend[3]"
    assert isinstance(err.__cause__, ValueError)
    assert "stream 'forward' failed in op 'attend[3]': ValueError: bad index" in str(err)
    assert "sticky, as on CUDA" in str(err) and "open a new device" in str(err)  # a later run's error says why
    # a stream that waits on the failed one fails too, with the chain kept
    sched.wait(fence)
    sched.record(done)
    with pytest.raises(StreamError) as info2:
        done.synchronize(timeout=T)
    assert info2.value.stream == "schedule" and info2.value.__cause__ is err
    with pytest.raises(StreamError):
        fwd.synchronize(timeout=T)
    assert later == []  # later ops on a failed stream are skipped
    assert fwd.error is err


def test_exception_inside_graph_replay_names_graph_and_op(dev):
    fwd = dev.stream("forward")

    def boom():
        raise RuntimeError("kaboom")

    with dev.capture(fwd, label="decode_bs4") as g:
        fwd.launch(lambda: None, label="prepare")
        fwd.launch(boom, label="layer0.attend")
    g.replay()
    with pytest.raises(StreamError, match="'decode_bs4/layer0.attend'.*kaboom"):
        fwd.synchronize(timeout=T)


def test_record_here_must_be_declared_and_in_order(dev):
    fwd = dev.stream("forward")
    a, b = dev.event("a"), dev.event("b")
    with pytest.raises(CaptureError, match="outside a launched function"):
        dev.record_here(a)
    fwd.launch(lambda: dev.record_here(a), label="undeclared")
    with pytest.raises(StreamError, match="not declared") as info:
        fwd.synchronize(timeout=T)
    assert isinstance(info.value.__cause__, CaptureError)

    s2 = dev.stream("s2")
    s2.launch(lambda: (dev.record_here(b), dev.record_here(a)), label="swapped", ops=[Record(a), Record(b)])
    with pytest.raises(StreamError, match="out of the declared order"):
        s2.synchronize(timeout=T)

    s3 = dev.stream("s3")
    s3.launch(lambda: None, label="forgot", ops=[Record(a)])
    with pytest.raises(StreamError, match="never recorded with record_here"):
        a.synchronize(timeout=T)


def test_platform_without_in_graph_events_refuses_in_graph_records():
    with CpuDevice(in_graph_events=False, timeout=T) as dev:
        assert dev.caps == Capabilities(in_graph_events=False, graphs=True)
        fwd, ev = dev.stream("forward"), dev.event("fence")
        with pytest.raises(CaptureError, match="in_graph_events=False"), dev.capture(fwd) as g:
            fwd.launch(lambda: dev.record_here(ev), label="body", ops=[Record(ev)])
        with pytest.raises(CaptureError, match="capture failed"):
            g.replay()
        # recording after the replay (or from an eager launch) is fine
        with dev.capture(fwd) as g2:
            fwd.launch(lambda: None, label="body")
        g2.replay()
        fwd.record(ev)
        fwd.launch(lambda: dev.record_here(ev), label="eager", ops=[Record(ev)])
        ev.synchronize(timeout=T)
        assert ev.generation == 2


def test_no_graphs_and_no_waits_inside_capture():
    with CpuDevice(graphs=False) as dev:
        with pytest.raises(CaptureError, match="graphs=False"), dev.capture(dev.stream("s")):
            pass
    with CpuDevice(timeout=T) as dev:
        s, ev = dev.stream("s"), dev.event("e")
        s.record(ev)
        with pytest.raises(CaptureError, match="inside a capture"), dev.capture(s):
            s.wait(ev)
        with pytest.raises(CaptureError, match="while it is capturing"), dev.capture(s):
            s.synchronize()


def test_foreign_streams_and_events_are_refused(dev):
    with CpuDevice() as other:
        with pytest.raises(DeviceError, match="not an event of device"):
            dev.stream("s").record(other.event("e"))
        with pytest.raises(DeviceError, match="not a stream of device"), dev.capture(other.stream("s")):
            pass


def _until(condition, timeout: float = T) -> None:
    """Return once ``condition()`` holds; fail if it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.001)


def test_close_fails_pending_work_instead_of_hanging():
    dev = CpuDevice(timeout=T)
    fwd = dev.stream("forward")
    ev = dev.event("fence")
    # runs until close() has begun, then ends: what is queued behind it is skipped, whatever the timing
    fwd.launch(lambda: _until(lambda: dev._closed), label="running")
    fwd.launch(lambda: None, label="queued")
    fwd.record(ev)
    dev.close()
    with pytest.raises(DeviceClosed):
        ev.synchronize(timeout=T)
    with pytest.raises(DeviceClosed, match="closed"):
        fwd.launch(lambda: None)
    with pytest.raises(DeviceClosed):
        fwd.synchronize(timeout=0.1)
    dev.close()  # idempotent
    _until(lambda: all(not s._thread.is_alive() for s in dev.streams))  # no worker thread outlives it


def test_streams_really_overlap():
    """Two streams run at the same time: an op on each meets the other's at a barrier, which
    two streams run one after the other could never pass (ratios are measured in the benchmarks)."""
    with CpuDevice(timeout=T) as dev:
        met = threading.Barrier(2, timeout=T)
        ends = [dev.event(f"end{i}") for i in range(2)]
        a = torch.randn(64, 64)
        for i, name in enumerate(["s0", "s1"]):
            s = dev.stream(name)
            s.launch(torch.mm, a, a, label="mm")
            s.launch(met.wait, label="meet the other stream")
            s.launch(torch.mm, a, a, label="mm")
            s.record(ends[i])
        dev.synchronize()
        assert not met.broken and all(e.query() for e in ends)


def test_observer_sees_every_action_in_enqueue_order(dev):
    class Log(DeviceObserver):
        def __init__(self):
            self.calls = []

        def on_launch(self, stream, label, ops):
            self.calls.append(("launch", stream, label, tuple(ops)))

        def on_record(self, stream, event):
            self.calls.append(("record", stream, event.name))

        def on_wait(self, stream, event):
            self.calls.append(("wait", stream, event.name))

        def on_event_synchronize(self, event):
            self.calls.append(("host-sync-event", event.name))

        def on_stream_synchronize(self, stream):
            self.calls.append(("host-sync-stream", stream))

    log = Log()
    dev.add_observer(log)
    fwd, sched = dev.stream("forward"), dev.stream("schedule")
    fence = dev.event("fence")
    with dev.capture(fwd, label="step") as g:
        fwd.launch(lambda: dev.record_here(fence), label="body", ops=[Read("b", "n"), Record(fence)])
    g.replay(step=4)
    sched.wait(fence)
    sched.launch(lambda: None, label="write", ops=[Write("b", label="w")], step=5)
    fence.synchronize(timeout=T)
    sched.synchronize(timeout=T)
    assert log.calls == [
        ("launch", "forward", "step", (Read("b", "n", 4), Record(fence))),
        ("wait", "schedule", "fence"),
        ("launch", "schedule", "write", (Write("b", 5, "w"),)),
        ("host-sync-event", "fence"),
        ("host-sync-stream", "schedule"),
    ]


def test_fault_injector_is_deterministic_per_seed():
    def run(seed):
        faults = FaultInjector(seed, max_delay_s=0.002, streams=["forward"], probability=0.7)
        with CpuDevice(faults=faults, timeout=T) as dev:
            fwd, sched = dev.stream("forward"), dev.stream("schedule")
            with dev.capture(fwd, label="g") as g:
                fwd.launch(lambda: dev.delay_point("between nodes"), label="a")
                fwd.launch(lambda: None, label="b")
            for i in range(5):
                g.replay(step=i)
                sched.launch(lambda: None, label="w")
            dev.synchronize()
        return faults.log

    log1, log2, log3 = run(1), run(1), run(2)
    assert log1 == log2
    assert log1 != log3
    assert set(log1) == {"forward"}  # only the chosen streams are delayed
    labels = [label for label, _ in log1["forward"]]
    assert labels[:3] == ["g/a", "between nodes", "g/b"]
    assert any(d > 0 for _, d in log1["forward"])
    assert all(0 <= d <= 0.002 for _, d in log1["forward"])


def test_default_device_is_cpu_without_cuda():
    dev = default_device(timeout=1.0)
    try:
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert dev.name.split(":")[0] == expected and dev.timeout == 1.0
    finally:
        dev.close()


# -- CUDA's event semantics ------------------------------------------------------------------------


def test_cuda_events_keep_no_per_record_handle_but_waits_still_bind_at_call_time():
    gate = threading.Event()
    with CpuDevice(timeout=T, cuda_events=True) as dev:
        s, side, ev = dev.stream("forward"), dev.stream("side"), dev.event("e")
        seen = []
        s.launch(gate.wait, T, label="held")
        s.record(ev)  # generation 1
        side.wait(ev)  # binds to generation 1, as cudaStreamWaitEvent does
        side.launch(seen.append, "after 1", label="read")
        s.launch(lambda: None, label="later")
        s.record(ev)  # generation 2: the event is now only this record
        assert (ev.generation, ev.latest, ev.timestamp, ev.single_stream) == (2, None, None, "forward")
        assert not ev.query()
        gate.set()
        ev.synchronize(T)
        side.synchronize(T)
        assert seen == ["after 1"]
        dev.stream("other").record(ev)
        assert ev.single_stream is None  # recorded on two streams


@pytest.mark.parametrize("action", ["event.synchronize", "event.query", "stream.synchronize",
                                    "other_stream.synchronize", "device.synchronize"])
def test_cuda_events_refuse_host_waits_and_queries_while_a_stream_captures(action):
    with CpuDevice(timeout=T, cuda_events=True) as dev:
        s, other, ev = dev.stream("forward"), dev.stream("other"), dev.event("e")
        other.record(ev)
        ev.synchronize(T)
        calls = {"event.synchronize": lambda: ev.synchronize(T), "event.query": ev.query,
                 "stream.synchronize": lambda: s.synchronize(T),
                 "other_stream.synchronize": lambda: other.synchronize(T),
                 "device.synchronize": lambda: dev.synchronize(T)}
        with dev.capture(s, label="g"):
            s.launch(lambda: None, label="a")
            with pytest.raises(CaptureError, match="is capturing"):
                calls[action]()
        calls[action]()  # after the capture: fine


def test_plain_cpu_events_keep_their_handles_and_allow_host_waits_during_a_capture(dev):
    s, other, ev = dev.stream("forward"), dev.stream("other"), dev.event("e")
    other.record(ev)
    with dev.capture(s):
        ev.synchronize(T)
        assert ev.query()
    assert ev.latest is not None and ev.latest.timestamp is not None


# -- batch(): one work item, the same semantics ------------------------------------------------
def test_a_batch_runs_when_it_ends_in_order_with_each_ops_own_error_and_skips(dev):
    s, other = dev.stream("forward"), dev.stream("schedule")
    before, after = dev.event("before"), dev.event("after")
    out: list[str] = []
    seen = []

    class Watch(DeviceObserver):
        def on_launch(self, stream, label, ops):
            seen.append((label, tuple(ops)))

    dev.add_observer(Watch())
    with s.batch():
        s.launch(out.append, "a", label="a", ops=[Read("req_to_token", "n")], step=4)
        s.record(before)
        other.wait(before)  # binds now, to the generation created inside the batch
        with s.batch():  # nested: still one unit
            s.launch(lambda: 1 / 0, label="boom")
        s.launch(out.append, "never", label="skipped")
        s.record(after)
        assert out == [] and seen[0] == ("a", (Read("req_to_token", "n", 4),))  # observers see it now
    other.launch(out.append, "after the wait", label="waiter")
    other.synchronize(timeout=T)
    before.synchronize(timeout=T)
    with pytest.raises(StreamError, match="boom"):
        after.synchronize(timeout=T)
    assert out == ["a", "after the wait"]
    assert isinstance(s.error, StreamError) and "boom" in str(s.error)


def test_a_host_wait_inside_a_batch_hands_over_what_was_issued(dev):
    s, ev = dev.stream("forward"), dev.event("mid")
    out: list[int] = []
    with s.batch():
        s.launch(out.append, 1)
        s.record(ev)
        ev.synchronize(timeout=T)  # would time out if the batch were still held back
        assert out == [1]
        s.launch(out.append, 2)
        s.synchronize(timeout=T)
        assert out == [1, 2]
        s.launch(out.append, 3)
    dev.synchronize(timeout=T)
    assert out == [1, 2, 3]


def test_closing_with_a_batch_open_fails_its_events_instead_of_hanging():
    dev = CpuDevice(timeout=T)
    s, ev = dev.stream("forward"), dev.event("late")
    with s.batch():
        s.record(ev)
        gen = ev._latest
        dev.close()  # hands the batch over, to be skipped
    with pytest.raises(DeviceClosed):
        gen.synchronize(T)
