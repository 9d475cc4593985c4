"""What the analysis concludes about a step on a live state, asked once per place in memory and evidence.

Lowering one step under several policies, and a checker that audits the step before lowering
it, ask the same question of the same traced program and live state: the audit's verdict at
the batch size lowered (``core.audit`` with ``state=``). It depends on the backend's code and
declaration, the step, *where* the live tensors are (the program bound to the state,
``core.bind``, itself computed once per program and place in memory) and what the ledgers of
the step's runs hold (``core.internal.Ledger``: a run that saw a read no run saw before changes
the verdict), not on the values the tensors hold; so it is computed once per such key and
evidence, and shared. A cached answer is the very value a fresh call would give: an ``Unsound``
is immutable.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from readfence.core import BackendLike, ForwardMode, ModelConfig, Unsound
from readfence.core import audit as audit_backend
from readfence.core.internal import Ledger, cache_with_traces, evidence_epoch, remember, state_key

State = Mapping[str, Mapping[str, Tensor]]

#: How many answers the cache keeps (the oldest is forgotten first); it is forgotten with the
#: traces (``core.clear_trace_cache``).
_LIMIT = 256

#: The audit's verdicts (``None``: sound) and the evidence they were made on, by what they depend on.
_VERDICTS: dict[tuple[object, ...], tuple[Unsound | None, int]] = cache_with_traces({})


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
    key = (backend, mode, cfg, batch_size, device, state_key(state))
    try:
        verdict, epoch = _VERDICTS[key]
        if epoch == evidence_epoch():
            return verdict
    except (KeyError, TypeError):  # TypeError: a backend that is not hashable
        pass
    verdict = audit_backend(backend, mode, cfg=cfg, batch_sizes=[batch_size], device=device,
                            state=state, ledger=ledger).swap().value_or(None)
    try:
        remember(_VERDICTS, key, (verdict, evidence_epoch()), _LIMIT)
    except TypeError:
        pass
    return verdict


__all__ = ["audit_verdict"]
