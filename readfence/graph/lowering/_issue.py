"""Issuing a lowered step: one generated straight-line function per event-ring slot.

``Lowered.run`` is on the scheduler's hot path: it makes about a dozen device calls per step,
and a hand-written loop making the same calls is the bar it is measured against
(``benchmarks/bench_overhead.py``). Written as one general method, it paid at every step for
choices fixed when the slot was built: check mode or not, a measured fence or not, a captured
graph or eager stages, how many events each end records, the labels. :func:`step_issuer`
makes those choices once and emits what is left as straight-line code, with the slot's
events, labels and actions bound as globals of the function: on the CPU device that took
``Lowered.run`` plus the fence wait from 1.11-1.12x of the hand loop's host time to 1.08-1.09x
(with ``Fence`` as a slots object; most of the rest is the batch's shape check).

The function issues exactly the calls the step needs, in stream order, and its source says
which (``Lowered.step_source``):

>>> from readfence.backends import paged
>>> from readfence.core import ForwardMode
>>> from readfence.graph import CpuDevice, Policy, lower
>>> with CpuDevice() as dev:
...     low = lower(paged(), ForwardMode.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER)
...     source = low.step_source(0)
>>> [line.strip() for line in source.splitlines() if line.strip().startswith(("s.", "graph."))]
... # doctest: +NORMALIZE_WHITESPACE
['s.wait(event)', 's.launch(load_batch, static_batch, staged, label=l_load, step=step)',
 's.launch(out_fn, label=l_out, ops=out_ops, step=step)', 'graph.replay(s, step=step)',
 's.launch(logits.copy_, static_logits, label=l_outputs, step=step)', 's.keep(logits)', 's.record(done)']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import attrs
import torch
from torch import Tensor

from readfence.core import BODY, PREPARE_OUT_GRAPH
from readfence.core.internal import define
from readfence.effects import ReadEnd

from ..devices import Event, Stream
from ..devices.internal import copy_all_from_host
from ._batch import gather_code
from ._fence import Fence

if TYPE_CHECKING:
    from ._poison import CheckState
    from ._slot import Slot


class StepRun(NamedTuple):
    """What one ``Lowered.run`` returns: ``step``, ``logits`` (a Tensor, or a tuple of them for
    composite steps; valid once ``fence.done`` fired) and ``fence`` (a :class:`Fence`, or a
    ``JoinedFence`` for composite steps). One is made per step on the host's hot path, with
    ``tuple.__new__`` (a NamedTuple's own constructor costs a Python call).

    >>> run = StepRun(3, None, None)
    >>> run.step, run.fence is None
    (3, True)
    """

    step: int
    logits: Any
    fence: Any

    def __repr__(self) -> str:
        return f"StepRun(step={self.step}, fence={self.fence!r})"

    def result(self, timeout: float | None = None) -> Tensor:
        """Host wait for the whole forward (with timeout), then the logits."""
        self.fence.wait_done(timeout)
        return self.logits


class StepIssuer(Protocol):
    """``issuer(batch, step, after, poison, first, last)``: the arguments of ``Lowered.run``;
    ``source`` is its generated code."""

    source: str

    def __call__(self, batch: Mapping[str, Tensor], step: int | None, after: Sequence[Event],
                 poison: Iterable[str] | None, first: bool, last: bool) -> StepRun: ...


def load_batch(static: Sequence[Tensor], staged: Sequence[Tensor]) -> None:
    """Copy a step's inputs into the graph's static buffers (from the host without blocking it;
    on the CPU device one torch call: the shapes were checked when the step was issued)."""
    copy_all_from_host(static, staged)


@attrs.define(eq=False)
class IssueSeam:
    """What a step issuer takes from its ``Lowered``, and the one thing it changes there.

    The static values (stream, the graph's batch and logits buffers, the labels, the check
    state) are bound into the generated code; the callables are the lowered step's own work
    that the code calls (the stages without a graph, the check mode's start of a step, a
    measured fence). ``runs`` counts the steps issued: ``Lowered.run`` picks its ring slot
    from it.
    """

    label: str
    batch_size: int
    stream: Stream
    batch: Mapping[str, Tensor]  # the graph's static batch buffers, by key
    logits: Tensor  # the graph's static logits buffer
    labels: Mapping[str, str]  # timeline labels of the step's launches, by stage
    check: CheckState | None
    poisons: frozenset[str]  # check mode: what this graph's release points poison by default
    graphed: bool
    measure: bool
    in_graph_work: Callable[[Slot, int | None], None]
    check_start: Callable[[Slot, int, frozenset[str], bool], None]
    measured_fence: Callable[[Slot, int, int], Fence]
    runs: int = 0


def step_issuer(seam: IssueSeam, slot: Slot, index: int) -> StepIssuer:
    """The function that issues one step through ``seam`` on its ring slot ``slot`` (number
    ``index``; see the module doc).

    It counts the run on ``seam`` and the slot's clock, enqueues the step as one batch of the
    stream, resyncs the slot's fence base if the step stops midway, and returns the
    :class:`StepRun`. Its ``source`` attribute is the generated code.
    """
    scope: dict[str, Any] = {
        "seam": seam, "slot": slot, "clock": slot.clock, "s": seam.stream, "label": seam.label,
        "load_batch": load_batch, "static_batch": tuple(seam.batch.values()), "out_fn": slot.out_fn,
        "out_ops": slot.out_ops, "graph": slot.graph, "empty_like": torch.empty_like,
        "static_logits": seam.logits, "done": slot.done, "fence_events": slot.fence_events,
        "new": tuple.__new__, "new_object": object.__new__, "StepRun": StepRun, "Fence": Fence,
        "check": seam.check, "poisons": seam.poisons,
    }
    scope.update({f"l_{short}": seam.labels[name] for short, name in
                  (("load", "load_batch"), ("out", PREPARE_OUT_GRAPH.name), ("outputs", "outputs"))})
    gather = gather_code(seam.label, seam.batch, f" (batch_size={seam.batch_size})")
    scope.update(gather.scope)
    body: list[str] = []

    def emit(*lines: str) -> None:
        body.extend(lines)

    def release(end: ReadEnd) -> None:
        # the end's records, then check mode's poison of what they release
        for i, event in enumerate(slot.at_end[end.rank]):
            scope[f"{end.name.lower()}{i}"] = event
            emit(f"s.record({end.name.lower()}{i})")
        act = slot.act_at_end[end.rank]
        if act is not None:
            scope[f"poison_{end.name.lower()}"] = act
            scope[f"l_poison_{end.name.lower()}"] = f"{seam.label}/poison@{end.name}"
            emit(f"s.launch(poison_{end.name.lower()}, label=l_poison_{end.name.lower()})")

    emit("for event in after:", "    s.wait(event)",
         "s.launch(load_batch, static_batch, staged, label=l_load, step=step)")
    if seam.check is not None:
        emit("seam.check_start(slot, step, poisons if poison is None else frozenset(poison), first)")
    emit("s.launch(out_fn, label=l_out, ops=out_ops, step=step)")
    release(PREPARE_OUT_GRAPH.end)
    emit("graph.replay(s, step=step)" if seam.graphed else "seam.in_graph_work(slot, step)")
    release(BODY.end)  # the graph's last stage: its points follow the replay
    emit("logits = empty_like(static_logits)  # allocated on the host's stream, written on s",
         "s.launch(logits.copy_, static_logits, label=l_outputs, step=step)",
         "s.keep(logits)")
    release(ReadEnd.UNKNOWN)
    if seam.check is not None:
        scope["l_restore"], scope["l_check"] = f"{seam.label}/restore", f"{seam.label}/check"
        emit("if last:",
             "    s.launch(check.restorer(), label=l_restore, step=step)",
             "    s.launch(check.finish, step, label=l_check, step=step)")
    emit("s.record(done)")
    if seam.measure:  # the CpuDevice generations kept: their timestamps give the slack
        fence = ["fence = seam.measured_fence(slot, step, ticket)"]
    else:  # ``fence_of``, inline; a CUDA event keeps no per-record handle
        fence = ["fence = new_object(Fence)", "fence._head = slot.head", "fence._step = step",
                 f"fence._done_handle = {'done.latest' if hasattr(slot.done, 'latest') else 'None'}",
                 "fence._ticket = ticket"]
    source = "\n".join([
        "def issue(batch, step, after, poison, first, last):",
        "    # the batch's tensors: missing keys and wrong shapes are refused before anything is enqueued",
        *(f"    {line}" for line in gather.lines),
        "    if step is None:",
        "        step = seam.runs",
        "    seam.runs += 1",
        "    clock.runs = ticket = clock.runs + 1",
        "    try:",
        "        with s.batch():  # the step is one work item of the stream (CpuDevice)",
        *(f"            {line}" for line in body),
        "    except BaseException:  # a step stopped midway recorded some events: later runs start from here",
        "        slot.rebase(label, tuple([e.generation - ticket for e in fence_events]))",
        "        raise",
        *(f"    {line}" for line in fence),
        "    return new(StepRun, (step, logits, fence))",
        "",
    ])
    issue = cast(StepIssuer, define("issue", source, scope, f"<step issuer of {seam.label} slot {index}>"))
    issue.source = source
    return issue
