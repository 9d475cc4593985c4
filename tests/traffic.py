"""Backends whose reads or values depend on the traffic a step carries, written as users write them.

Each takes a path, or computes a value, only on a kind of batch the trace's example is not: a
request at its first token, a mixed batch (requests new and deep in context side by side), a
request at the longest context, a row a finished request left behind (a slot about to be reused).
None of them escapes the tracer: the condition is a count taken from a boolean mask (a
data-dependent shape), which the trace bakes as a Python value. Each hidden read or baked value
changes the logits when it goes wrong, so the checks that trust no analysis (the comparison with
the serial run, poison on release, the runtime read observer) can see it.

* :data:`OUT_OF_GRAPH`: the out-of-graph stage of a replayed step (DECODE) reads a buffer only on
  such a batch. Declared not to read it, the fence releases it at the step's start.
* :data:`KEPT`: a custom op reads the live lengths through a reference the backend keeps.
* :data:`BAKED`: ``prepare_in_graph`` computes a count from a boolean mask, which the capture bakes.
* :data:`EXTEND_BRANCHES`: a stage of EXTEND, which runs its Python every step, reads the page
  table only on a mixed batch.

``honest=True`` gives the same code with the declaration that covers the hidden read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode
from readfence.effects import ReadEffect, ReadEnd

M = ForwardMode
PRE, IN, POST = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY
State = Mapping[str, Mapping[str, Tensor]]


# -- conditions, each a count from a boolean mask: no host read the tracer could flag ------------
def some_first_token(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], max_ctx: int) -> bool:
    pos = batch["positions"]
    return bool(pos[pos == 0].numel())


def mixed(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], max_ctx: int) -> bool:
    pos = batch["positions"]
    return bool(pos[pos == 0].numel()) and bool(pos[pos > 0].numel())


def at_longest(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], max_ctx: int) -> bool:
    pos = batch["positions"]
    return bool(pos[pos == max_ctx - 1].numel())


def stale_rows(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], max_ctx: int) -> bool:
    # a row outside the batch with a length: a finished request's, its slot about to be reused
    lens = shared["seq_lens"]
    return lens[lens > 0].numel() > batch["req_pool_indices"].numel()


def middle_length(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], max_ctx: int) -> bool:
    # a split-KV style bucket: the batch's longest length neither short nor long
    lens = batch["positions"] + 1
    return bool(lens[lens > 2].numel()) and not lens[lens > (2 * max_ctx) // 3].numel()


def pad_token(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], max_ctx: int) -> bool:
    # a padding row's token (id 0), as a graph captured for a larger batch runs a smaller one
    ids = batch["input_ids"]
    return bool(ids[ids == 0].numel())


Condition = Callable[[Mapping[str, Tensor], Mapping[str, Tensor], int], bool]


# -- the out-of-graph stage of a replayed step ---------------------------------------------------
def out_of_graph(name: str, when: Condition, max_ctx: int, *, hidden: str = "seq_lens", honest: bool = False) -> Any:
    """A DECODE leaf snapshotting its metadata before the replay (``prepare_out_graph``): the page
    rows, and the lengths, from the positions (one new token each: a length is its position + 1),
    except when ``when`` holds: then it takes the lengths from ``seq_lens`` (the same values on a
    consistent state), or (``hidden="state_slots"``) adds a mark of each request's state slot. It
    declares ``hidden`` not read (``NONE``: released at the step's start), or, ``honest``, read
    before the replay."""

    def out(mode, shared, batch):
        rows = batch["req_pool_indices"]
        meta = {"kv_indices": shared["req_to_token"].index_select(0, rows), "kv_lens": batch["positions"] + 1,
                "mark": torch.zeros(rows.shape[0])}
        if when(shared, batch, max_ctx):
            if hidden == "seq_lens":
                meta["kv_lens"] = shared["seq_lens"].index_select(0, rows).long()
            else:
                meta["mark"] = shared[hidden].index_select(0, rows).float() * 1e-3
        return meta

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out + meta["mark"].view(-1, 1, 1)

    ends = {"req_to_token": PRE, hidden: PRE if honest else ReadEnd.NONE}
    if when is stale_rows:
        ends["seq_lens"] = PRE  # (the condition reads the lengths: on every path)
    return leaf(f"{name}{'_honest' if honest else ''}", attend, prepare_out_graph=out,
                declare={M.DECODE: ReadEffect.of(ends)})


def out_of_graph_cases(max_ctx: int) -> dict[str, Callable[[bool], Any]]:
    """Each spelling, by name: ``make(honest)``."""
    return {
        "first_token": lambda honest: out_of_graph("first_token", some_first_token, max_ctx, honest=honest),
        "mixed_batch": lambda honest: out_of_graph("mixed_batch", mixed, max_ctx, honest=honest),
        "longest_context": lambda honest: out_of_graph("longest_context", at_longest, max_ctx, honest=honest),
        "reused_slot": lambda honest: out_of_graph("reused_slot", stale_rows, max_ctx, hidden="state_slots",
                                                   honest=honest),
        "middle_length": lambda honest: out_of_graph("middle_length", middle_length, max_ctx, honest=honest),
        "pad_token": lambda honest: out_of_graph("pad_token", pad_token, max_ctx, hidden="state_slots", honest=honest),
    }


# -- a custom op reading the live lengths through a reference the backend keeps ------------------
class Plan:
    """What a FlashInfer-style wrapper keeps between plan and run: a reference to the runner's live lengths."""

    lens: Tensor | None = None


PLAN = Plan()


@torch.library.custom_op("readfence_traffic::kept_lens", mutates_args=())
def kept_lens(rows: Tensor) -> Tensor:
    """The lengths of ``rows``, from the live lengths the plan kept (none of its arguments)."""
    assert PLAN.lens is not None, "plan before run"
    return PLAN.lens.index_select(0, rows).long()


@kept_lens.register_fake
def _(rows: Tensor) -> Tensor:
    return torch.empty_like(rows, dtype=torch.long)


_LIBRARY = torch.library.Library("readfence_traffic_lib", "DEF")  # kept alive: the ops live as long as it
_LIBRARY.define("lens_of(Tensor rows) -> Tensor")
_CLOSURES: dict[str, Callable[[Tensor], Tensor]] = {}


def _lens_of(rows: Tensor) -> Tensor:
    return _CLOSURES["lens_of"](rows)


_LIBRARY.impl("lens_of", _lens_of, "CPU")
_LIBRARY.impl("lens_of", lambda rows: torch.empty_like(rows, dtype=torch.long), "Meta")


class Runner:
    """An engine-style object: its method kernel reads the lengths it was built with (its runner's)."""

    def __init__(self, lens: Tensor) -> None:
        self.lens = lens

    def lengths(self, rows: Tensor) -> Tensor:
        return self.lens.index_select(0, rows).long()


@torch.library.custom_op("readfence_traffic::runner_lens", mutates_args=())
def runner_lens(rows: Tensor, key: int) -> Tensor:
    """The lengths of ``rows``, by the runner registered under ``key``."""
    return RUNNERS[key].lengths(rows)


@runner_lens.register_fake
def _(rows: Tensor, key: int) -> Tensor:
    return torch.empty_like(rows, dtype=torch.long)


RUNNERS: dict[int, Runner] = {}


def kept(name: str, state: State | None, *, honest: bool = False) -> Any:
    """A paged leaf whose lengths come from a custom op reading the live ``seq_lens`` it keeps, in
    the body (``custom_op``, ``library``: an op defined with ``torch.library.Library`` whose kernel
    is a plain Python closure over the tensor, ``method``: a kernel calling a method of an object
    holding it) or in ``prepare_in_graph`` (``in_graph``). It declares the lengths read in the graph
    (``IN_REPLAY``), or, ``honest``, until the body's end."""
    lens = state["shared"]["seq_lens"] if state is not None else torch.ones(64, dtype=torch.int32)
    if name in ("custom_op", "in_graph"):
        PLAN.lens = lens
        read: Callable[[Tensor], Tensor] = kept_lens
    elif name == "library":
        _CLOSURES["lens_of"] = lambda rows: lens.index_select(0, rows).long()
        read = torch.ops.readfence_traffic_lib.lens_of
    else:
        RUNNERS[1] = Runner(lens)
        read = lambda rows: runner_lens(rows, 1)  # noqa: E731

    def prep(mode, shared, batch, meta):
        out = {"kv_indices": shared["req_to_token"].index_select(0, batch["req_pool_indices"])}
        if name == "in_graph":
            out["kv_lens"] = read(batch["req_pool_indices"])
        return out

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = meta["kv_lens"] if name == "in_graph" else read(batch["req_pool_indices"])
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    late = IN if name == "in_graph" else POST
    lens_end = late if honest else (PRE if name == "in_graph" else IN)
    effect = ReadEffect.of({"req_to_token": IN, "seq_lens": lens_end})
    return leaf(f"kept_{name}{'_honest' if honest else ''}", attend, prepare_in_graph=prep,
                declare={M.DECODE: effect})


KEPT = ("custom_op", "library", "method", "in_graph")


# -- a count from a boolean mask, baked into the capture of prepare_in_graph -----------------------
def baked(name: str, max_ctx: int) -> Any:
    """A paged leaf whose ``prepare_in_graph`` hands the body a bias made from a count taken from a
    boolean mask: ``pairs`` (new requests times deep ones), ``mixed`` (whether the batch is mixed,
    a Python branch), ``stale`` (rows with a length beyond the batch's: finished requests'). The
    capture bakes the count of the traced step, which is the same on the trace's example and on
    every state of the first-tokens and longest-context kinds, and another on a mixed batch.
    ``power_of_two``: whether the batch's longest length is a power of two (a split-KV bucket's
    test), which at batch size 1 is so on the example, the first token and the longest context;
    ``power_of_two_between``: whether it is a power of two strictly between the first token's and
    the longest context's (so on neither), which at batch sizes 2 and 4 is not so on the example."""

    def count(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> int:
        pos = batch["positions"]
        if name == "pairs":
            return pos[pos == 0].numel() * pos[pos > 0].numel()
        if name == "mixed":
            return 3 if mixed(shared, batch, max_ctx) else 0
        if name.startswith("power_of_two"):
            lens = shared["seq_lens"].index_select(0, batch["req_pool_indices"])
            longest = lens[lens == lens.max()]
            if name == "power_of_two_between":
                longest = longest[(longest > 1) & (longest < max_ctx)]
            return 3 if longest[(longest & (longest - 1)) == 0].numel() else 0
        lens = shared["seq_lens"]
        return lens[lens > 0].numel() - batch["req_pool_indices"].numel()

    def prep(mode, shared, batch, meta):
        out = page_meta(shared, batch)
        out["bias"] = torch.full(out["kv_lens"].shape, 1e-2 * count(shared, batch))
        return out

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out + meta["bias"].view(-1, 1, 1)

    effect = ReadEffect.of({"req_to_token": IN, "seq_lens": IN})
    return leaf(f"baked_{name}", attend, prepare_in_graph=prep, declare={M.DECODE: effect})


BAKED = ("pairs", "mixed", "stale", "power_of_two", "power_of_two_between")

#: The batch size each spelling of :data:`BAKED` hides at best (the power-of-two test at batch size
#: 1, where every length the trace's example and two of the generated states take is one).
BAKED_AT = {"power_of_two": 1}


# -- EXTEND: a stage reads the page table only on a mixed batch -----------------------------------
def extend_branch(name: str, max_ctx: int, *, honest: bool = False) -> Any:
    """An EXTEND leaf reading its metadata before the replay; on a mixed batch (a request at its first
    tokens beside one deep in context) it reads the page table again, in the body (``body``,
    ``body_pairs``: the condition a product of counts) or in ``prepare_in_graph`` (``in_graph``).
    It declares every read before the replay, or, ``honest``, until that stage's end."""

    def is_mixed(batch: Mapping[str, Tensor]) -> bool:
        pos = batch["positions"]
        first, deep = pos[pos == 0], pos[pos >= 4]
        return first.numel() * deep.numel() > 0 if name == "body_pairs" else bool(first.numel() and deep.numel())

    def out(mode, shared, batch):
        return page_meta(shared, batch)

    def prep(mode, shared, batch, meta):
        if name == "in_graph" and is_mixed(batch):
            return {"kv_indices": shared["req_to_token"].index_select(0, batch["req_pool_indices"])}
        return {"kv_indices": meta["kv_indices"]}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        indices = meta["kv_indices"]
        if name != "in_graph" and is_mixed(batch):
            indices = shared["req_to_token"].index_select(0, batch["req_pool_indices"])
        return softmax_attention(mode, q, pools, layer, indices, meta["kv_lens"])

    late = IN if name == "in_graph" else POST
    effect = ReadEffect.of({"req_to_token": late if honest else PRE, "seq_lens": PRE})
    return leaf(f"extend_{name}{'_honest' if honest else ''}", attend, prepare_out_graph=out,
                prepare_in_graph=prep, declare={M.EXTEND: effect})


EXTEND_BRANCHES = ("body", "body_pairs", "in_graph")
