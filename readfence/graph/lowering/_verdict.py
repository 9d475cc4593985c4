"""What the analysis concludes about a step on a live state, asked once per place in memory.

Lowering one step under several policies, and a checker that audits the step before lowering
it, ask the same question of the same traced program and live state: the audit's verdict at
the batch size lowered (``core.audit`` with ``state=``). It depends on the backend's code, the
Python values that code reads (``core.internal.CodeKey``), its declaration, the step, and
*where* the live tensors are (the program bound to the state, ``core.bind``, itself computed
once per program and place in memory), not on the values the tensors hold; so it is computed
once per such key (:class:`VerdictKey`) and shared, and it is current only while every trace the
audit read is (a trace whose captured tensor the backend replaced is traced again, and the
verdict computed again). A cached answer is the very value a fresh call would give: an
``Unsound`` is immutable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from torch import Tensor

from readfence.core import BackendLike, ForwardMode, ModelConfig, Unsound
from readfence.core import audit as audit_backend
from readfence.core.internal import CACHES, CodeKey, code_key, state_key

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
                  state: State) -> Unsound | None:
    """The audit's verdict on ``backend``'s step at ``batch_size`` on the live ``state``
    (``None``: sound); what ``lower`` refuses. Raises what the audit raises (a stage that
    writes a shared buffer or starts a thread); a backend that is not hashable is audited
    every time.

    >>> from readfence.backends import paged
    >>> from readfence.graph.lowering import make_state
    >>> cfg = ModelConfig(layers=1)
    >>> print(audit_verdict(paged(), ForwardMode.DECODE, cfg=cfg, batch_size=2, device="cpu",
    ...                     state=make_state(cfg)))
    None
    """
    def verdict() -> Unsound | None:
        return audit_backend(backend, mode, cfg=cfg, batch_sizes=[batch_size], device=device,
                             state=state).swap().value_or(None)

    try:
        key = VerdictKey(backend, code_key(backend), mode, cfg, batch_size, device, state_key(state))
        hash(key)
    except TypeError:  # a backend that is not hashable
        return verdict()
    return _VERDICTS.compute(key, verdict)


__all__ = ["VerdictKey", "audit_verdict"]
