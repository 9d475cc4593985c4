"""Errors raised by devices: every message names the stream, event or op involved.

>>> err = StreamError("forward", "attend[3]", ValueError("boom"))
>>> print(err)  # doctest: +NORMALIZE_WHITESPACE
stream 'forward' failed in op 'attend[3]': ValueError: boom (the error is sticky, as on CUDA: every later op on
this stream fails with it; open a new device)
"""

from __future__ import annotations

from readfence.effects import ReadfenceError


class DeviceError(ReadfenceError, RuntimeError):
    """Base class of every error raised by a :class:`~readfence.graph.Device`."""


class DeviceTimeout(DeviceError, TimeoutError):
    """A host wait (or a device-side wait on :class:`CpuDevice`) ran past its timeout.

    ``waited_on`` says what was waited on (an event or a stream, by name); ``stream`` is the
    stream whose work would have signalled it (``None`` when unknown).

    >>> print(DeviceTimeout("event 'fence'", stream="forward", timeout=0.2))
    timed out after 0.2 s waiting for event 'fence' (recorded on stream 'forward')
    """

    def __init__(self, waited_on: str, *, stream: str | None, timeout: float, detail: str = "") -> None:
        self.waited_on = waited_on
        self.stream = stream
        self.timeout = timeout
        where = f" (recorded on stream {stream!r})" if stream is not None else ""
        extra = f"; {detail}" if detail else ""
        super().__init__(f"timed out after {timeout:g} s waiting for {waited_on}{where}{extra}")


class StreamError(DeviceError):
    """An op failed on a stream; raised at the next wait or synchronize that depends on it.

    The original exception is ``__cause__``. Once a stream has failed, every later op on it is
    skipped and every event it would have recorded fails with this error (errors are sticky,
    as on CUDA).
    """

    def __init__(self, stream: str, label: str, cause: BaseException) -> None:
        self.stream = stream
        self.label = label
        self.original = cause
        super().__init__(f"stream {stream!r} failed in op {label!r}: {type(cause).__name__}: {cause} (the error is "
                         f"sticky, as on CUDA: every later op on this stream fails with it; open a new device)")
        self.__cause__ = cause


class EventNeverRecorded(DeviceError):
    """A wait (host or device side) on an event that was never recorded.

    On CUDA such a wait silently passes, which hides a fence that was never placed; readfence
    refuses it instead.
    """

    def __init__(self, event: str, action: str) -> None:
        self.event = event
        super().__init__(
            f"{action} on event {event!r}, which was never recorded: "
            "a wait on an unrecorded event would pass without ordering anything"
        )


class CaptureError(DeviceError):
    """Something that cannot happen inside (or outside) a graph capture, with the reason."""

    @classmethod
    def wait_in_capture(cls, stream: str, event: str) -> CaptureError:
        """A stream's wait on an event inside its capture: every device refuses it (a graph
        replays its waits on the events recorded at capture time, not the step's).

        >>> print(CaptureError.wait_in_capture("forward", "sched"))
        stream 'forward' cannot wait on event 'sched' inside a capture; wait before the replay instead
        """
        return cls(f"stream {stream!r} cannot wait on event {event!r} inside a capture; wait before the replay instead")


class DeviceClosed(DeviceError):
    """The device was closed while work or waits were still pending."""
