"""What a run of the decode loop gives back: :class:`LoopResult` (the logits, the time, the
sanitizer's findings, the fence slack), and :func:`same_logits`, the bit-for-bit comparison every
loop's outputs are held to against their serial reference."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs
from torch import Tensor

from readfence.core.internal import same_values

from ..lowering import Policy
from ._sanitizer import Violation


@attrs.frozen(repr=False)
class LoopResult:
    """Outputs and measurements of one run of the decode loop; its repr is a one-line summary (the
    logits are in ``logits``).

    >>> LoopResult(None, [], 0.5, intervals=(0.1, 0.1))
    <LoopResult serial: 0 steps, 10.0 steps/s, 0 violations>
    """

    policy: Policy | None
    logits: list[Tensor | tuple[Tensor, ...]]  # a tuple per step for a composite step
    seconds: float
    violations: tuple[Violation, ...] = ()
    slack: dict[str, float] = attrs.Factory(dict)
    intervals: tuple[float, ...] = ()  # seconds between consecutive steps' ends (CpuDevice)

    @property
    def steps(self) -> int:
        return len(self.logits)

    @property
    def steps_per_s(self) -> float:
        """Steady-state throughput: 1 / the median time between two steps' ends, where the
        device timestamps them (robust to a hiccup of a noisy machine); else steps / wall time."""
        if self.intervals:
            median = statistics.median(self.intervals)
            return 1.0 / median if median > 0 else float("inf")
        return self.steps / self.seconds if self.seconds > 0 else float("inf")

    def __repr__(self) -> str:
        policy = "serial" if self.policy is None else self.policy.name
        return (f"<LoopResult {policy}: {self.steps} steps, {self.steps_per_s:.1f} steps/s, "
                f"{len(self.violations)} violations>")

    def matches(self, reference: LoopResult | Sequence[Tensor | tuple[Tensor, ...]]) -> bool:
        """Bit-identical logits, step by step (phases and streams included); the reference
        must be on the same device (``ValueError`` otherwise)."""
        ref = reference.logits if isinstance(reference, LoopResult) else list(reference)
        return len(ref) == len(self.logits) and all(same_logits(a, b) for a, b in zip(self.logits, ref))

    @property
    def mean_slack(self) -> float | None:
        """Mean over buffers of the mean time from a buffer's last read to its release (s)."""
        return statistics.fmean(self.slack.values()) if self.slack else None


def same_logits(a: Tensor | tuple[Tensor, ...], b: Tensor | tuple[Tensor, ...]) -> bool:
    """Bit-identical logits (tensors, or tuples of them for composite steps), on one device: the
    comparison every check of values makes (``core.internal.same_values``: a NaN where the other
    has a NaN is the same value; a backend whose output holds one is not a different program).

    >>> import torch
    >>> nan = torch.tensor([1.0, float("nan")])
    >>> same_logits(nan, nan.clone()), same_logits((nan,), (torch.tensor([1.0, 2.0]),))
    (True, False)
    """
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.device != b.device:
            raise ValueError(
                f"cannot compare logits on {a.device} with logits on {b.device} bit for bit: run the "
                f"reference on the run's device (run_serial(..., device=...))"
            )
        return same_values(a, b)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    return len(a) == len(b) and all(same_logits(x, y) for x, y in zip(a, b))
