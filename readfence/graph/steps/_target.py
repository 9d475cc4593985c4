"""What a step runs: a backend, a ``per_stream`` group or a step shape, and each one's dispatch.

The one place that tells the three apart: the loops check a target, lower it, run its serial
reference and pick the mode its scheduler works in through these functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

from torch import Tensor

from readfence.backends import PerStream
from readfence.core import BackendLike, ForwardMode, ModelConfig, StepInputs, run_step
from readfence.core.internal import check_backend, check_forward_mode

from ..devices import Device
from ..devices.internal import check_device
from ..lowering import Lowered, LowerOptions, Policy, lower
from ..lowering.internal import lowering_options
from ._composite import PhasedStep, StreamGroup, StreamOrder, eager_phases, eager_streams
from ._shapes import STEP_SHAPES, StepShape

Target: TypeAlias = BackendLike | StepShape
"""What a step runs: a backend (``readfence.backends.paged()``; a ``per_stream`` group is one,
lowered one member per forward stream) or a step shape (``eagle(...)``)."""

LoweredStep: TypeAlias = Lowered | PhasedStep | StreamGroup
"""A target lowered for one step (what :func:`lower_step` returns): ``run``, ``shared``, ``write_key``."""


def _parse_hint(text: str) -> str:
    head = text.strip().partition("(")[0].strip()
    parser = "readfence.graph.parse_step" if head in STEP_SHAPES else "readfence.backends.parse"
    return f"{parser}({text!r}).unwrap()"


def check_target(target: object, name: str = "backend") -> Target:
    """``target`` if it is a backend, a ``per_stream`` group or a :class:`StepShape`; else a
    ``TypeError`` that names ``name`` (and, for a spec string, the call that parses it).

    >>> check_target("eagle(paged, paged)")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: backend must be a backend (e.g. readfence.backends.paged()), a per_stream group or a
    step shape (e.g. readfence.graph.eagle(...)), got 'eagle(paged, paged)' (str); to use a spec
    string, parse it first: readfence.graph.parse_step('eagle(paged, paged)').unwrap()
    """
    checked: Target = check_backend(target, name, accept=(StepShape,), parse_hint=_parse_hint,
                         allowed="a backend (e.g. readfence.backends.paged()), a per_stream group or "
                                 "a step shape (e.g. readfence.graph.eagle(...))")
    return checked



def check_run(target: object, mode: ForwardMode, action: str = "run", name: str = "backend") -> Target:
    """The checks every loop entry point makes first: ``target`` is a backend, a ``per_stream``
    group or a :class:`StepShape`, and (unless a step shape, whose phases bring their own modes)
    ``mode`` is a mode that runs a forward (not ``IDLE``)."""
    checked = check_target(target, name)
    if not isinstance(checked, StepShape):
        check_forward_mode(mode, action)
    return checked


def scheduling_mode(target: Target, mode: ForwardMode) -> ForwardMode:
    """The mode the scheduler allocates tokens for: a step shape's largest phase, else ``mode``."""
    return target.scheduling_mode() if isinstance(target, StepShape) else mode


def eager_step(target: Target, mode: ForwardMode, cfg: ModelConfig, state: Mapping[str, dict[str, Tensor]],
               batch: dict[str, Tensor], padded: int | None = None) -> Tensor | tuple[Tensor, ...]:
    """The serial reference of one step of ``target``: its logits (a tuple for a composite step).

    ``padded``: the batch size of the graph the lowered step runs ``batch`` in (padded); a
    ``per_stream`` group's members then serve the requests of their shares of that size."""
    shared, pools, params = state["shared"], state["pools"], state["params"]
    if isinstance(target, StepShape):
        return eager_phases(target, cfg, shared, pools, params, batch)
    if isinstance(target, PerStream):
        return eager_streams(target.members, mode, cfg, shared, pools, params, batch, padded)
    return run_step(target, mode, cfg, StepInputs(shared=shared, batch=batch, pools=pools, params=params)).clone()


def lower_step(target: Target, mode: ForwardMode, *, device: Device, policy: Policy, batch_size: int,
               cfg: ModelConfig, state: Mapping[str, dict[str, Tensor]], lowering: LowerOptions | None = None,
               order: StreamOrder | None = None) -> LoweredStep:
    """Lower one step of ``target``: a backend, a ``per_stream`` group, or a :class:`StepShape`,
    every graph of it with ``lowering``. ``order`` is the stream order the ``per_stream`` groups
    of one loop share (other targets have no use for it).

    A backend with a ``lower_step(mode, *, device, policy, batch_size, cfg, state, lowering)``
    method lowers itself (an engine's own runner, ``readfence.engine``): it returns an object
    with ``run``, ``shared``, ``plan`` and ``write_key``, as :class:`Lowered` has."""
    check_run(target, mode, "lower", "target")
    check_device(device)
    lowering = lowering_options(lowering, "lower_step")
    if isinstance(target, StepShape):
        return PhasedStep(target, device=device, policy=policy, batch_size=batch_size, cfg=cfg, state=state,
                          lowering=lowering, order=order)
    if isinstance(target, PerStream):
        return StreamGroup(target.members, mode, device=device, policy=policy, batch_size=batch_size, cfg=cfg,
                           state=state, order=order, lowering=lowering)
    own = getattr(target, "lower_step", None)
    if callable(own):
        return own(mode, device=device, policy=policy, batch_size=batch_size, cfg=cfg, state=state,
                   lowering=lowering)
    return lower(target, mode, batch_size=batch_size, device=device, policy=policy, cfg=cfg, state=state,
                 lowering=lowering)
