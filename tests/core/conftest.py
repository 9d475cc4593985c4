"""Fixtures of these tests: torch on one intra-op thread for every module."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread(one_intra_op_thread):
    """The tiny model's ops are too small to split over threads: torch's default pool made the
    tests that trace, audit or run it three times slower on a loaded two-core machine (the
    verdicts and outputs compared do not depend on it)."""
    yield
