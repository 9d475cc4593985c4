"""Engines as they are: an engine's stateful attention backend object, audited, verified and run.

>>> from readfence.core import ForwardMode
>>> from readfence.engine import adapt
>>> from readfence.engine.reference import TrtllmMhaBackend
>>> adapt(TrtllmMhaBackend).read_end(ForwardMode.DECODE)
<ReadEnd.PRE_REPLAY: 1>
"""

from ._adapter import EngineBackend, adapt
from ._contract import END_NAMES, ContractError, EngineError, EngineMode
from ._view import DEFAULT_LAYOUT, AttentionLayer, ForwardBatch, ModelRunnerView, ReqToTokenPool, StatePool, TokenToKVPool

__all__ = [
    "DEFAULT_LAYOUT",
    "END_NAMES",
    "AttentionLayer",
    "ContractError",
    "EngineBackend",
    "EngineError",
    "EngineMode",
    "ForwardBatch",
    "ModelRunnerView",
    "ReqToTokenPool",
    "StatePool",
    "TokenToKVPool",
    "adapt",
]
