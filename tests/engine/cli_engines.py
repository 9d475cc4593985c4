"""Factories for ``--engine tests.engine.cli_engines:NAME`` (the small model: fast command tests)."""

from readfence.engine import adapt
from readfence.engine import reference as ref

from .classes import HostBounds
from .conftest import CFG


def triton():
    return ref.triton_engine(CFG)


def minimax_hybrid():
    return ref.minimax_hybrid_engine(CFG)


def host_bounds(cfg=None):
    return adapt(HostBounds, cfg=CFG if cfg is None else cfg)


PAIR = {"triton": triton, "host_bounds": host_bounds}


def raises():
    raise RuntimeError("no GPU in this engine's config")


def not_an_engine():
    return 42


def two_arguments(runner, extra):
    return None


def factory_raising(runner):
    raise KeyError("kv pool")


def nothing():
    return []


EMPTY: dict = {}
