"""Verification: checks of a lowered step that do not trust the analysis that placed its fences.

``verify`` runs each policy in check mode (poison on release, a write guard, the runtime read
observer) against the serial run; ``readfence.graph.fuzz`` holds the static analysis to these
checks on generated programs.
"""

from ._verify import CHECKS, LateRead, LateReadWatch, PolicyCheck, VerifyReport, phase_modes, verify

__all__ = ["CHECKS", "LateRead", "LateReadWatch", "PolicyCheck", "VerifyReport", "phase_modes", "verify"]
