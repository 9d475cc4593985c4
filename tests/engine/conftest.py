"""Fixtures of the engine tests: a small model (fast traces) and a CPU device."""

import pytest
import torch

from readfence.core import ModelConfig
from readfence.graph import CpuDevice

#: Two layers, four requests of at most 16 tokens: every trace and run stays cheap.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """Streams are the parallelism: on two cores torch's default pool makes small ops slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def dev():
    """A CpuDevice whose waits time out after 10 s (a test that hangs fails instead)."""
    with CpuDevice(timeout=10.0) as d:
        yield d
