"""Fixtures of the graph tests."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """Streams are the parallelism: on two cores torch's default pool makes small ops slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
