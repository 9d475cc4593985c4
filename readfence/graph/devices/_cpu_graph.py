"""The graphs of a :class:`~readfence.graph.devices.CpuDevice`: launches and records captured on one
stream, each entry computed at capture, replayed as one work item."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ._base import GraphBase
from ._context import _run_launched
from ._cpu_events import CpuEvent
from ._cpu_items import _Item
from ._errors import StreamError
from ._ops import Op, Record, records_in
from ._protocol import Stream

if TYPE_CHECKING:
    from ._cpu_base import CpuDeviceBase


class _ReplayItem(_Item):
    def __init__(self, graph: CpuGraph, tokens: list[list]) -> None:
        self.graph = graph
        self.tokens = tokens
        self.label = graph.label

    def run(self, dev: CpuDeviceBase, stream: str) -> None:
        for entry, tokens in zip(self.graph._entries, self.tokens, strict=True):
            label = entry.full_label
            try:
                dev._delay(stream, label)
                if entry.fn is None:  # an in-graph record
                    tokens[0][1]._fire()
                else:
                    _run_launched(dev, stream, label, entry.fn, entry.args, tokens)
            except BaseException as exc:
                raise StreamError(stream, label, exc) from exc

    def skip(self, error: BaseException) -> None:
        for tokens in self.tokens:
            for _, gen in tokens:
                gen._fail(error)


@attrs.frozen(eq=False)
class _GraphEntry:
    """A captured launch (``fn(*args)``), or an in-graph record (``fn`` is None). Everything a
    replay needs is computed at capture: a replay is on the host's hot path."""

    fn: Callable[..., Any] | None
    args: tuple[Any, ...]
    label: str
    ops: tuple[Op, ...]
    full_label: str  # graph label / entry label, for errors and fault injection
    records: tuple[Any, ...]  # the events it records, in order

    @classmethod
    def launch(cls, graph: str, fn: Callable[..., Any], args: tuple[Any, ...], label: str,
               ops: tuple[Op, ...]) -> _GraphEntry:
        return cls(fn, args, label, ops, f"{graph}/{label}", records_in(ops))

    @classmethod
    def record(cls, graph: str, event: CpuEvent) -> _GraphEntry:
        label = f"record({event.name})"
        return cls(None, (), label, (Record(event),), f"{graph}/{label}", (event,))


class CpuGraph(GraphBase):
    """Launches and records captured on one stream, replayed as one unit.

    Obtain one from ``with device.capture(stream) as graph:``.
    """

    def __init__(self, device: CpuDeviceBase, stream: Stream, label: str) -> None:
        super().__init__(device, stream, label)
        self._entries: list[_GraphEntry] = []
        self._ops: tuple[Op, ...] | None = None  # cached once sealed

    @property
    def ops(self) -> tuple[Op, ...]:
        """The static op sequence of the graph: its launches' ops and its records, in order."""
        if self._ops is not None:
            return self._ops
        ops = tuple(op for entry in self._entries for op in entry.ops)
        if self._sealed:
            self._ops = ops
        return ops

    def _add(self, entry: _GraphEntry) -> None:
        self._refuse_records(entry.ops, entry.label)
        self._entries.append(entry)

    def replay(self, stream: Stream | None = None, *, step: int | None = None) -> None:
        """Enqueue the whole graph on ``stream`` (default: the capture stream) as one op.

        The generations of the graph's in-graph records are created now, so a wait enqueued
        after this call binds to this replay. ``step`` binds unbound steps of the graph's ops
        for observers.
        """
        target, ops = self._replay_ops(stream, step)
        with self.device._lock:
            self._announce_locked(target, ops)
            name = target.name
            tokens = [[(ev, ev._new_generation(name, entry.full_label)) for ev in entry.records]
                      for entry in self._entries]
            target._put(_ReplayItem(self, tokens))

    def __repr__(self) -> str:
        return f"<CpuGraph {self.label!r}: {len(self._entries)} ops captured on {self.stream.name!r}>"
