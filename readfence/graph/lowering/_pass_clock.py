"""Where a lowering's time goes: wall seconds per pass, as ``Lowered.pass_seconds`` reports them.

A 64-layer ``lower`` takes about a second of which no single pass is most; a user deciding
whether to lower fewer batch sizes, or a developer deciding which pass to make cheaper, needs the
split (torch.compile's ``compile_times`` answers the same question). The passes are timed where
``lower`` calls them; a pass called more than once (a second compile for records only a run
could place, the plain code a miscompile falls back to) adds up under its one name.

>>> import time
>>> clock = PassClock()
>>> with clock.timing("compile"):
...     time.sleep(0.001)
>>> with clock.timing("compile"):
...     pass
>>> clock.seconds()["compile"] >= 0.001, clock.seconds()["trace"]
(True, 0.0)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType

#: The passes of ``lower``, in the order it runs them (``Lowered.pass_seconds`` has these keys):
#: trace and bind to the live state; compile the captured stages; validate the compiled code
#: against the stages' Python on the generated states; the audit's verdict; the rehearsal; plan
#: the fences; bind each ring slot's hooks and capture it.
PASSES: tuple[str, ...] = ("trace", "compile", "validate", "verdict", "rehearse", "plan", "capture")


class PassClock:
    """Wall seconds per pass name, summed over every time a pass ran (:meth:`timing`)."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(PASSES, 0.0)

    @contextlib.contextmanager
    def timing(self, name: str) -> Iterator[None]:
        """Add the block's wall seconds to pass ``name`` (one of :data:`PASSES`), however it ends."""
        if name not in self._seconds:
            raise ValueError(f"unknown lowering pass {name!r}: one of {', '.join(PASSES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start

    def seconds(self) -> Mapping[str, float]:
        """Each pass's seconds so far, in :data:`PASSES` order (read-only)."""
        return MappingProxyType(dict(self._seconds))


__all__ = ["PASSES", "PassClock"]
