"""Shared pytest configuration: tests marked ``cuda`` skip when CUDA is unavailable."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def solo_group():
    """The name of a gloo process group of one rank, in this process: real functional
    collectives with no other process (a rank whose partners contribute nothing)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
