"""Engines as they are: an engine's stateful attention backend object, audited, verified and run.

>>> from readfence.core import ForwardMode
>>> from readfence.engine import adapt
>>> from readfence.engine.reference import TrtllmMhaBackend
>>> adapt(TrtllmMhaBackend).read_end(ForwardMode.DECODE)
<ReadEnd.PRE_REPLAY: 1>
"""

from ._adapter import EngineBackend, adapt
from ._audit import ENGINE_MODES, EngineAudit, EngineRow, NodeAudit, audit_engine
from ._check import RUNNER, CompareRow, Comparison, EngineVerification, VerifyRow, compare, verify_engine
from ._contract import END_NAMES, ContractError, EngineError, EngineMode
from ._observe import observe_engine
from ._runner import EngineRunner, Mailbox, RunnerModel, RunnerTarget, runner_model
from ._view import DEFAULT_LAYOUT, AttentionLayer, ForwardBatch, ModelRunnerView, ReqToTokenPool, StatePool, TokenToKVPool

__all__ = [
    "DEFAULT_LAYOUT",
    "END_NAMES",
    "ENGINE_MODES",
    "RUNNER",
    "AttentionLayer",
    "CompareRow",
    "Comparison",
    "ContractError",
    "EngineAudit",
    "EngineBackend",
    "EngineError",
    "EngineMode",
    "EngineRow",
    "EngineRunner",
    "EngineVerification",
    "ForwardBatch",
    "Mailbox",
    "ModelRunnerView",
    "NodeAudit",
    "ReqToTokenPool",
    "RunnerModel",
    "RunnerTarget",
    "StatePool",
    "TokenToKVPool",
    "VerifyRow",
    "adapt",
    "audit_engine",
    "compare",
    "observe_engine",
    "runner_model",
    "verify_engine",
]
