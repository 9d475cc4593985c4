"""Multi-phase step shapes (speculative decoding): a step is a sequence of lowered phases.

Each phase runs one backend in one mode on one runner (a runner's graph for a mode is
captured once and replayed by every phase that uses it). A buffer's last read in the step is
the maximum :class:`~readfence.effects.Position` over the phases; the phase holding it
publishes the buffer's fence. Which effect ranks the phases is the policy's (its
``placing_effect``: declared, traced, or the whole step). Nothing here is configured by hand,
except where an engine does it: a shape with ``waits_on`` is an engine's step whose scheduler
waits on one runner's event whatever the phases read (``waits_on``: SGLang's
``last_shared_read_runner``);
:meth:`StepShape.late_reads` says which reads that event does not cover.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from returns.result import Result

from readfence.backends import Backend, CallForm, SpecError, parse_call
from readfence.core import SHARED_BUFFERS, BackendLike, ForwardMode
from readfence.core.internal import check_backend, positive_int, tokens_per_request
from readfence.effects import Position, ReadEffect, publish_positions

from ..lowering import Policy
from ..lowering.internal import placing_effect


@attrs.frozen
class Phase:
    """One phase of a step: ``backend`` in ``mode`` on graph runner ``runner``."""

    name: str
    backend: BackendLike
    mode: ForwardMode
    runner: str

    @property
    def graph_key(self) -> tuple[str, ForwardMode]:
        """Phases with the same key replay the same lowered graph."""
        return (self.runner, self.mode)


@attrs.frozen
class StepShape:
    """A named sequence of phases; ``spec`` is how it is written (``parse_step`` reads it).

    >>> from readfence.backends import paged, trtllm_mha
    >>> shape = eagle(paged(), trtllm_mha(), draft_steps=2)
    >>> [p.name for p in shape.phases]
    ['draft_decode[0]', 'draft_decode[1]', 'target_verify', 'draft_extend']
    >>> shape.publisher("req_to_token").name
    'draft_extend'
    """

    name: str
    phases: tuple[Phase, ...] = attrs.field(validator=lambda _, __, v: _check_graph_keys(v))
    spec: str
    waits_on: str | None = attrs.field(default=None, kw_only=True)

    @waits_on.validator
    def _check_waits_on(self, _attribute: attrs.Attribute[str | None], value: str | None) -> None:
        names = [p.name for p in self.phases]
        if value is not None and value not in names:
            raise ValueError(f"{self.spec}: waits_on={value!r} is not a phase; the phases are {names}")

    @property
    def waits_on_index(self) -> int | None:
        """The index of the phase whose event the scheduler waits on (``None``: each buffer's is
        the phase holding its last read)."""
        return None if self.waits_on is None else [p.name for p in self.phases].index(self.waits_on)

    def late_reads(self, effects: Sequence[ReadEffect]) -> dict[str, tuple[Phase, Position]]:
        """Per buffer read after the phase the scheduler waits on (``waits_on``, when it is not the
        last reader), the phase and position of that last read; ``{}`` without ``waits_on``.

        >>> from readfence.backends import paged
        >>> from readfence.effects import ReadEnd
        >>> shape = attrs.evolve(eagle(paged(), paged(), draft_steps=1), waits_on="target_verify")
        >>> read = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY})
        >>> phase, pos = shape.late_reads([read, read, read])["req_to_token"]
        >>> phase.name, pos.end.name
        ('draft_extend', 'IN_REPLAY')
        """
        k = self.waits_on_index
        if k is None:
            return {}
        return {b: (self.phases[p.phase], p) for b, p in self.positions(effects).items() if p.phase > k}

    def effects(self) -> list[ReadEffect]:
        """Each phase's declared effect."""
        return [p.backend.read_effect(p.mode) for p in self.phases]

    def positions(self, effects: Sequence[ReadEffect] | None = None) -> dict[str, Position]:
        """Per shared buffer, the position (phase index, end) of its last read in the step.

        ``effects[i]`` is phase ``i``'s effect (default: the declared ones, :meth:`effects`).
        """
        effects = self.effects() if effects is None else list(effects)
        if len(effects) != len(self.phases):
            raise ValueError(f"{self.spec}: {len(effects)} effects for {len(self.phases)} phases")
        return publish_positions(effects, SHARED_BUFFERS)

    def positions_under(self, policy: Policy, observed: Sequence[ReadEffect]) -> dict[str, Position]:
        """The positions that decide the publishing phases when lowered with ``policy``.

        ``observed[i]`` is phase ``i``'s traced effect. Each phase is ranked by the effect
        ``policy`` places its events from (``placing_effect``), so the phase chosen is one
        whose plan really covers the buffer's last read.

        >>> from readfence.backends import trtllm_mha
        >>> from readfence.effects import ReadEnd
        >>> shape = ngram(trtllm_mha())
        >>> seen = [ReadEffect.of({"swa_map": ReadEnd.IN_REPLAY})]
        >>> shape.positions_under(Policy.EXACT, seen)["req_to_token"].phase
        -1
        >>> shape.positions_under(Policy.PER_BUFFER, seen)["req_to_token"].end.name
        'IN_REPLAY'
        """
        observed = list(observed)
        if len(observed) != len(self.phases):
            raise ValueError(f"{self.spec}: {len(observed)} observed effects for {len(self.phases)} phases")
        return self.positions([placing_effect(policy, declared=d, observed=o)
                               for d, o in zip(self.effects(), observed)])

    def publisher(self, buffer: str) -> Phase | None:
        """The phase that publishes ``buffer``'s fence by the declarations (JOINED, PER_BUFFER);
        ``None``: no phase declares reading it. See :meth:`positions_under` for any policy."""
        pos = self.positions()[buffer]
        return None if pos.phase < 0 else self.phases[pos.phase]

    @property
    def tokens(self) -> int:
        """Tokens per request the scheduler allocates per step (the largest phase)."""
        return max(tokens_per_request(p.mode) for p in self.phases)

    def scheduling_mode(self) -> ForwardMode:
        """A mode with :attr:`tokens` tokens per request (for the scheduler)."""
        return next(m for m in ForwardMode if tokens_per_request(m) == self.tokens)

    def __str__(self) -> str:
        return self.spec


def _check_graph_keys(phases: Sequence[Phase]) -> None:
    # One graph is lowered per (runner, mode) and replayed by all its phases: a phase with
    # another backend on the same key would replay code that is not its own, and its
    # declaration would rank the phases for a graph it does not run.
    seen: dict[tuple[str, ForwardMode], Phase] = {}
    for ph in phases:
        first = seen.setdefault(ph.graph_key, ph)
        if first.backend != ph.backend:
            raise ValueError(f"phases {first.name!r} and {ph.name!r} share runner {ph.runner!r} in "
                             f"{ph.mode.name} (one graph) but run {first.backend} and {ph.backend}; "
                             "give them different runners")


def _check(name: str, backends: Sequence[Any]) -> None:
    for i, b in enumerate(backends):
        check_backend(b, f"{name}: argument {i}")


# EAGLE drafts a handful of tokens per step; each draft step is one more captured graph and
# one more phase to fence, so thousands cannot be useful (and take minutes to lower)
MAX_DRAFT_STEPS = 64


def eagle(target: BackendLike, draft: BackendLike, *, draft_steps: int = 2) -> StepShape:
    """EAGLE: the draft decodes ``draft_steps`` times, the target verifies, the draft extends.

    The draft extend runs last, so it publishes every buffer it reads.
    """
    _check("eagle", [target, draft])
    positive_int("eagle: draft_steps", draft_steps, at_most=MAX_DRAFT_STEPS, limit="MAX_DRAFT_STEPS")
    phases = [Phase(f"draft_decode[{i}]", draft, ForwardMode.DECODE, "draft") for i in range(draft_steps)]
    phases += [Phase("target_verify", target, ForwardMode.TARGET_VERIFY, "target"),
               Phase("draft_extend", draft, ForwardMode.DRAFT_EXTEND, "draft")]
    return StepShape("eagle", tuple(phases), f"eagle({target}, {draft}, draft_steps={draft_steps})")


def multi_eagle(target: BackendLike, *drafts: BackendLike) -> StepShape:
    """Multi-layer EAGLE: the target verifies, then each draft runner extends in turn.

    The last draft runner reads last, so it publishes.
    """
    _check("multi_eagle", [target, *drafts])
    if not drafts:
        raise ValueError("multi_eagle needs at least one draft backend")
    phases = [Phase("target_verify", target, ForwardMode.TARGET_VERIFY, "target")]
    phases += [Phase(f"draft_extend[{i}]", d, ForwardMode.DRAFT_EXTEND, f"draft[{i}]") for i, d in enumerate(drafts)]
    spec = f"multi_eagle({', '.join(str(b) for b in (target, *drafts))})"
    return StepShape("multi_eagle", tuple(phases), spec)


def ngram(target: BackendLike) -> StepShape:
    """An n-gram speculator: no draft model, target verify is the only phase."""
    _check("ngram", [target])
    return StepShape("ngram", (Phase("target_verify", target, ForwardMode.TARGET_VERIFY, "target"),),
                     f"ngram({target})")


#: The step shapes a spec can name, as call forms of the one spec grammar
#: (:func:`readfence.backends.parse_call`); each is callable like its constructor.
STEP_SHAPES: dict[str, CallForm] = {
    "eagle": CallForm(eagle, 2, 2, {"draft_steps": range(1, MAX_DRAFT_STEPS + 1)},
                      usage="eagle(target, draft, draft_steps=N)"),
    "multi_eagle": CallForm(multi_eagle, 2, None, usage="multi_eagle(target, draft, ...)"),
    "ngram": CallForm(ngram, 1, 1, usage="ngram(target)"),
}


def parse_step(spec: str) -> Result[StepShape, SpecError]:
    """Parse ``eagle(TARGET, DRAFT[, draft_steps=N])``, ``multi_eagle(T, D1, D2...)``, ``ngram(T)``.

    Backend arguments are backend specs, in the one spec grammar (``readfence.backends.parse``):
    a failure is a :class:`~readfence.backends.SpecError` with its position.

    >>> parse_step("eagle(paged, trtllm_mha, draft_steps=3)").unwrap().phases[2].name
    'draft_decode[2]'
    >>> print(parse_step("eagle(paged, paged, draft_steps=0)").failure())
    position 32: eagle(draft_steps=...) expects an int in 1..64, got 0
      eagle(paged, paged, draft_steps=0)
                                      ^
    """
    return parse_call(spec, STEP_SHAPES, what="step shape")


def parse_target(spec: str) -> Result[Backend | StepShape, SpecError]:
    """Parse a spec that names a backend or a step shape (what every command takes).

    >>> [str(parse_target(s).unwrap()) for s in ("tbo(paged, linear)", "ngram(paged)")]
    ['tbo(paged, linear)', 'ngram(paged)']
    >>> parse_target("eagle(ngram(paged), paged)").failure().message
    'ngram is a step shape: it can only be the whole spec, not an argument (its arguments are backends)'
    """
    return parse_call(spec, STEP_SHAPES, what="step shape", or_backend=True)
