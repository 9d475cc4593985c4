"""Composite steps: several lowered graphs per step, and the fence they publish together.

* :class:`PhasedStep`: the phases of a :class:`StepShape` run in order on one forward
  stream; each buffer's fence comes from the phase holding its last read, ranked by what
  the policy places events from (the declarations; under EXACT the bound trace joined with the
  reads the lowering's rehearsal saw; under COARSE the last phase publishes every buffer).
* :class:`StreamGroup`: a ``per_stream`` backend; member ``s`` is lowered on its own forward
  stream and serves its share of the requests; each stream's fence comes from its own
  member's graph, and the scheduler waits on every stream that reads a buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor

from readfence.core import SHARED_BUFFERS, BackendLike, ForwardMode, ModelConfig, StepInputs, run_step
from readfence.core.internal import request_ranges, tokens_per_request

from ..devices import Device, Event, Stream
from ..lowering import Fence, Lowered, LowerOptions, Placement, Policy, StepRun, UnsoundLowering, lower
from ..lowering.internal import lowering_options, placing_effect
from ._shapes import StepShape


@attrs.frozen
class JoinedFence:
    """A step's fence made of parts: per buffer, the part fences that must all release it.

    >>> JoinedFence("demo", 0, {"seq_lens": ()}, ()).released("seq_lens")
    True
    """

    owner: str
    step: int
    parts: Mapping[str, tuple[Fence, ...]]
    done_parts: tuple[Fence, ...]

    def _check(self, buffers: Iterable[str] | None) -> list[str]:
        names = list(self.parts) if buffers is None else list(buffers)
        unknown = [b for b in names if b not in self.parts]
        if unknown:
            raise KeyError(f"fence of {self.owner} (step {self.step}) publishes no buffer {unknown}")
        return names

    def wait(self, stream: Stream, buffers: Iterable[str] | None = None) -> None:
        for b in self._check(buffers):
            for part in self.parts[b]:
                part.wait(stream, [b])

    def synchronize(self, buffers: Iterable[str] | None = None, *, timeout: float | None = None) -> None:
        for b in self._check(buffers):
            for part in self.parts[b]:
                part.synchronize([b], timeout=timeout)

    def wait_done(self, timeout: float | None = None) -> None:
        for part in self.done_parts:
            part.wait_done(timeout)

    def wait_end(self, stream: Stream) -> None:
        for part in self.done_parts:
            part.wait_end(stream)

    def done_time(self) -> float | None:
        return _latest_of([p.done_time() for p in self.done_parts])

    def released(self, buffer: str) -> bool:
        return all(p.released(buffer) for p in self.parts[buffer])

    def _latest(self, buffer: str, get: str) -> float | None:
        return _latest_of([getattr(p, get)(buffer) for p in self.parts[buffer]])

    def release_time(self, buffer: str) -> float | None:
        return self._latest(buffer, "release_time")

    def last_read_time(self, buffer: str) -> float | None:
        return self._latest(buffer, "last_read_time")

    def slack(self, buffer: str) -> float | None:
        read, release = self.last_read_time(buffer), self.release_time(buffer)
        return None if read is None or release is None else release - read

    @property
    def fences(self) -> tuple[Fence, ...]:
        """The part fences, each once (those that release a buffer, then those that end the step)."""
        seen: dict[int, Fence] = {}
        for part in (*(f for fs in self.parts.values() for f in fs), *self.done_parts):
            seen.setdefault(id(part), part)
        return tuple(seen.values())


def _latest_of(times: Sequence[float | None]) -> float | None:
    """The latest of ``times``; ``None`` when there are none or one is unknown."""
    known = [t for t in times if t is not None]
    return max(known) if known and len(known) == len(times) else None


def narrow_tokens(batch: Mapping[str, Tensor], have: int, want: int) -> dict[str, Tensor]:
    """The first ``want`` of each request's ``have`` new tokens (request-major batches).

    >>> import torch
    >>> b = {"input_ids": torch.arange(6), "req_pool_indices": torch.tensor([4, 9])}
    >>> narrow_tokens(b, 3, 1)["input_ids"].tolist()
    [0, 3]
    """
    if want == have:
        return dict(batch)
    out = {}
    for key, t in batch.items():
        out[key] = t if key == "req_pool_indices" else t.reshape(-1, have)[:, :want].reshape(-1).contiguous()
    return out


def _sort_key(placement: Placement | None) -> tuple[int, int, int]:
    return (-1, 0, 0) if placement is None else placement.sort_key


class PhasedStep:
    """The phases of ``shape`` lowered on one forward stream (one graph per runner and mode),
    each graph with ``lowering``; a phase backend with a ``lower_step`` method (an engine's own
    runner) lowers itself, as in :func:`lower_step`.

    A shape with ``waits_on`` is an engine's step: every buffer's fence is that phase's, and
    a read in a later phase is refused (``UnsoundLowering``) unless the lowering skips the
    soundness check, as an engine trusting its runner does."""

    def __init__(self, shape: StepShape, *, device: Device, policy: Policy, batch_size: int, cfg: ModelConfig,
                 state: Mapping[str, dict[str, Tensor]], lowering: LowerOptions | None = None,
                 order: StreamOrder | None = None) -> None:
        lowering = lowering_options(lowering, "PhasedStep")
        self.order = StreamOrder() if order is None else order
        self.shape, self.cfg = shape, cfg
        self.shared = state["shared"]
        self.tokens = shape.tokens
        replays: dict[Any, int] = {}
        for ph in shape.phases:
            replays[ph.graph_key] = replays.get(ph.graph_key, 0) + 1
        stream = device.stream("forward")
        self.graphs: dict[Any, Lowered] = {}
        for ph in shape.phases:
            if ph.graph_key in self.graphs:
                continue
            # Every replay of a runner's graph in one step is a step in flight for its events.
            own = getattr(ph.backend, "lower_step", None)
            if callable(own):
                self.graphs[ph.graph_key] = own(ph.mode, device=device, policy=policy, batch_size=batch_size, cfg=cfg,
                                                state=state, lowering=lowering)
            else:
                self.graphs[ph.graph_key] = lower(
                    ph.backend, ph.mode, batch_size=batch_size, device=device, policy=policy, cfg=cfg, stream=stream,
                    state=state, lowering=lowering, steps_in_flight=replays[ph.graph_key])
        # Ranked by what each phase's graph places its events from (under EXACT its bound trace
        # joined with what its rehearsal saw): the phase chosen is one whose plan really covers
        # the buffer's last read, and check mode poisons the buffer at that very point.
        observed = [getattr(self.graphs[ph.graph_key], "observed", None) for ph in shape.phases]
        if shape.waits_on_index is None:
            positions = shape.positions_under(policy, observed)  # type: ignore[arg-type]
            self.owner = {b: p.phase for b, p in positions.items() if p.phase >= 0}
        else:
            self.owner = self._published(shape, policy, observed, lowering.UNSAFE_skip_soundness_check)
        self.checked = lowering.check is not None
        # a buffer no phase reads, or whose publishing phase waits for none of its reads, is
        # released as the step starts: check mode poisons it there, before any phase runs
        never_read = (b for b in SHARED_BUFFERS if b not in self.owner)
        self.at_start = (*never_read, *(b for b, k in self.owner.items()
                                        if not self.graphs[shape.phases[k].graph_key].plan.placements[b].waits))
        if self.checked:
            self.graphs[shape.phases[0].graph_key].poison_at_start(self.at_start)
        self.stream = stream
        self.label = f"{shape.name}/{policy.name}"

    @staticmethod
    def _published(shape: StepShape, policy: Policy, observed: Sequence[Any], trusted: bool) -> dict[str, int]:
        """Every buffer's fence from ``shape.waits_on`` (refused where a later phase reads it)."""
        k = shape.waits_on_index
        assert k is not None
        if not trusted:
            ranked = [placing_effect(policy, declared=ph.backend.read_effect(ph.mode),
                                     observed=ph.backend.read_effect(ph.mode) if o is None else o)
                      for o, ph in zip(observed, shape.phases)]
            late = shape.late_reads(ranked)
            if late:
                buffer, (phase, _) = sorted(late.items())[0]
                raise UnsoundLowering(f"{shape.spec}: the scheduler waits on phase {shape.waits_on!r}'s event, but "
                                      f"phase {phase.name!r} reads {buffer!r} after it; publish from the last phase "
                                      f"that reads it")
        return dict.fromkeys(SHARED_BUFFERS, k)

    def write_key(self, buffer: str) -> tuple[int, tuple[int, int, int]]:
        """Order of the scheduler's writes: by the position that releases the buffer."""
        k = self.owner.get(buffer)
        if k is None:
            return (-1, (0, 0, 0))
        return (k, _sort_key(self.graphs[self.shape.phases[k].graph_key].plan.placements.get(buffer)))

    def run(self, batch: Mapping[str, Tensor], *, step: int, after: Sequence[Event] = ()) -> StepRun:
        # a loop that runs a per_stream group's steps on other streams (a serving loop's prefills of
        # this shape's target) shares the pools with them: this step waits for their latest step
        self.order.wait_on_others(self.stream, f"{self.label} step {step}")
        runs = []
        last = len(self.shape.phases) - 1
        for i, ph in enumerate(self.shape.phases):
            part = narrow_tokens(batch, self.tokens, tokens_per_request(ph.mode))
            kw: dict[str, Any] = {}
            if self.checked:  # only the owner phase's replay of a shared graph poisons a buffer
                owned = [b for b, k in self.owner.items() if k == i and b not in self.at_start]
                kw = {"poison": owned, "first": i == 0, "last": i == last}
            runs.append(self.graphs[ph.graph_key].run(part, step=step, after=after if i == 0 else (), **kw))
        parts: dict[str, tuple[Fence, ...]] = {b: (runs[k].fence,) for b, k in self.owner.items()}
        parts.update({b: () for b in SHARED_BUFFERS if b not in parts})
        if self.shape.waits_on is not None:
            parts = self._coarse_where_unpublished(parts, runs, step)
        fence = JoinedFence(self.label, step, parts, (runs[-1].fence,))
        self.order.latest[self.stream.name] = runs[-1].fence
        return StepRun(step, tuple(r.logits for r in runs), fence)

    def _coarse_where_unpublished(self, parts: dict[str, tuple[Fence, ...]], runs: Sequence[StepRun],
                                  step: int) -> dict[str, tuple[Fence, ...]]:
        # An engine's publishing phase that publishes nothing for a buffer hands out the end of its
        # own replay; its scheduler then waits for the whole forward stream: the last phase's end.
        last = runs[-1].fence
        whole = Fence(self.label, step, dict.fromkeys(SHARED_BUFFERS, last.done), last.done)
        out = {}
        for b, fences in parts.items():
            own = [f for f in fences if isinstance(f, Fence) and f.per_buffer.get(b) == f.done and f is not last]
            out[b] = tuple(whole if f in own else f for f in fences)
        return out

    def eager(self, shared: dict[str, Tensor], pools: dict[str, Tensor], params: dict[str, Tensor],
              batch: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        return eager_phases(self.shape, self.cfg, shared, pools, params, batch)


def eager_phases(shape: StepShape, cfg: ModelConfig, shared: dict[str, Tensor], pools: dict[str, Tensor],
                 params: dict[str, Tensor], batch: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
    """The serial reference of one multi-phase step: each phase's eager ``run_step``."""
    out = []
    for ph in shape.phases:
        part = narrow_tokens(batch, shape.tokens, tokens_per_request(ph.mode))
        out.append(run_step(ph.backend, ph.mode, cfg, StepInputs(shared, part, pools, params)).clone())
    return tuple(out)


def split_requests(batch: Mapping[str, Tensor], tokens: int, parts: int,
                   padded: int | None = None) -> list[dict[str, Tensor]]:
    """Consecutive request ranges of a request-major batch, one per stream: the shares of a
    batch of ``padded`` requests (default: the batch's own size), cut to the batch's requests
    (a padded graph's member serves the real requests of its share; the rest are padding).

    >>> import torch
    >>> b = {"input_ids": torch.arange(3), "req_pool_indices": torch.arange(3)}
    >>> [p["input_ids"].tolist() for p in split_requests(b, 1, 2)], [p["input_ids"].tolist() for p in split_requests(b, 1, 2, 8)]
    ([[0, 1], [2]], [[0, 1, 2], []])
    """
    size = int(batch["req_pool_indices"].shape[0])
    ranges = [(min(lo, size), min(hi, size)) for lo, hi in request_ranges(size if padded is None else padded, parts)]
    return [{k: (t[lo:hi] if k == "req_pool_indices" else t[lo * tokens:hi * tokens]).contiguous()
             for k, t in batch.items()} for lo, hi in ranges]


def eager_streams(members: Sequence[BackendLike], mode: ForwardMode, cfg: ModelConfig, shared: dict[str, Tensor],
                  pools: dict[str, Tensor], params: dict[str, Tensor], batch: Mapping[str, Tensor],
                  padded: int | None = None) -> tuple[Tensor, ...]:
    """The serial reference of a ``per_stream`` step: each member on its share, one after another
    (the shares of a batch padded to ``padded`` requests: see :func:`split_requests`; a member
    with no real request gives no logits)."""
    parts = split_requests(batch, tokens_per_request(mode), len(members), padded)
    vocab = params["lm_head"].shape[-1]
    return tuple(run_step(m, mode, cfg, StepInputs(shared, p, pools, params)).clone()
                 if p["req_pool_indices"].shape[0] else params["lm_head"].new_zeros(0, vocab)
                 for m, p in zip(members, parts))


class StreamOrder:
    """The latest step fence of each forward stream, shared by the ``per_stream`` groups and step
    shapes of one loop (a serving loop runs a group per batch size on the same streams, and a
    shape's decode steps on another than its target group's prefills): they share the KV and state
    pools, so each stream's step waits for every other stream's latest step."""

    def __init__(self) -> None:
        self.latest: dict[str, Fence] = {}

    def wait_on_others(self, stream: Stream, what: str) -> None:
        """Make ``stream`` wait for every other stream's latest step (``what`` names the step waiting)."""
        for name, prev in self.latest.items():
            if name != stream.name:
                stream.wait(prev.done.check(what))


def check_shares(streams: int, batch_size: int, *, who: str, name: str = "batch_size") -> None:
    """``ValueError`` unless each of ``streams`` forward streams gets a request of a batch of
    ``batch_size`` (``who`` runs them; ``name`` is how the caller calls the batch size).

    >>> check_shares(2, 1, who="per_stream(paged, paged)")
    Traceback (most recent call last):
    ...
    ValueError: per_stream(paged, paged) runs 2 forward streams, each on a share of the batch: batch_size must be at least 2, got 1
    """
    if batch_size < streams:
        raise ValueError(f"{who} runs {streams} forward streams, each on a share of the batch: {name} must be at "
                         f"least {streams}, got {batch_size}")


class StreamGroup:
    """A ``per_stream`` backend: member ``s`` lowered on stream ``forward[s]`` with ``lowering``;
    ``order`` is the stream order the groups of one loop share (default: this group's own)."""

    def __init__(self, members: Sequence[BackendLike], mode: ForwardMode, *, device: Device, policy: Policy, batch_size: int,
                 cfg: ModelConfig, state: Mapping[str, dict[str, Tensor]], order: StreamOrder | None = None,
                 lowering: LowerOptions | None = None) -> None:
        lowering = lowering_options(lowering, "StreamGroup")
        check_shares(len(members), batch_size, who=f"per_stream with {len(members)} members")
        self.members, self.mode, self.cfg = tuple(members), mode, cfg
        self.shared = state["shared"]
        self.tokens = tokens_per_request(mode)
        sizes = [hi - lo for lo, hi in request_ranges(batch_size, len(members))]
        self.lowered = [
            lower(m, mode, batch_size=n, device=device, policy=policy, cfg=cfg,
                  stream=device.stream(f"forward[{s}]"), state=state, lowering=lowering)
            for s, (m, n) in enumerate(zip(members, sizes))
        ]
        self.label = f"per_stream/{policy.name}"
        self.batch_size = batch_size
        self.order = StreamOrder() if order is None else order
        # check mode: the members run one after another, each poisoning at its own release
        # points and restoring at its end (a member reading after its own release is late,
        # whatever the others do)
        self.checked = lowering.check is not None

    def write_key(self, buffer: str) -> tuple[int, int, int]:
        return max(_sort_key(low.plan.placements.get(buffer)) for low in self.lowered)

    def run(self, batch: Mapping[str, Tensor], *, step: int, after: Sequence[Event] = ()) -> StepRun:
        parts = split_requests(batch, self.tokens, len(self.lowered))
        # The members share the KV and state pools, and the scheduler may hand a slot freed by
        # one stream's request to another stream's request at once: each stream's step waits
        # for the other streams' previous step (bound before any member of this step runs).
        for low in self.lowered:
            self.order.wait_on_others(low.stream, f"{self.label} step {step}")
        runs: list[StepRun] = []
        for low, p in zip(self.lowered, parts):
            if self.checked and runs:
                runs[-1].fence.wait_end(low.stream)
            runs.append(low.run(p, step=step, after=after))
        for low, r in zip(self.lowered, runs):
            self.order.latest[low.stream.name] = r.fence
        fence = JoinedFence(self.label, step, {b: tuple(r.fence for r in runs) for b in SHARED_BUFFERS},
                            tuple(r.fence for r in runs))
        return StepRun(step, tuple(r.logits for r in runs), fence)

    def eager(self, shared: dict[str, Tensor], pools: dict[str, Tensor], params: dict[str, Tensor],
              batch: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        return eager_streams(self.members, self.mode, self.cfg, shared, pools, params, batch)

