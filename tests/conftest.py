"""Shared pytest configuration: tests marked ``cuda`` skip when CUDA is unavailable."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch
from hypothesis import settings

from readfence.core import ModelConfig

#: Whether the real triton is installed (the ``triton`` extra); without a GPU its kernels run in its
#: interpreter, which reads ``TRITON_INTERPRET`` when a kernel is decorated: set before any test imports it.
TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = ("triton is not installed (pip install -e '.[triton]'): its kernels run in triton's interpreter on a "
             "machine without a GPU")
if TRITON and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No test may depend on how fast the machine is: hypothesis' per-example deadline (200 ms by
# default) would fail a loaded machine's slow example, so the suite runs without one.
settings.register_profile("readfence-tests", deadline=None)
settings.load_profile("readfence-tests")

#: The model configs the tests share (``trace`` caches per config, so modules using the same
#: one share their traces): most run the small one.
SMALL = ModelConfig(layers=2, max_reqs=8, max_ctx=16)
ONE_LAYER = ModelConfig(layers=1, max_reqs=8, max_ctx=16)  # user backends' steps: half the ops
TWO_LAYERS = ModelConfig(layers=2)  # the default sizes, two layers: every combinator mixes its children
SINGLE_LAYER = ModelConfig(layers=1)
DEFAULT = ModelConfig()


def first_of_each(values: list, group) -> list:
    """``values`` as pytest params: the first of each ``group(value)`` in the quick tier
    (``-m "not slow"``), the others marked ``slow`` (the full suite runs them all).

    >>> [p.marks for p in first_of_each(["a1", "a2", "b1"], lambda v: v[0])][1][0].name
    'slow'
    """
    seen: set = set()
    out = []
    for value in values:
        key = group(value)
        out.append(pytest.param(value, marks=[pytest.mark.slow] if key in seen else []))
        seen.add(key)
    return out


#: Tests a timed run measured slow (``scripts/slow_tests.py`` writes it): marked ``slow`` here.
SLOW_LIST = pathlib.Path(__file__).with_name("slow.txt")


def measured_slow() -> frozenset[str]:
    """The node ids listed in :data:`SLOW_LIST` (comment lines left out)."""
    lines = SLOW_LIST.read_text().splitlines() if SLOW_LIST.is_file() else []
    return frozenset(line for line in lines if line and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = measured_slow()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
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


@pytest.fixture
def dev():
    """A CpuDevice whose waits time out after 30 s (a test that hangs fails instead)."""
    from readfence.graph import CpuDevice

    with CpuDevice(timeout=30.0) as d:
        yield d


@pytest.fixture(scope="session", autouse=True)
def command_runs_shared(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One folder for every pytest-xdist worker of this run (their base temps' parent; this
    run's own base temp without xdist), where ``tests.command_runs`` keeps each command's run."""
    from tests.command_runs import share_runs_in

    base = tmp_path_factory.getbasetemp()
    share_runs_in((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "command-runs")


@pytest.fixture(autouse=True)
def command_runs_environment() -> None:
    """The environment as each test starts, for ``tests.command_runs`` to key a run by what the
    test changed of it."""
    from tests.command_runs import note_test_start

    note_test_start()
