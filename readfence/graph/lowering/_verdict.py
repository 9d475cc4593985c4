"""What the analysis concludes about a step on a live state, asked once per place in memory and evidence.

Lowering one step under several policies, and a checker that audits the step before lowering
it, ask the same question of the same traced program and live state: the audit's verdict at
the batch size lowered (``core.audit`` with ``state=``). It depends on the backend's code, the
Python values that code reads (``core.internal.CodeKey``), its declaration, the step, *where*
the live tensors are (the program bound to the state, ``core.bind``, itself computed once per
program and place in memory) and what the ledgers of the step's runs hold
(``core.internal.Ledger``: a run that saw a read no run saw before changes the verdict), not on
the values the tensors hold; so it is computed once per such key (:class:`VerdictKey`) and
evidence, and shared, and it is current only while every trace the audit read is (a trace whose
captured tensor the backend replaced is traced again, and the verdict computed again). A cached
answer is the very value a fresh call would give: an ``Unsound`` is immutable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from torch import Tensor

from readfence.core import BackendLike, ForwardMode, ModelConfig, Unsound
from readfence.core.internal import CACHES, CodeKey, Ledger, audit_failure, code_key, evidence_epoch, state_key

State = Mapping[str, Mapping[str, Tensor]]


@attrs.frozen
class VerdictKey:
    """What the audit's verdict depends on: the backend (its declaration, by value), its code
    and the values that code can read (``code``), the step (mode, model, batch size, device) and
    where the live state is. The traces, bindings and observations the audit read are checked
    at every use too (``Table.compute``): a verdict never outlives them."""

    backend: BackendLike
    code: CodeKey
    mode: ForwardMode
    cfg: ModelConfig
    batch_size: int
    device: str
    state: tuple[tuple[Any, ...], ...]


#: The audit's verdicts (``None``: sound).
_VERDICTS = CACHES.table("verdicts", VerdictKey, "the audit's verdict on a step at one batch size on a live state "
                         "(None: sound); current while the traces it read are", limit=256)


def audit_verdict(backend: BackendLike, mode: ForwardMode, *, cfg: ModelConfig, batch_size: int, device: str,
                  state: State, ledger: Ledger | None = None) -> Unsound | None:
    """The audit's verdict on ``backend``'s step at ``batch_size`` on the live ``state``
    (``None``: sound); what ``lower`` refuses. ``ledger`` is the lowering's ledger of the step
    (its rehearsal and validation runs count too). A cached verdict is used while no run of any
    step saw a read, escape or write that none saw before (``core.internal.evidence_epoch``).
    Raises what the audit raises (a stage that writes a shared buffer or starts a thread); a
    backend that is not hashable is audited every time.

    >>> from readfence.backends import paged
    >>> from readfence.graph.lowering import make_state
    >>> cfg = ModelConfig(layers=1)
    >>> print(audit_verdict(paged(), ForwardMode.DECODE, cfg=cfg, batch_size=2, device="cpu",
    ...                     state=make_state(cfg)))
    None
    """
    def verdict() -> Unsound | None:
        return audit_failure(backend, mode, cfg=cfg, batch_sizes=[batch_size], device=device, state=state,
                             ledger=ledger)

    try:
        key = VerdictKey(backend, code_key(backend), mode, cfg, batch_size, device, state_key(state))
        hash(key)
    except TypeError:  # a backend that is not hashable
        return verdict()
    made_at: list[int] = []  # the evidence epoch the verdict was made at

    def made() -> Unsound | None:
        answer = verdict()
        made_at.append(evidence_epoch())
        return answer

    def current() -> str | None:
        return None if made_at and made_at[-1] == evidence_epoch() else "a run saw what no run saw before"

    return _VERDICTS.compute(key, made, check=current)


__all__ = ["VerdictKey", "audit_verdict"]
