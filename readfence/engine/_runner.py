"""A model of an engine's runner: how SGLang publishes its backend's one scalar declaration.

Per step, on the host, the runner resolves one end for all shared buffers and publishes it:

* it asks the backend object (``shared_read_ends(mode)``, now; in EXTEND
  ``resolve_prefill_shared_read_ends(forward_batch, num_qo_tokens=T, build_snapshot=False)``
  when the object has it: prefill decides per batch);
* an ``IN_REPLAY`` end without an in-graph marker event resolves to ``POST_REPLAY`` (the
  model's ``no_marker``: an older SGLang resolved it to ``PRE_REPLAY``, earlier than declared);
* ``PRE_REPLAY`` publishes an event before the replay, ``IN_REPLAY`` hands over the in-graph
  marker, ``POST_REPLAY`` publishes after the replay, ``UNKNOWN`` publishes nothing; a runner
  whose code records the event elsewhere says so in ``places`` (SGLang's single-layer EAGLE
  draft-extend runner records ``IN_REPLAY`` after the replay: it has no in-graph marker);
* the event goes into a one-slot :class:`Mailbox`; the scheduler takes it and clears it, and
  with nothing there waits for the whole forward, so a stale event is never consumed;
* a kill switch forces the coarse barrier (nothing published, the scheduler waits for the
  forward); prefill read-done can be turned off on its own.

:func:`runner_model` makes an adapted backend run under this model on readfence's own loop
(``decode_loop``, ``run_overlapped``, ``verify`` with ``Policy.JOINED``; ``Policy.COARSE``
turns the kill switch on), so an engine's behaviour and readfence's policies are compared
on the same steps. It trusts the declaration, as the engine does: an unsound one races, and
the sanitizer (``run_overlapped``) or poison (``verify``) says so. The declaration methods are
asked on the host while earlier steps may still run: they must not change the object (a
``resolve_prefill_shared_read_ends`` asked with ``build_snapshot=False`` only answers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor

from readfence.backends import Backend
from readfence.core import ForwardMode, ModelConfig
from readfence.core.internal import check_mode, example_step
from readfence.effects import ReadEnd
from readfence.graph import Device, Fence, Lowered, LowerOptions, Policy, StepRun, lower
from readfence.graph.devices import Event
from readfence.graph.lowering import Bound
from readfence.graph.lowering.internal import lowering_options

from ._adapter import EngineBackend, Tensors, check_engine

Switch = bool | Callable[[int], bool]

#: A runner's publish points: per end it resolves, the end its code records the event at.
Places = tuple[tuple[ReadEnd, ReadEnd], ...]


def _places(value: Mapping[ReadEnd, ReadEnd] | Places) -> Places:
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for end, at in items:
        if not isinstance(end, ReadEnd) or not isinstance(at, ReadEnd):
            raise TypeError(f"RunnerModel.places maps a ReadEnd to the ReadEnd the runner records its event at, got "
                            f"{end!r}: {at!r}")
        out.append((end, at))
    return tuple(sorted(out))


def _on(switch: Switch, step: int) -> bool:
    return bool(switch(step)) if callable(switch) else bool(switch)


@attrs.frozen
class RunnerModel:
    """The runner's settings. ``kill_switch`` and ``prefill_read_done`` are a bool or a function
    of the step (a switch flipped while the engine runs); ``in_graph_marker`` says whether the
    runner has an in-graph marker event (``None``: whatever the device can record inside a
    graph); ``clear_mailbox=False`` is the stale-event bug: the scheduler takes the event and
    leaves it there, and a later step that publishes nothing hands out an old one.

    ``no_marker`` is where a declared ``IN_REPLAY`` lands in a replayed graph without an in-graph
    marker (``POST_REPLAY``, the sound one; ``PRE_REPLAY`` is the earlier fallback SGLang's decode
    runner once had). ``places`` maps an end the runner resolves to the end its code records the
    event at, where that differs (a runner without an in-graph marker records ``IN_REPLAY``
    after the replay; one that records every end before the replay publishes too early). A
    runner that places an end earlier than it resolved races; :func:`audit_runner` says so
    before anything runs.

    >>> RunnerModel().killed(3), RunnerModel(kill_switch=lambda step: step % 2 == 1).killed(3)
    (False, True)
    >>> RunnerModel(places={ReadEnd.IN_REPLAY: ReadEnd.POST_REPLAY}).placed(ReadEnd.IN_REPLAY).name
    'POST_REPLAY'
    """

    kill_switch: Switch = False
    prefill_read_done: Switch = True
    in_graph_marker: bool | None = None
    clear_mailbox: bool = True
    no_marker: ReadEnd = attrs.field(default=ReadEnd.POST_REPLAY)
    places: Places = attrs.field(default=(), converter=_places)

    @no_marker.validator
    def _check_no_marker(self, _attribute: attrs.Attribute[ReadEnd], value: ReadEnd) -> None:
        if not isinstance(value, ReadEnd):
            raise TypeError(f"RunnerModel.no_marker must be a ReadEnd, got {value!r} ({type(value).__name__})")

    def placed(self, end: ReadEnd) -> ReadEnd:
        """The end the runner records its event at for a resolved ``end``: ``end`` itself unless
        ``places`` says otherwise (a runner that records after its replay whatever the backend
        declares maps ``UNKNOWN`` to ``POST_REPLAY``)."""
        return dict(self.places).get(end, end)

    def killed(self, step: int) -> bool:
        return _on(self.kill_switch, step)

    def prefill_enabled(self, step: int) -> bool:
        return _on(self.prefill_read_done, step)


class Mailbox:
    """The one slot between the forward and the scheduler: the forward ``put``\\ s the event of the
    step it publishes for; the scheduler ``take``\\ s it (and clears it, unless told not to).

    >>> box = Mailbox()
    >>> box.put(0, "event of step 0"); box.take(), box.take()
    ((0, 'event of step 0'), None)
    """

    def __init__(self, *, clear_on_take: bool = True) -> None:
        self.clear_on_take = clear_on_take
        self._slot: tuple[int, Bound] | None = None

    def put(self, step: int, event: Bound) -> None:
        self._slot = (step, event)

    def take(self) -> tuple[int, Bound] | None:
        slot = self._slot
        if self.clear_on_take:
            self._slot = None
        return slot

    def peek(self) -> tuple[int, Bound] | None:
        """What :meth:`take` would return now, without taking it."""
        return self._slot


class EngineRunner:
    """One lowered step run the way the engine's runner runs it (what :func:`runner_model`'s
    ``lower_step`` returns): a :class:`~readfence.graph.Lowered` placing one event at the
    runner's end, and, per step, the mailbox deciding what the scheduler waits on."""

    def __init__(self, engine: EngineBackend, mode: ForwardMode, model: RunnerModel, inner: Lowered, point: ReadEnd,
                 marker: bool, graphed: bool) -> None:
        self.engine, self.mode, self.model, self.inner, self.point = engine, mode, model, inner, point
        self.marker, self.graphed = marker, graphed
        self.mailbox = Mailbox(clear_on_take=model.clear_mailbox)
        self.shared, self.plan, self.program = inner.shared, inner.plan, inner.program
        self.ledger = inner.ledger  # what every run of the step saw: verify's attribution reads it
        self.label = f"runner:{inner.label}"
        self.published: list[tuple[int, ReadEnd]] = []  # per step, what was resolved (UNKNOWN: nothing published)
        self.stale: list[tuple[int, int]] = []  # (step, the step whose event its scheduler was handed instead)
        self._steps = 0

    def write_key(self, buffer: str) -> tuple[int, int, int]:
        return self.inner.write_key(buffer)

    def poison_at_start(self, buffers: Iterable[str]) -> None:
        """Check mode: what a multi-phase step releases before any phase runs (see ``Lowered``)."""
        self.inner.poison_at_start(buffers)

    def resolve(self, step: int, batch: Mapping[str, Tensor]) -> ReadEnd:
        """The end the runner publishes for this step (on the host, before the step runs)."""
        if self.model.killed(step):
            return ReadEnd.UNKNOWN
        return resolve_end(self.engine, self.mode, batch, marker=self.marker, graphed=self.graphed,
                           prefill=self.model.prefill_enabled(step), model=self.model)

    def run(self, batch: Mapping[str, Tensor], *, step: int | None = None, after: Sequence[Event] = (),
            poison: Iterable[str] | None = None, first: bool = True, last: bool = True) -> StepRun:
        step = self._steps if step is None else step
        self._steps += 1
        end = self.resolve(step, batch)
        # the one event lowered is at the runner's static end: a step whose end is later than
        # it publishes nothing (its event would fire early), an earlier one publishes it (later)
        publish = end is not ReadEnd.UNKNOWN and self.point is not ReadEnd.UNKNOWN and end <= self.point
        self.published.append((step, end if publish else ReadEnd.UNKNOWN))
        # An event left in the mailbox by an earlier step (it is not cleared when taken) is what the
        # scheduler waits on for a step that publishes nothing: that step's buffers are released
        # before it runs, so check mode poisons them there.
        left = self.mailbox.peek()
        stale = not publish and not self.model.killed(step) and left is not None and left[0] != step
        if stale:
            self.stale.append((step, left[0]))  # type: ignore[index]
        early = stale and first and self.inner.check is not None
        if early:
            self.inner.poison_at_start(self.inner.plan.placements)
        try:
            run = self.inner.run(batch, step=step, after=after, poison=poison if publish else (), first=first,
                                 last=last)
        finally:
            if early:
                self.inner.poison_at_start(())
        fence = run.fence
        if publish:
            bound = next(b for b in fence.per_buffer.values() if b is not None)
            self.mailbox.put(step, bound)
        taken = self.mailbox.take()
        chosen: Bound = fence.done if taken is None or self.model.killed(step) else taken[1]
        ours = Fence(self.label, step, dict.fromkeys(fence.per_buffer, chosen), fence.done, fence.probes)
        return StepRun(step, run.logits, ours)

    def describe(self) -> list[dict[str, str]]:
        return self.inner.describe()


def resolve_end(engine: EngineBackend, mode: ForwardMode, batch: Mapping[str, Tensor], *, marker: bool, graphed: bool,
                prefill: bool = True, model: RunnerModel | None = None) -> ReadEnd:
    """The end the runner publishes at for a step of ``batch``: the object's declaration asked now
    (in EXTEND its per-batch prefill resolution, when it has one; ``UNKNOWN`` when prefill
    read-done is off), ``IN_REPLAY`` moved to the model's ``no_marker`` (``POST_REPLAY``) in a
    replayed graph without a marker, then placed where the model's runner records it
    (:meth:`RunnerModel.placed`); ``UNKNOWN`` (nothing published: the scheduler waits for the
    whole forward) in a mode the engine graph-replays for other backends but runs eagerly for this
    one (:meth:`EngineBackend.replayed`)."""
    model = RunnerModel() if model is None else model
    if mode is not ForwardMode.EXTEND and not engine.replayed(mode):
        return ReadEnd.UNKNOWN  # an eager step of a mode the engine replays elsewhere: the coarse barrier
    if mode is ForwardMode.EXTEND:
        if not prefill:
            return ReadEnd.UNKNOWN
        end = engine.prefill_end(batch)
        end = engine.declared_end(mode) if end is None else end
    else:
        end = engine.declared_end(mode)
    if graphed and end is ReadEnd.IN_REPLAY and not marker:
        end = model.no_marker
    return model.placed(end)


@attrs.frozen(eq=False, repr=False)
class RunnerTarget(Backend):
    """An adapted backend that lowers itself into an :class:`EngineRunner` (see :func:`runner_model`)."""

    engine: EngineBackend
    model: RunnerModel
    _table: Any = attrs.field(init=False, default=None)
    _hash: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._finish(self.engine._table)

    @property
    def name(self) -> str:
        return f"{self.engine.name} (engine runner)"

    def _shallow(self) -> tuple[Any, ...]:
        return ("runner", self.engine._hash, self.engine.binding.serial, self.engine.path, self.model)

    def _spec_parts(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        return f"runner[{self.engine.name}]", ()

    def replayed(self, mode: ForwardMode) -> bool:
        """Whether the engine replays the step in ``mode`` (the adapted backend's answer)."""
        return self.engine.replayed(mode)

    def prepare_out_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors) -> dict[str, Tensor]:
        return self.engine.prepare_out_graph(mode, shared, batch)

    def prepare_in_graph(self, mode: ForwardMode, shared: Tensors, batch: Tensors, meta: Tensors) -> dict[str, Tensor]:
        return self.engine.prepare_in_graph(mode, shared, batch, meta)

    def attend(self, mode: ForwardMode, layer: int, q: Tensor, k: Tensor, v: Tensor, pools: dict[str, Tensor],
               shared: Tensors, batch: Tensors, meta: Tensors) -> Tensor:
        return self.engine.attend(mode, layer, q, k, v, pools, shared, batch, meta)

    def lower_step(self, mode: ForwardMode, *, device: Device, policy: Policy, batch_size: int, cfg: ModelConfig,
                   state: Mapping[str, dict[str, Tensor]], lowering: LowerOptions | None = None) -> EngineRunner:
        """Lower for the runner model: ``Policy.JOINED`` is the runner as configured,
        ``Policy.COARSE`` the runner with its kill switch on; the runner's graph is lowered with
        ``lowering``, but always past the soundness check (the engine trusts its declaration)."""
        mode = check_mode(mode)
        if policy not in (Policy.JOINED, Policy.COARSE):
            raise ValueError(f"the engine runner publishes one event for all buffers from the backend's scalar "
                             f"declaration (SGLang's semantics): run it with Policy.JOINED (or Policy.COARSE, its "
                             f"kill switch), not {policy.name}; PER_BUFFER and EXACT are readfence's, for the "
                             f"adapted backend itself")
        model = self.model if policy is Policy.JOINED else attrs.evolve(self.model, kill_switch=True)
        graphed = self.engine.replayed(mode) and device.caps.graphs
        marker = device.caps.in_graph_events if model.in_graph_marker is None else model.in_graph_marker
        example = example_step(cfg, mode, batch_size).batch
        point = resolve_end(self.engine, mode, example, marker=marker, graphed=graphed, model=model)
        lowered_backend = (self.engine if self.engine.read_effect(mode).end is point
                           else self.engine.redeclared(mode, point))
        trusted = attrs.evolve(lowering_options(lowering, "lower_step"), UNSAFE_skip_soundness_check=True)
        inner = lower(lowered_backend, mode, device=device, policy=Policy.JOINED, batch_size=batch_size, cfg=cfg,
                      state=state, lowering=trusted)
        return EngineRunner(self.engine, mode, model, inner, point, marker, graphed)


def runner_model(engine: EngineBackend, model: RunnerModel | None = None) -> RunnerTarget:
    """``engine`` run by its engine's runner (see the module docstring), for readfence's loop.

    >>> from readfence.engine.reference import trtllm_mha_engine
    >>> from readfence.graph import CpuDevice, run_overlapped, run_serial
    >>> engine = trtllm_mha_engine()
    >>> serial = run_serial(engine, steps=3, batch_size=2, state=engine.state)
    >>> with CpuDevice() as dev:
    ...     run = run_overlapped(runner_model(engine), steps=3, policy=Policy.JOINED, device=dev, batch_size=2,
    ...                          state=engine.state, cfg=engine.cfg)
    >>> run.violations, run.matches(serial)
    ((), True)
    """
    return RunnerTarget(check_engine(engine), RunnerModel() if model is None else model)


__all__ = ["EngineRunner", "Mailbox", "RunnerModel", "RunnerTarget", "runner_model"]
