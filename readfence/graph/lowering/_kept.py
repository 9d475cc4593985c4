"""Lowering pass: which tensors a lowered step's graphs captured, and whether they still are the
backend's.

A graph that captured a tensor a backend keeps (a metadata buffer it regrows for a larger batch)
reads that tensor at every replay, whatever the backend holds by then. ``Lowered.stale`` and every
replay ask :func:`stale_capture`: a captured tensor the backend has replaced, resized or moved since
is a refusal (``StaleCaptureError``), never a stale read.
"""

from __future__ import annotations

from collections.abc import Callable

from readfence.core import BackendLike, Program
from readfence.core.internal import KeptTensor, StaleCaptureError, UnkeptCaptureError, first_stale, kept_tensors, reach


def captured_kept(backend: BackendLike, program: Program) -> tuple[KeptTensor, ...]:
    """The tensors the stages that replay a compiled graph captured (a stage that runs its Python
    reads what the backend keeps now), and where the backend keeps each. Refuses
    (``UnkeptCaptureError``) one that the Python of a stage run in the step fills but that is kept
    nowhere the walk finds: its replacement could not be seen."""
    replayed_stages = [s for s in program.stages if not s.runs_python and s.analysis.captured]
    kept = kept_tensors(replayed_stages, reach(backend, "backend")) if replayed_stages else ()
    python = {s.stage.name for s in program.stages if s.runs_python}
    for k in kept:
        if not k.homes and k.filled_by & python:
            raise UnkeptCaptureError(backend.name, k.stage, tuple(k.tensor.shape), min(k.filled_by & python))
    return kept


def stale_capture(kept: tuple[KeptTensor, ...], backend: BackendLike, label: str) -> StaleCaptureError | None:
    """The error that refuses to replay the graphs of ``label`` because one of the tensors they
    captured (``kept``) changed where ``backend`` keeps it; ``None`` when none did."""
    found = first_stale(kept, backend)
    if found is None:
        return None
    tensor, what = found
    return StaleCaptureError(backend.name, label, tensor.stage, tensor.where, what)


def kept_check(kept: tuple[KeptTensor, ...], backend: BackendLike, label: str) -> Callable[[], None] | None:
    """What every replay checks once the out-of-graph stage's Python (which may have regrown a
    buffer) has run: that no tensor in ``kept`` changed (raises ``StaleCaptureError``); ``None``
    for graphs that captured no tensor."""
    if not kept:
        return None

    def check() -> None:
        error = stale_capture(kept, backend, label)
        if error is not None:
            raise error

    return check


__all__ = ["captured_kept", "kept_check", "stale_capture"]
