"""Backends that raise one of readfence's own errors, for ``tests/cli/test_error_lines.py``.

``READFENCE_TEST_RAISES`` names the error class (its ``__qualname__``); the backend's out-of-graph
stage raises an instance of it, built with the class's own constructor and a message of two
lines, wherever a command runs the stage (the trace, the audit's observer, a lowered step). The
engine class does the same from ``init_forward_metadata_out_graph``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from returns.result import Failure

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, NotGraphSafe, StageOutputError, StageThreadError, StageWriteError
from readfence.core.tracing._captured import CapturedStateError
from readfence.core.tracing._triton import LaunchStreamError, UnboundedKernelError, UnsupportedLaunchError
from readfence.effects import ReadfenceError, UnwrapError
from readfence.effects.laws import Law, LawViolation
from readfence.engine import ContractError, EngineError, adapt
from readfence.graph import DeviceError, DeviceTimeout, UncapturableStage, UnsoundLowering
from readfence.graph.devices import CaptureError, DeviceClosed, EventNeverRecorded, StreamError
from readfence.graph.devices._cuda import SelfCheckFailed
from readfence.graph.lowering._fence import ForeignEventError, RingWrapError
from readfence.graph.lowering._fx_aliases import ReplayAliasError
from readfence.graph.runtime import SanitizerError
from readfence.parallel import TensorParallelError
from readfence.parallel._launch import RankFailure

from ..engine.classes import KeptCopies
from ..engine.conftest import CFG

#: The environment variable naming the error class to raise.
RAISES = "READFENCE_TEST_RAISES"

_TWO_LINES = "raised on purpose\nby the backend under test"

#: Each of readfence's error classes (bad input, ``InputError``, is the command line's own), built
#: as readfence builds it.
ERRORS: dict[str, Callable[[], ReadfenceError]] = {
    "ReadfenceError": lambda: ReadfenceError(_TWO_LINES),
    "StageOutputError": lambda: StageOutputError(_TWO_LINES, stage="prepare_out_graph"),
    "StageThreadError": lambda: StageThreadError("raising", "prepare_out_graph", "a thread 'late' running copy",
                                                 f"{__file__}:1 in snapshot", None),
    "NotGraphSafe": lambda: NotGraphSafe("raising", "DECODE", "body", "logits", _TWO_LINES, f"{__file__}:1"),
    "StageWriteError": lambda: StageWriteError("raising", "prepare_out_graph", "seq_lens", "add_", "aten.add_.Tensor",
                                               _TWO_LINES, f"{__file__}:1 in snapshot"),
    "CapturedStateError": lambda: CapturedStateError("raising", ForwardMode.DECODE, ()),
    "LaunchStreamError": lambda: LaunchStreamError("copy_rows"),
    "UnboundedKernelError": lambda: UnboundedKernelError("copy_rows", f"{__file__}:1"),
    "UnsupportedLaunchError": lambda: UnsupportedLaunchError(_TWO_LINES),
    "UnwrapError": lambda: UnwrapError(Failure(_TWO_LINES)),
    "LawViolation": lambda: LawViolation("raising", Law("idem", "a | a == a", 1, lambda a: None), (1,), _TWO_LINES),
    "ContractError": lambda: ContractError(_TWO_LINES),
    "EngineError": lambda: EngineError(_TWO_LINES, method="init_forward_metadata_out_graph", where=f"{__file__}:1"),
    "SelfCheckFailed": lambda: SelfCheckFailed(_TWO_LINES),
    "CaptureError": lambda: CaptureError(_TWO_LINES),
    "DeviceClosed": lambda: DeviceClosed(_TWO_LINES),
    "DeviceError": lambda: DeviceError(_TWO_LINES),
    "DeviceTimeout": lambda: DeviceTimeout("event 'done'", stream="forward", timeout=0.5, detail=_TWO_LINES),
    "EventNeverRecorded": lambda: EventNeverRecorded("done", "waited on"),
    "StreamError": lambda: StreamError("forward", "body", ValueError(_TWO_LINES)),
    "ForeignEventError": lambda: ForeignEventError(_TWO_LINES),
    "RingWrapError": lambda: RingWrapError(_TWO_LINES),
    "ReplayAliasError": lambda: ReplayAliasError("raising", "body", "view", "mine::view", frozenset({"seq_lens"})),
    "UncapturableStage": lambda: UncapturableStage(_TWO_LINES),
    "UnsoundLowering": lambda: UnsoundLowering(_TWO_LINES),
    "SanitizerError": lambda: SanitizerError(_TWO_LINES),
    "TensorParallelError": lambda: TensorParallelError([RankFailure(1, "raised", _TWO_LINES)], 2),
}


def _raise_if_asked() -> None:
    name = os.environ.get(RAISES)
    if name:
        raise ERRORS[name]()


def _snapshot(mode: ForwardMode, shared: Any, batch: Any) -> Any:
    _raise_if_asked()
    return page_meta(shared, batch)


def _attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])


#: A leaf whose out-of-graph stage raises the error ``READFENCE_TEST_RAISES`` names.
backend = leaf("raising", _attend, prepare_out_graph=_snapshot)


class RaisingEngine(KeptCopies):
    """An engine backend whose out-of-graph metadata raises the error ``READFENCE_TEST_RAISES`` names."""

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        _raise_if_asked()
        super().init_forward_metadata_out_graph(forward_batch, in_capture)


def engine() -> Any:
    return adapt(RaisingEngine, cfg=CFG)


__all__ = ["ERRORS", "RAISES", "backend", "engine"]
