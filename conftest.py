"""What every test and doctest of the repository runs under: torch on one intra-op thread.

The suite's parallelism is its pytest-xdist workers (and a CPU device's streams, threads of
their own); the tiny model's ops are too small to split over threads, and on a loaded two-core
machine torch's default pool, beside two workers, made the tests that trace, audit or run it
two to ten times slower. No verdict or output a test compares depends on it (the CLI's commands
run the same way: ``readfence.cli._torch_threads``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """Torch on one intra-op thread for a module's tests and doctests, then as it was."""
    from readfence.cli._torch_threads import one_intra_op_thread as one_thread

    with one_thread():
        yield
