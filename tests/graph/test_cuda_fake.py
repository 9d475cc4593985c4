"""CudaDevice against a fake ``torch.cuda`` (runs on any build): what the device asks of torch.

It checks the calls CudaDevice makes, not what a GPU does with them: which stream is current
when an event is recorded or waited on, that host waits and queries are refused during a
capture, how in-graph event support is detected, how ``_sleep`` is calibrated, and that output
tensors are kept for the stream that writes them. ``test_cuda_device.py`` runs on a real GPU.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from readfence.graph.devices import CaptureError, _cuda


class FakeCuda:
    """The parts of ``torch.cuda`` CudaDevice uses; ``log`` records (call, stream, current)."""

    def __init__(self, *, external_events: bool = True, elapsed_ms=(1.0,)) -> None:
        self.log: list[tuple] = []
        self.default = self.Stream()
        self._current = [self.default]
        self.external_events = external_events
        self._elapsed = list(elapsed_ms)
        fake = self

        class Event:
            def __init__(self, enable_timing=False, external=False, **kwargs):
                if external and not fake.external_events:
                    raise TypeError("__init__() got an unexpected keyword argument 'external'")

            def record(self, stream=None):
                fake.log.append(("record", stream, fake.current_stream()))

            def query(self):
                return True

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return fake._elapsed.pop(0) if len(fake._elapsed) > 1 else fake._elapsed[0]

        self.Event = Event

    class Stream:
        def __init__(self, device=None) -> None:
            self.waits = []

        def wait_event(self, event) -> None:
            self.waits.append(event)

    class CUDAGraph:
        def replay(self) -> None:
            pass

    def is_available(self) -> bool:
        return True

    def current_stream(self):
        return self._current[-1]

    @contextlib.contextmanager
    def stream(self, s):
        self._current.append(s)
        try:
            yield
        finally:
            self._current.pop()

    def graph(self, g, stream=None, capture_error_mode=None):
        return self.stream(stream)

    def device(self, index):
        return contextlib.nullcontext()

    def _sleep(self, cycles) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """``make(**options)`` installs a FakeCuda as the ``torch`` CudaDevice sees; returns it."""

    def make(**options) -> FakeCuda:
        fake = FakeCuda(**options)
        monkeypatch.setattr(_cuda, "torch", types.SimpleNamespace(cuda=fake, __version__=torch.__version__))
        return fake

    return make


def test_in_graph_event_support_is_detected_from_the_feature_not_the_version(fake_cuda):
    fake_cuda(external_events=False)
    with _cuda.CudaDevice() as dev:
        assert dev.caps.in_graph_events is False  # a torch >= 2.8 version string, no external events
    fake_cuda(external_events=True)
    _cuda.torch.__version__ = "2.5.0"  # a build whose version alone says no
    with _cuda.CudaDevice() as dev:
        assert dev.caps.in_graph_events is True


def test_sleep_calibration_averages_several_samples_without_the_outliers(fake_cuda):
    # ten samples of 1_000_000 cycles: a slow first one (clocks ramping up), a host hiccup, and
    # eight at 1 ms: the rate is 1e9 cycles/s, whatever the outliers
    fake_cuda(elapsed_ms=[50.0, 1.0, 1.0, 1.0, 0.01, 1.0, 1.0, 1.0, 1.0, 1.0])
    with _cuda.CudaDevice() as dev:
        assert dev._cycles_per_s == pytest.approx(1e9)


def test_records_and_waits_run_with_their_stream_current(fake_cuda):
    fake = fake_cuda()
    with _cuda.CudaDevice() as dev:
        a, b, ev = dev.stream("a"), dev.stream("b"), dev.event("e")
        fake.log.clear()
        a.record(ev)
        assert fake.log == [("record", a.torch, a.torch)]  # not the host's default stream
        b.wait(ev)
        assert b.torch.waits == [ev.torch]


@pytest.mark.parametrize("action", ["event.synchronize", "event.query", "other_stream.synchronize",
                                    "device.synchronize"])
def test_host_waits_and_queries_are_refused_while_a_stream_captures(fake_cuda, action):
    fake_cuda()
    with _cuda.CudaDevice(timeout=1.0) as dev:
        s, other, ev = dev.stream("forward"), dev.stream("other"), dev.event("e")
        other.record(ev)
        calls = {"event.synchronize": lambda: ev.synchronize(1.0), "event.query": ev.query,
                 "other_stream.synchronize": lambda: other.synchronize(1.0),
                 "device.synchronize": lambda: dev.synchronize(1.0)}
        with dev.capture(s, label="g"):
            with pytest.raises(CaptureError, match="is capturing"):
                calls[action]()
        calls[action]()


def test_outputs_are_kept_for_the_stream_that_writes_them(fake_cuda):
    fake_cuda()
    kept = []
    tensor = types.SimpleNamespace(record_stream=kept.append)
    with _cuda.CudaDevice() as dev:
        s = dev.stream("forward")
        s.keep(tensor)
        assert kept == [s.torch]


class InvalidatingFakeCuda(FakeCuda):
    """A FakeCuda whose graph context does what ``torch.cuda.graph`` does after the code inside
    it invalidated the capture: ending the capture raises a bare "previous error" and leaves
    the capture stream current (its ``__exit__`` stops at ``capture_end``)."""

    def __init__(self) -> None:
        super().__init__()
        self.invalidated = False

    @contextlib.contextmanager
    def stream(self, s):
        # as torch.cuda.StreamContext: make s current, then restore what was current on entry
        before, self._current[-1] = self._current[-1], s
        try:
            yield
        finally:
            self._current[-1] = before

    def graph(self, g, stream=None, capture_error_mode=None):
        fake = self

        class Capture:
            def __enter__(self):
                self.before, fake._current[-1] = fake._current[-1], stream

            def __exit__(self, *exc):
                if fake.invalidated:
                    fake.invalidated = False
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                fake._current[-1] = self.before

        return Capture()

    def host_sync(self) -> None:
        """What ``tensor.item()`` or a stream synchronize does inside a capture."""
        self.invalidated = True
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_a_capture_invalidated_by_a_host_sync_fails_with_a_capture_error_and_the_host_stream_back(monkeypatch):
    fake = InvalidatingFakeCuda()
    monkeypatch.setattr(_cuda, "torch", types.SimpleNamespace(cuda=fake, __version__=torch.__version__))
    with _cuda.CudaDevice() as dev:
        s = dev.stream("forward")
        host = fake.current_stream()
        with pytest.raises(CaptureError, match=r"graph 'step' on stream 'forward' failed: RuntimeError: "
                                               r"CUDA error: operation not permitted.*must not wait") as info:
            with dev.capture(s, label="step") as broken:
                s.launch(fake.host_sync, label="x.item()")
        assert "previous error during capture" in str(info.value.__cause__)
        assert "not permitted" in str(info.value.__cause__.__context__)
        assert fake.current_stream() is host  # not the capture stream torch.cuda.graph left current
        with pytest.raises(CaptureError, match="capture failed"):
            broken.replay()
        with dev.capture(s, label="again") as graph:  # the stream captures again
            s.launch(fake._sleep, 1, label="spin")
        graph.replay()
        assert fake.current_stream() is host


def test_errors_raised_inside_a_capture_name_the_graph_and_readfence_refusals_pass_unchanged(fake_cuda):
    fake_cuda()
    with _cuda.CudaDevice(timeout=1.0) as dev:
        s, ev = dev.stream("forward"), dev.event("e")
        s.record(ev)

        def bad() -> None:
            raise ValueError("bad shape")

        with pytest.raises(CaptureError, match=r"graph 'g' on stream 'forward' failed: ValueError: bad shape$") as info:
            with dev.capture(s, label="g"):
                s.launch(bad, label="bad")
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(CaptureError, match=r"^cannot query event 'e' while stream 'forward' is capturing"):
            with dev.capture(s, label="g"):
                ev.query()


def test_each_replay_counts_each_in_graph_record_once(fake_cuda):
    # what a lowered fence derives its generations from (its slot's base plus its run): a graph
    # replay adds exactly one generation per in-graph record, and a capture adds none
    fake_cuda()
    with _cuda.CudaDevice() as dev:
        s, pre, mid, post = dev.stream("forward"), dev.event("pre"), dev.event("mid"), dev.event("post")
        s.record(pre)
        with dev.capture(s, label="step") as graph:
            s.launch(lambda: None, label="prepare_in_graph")
            s.record(mid)
            s.launch(lambda: None, label="body")
        s.record(post)
        base = (pre.generation, mid.generation, post.generation)
        assert base == (1, 0, 1)
        for run in range(1, 4):
            s.record(pre)
            graph.replay(s)
            s.record(post)
            assert (pre.generation, mid.generation, post.generation) == tuple(b + run for b in base)
