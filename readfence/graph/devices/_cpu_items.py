"""The work items a :class:`~readfence.graph.devices.CpuStream`'s worker runs: a launch, a record,
a device-side wait, and the batch that hands several over as one (a graph replay is
``_cpu_graph``'s). Each runs on the worker, given the device and the stream's name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._context import _run_launched
from ._cpu_events import Generation
from ._errors import DeviceTimeout

if TYPE_CHECKING:
    from ._cpu_base import CpuDeviceBase


class _Item:
    label: str

    def run(self, device: CpuDeviceBase, stream: str) -> None:
        raise NotImplementedError

    def skip(self, error: BaseException) -> None:
        """The stream failed or closed before this item ran: fail what it would signal."""


class _Stop(_Item):
    label = "<stop>"


class _Batch:
    """Ops issued in one ``stream.batch()``: one queue item; the worker runs each as its own."""

    __slots__ = ("items",)

    def __init__(self, items: list[_Item]) -> None:
        self.items = items


_STOP = _Stop()


class _LaunchItem(_Item):
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], label: str, tokens: list) -> None:
        self.fn, self.args, self.label, self.tokens = fn, args, label, tokens

    def run(self, device: CpuDeviceBase, stream: str) -> None:
        device._delay(stream, self.label)
        _run_launched(device, stream, self.label, self.fn, self.args, self.tokens)

    def skip(self, error: BaseException) -> None:
        for _, gen in self.tokens:
            gen._fail(error)


class _RecordItem(_Item):
    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.label = gen.label

    def run(self, device: CpuDeviceBase, stream: str) -> None:
        if self.gen.event is not None:
            device._delay(stream, self.label)
        self.gen._fire()

    def skip(self, error: BaseException) -> None:
        self.gen._fail(error)


class _WaitItem(_Item):
    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        assert gen.event is not None
        self.label = gen.event._wait_label

    def run(self, device: CpuDeviceBase, stream: str) -> None:
        timeout = device.timeout
        if not self.gen._wait(timeout):
            raise DeviceTimeout(
                f"{self.gen._what()} (device-side wait on stream {stream!r})",
                stream=self.gen.stream,
                timeout=timeout,
                detail=f"op {self.gen.label!r} has not run",
            )
        if self.gen.error is not None:
            raise self.gen.error
