"""Which keys of its metadata a traced stage reads: every way a dict hands out a value notes its key,
and a stage's output guard then holds only the Python values some captured stage after it read."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from readfence.core import PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, ForwardMode
from readfence.core.internal import StepFunctions, trace_step
from readfence.core.tracing._consumed import ReadKeys


def _match(d: Any) -> Any:
    match d:
        case {"a": x}:
            return x
    return None


#: Each way a stage may take the value at key "a" (or every value) out of its ``meta``.
READS: dict[str, Callable[[Any], Any]] = {
    "subscript": lambda d: d["a"],
    "get": lambda d: d.get("a"),
    "pop": lambda d: d.pop("a"),
    "setdefault": lambda d: d.setdefault("a", 0),
    "values": lambda d: list(d.values()),
    "items": lambda d: dict(d.items()),
    "unpacking": lambda d: {**d},
    "keywords": lambda d: (lambda **kw: kw)(**d),
    "dict": dict,
    "update": lambda d: {}.update(d),
    "copy": lambda d: d.copy(),
    "or": lambda d: d | {},
    "ror": lambda d: {} | d,
    "eq": lambda d: d == {"a": 1},
    "repr": repr,
    "format": lambda d: f"{d}",
    "copy.copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": pickle.dumps,
    "json": json.dumps,
    "pytree": pytree.tree_leaves,
    "match": _match,
}


@pytest.mark.parametrize("name", sorted(READS))
def test_every_way_a_dict_hands_out_a_value_notes_its_key(name: str) -> None:
    read: set[Any] = set()
    meta = ReadKeys({"a": 1, "b": 2}, read)
    READS[name](meta)
    assert "a" in read, read


def test_asking_for_keys_alone_notes_none() -> None:
    read: set[Any] = set()
    meta = ReadKeys({"a": 1, "b": 2}, read)
    assert ("a" in meta, len(meta), sorted(meta.keys()), sorted(meta)) == (True, 2, ["a", "b"], ["a", "b"])
    assert read == set()


def _program(inn: Callable[..., Any], body: Callable[..., Any]):
    shared = {"seq_lens": torch.arange(1, 5, dtype=torch.int32)}

    def out(shared, batch):  # a bound read on the host from a copy, a scale, a nan sentinel
        lens = shared["seq_lens"] + 0
        return {"lens": lens, "bound": int(lens.max()), "scale": 2, "cap": float("nan")}

    fns = StepFunctions(out, inn, body, "toy")
    return trace_step(fns, ForwardMode.DECODE, {"shared": shared, "batch": {}})


def test_the_guard_holds_the_values_the_captured_stages_read_and_no_other() -> None:
    program = _program(lambda shared, batch, meta: {"lens2": meta["lens"] * meta["scale"]},
                       lambda shared, batch, meta: meta["lens2"] + meta["lens"])
    assert program.stage(PREPARE_OUT_GRAPH).hooks.guard.consumed == {"lens", "scale"}
    assert program.stage(PREPARE_IN_GRAPH).hooks.guard.consumed == {"lens2"}
    eager = program.stage(PREPARE_OUT_GRAPH).hooks.eager  # what the lowered step runs: the same guard
    assert eager.guard is program.stage(PREPARE_OUT_GRAPH).hooks.guard


def test_a_value_read_by_a_stage_that_runs_its_python_is_not_baked() -> None:
    def inn(shared, batch, meta):  # escapes: it runs as Python every step, reading the bound afresh
        return {"lens2": meta["lens"].clamp(max=meta["bound"] + int(meta["lens"].sum()) * 0)}

    program = _program(inn, lambda shared, batch, meta: meta["lens2"] * 1)
    assert not program.stage(PREPARE_IN_GRAPH).analysis.faithful
    assert program.stage(PREPARE_OUT_GRAPH).hooks.guard.consumed == frozenset()
