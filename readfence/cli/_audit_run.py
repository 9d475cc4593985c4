"""What ``readfence audit`` runs: declared vs traced read ends, for every mode and every node."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from readfence.core import ForwardMode
from readfence.core.internal import audit_report, positive_int
from readfence.graph import StepShape

from ._errors import InputError


def reference_backends() -> list[Any]:
    """Every reference leaf (default options), then every reference composition.

    >>> [str(b) for b in reference_backends()][:3]
    ['paged', 'trtllm_mha', 'deepseek_v4']
    """
    from readfence.backends import REFERENCE_LEAVES, reference_compositions

    return [make() for make in REFERENCE_LEAVES.values()] + list(reference_compositions().values())


def audit_all(backends: Iterable[Any], modes: Sequence[ForwardMode], *, progress: bool = False,
              batch_sizes: Sequence[int] | None = None, jobs: int = 1) -> list[Any]:
    """One :class:`~readfence.core.AuditReport` per (backend, mode), in that order.

    ``progress`` shows a bar on stderr when it is a terminal (tracing takes a while);
    ``batch_sizes`` are traced for each (default: 1, 2 and the model's maximum); ``jobs`` > 1
    audits the modes in that many worker processes (the same reports, in the same order).

    >>> from readfence.backends import paged
    >>> [r.sound for r in audit_all([paged()], [ForwardMode.DECODE])]
    [True]
    """
    return _audit_pairs([(b, m) for b in backends for m in modes], progress, batch_sizes, jobs)


def audit_phases(shape: StepShape, modes: Sequence[ForwardMode] = (), *, progress: bool = False,
                 batch_sizes: Sequence[int] | None = None, jobs: int = 1) -> list[Any]:
    """One report per distinct (backend, mode) of a step shape's phases (a phase fixes its own
    mode); ``modes``, when given, keeps only the phases in those modes; ``jobs`` as for
    :func:`audit_all`.

    >>> from readfence.graph import parse_step
    >>> [(r.path, r.mode.name) for r in audit_phases(parse_step("ngram(paged)").unwrap(), batch_sizes=[2])]
    [('paged', 'TARGET_VERIFY')]
    """
    pairs = [(b, m) for b, m in dict.fromkeys((p.backend, p.mode) for p in shape.phases) if not modes or m in modes]
    if not pairs:
        have = sorted({p.mode.name.lower() for p in shape.phases})
        raise InputError(f"{shape} has no phase in mode {', '.join(m.name.lower() for m in modes)}; "
                         f"its phases run in: {', '.join(have)}")
    return _audit_pairs(pairs, progress, batch_sizes, jobs)


def _audit_pairs(pairs: Sequence[tuple[Any, ForwardMode]], progress: bool,
                 batch_sizes: Sequence[int] | None, jobs: int) -> list[Any]:
    from tqdm import tqdm

    from ._audit_pool import audit_in_workers
    from ._torch_threads import one_intra_op_thread

    class Bar(tqdm):
        # no monitor thread (tqdm starts one with its first bar, shown or not): with a thread
        # alive the pool cannot fork its workers (``_audit_pool._context``), and a fork-server
        # worker imports torch and readfence again, 3 s each
        monitor_interval = 0

    positive_int("jobs", jobs)
    with one_intra_op_thread(), Bar(total=len(pairs), file=sys.stderr, unit="audit", leave=False,
                                    disable=not (progress and sys.stderr.isatty())) as bar:
        if jobs > 1 and len({m for _, m in pairs}) > 1:
            reports = audit_in_workers(pairs, jobs=jobs, batch_sizes=batch_sizes, done=bar.update)
            if reports is not None:
                return reports
            bar.reset()
        out = []
        for b, m in pairs:
            out.append(audit_report(b, m, batch_sizes=batch_sizes))
            bar.update()
        return out


def totals(reports: Iterable[Any]) -> dict[str, int]:
    """Sum of every report's ``counts()``."""
    out: dict[str, int] = {}
    for r in reports:
        for k, v in r.counts().items():
            out[k] = out.get(k, 0) + v
    return out
