"""A finding of ``verify``: what one check found wrong with one lowering of a step."""

from __future__ import annotations

from typing import Any

import attrs

from readfence.core import ForwardMode, StageWriteError
from readfence.effects.internal import one_line

from ..lowering import Policy


@attrs.frozen
class LateRead:
    """A finding of :func:`verify`: a read after the buffer's release, a write by the forward,
    an output that differs, or a declaration the lowering refuses.

    ``kind``: ``"late read"``, ``"write"``, ``"differs"``, ``"unsound declaration"``,
    ``"thread"`` (a stage hands work to another thread: ``op`` names it), ``"miscompiled"``
    (readfence's compile passes are wrong: a bug of readfence's, not of the backend), ``"padding"``
    (in the serving loop: a request's outputs depend on the padding rows its batch is run with, as
    the serial run padded the same way shows) or ``"refused"``
    (captured trace-time state, a stage no graph can capture, a captured stage that computes
    other than its Python, an opaque op whose output aliased a shared buffer at a replay where
    no example showed it: ``op`` names it); ``evidence``: ``"observer"``, ``"poison"``, ``"guard"``,
    ``"output"``, ``"audit"``, ``"replay"`` (the capture replayed on fresh states differs from
    the stage's Python: ``stage`` and ``op``, the output, name it), ``"rerun"`` (the step lowered
    without readfence's compile passes, or the serial run padded as the loop pads, matches where the
    lowered step does not) or
    ``"run"`` (found while the step ran).
    """

    target: str
    mode: ForwardMode
    policy: Policy
    kind: str
    evidence: str
    buffer: str | None = None
    step: int | None = None
    stage: str | None = None
    op: str | None = None
    detail: str = attrs.field(default="", converter=one_line)  # one line: a report shows it in a row

    def __str__(self) -> str:
        where = f" of {self.buffer!r}" if self.buffer else ""
        when = f" at step {self.step}" if self.step is not None else ""
        by = f" by {self.stage}: {self.op}" if self.op else ""
        text = (f"{self.kind}{where}{when}{by} ({self.evidence}): {self.target} in {self.mode.name} "
                f"under {self.policy.name}")
        return f"{text}; {self.detail}" if self.detail else text

    def as_json(self) -> dict[str, Any]:
        return {"spec": self.target, "mode": self.mode.name, "policy": self.policy.name, "verdict": self.kind,
                "evidence": self.evidence, "buffer": self.buffer, "step": self.step, "stage": self.stage,
                "op": self.op, "detail": self.detail}

    @classmethod
    def refused_write(cls, target: str, mode: ForwardMode, policy: Policy, error: StageWriteError) -> LateRead:
        """The finding of a write of a shared buffer the lowering refused (evidence ``audit``)."""
        return cls(target, mode, policy, "write", "audit", error.buffer, None, error.stage, error.op, str(error))


__all__ = ["LateRead"]
