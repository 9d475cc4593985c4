"""Fixtures of these tests: torch on one intra-op thread for every module, as the core tests."""

from ..core.conftest import _one_intra_op_thread  # noqa: F401 (fixtures)
