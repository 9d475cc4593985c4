"""Fixtures of the engine tests: a small model (fast traces)."""

from readfence.core import ModelConfig

#: Two layers, four requests of at most 16 tokens: every trace and run stays cheap.
CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)
