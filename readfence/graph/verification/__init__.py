"""Verification: checks of a lowered step that do not trust the analysis that placed its fences.

``verify`` (``verify_serve`` for the serving loop) runs each policy in check mode (poison on release, a write guard, the runtime read
observer) against the serial run; ``readfence.graph.fuzz`` holds the static analysis to these
checks on generated programs.
"""

from ..runtime.internal import CHECKS
from ._verify import WORKLOAD, LateRead, LateReadWatch, PolicyCheck, VerifyReport, phase_modes, verify, verify_serve

__all__ = ["CHECKS", "WORKLOAD", "LateRead", "LateReadWatch", "PolicyCheck", "VerifyReport", "phase_modes", "verify",
           "verify_serve"]
