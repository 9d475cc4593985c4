"""Graphs, in-graph events and host waits as the fences use them, on a GPU.

What the fences rely on: an event recorded inside a graph fires at that point of every
replay, so a stream waiting on it starts before the graph ends and sees what was written
before the record (not after); a replay on another stream carries its records with it; a
failed capture raises a readfence error and leaves the device usable; every host wait times
out instead of hanging; and the overlapped decode loop on CUDA is bit-identical to a serial
run on CUDA, with no sanitizer finding.

Each test runs on ``CudaDevice`` (marked ``cuda``: skipped without CUDA) and, where the
behaviour is the device protocol's rather than torch.cuda's, on ``CpuDevice(cuda_events=True)``
too: that checks the tests themselves (their timings, values and messages) on any machine.
A :class:`Hold` keeps a stream at one point of its work: on the CPU device a gate the test opens
once it has checked what must hold meanwhile, so nothing there depends on how fast the machine
runs; on CUDA, where a stream cannot wait for the host, a spin (``device.stall``:
``torch.cuda._sleep``) long enough for the host's checks. Every host wait has a timeout.
"""

from __future__ import annotations

import threading

import pytest
import torch

from readfence.backends import paged
from readfence.core import ForwardMode
from readfence.effects import ReadEnd
from readfence.graph import CpuDevice, DeviceTimeout, LoopResult, Policy, Sanitizer, Scheduler, decode_loop, lower, run_serial
from readfence.graph.devices import CaptureError
from readfence.graph.lowering import torch_device
from tests.conftest import TWO_LAYERS as CFG

T = 60.0  # every host wait that should succeed
SHORT = 0.1  # s: a spin before the first in-graph record (the host enqueues its waits meanwhile)
LONG = 0.5  # s: a spin after a record (the waiting stream runs meanwhile)
QUICK = 0.05  # s: the timeout of a wait that must time out

DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda), "cpu"]


def _open(kind: str):
    if kind == "cuda":
        from readfence.graph import CudaDevice

        return CudaDevice(timeout=T)
    return CpuDevice(timeout=T, cuda_events=True)


@pytest.fixture(params=DEVICES)
def device(request):
    """A CudaDevice, or a CpuDevice with CUDA's event semantics; all its work done at the end."""
    with _open(request.param) as dev:
        yield dev
        dev.synchronize(timeout=T)


@pytest.fixture
def cuda_device():
    with _open("cuda") as dev:
        yield dev
        dev.synchronize(timeout=T)


def _ready(dev, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``tensors`` on ``dev``, usable from any of its streams: on CUDA they are
    written on the host's stream, which the device's (non-blocking) streams do not wait for."""
    out = [t.to(torch_device(dev)) for t in tensors]
    if torch_device(dev) == "cuda":
        torch.cuda.current_stream().synchronize()
    return out


class Hold:
    """What holds a stream at one point of its work, once per time the point is reached.

    On the CPU device a gate: the stream waits there until the test calls :meth:`open` (once per
    pass), so what the test checks meanwhile cannot depend on timing. On CUDA a spin of
    ``seconds`` (a GPU stream cannot wait for the host): :meth:`open` does nothing there."""

    def __init__(self, dev, seconds: float) -> None:
        self.dev, self.seconds = dev, seconds
        self.passes = None if torch_device(dev) == "cuda" else threading.Semaphore(0)

    def launch(self, stream, label: str) -> None:
        if self.passes is None:
            stream.launch(self.dev.stall, self.seconds, label=label)
        else:
            stream.launch(self._wait, label=label)

    def _wait(self) -> None:
        assert self.passes is not None and self.passes.acquire(timeout=T), "the test never opened the hold"

    def open(self) -> None:
        if self.passes is not None:
            self.passes.release()


def _capture_spins(dev, stream, x: torch.Tensor, segments, *, label: str = "spins"):
    """A graph captured on ``stream``: per ``(hold, event)`` segment, wait at ``hold`` (none if
    ``None``), ``x += 1``, then record ``event`` inside the graph (none if ``None``).

    Its kernels run once before the capture (on CUDA they must load outside it)."""
    stream.launch(x.add_, 0.0, label="warm up")
    stream.launch(dev.stall, 0.001, label="warm up")
    stream.synchronize(timeout=T)
    with dev.capture(stream, label=label) as graph:
        for hold, event in segments:
            if hold is not None:
                hold.launch(stream, label=f"hold {hold.seconds} s")
            stream.launch(x.add_, 1.0, label="x += 1")
            if event is not None:
                stream.record(event)
    return graph


def _copy_after(stream, event, dst: torch.Tensor, src: torch.Tensor) -> None:
    """On ``stream``: wait for ``event``'s latest record, then ``dst.copy_(src)``."""
    stream.wait(event)
    stream.launch(dst.copy_, src, label=f"copy after {event.name}")


def test_capture_spins_builds_the_graph_it_describes():
    with CpuDevice(timeout=T, cuda_events=True) as dev:
        s, a, b = dev.stream("s"), dev.event("a"), dev.event("b")
        (x,) = _ready(dev, torch.zeros(1))
        g = _capture_spins(dev, s, x, [(None, a), (None, None), (None, b)], label="g")
        assert g.records == (a, b)
        assert x.item() == 0.0  # captured, not run
        g.replay()
        b.synchronize(timeout=T)
    assert x.item() == 3.0 and (a.generation, b.generation) == (1, 1)


# -- in-graph records ------------------------------------------------------------------------


def test_a_stream_waiting_on_an_in_graph_record_finishes_before_the_graph_ends(device):
    dev = device
    fwd, side = dev.stream("forward"), dev.stream("side")
    mid, copied, end = dev.event("mid"), dev.event("copied"), dev.event("end")
    x, seen = _ready(dev, torch.zeros(1), torch.full((1,), -1.0))
    first, rest = Hold(dev, SHORT), Hold(dev, LONG)
    graph = _capture_spins(dev, fwd, x, [(first, mid), (rest, None)])
    graph.replay(fwd)
    fwd.record(end)
    _copy_after(side, mid, seen, x)
    side.record(copied)
    first.open()
    copied.synchronize(timeout=T)
    assert not end.query(), "the side stream's work finished only once the graph had ended"
    rest.open()
    end.synchronize(timeout=T)
    assert seen.item() == 1.0, "the side stream did not wait for the in-graph record"
    assert x.item() == 2.0


def test_a_wait_on_an_in_graph_record_sees_what_was_written_before_it_not_after(device):
    dev = device
    fwd = dev.stream("forward")
    first, second = dev.event("first"), dev.event("second")
    x, at_first, at_second = _ready(dev, torch.zeros(1), torch.full((1,), -1.0), torch.full((1,), -1.0))
    holds = [Hold(dev, SHORT), Hold(dev, LONG), Hold(dev, LONG)]
    graph = _capture_spins(dev, fwd, x, list(zip(holds, [first, second, None])))
    for replay in range(2):
        graph.replay(fwd)
        waiting = [dev.stream("after first"), dev.stream("after second")]
        _copy_after(waiting[0], first, at_first, x)
        _copy_after(waiting[1], second, at_second, x)
        for hold, stream in zip(holds, waiting):  # each copy ends while the next hold keeps x
            hold.open()
            stream.synchronize(timeout=T)
        holds[2].open()
        dev.synchronize(timeout=T)
        base = 3.0 * replay
        assert (at_first.item(), at_second.item(), x.item()) == (base + 1, base + 2, base + 3), f"replay {replay}"


def test_a_replay_on_another_stream_runs_there_and_its_records_bind_to_that_replay(device):
    dev = device
    capture, other, side = dev.stream("capture"), dev.stream("other"), dev.stream("side")
    mid, late = dev.event("mid"), dev.event("late")
    x, seen = _ready(dev, torch.zeros(1), torch.full((1,), -1.0))
    holds = [Hold(dev, SHORT), Hold(dev, LONG)]
    graph = _capture_spins(dev, capture, x, list(zip(holds, [mid, late])))
    graph.replay()  # on the capture stream: x is 2 at its end
    for hold in holds:
        hold.open()
    late.synchronize(timeout=T)
    graph.replay(other)
    # binds to the second replay's record (x = 3), not to the first's, which has fired: a wait
    # bound to that one would copy at once, while the second replay's first spin holds x at 2
    _copy_after(side, mid, seen, x)
    capture.synchronize(timeout=LONG / 2)  # nothing of the second replay runs on the capture stream
    assert not late.query(), "the replay on 'other' ended before the capture stream was idle"
    with pytest.raises(DeviceTimeout, match="'late'.*'other'"):
        late.synchronize(timeout=QUICK)  # the event's latest record is the replay on 'other'
    holds[0].open()
    side.synchronize(timeout=T)  # copied at the second replay's mid, while its second hold keeps x at 3
    holds[1].open()
    late.synchronize(timeout=T)
    other.synchronize(timeout=T)
    side.synchronize(timeout=T)
    assert (mid.generation, late.generation, mid.single_stream) == (2, 2, None)
    assert seen.item() == 3.0, "the wait did not bind to the replay on 'other'"
    assert x.item() == 4.0


# -- capture failures ------------------------------------------------------------------------


def _check_usable(dev, stream, x: torch.Tensor, seen: torch.Tensor) -> None:
    """A new capture on ``stream``, replayed, with a stream waiting on its in-graph record."""
    mid = dev.event("mid after the failure")
    x.zero_()
    if torch_device(dev) == "cuda":
        torch.cuda.current_stream().synchronize()
    holds = [Hold(dev, SHORT), Hold(dev, SHORT)]
    graph = _capture_spins(dev, stream, x, list(zip(holds, [mid, None])), label="after the failure")
    graph.replay()
    _copy_after(dev.stream("side"), mid, seen, x)
    holds[0].open()
    dev.stream("side").synchronize(timeout=T)  # copied while the second hold keeps x at 1
    holds[1].open()
    dev.synchronize(timeout=T)
    assert (seen.item(), x.item()) == (1.0, 2.0)


def _refused_actions(dev, capturing, other, ev):
    return {
        "query an event": ev.query,
        "synchronize an event": lambda: ev.synchronize(timeout=T),
        "synchronize the capturing stream": lambda: capturing.synchronize(timeout=T),
        "synchronize another stream": lambda: other.synchronize(timeout=T),
        "synchronize the device": lambda: dev.synchronize(timeout=T),
        "wait on an event": lambda: capturing.wait(ev),
    }


REFUSED = ["query an event", "synchronize an event", "synchronize the capturing stream",
           "synchronize another stream", "synchronize the device", "wait on an event"]


@pytest.mark.parametrize("action", REFUSED)
def test_a_host_wait_or_query_inside_a_capture_is_refused_and_the_device_stays_usable(device, action):
    dev = device
    fwd, other, ev = dev.stream("forward"), dev.stream("other"), dev.event("done elsewhere")
    x, seen = _ready(dev, torch.zeros(1), torch.full((1,), -1.0))
    other.launch(x.add_, 0.0, label="touch x")
    other.record(ev)
    fwd.launch(x.add_, 0.0, label="warm up")
    fwd.synchronize(timeout=T)
    with pytest.raises(CaptureError, match="capturing|capture") as info:
        with dev.capture(fwd, label="refused") as broken:
            fwd.launch(x.add_, 1.0, label="x += 1")
            _refused_actions(dev, fwd, other, ev)[action]()
    assert "'forward'" in str(info.value) or "'done elsewhere'" in str(info.value), str(info.value)
    with pytest.raises(CaptureError, match="capture failed"):
        broken.replay()
    ev.synchronize(timeout=T)  # host waits work again once the capture is over
    _check_usable(dev, fwd, x, seen)


HOST_SYNCS = {
    "tensor.item()": lambda x: x.item(),
    "stream.synchronize()": lambda x: torch.cuda.current_stream().synchronize(),
}


@pytest.mark.cuda
@pytest.mark.parametrize("sync", list(HOST_SYNCS))
def test_a_host_sync_inside_a_capture_fails_it_with_a_capture_error_and_the_device_recovers(cuda_device, sync):
    # torch raises inside the capture, then again when ending the invalidated capture, and
    # torch.cuda.graph then leaves the capture stream current: CudaDevice turns that into a
    # CaptureError naming the graph, the stream and the first error, and restores the stream.
    dev = cuda_device
    fwd = dev.stream("forward")
    x, seen = _ready(dev, torch.zeros(1), torch.full((1,), -1.0))
    fwd.launch(x.add_, 0.0, label="warm up")
    fwd.synchronize(timeout=T)
    host_stream = torch.cuda.current_stream()
    with pytest.raises(CaptureError, match=r"graph 'host sync' on stream 'forward' failed") as info:
        with dev.capture(fwd, label="host sync") as broken:
            fwd.launch(x.add_, 1.0, label="x += 1")
            fwd.launch(HOST_SYNCS[sync], x, label=sync)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert torch.cuda.current_stream() == host_stream
    with pytest.raises(CaptureError, match="capture failed"):
        broken.replay()
    assert x.item() == 0.0  # nothing of the failed capture ran
    _check_usable(dev, fwd, x, seen)


# -- host waits time out -----------------------------------------------------------------------

HOLD = 0.5  # s: how long a stream is held while a host wait times out


def _held(dev, kind: str):
    """Hold a stream (HOLD seconds on CUDA, until opened on the CPU device); returns (host wait
    taking a timeout, what its error names, the hold)."""
    held, ev, hold = dev.stream("held"), dev.event("behind the spin"), Hold(dev, HOLD)
    dev.stream("idle").launch(lambda: None, label="nothing")
    if kind == "in-graph event":
        (x,) = _ready(dev, torch.zeros(1))
        graph = _capture_spins(dev, held, x, [(hold, ev)], label="held")
        graph.replay()
        return ev.synchronize, "event 'behind the spin'.*'held'", hold
    hold.launch(held, label="spin")
    held.record(ev)
    waits = {
        "event": (ev.synchronize, "event 'behind the spin'.*'held'"),
        "stream": (held.synchronize, "stream 'held'"),
        "device": (dev.synchronize, "stream 'held'"),
    }
    return (*waits[kind], hold)


WAITS = ["event", "stream", "device", "in-graph event"]


@pytest.mark.parametrize("kind", WAITS)
def test_every_host_wait_times_out_on_a_held_stream_instead_of_hanging(device, kind):
    dev = device
    wait, names, hold = _held(dev, kind)
    with pytest.raises(DeviceTimeout, match=names) as info:
        wait(timeout=QUICK)
    assert isinstance(info.value, TimeoutError) and info.value.timeout <= QUICK  # its own timeout, not T
    hold.open()
    wait(timeout=T)  # the same wait succeeds once the hold is over


BATCH = 2


def test_a_held_step_times_out_its_fence_and_result_waits(device):
    dev = device
    low = lower(paged(), ForwardMode.DECODE, batch_size=BATCH, device=dev, policy=Policy.PER_BUFFER, cfg=CFG)
    sched, ready, hold = dev.stream("schedule"), dev.event("scheduled"), Hold(dev, HOLD)
    hold.launch(sched, label="slow scheduler")
    sched.record(ready)
    batch = Scheduler(CFG, ForwardMode.DECODE, BATCH).next_step().batch
    run = low.run(batch, step=0, after=[ready])  # the whole step waits for the scheduler
    with pytest.raises(DeviceTimeout) as info:
        run.fence.synchronize(["req_to_token"], timeout=QUICK)
    assert info.value.timeout <= QUICK
    with pytest.raises(DeviceTimeout, match="done"):
        run.result(timeout=QUICK)
    hold.open()
    assert run.result(timeout=T).device.type == torch_device(dev)
    run.fence.synchronize(timeout=T)


# -- the overlapped decode loop on the device --------------------------------------------------

STEPS = 16


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT], ids=lambda p: p.name)
def test_overlapped_paged_decode_is_bit_identical_to_serial_on_the_device_and_clean(device, policy):
    dev = device
    ref = run_serial(paged(), ForwardMode.DECODE, steps=STEPS, batch_size=BATCH, cfg=CFG, device=dev)
    loop = decode_loop(paged(), ForwardMode.DECODE, policy=policy, device=dev, batch_size=BATCH, cfg=CFG)
    low = loop.lowered
    assert low.graphed, "DECODE should replay a captured graph"
    # the page table is released inside the replay: the fence under test is an in-graph record
    assert low.plan.end("req_to_token") is ReadEnd.IN_REPLAY
    assert dev.caps.in_graph_events
    san = Sanitizer()
    dev.add_observer(san)
    try:
        runs, _ = loop.run(STEPS, timeout=T)
    finally:
        dev.remove_observer(san)
    res = LoopResult(policy, [r.logits for r in runs], 0.0)
    assert {t.device.type for t in res.logits} == {torch_device(dev)}
    assert not san.violations, "\n".join(map(str, san.violations[:5]))
    first_bad = next((i for i, (a, b) in enumerate(zip(res.logits, ref.logits)) if not torch.equal(a, b)), None)
    assert first_bad is None, f"{policy.name}: logits differ from the serial run on {dev.name} at step {first_bad}"
    assert res.matches(ref)
