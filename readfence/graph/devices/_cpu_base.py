"""What the parts of a :class:`~readfence.graph.devices.CpuDevice` (its events, streams, graphs and
their work items) rely on of it: its part of the ``Device`` protocol that needs none of them.
They are typed against this base, so that each sits in a module of its own below the device."""

from __future__ import annotations

import time

from ._base import DeviceBase, _check_seconds
from ._context import _take_pending
from ._protocol import Event


class CpuDeviceBase(DeviceBase):
    """The CPU device less its construction and its parts' types (see :class:`CpuDevice`)."""

    cuda_events: bool
    _batches: int  # streams with an open batch()

    def _flush_batches(self) -> None:
        """Before a host wait: hand every open batch's ops to its worker, or the wait could not end."""
        if self._batches:
            with self._lock:
                for s in self._streams.values():
                    if s._pending:
                        s._flush_locked()

    def _refuse_host_wait_while_capturing(self, action: str) -> None:
        if self.cuda_events:
            super()._refuse_host_wait_while_capturing(action)

    # -- inside launched code
    def record_here(self, event: Event) -> None:
        """Record ``event`` at this point of the running launch or graph replay.

        Must be called on the stream's worker thread, from a launched function whose ``ops``
        declare ``Record(event)`` next in order; fires the generation created when the
        launch (or replay) was enqueued.
        """
        _, gen = _take_pending(self._own_event(event))
        gen._fire()

    def stall(self, seconds: float) -> None:
        """From inside a launched function: hold the running stream for about ``seconds``
        without using the CPU (the stream's worker thread sleeps).

        >>> import time
        >>> from readfence.graph.devices import CpuDevice
        >>> with CpuDevice() as dev:
        ...     s = dev.stream("copy engine")
        ...     t0 = time.perf_counter()
        ...     s.launch(dev.stall, 0.05, label="copy"); s.synchronize(timeout=5)
        >>> time.perf_counter() - t0 >= 0.05
        True
        """
        time.sleep(_check_seconds(seconds))

    def _delay(self, stream: str, label: str) -> None:
        if self.faults is not None:
            self.faults.maybe_delay(stream, label)
