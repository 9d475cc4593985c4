"""The package's doctests run as its tests do: torch on one intra-op thread.

The examples trace, audit and run the tiny model, whose ops are too small to split over
threads; on a loaded two-core machine torch's default pool made them several times slower.
What they print does not depend on it (``readfence.cli._torch_threads``: the CLI's commands
run the same way).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from _pytest.doctest import DoctestItem


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """A doctest's run on one intra-op thread, then torch as it was; other items as they are."""
    if not isinstance(item, DoctestItem):
        return (yield)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return (yield)
    finally:
        torch.set_num_threads(before)
