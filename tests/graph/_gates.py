"""A gate that holds a stream in a test until the test opens it (shared by the graph tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def make_gate(timeout: float) -> tuple[threading.Event, Callable[[], None]]:
    """A threading.Event and a launchable function that blocks until it is set.

    The function fails (instead of hanging) if the gate stays shut for ``timeout`` seconds.
    """
    opened = threading.Event()

    def block() -> None:
        assert opened.wait(timeout), "test gate never opened"

    return opened, block
