"""The sanitizer: vector clocks per stream plus a host agent, graph-aware through ops lists.

Every safety test pairs a correct case with a deliberately broken one that must be caught.
"""

from __future__ import annotations

import pytest
import torch

from readfence.graph import CpuDevice, FaultInjector, Sanitizer, SanitizerError, Violation
from readfence.graph.devices import Read, Record, Write

T = 5.0
B = "req_to_token"


class Ev:
    """A stand-in event for driving the sanitizer by hand."""

    def __init__(self, name: str) -> None:
        self.name = name


def step_ops(fence: Ev, *, fence_after: str) -> list:
    """One replay's ops: prepare reads B, then the body reads B; the fence goes after
    ``fence_after`` ('prepare' is one node too early, 'attend' is exact)."""
    ops: list = [Read(B, "prepare")]
    if fence_after == "prepare":
        ops.append(Record(fence))
    ops.append(Read(B, "attend"))
    if fence_after == "attend":
        ops.append(Record(fence))
    return ops


def drive(fence_after: str, *, wait: bool = True, steps: int = 3) -> Sanitizer:
    """The overlap loop, by hand: replay step i, then write step i+1 behind step i's fence."""
    san = Sanitizer()
    fence, written = Ev("fence"), Ev("written")
    san.on_launch("schedule", "write", [Write(B, 0, "sched")])
    san.on_record("schedule", written)
    for i in range(steps):
        san.on_wait("forward", written)
        san.on_launch("forward", f"replay[{i}]", [op.at(i) for op in step_ops(fence, fence_after=fence_after)])
        if wait:
            san.on_wait("schedule", fence)
        san.on_launch("schedule", "write", [Write(B, i + 1, "sched")])
        san.on_record("schedule", written)
    return san


def test_correctly_fenced_write_is_clean():
    san = drive("attend")
    assert san.violations == [] and san.count == 0
    san.assert_clean()


def test_fence_one_node_too_early_is_reported_with_buffer_node_and_step():
    san = drive("prepare")
    assert san.count == 3
    v = san.violations[0]
    assert v == Violation(
        kind="write-after-read",
        buffer=B,
        reading_node="attend",
        read_step=0,
        reader="forward",
        write_step=1,
        writer="schedule",
        write_label="sched",
    )
    assert str(v) == (
        "write-after-read race on 'req_to_token': the write for step 1 ('sched' on 'schedule') "
        "is not ordered after node 'attend' of step 0 reading it on 'forward'"
    )
    with pytest.raises(SanitizerError, match="3 race"):
        san.assert_clean()


def test_write_with_no_wait_is_reported():
    san = drive("attend", wait=False)
    assert san.count == 3
    assert {v.reading_node for v in san.violations} == {"attend"}
    assert [v.write_step for v in san.violations] == [1, 2, 3]


def test_host_synchronize_then_host_write_is_clean_and_without_sync_is_not():
    for sync in (True, False):
        san = Sanitizer()
        fence = Ev("fence")
        san.on_launch("forward", "replay", [Read(B, "attend", 0), Record(fence)])
        if sync:
            san.on_event_synchronize(fence)
        san.host_write(B, 1, "cpu copy")
        assert san.count == (0 if sync else 1)
        if not sync:
            assert san.violations[0].writer == "<host>"
            assert san.violations[0].write_label == "cpu copy"


def test_stream_and_device_synchronize_order_the_host():
    for sync in ("stream", "device", "other stream"):
        san = Sanitizer()
        san.on_launch("forward", "replay", [Read(B, "attend", 0)])
        san.on_launch("other", "x", [])
        {"stream": lambda san=san: san.on_stream_synchronize("forward"),
         "device": san.on_device_synchronize,
         "other stream": lambda san=san: san.on_stream_synchronize("other")}[sync]()
        san.host_write(B, 1)
        assert san.count == (1 if sync == "other stream" else 0), sync


def test_host_sync_then_launched_write_is_ordered():
    """Work the host enqueues after learning something is ordered after it."""
    san = Sanitizer()
    fence = Ev("fence")
    san.on_launch("forward", "replay", [Read(B, "attend", 0), Record(fence)])
    san.on_event_synchronize(fence)
    san.on_launch("schedule", "write", [Write(B, 1)])
    assert san.count == 0


def test_host_enqueue_alone_orders_nothing_across_streams():
    san = Sanitizer()
    san.on_launch("forward", "replay", [Read(B, "attend", 0)])
    san.on_launch("schedule", "write", [Write(B, 1)])  # enqueued later by the host: still a race
    assert san.count == 1


def test_transitive_ordering_through_two_streams():
    for broken in (False, True):
        san = Sanitizer()
        e1, e2 = Ev("e1"), Ev("e2")
        san.on_launch("forward", "replay", [Read(B, "attend", 0), Record(e1)])
        if broken:  # the relay records e2 before it waits on e1
            san.on_record("relay", e2)
            san.on_wait("relay", e1)
        else:
            san.on_wait("relay", e1)
            san.on_record("relay", e2)
        san.on_wait("schedule", e2)
        san.on_launch("schedule", "write", [Write(B, 1)])
        assert san.count == (1 if broken else 0)


def test_wait_binds_to_the_generation_current_at_wait_time():
    """A wait issued before step 1's replay binds to step 0's fence: writing step 2 then races
    with step 1's reads."""
    for early_wait in (False, True):
        san = Sanitizer()
        fence = Ev("fence")
        san.on_launch("forward", "replay[0]", [Read(B, "attend", 0), Record(fence)])
        if early_wait:
            san.on_wait("schedule", fence)
        san.on_launch("forward", "replay[1]", [Read(B, "attend", 1), Record(fence)])
        if not early_wait:
            san.on_wait("schedule", fence)
        san.on_launch("schedule", "write", [Write(B, 2)])
        assert san.count == (1 if early_wait else 0)
        if early_wait:
            assert san.violations[0].read_step == 1


def test_read_before_write_is_reported():
    for wait in (True, False):
        san = Sanitizer()
        written = Ev("written")
        san.on_launch("schedule", "write", [Write(B, 0, "sched"), Record(written)])
        if wait:
            san.on_wait("forward", written)
        san.on_launch("forward", "replay", [Read(B, "attend", 0)])
        assert san.count == (0 if wait else 1)
        if not wait:
            v = san.violations[0]
            assert v.kind == "read-before-write" and v.reading_node == "attend" and v.write_step == 0
            assert "not ordered after the write for step 0" in str(v)
    # the check can be turned off
    san = Sanitizer(check_reads=False)
    san.on_launch("schedule", "write", [Write(B, 0)])
    san.on_launch("forward", "replay", [Read(B, "attend", 0)])
    assert san.count == 0


def test_reads_of_later_steps_do_not_count_against_an_earlier_write():
    san = Sanitizer(check_reads=False)
    san.on_launch("forward", "replay", [Read(B, "attend", 5)])
    san.on_launch("schedule", "write", [Write(B, 5)])  # only reads of steps < 5 matter
    assert san.count == 0


def test_memory_is_bounded_over_thousands_of_steps():
    san = Sanitizer()
    fence, written = Ev("fence"), Ev("written")
    buffers = [B, "swa_map", "state_slots"]
    for i in range(3000):
        san.on_launch("schedule", "write", [Write(b, i, "sched") for b in buffers] + [Record(written)])
        san.on_wait("forward", written)
        san.on_launch("forward", "replay", [Read(b, f"n{j}", i) for j in range(4) for b in buffers] + [Record(fence)])
        san.on_wait("schedule", fence)
    assert san.count == 0
    assert san.tracked_reads <= 2 * len(buffers)
    assert all(len(h) <= san.write_history for w in san._writes.values() for h in w.values())


def test_unbound_step_and_backwards_write_are_refused():
    san = Sanitizer()
    with pytest.raises(ValueError, match="no step"):
        san.on_launch("forward", "replay", [Read(B, "attend")])
    san.on_launch("schedule", "w", [Write(B, 3)])
    with pytest.raises(ValueError, match="nondecreasing"):
        san.on_launch("schedule", "w", [Write(B, 2)])


def test_raise_on_violation_raises_at_the_racy_call():
    san = Sanitizer(raise_on_violation=True)
    san.on_launch("forward", "replay", [Read(B, "attend", 0)])
    with pytest.raises(SanitizerError, match="'req_to_token'.*'attend'"):
        san.on_launch("schedule", "write", [Write(B, 1)])


# ------------------------------------------------------------------- driven by a real device


def run_loop(fence_after: str, *, steps: int = 30, seed: int = 0) -> tuple[Sanitizer, list[torch.Tensor]]:
    """A small overlapped loop on CpuDevice with delays: the scheduler writes step i+1's page
    table behind step i's fence while the forward replays a graph that reads it in two nodes
    and records the fence from inside with record_here."""
    san = Sanitizer()
    faults = FaultInjector(seed, max_delay_s=0.001)
    outs: list[torch.Tensor] = []
    with CpuDevice(faults=faults, observers=[san], timeout=T) as dev:
        fwd, sched = dev.stream("forward"), dev.stream("schedule")
        fence, written = dev.event("fence"), dev.event("written")
        table = torch.zeros(8)
        out = torch.zeros(8)

        def body():
            out.copy_(table)  # node "prepare" reads the table
            if fence_after == "prepare":
                dev.record_here(fence)
            dev.delay_point("between prepare and attend")
            out.add_(table)  # node "attend" reads it again
            if fence_after == "attend":
                dev.record_here(fence)
            outs.append(out.clone())

        with dev.capture(fwd, label="decode") as g:
            fwd.launch(body, label="body", ops=step_ops(fence, fence_after=fence_after))
        sched.launch(table.fill_, 0.0, label="write", ops=[Write(B, 0, "sched")])
        sched.record(written)
        for i in range(steps):
            fwd.wait(written)
            g.replay(step=i)
            sched.wait(fence)
            sched.launch(table.fill_, float(i + 1), label="write", ops=[Write(B, i + 1, "sched")])
            sched.record(written)
        dev.synchronize()
    return san, outs


def test_device_driven_loop_is_clean_when_fenced_after_the_last_read():
    san, outs = run_loop("attend")
    san.assert_clean()
    assert [o[0].item() for o in outs] == [2.0 * i for i in range(30)]  # bit-identical to serial


def test_device_driven_loop_with_early_fence_is_caught_deterministically():
    """The sanitizer's verdict does not depend on the timing of the run."""
    for seed in (0, 1):
        san, _ = run_loop("prepare", seed=seed)
        assert san.count == 30
        assert {(v.buffer, v.reading_node) for v in san.violations} == {(B, "attend")}
        assert [v.read_step for v in san.violations] == list(range(30))
