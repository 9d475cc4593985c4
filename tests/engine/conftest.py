"""Fixtures of the engine tests: a small model (fast traces), and the graph tests' CPU device
and one intra-op thread."""

from readfence.core import ModelConfig

from ..graph.conftest import _one_intra_op_thread  # noqa: F401 (fixtures)

#: Two layers, four requests of at most 16 tokens: every trace and run stays cheap.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)
