"""Lowering: a traced step becomes device work with its fences placed from the joined effect.

Fence policies and plans (where each buffer's release is published), the FX passes that
insert event records after chosen nodes and alias checks after opaque ops, the fences a step publishes (event generations,
event rings), the poison-on-release check mode, ``lower`` itself and ``LowerOptions``, the options
the functions that lower for you hand on to it.
"""

from ._fence import Bound, Fence, ForeignEventError, RingWrapError
from ._fx_aliases import ReplayAliasError
from ._live_state import make_state, torch_device
from ._lower import Lowered, StepRun, UncapturableStage, UnsoundLowering, last_reads, lower
from ._options import LowerOptions
from ._plan import FencePlan, Placement, plan_fences
from ._poison import POISONS, CheckState, poison_family
from ._policy import Policy

__all__ = [
    "POISONS",
    "Bound",
    "CheckState",
    "Fence",
    "ForeignEventError",
    "FencePlan",
    "LowerOptions",
    "Lowered",
    "Placement",
    "Policy",
    "ReplayAliasError",
    "RingWrapError",
    "StepRun",
    "UncapturableStage",
    "UnsoundLowering",
    "last_reads",
    "lower",
    "make_state",
    "plan_fences",
    "poison_family",
    "torch_device",
]
