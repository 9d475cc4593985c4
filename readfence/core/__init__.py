"""The step program: forward modes, shared state, the tiny model, tracing and audit."""

from ._modes import ForwardMode
from ._protocol import STAGE_ENDS, BackendLike

__all__ = ["STAGE_ENDS", "BackendLike", "ForwardMode"]
