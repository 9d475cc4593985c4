"""Adversarial user backends: every way a read of a shared buffer might hide from the analysis.

Each case is a leaf written through the public ``leaf(...)`` API, as a user would, whose
hidden read changes the output (a late read that races changes the logits). Cases carry the
verdict the analysis must reach:

* ``refused``: ``audit`` reports it unsound (or a ``StageWriteError``) and ``lower`` refuses it
  for every policy but COARSE (captured trace-time state: every policy);
* ``accepted``: genuinely fine, it must be accepted and run bit-identical to the serial run
  under every policy, with delays injected on the forward stream;
* ``invisible``: no analysis can see the read (a compiled kernel reading a buffer through
  memory it kept before anything watched): accepted by ``audit``; only the dynamic checks catch
  it. A custom op reading or writing through torch ops a buffer it keeps by reference is not:
  the audit's runs watch the live state they are given, and refuse it.

Builders take the live state (``shared``/``pools``/``params``) so that backends holding a
reference to the engine's live buffers (closures, attributes, globals, DLPack) can be built
against the state they will run on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from readfence.backends import join, kv_indices, leaf, page_meta, per_stream, select, softmax_attention, store_kv, tbo
from readfence.backends.fuzz import gather_rows as gather_lens
from readfence.backends.fuzz import gather_rows_unknown as gather_lens_unknown
from readfence.backends.fuzz import keep, planned_gather
from readfence.core import ForwardMode
from readfence.effects import ReadEffect, ReadEnd

M = ForwardMode
PRE, IN, POST = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY
State = Mapping[str, Mapping[str, Tensor]]
LensFn = Callable[..., Tensor]  # (shared, batch, meta, layer, q) -> lens [B] int64


@attrs.frozen
class Case:
    """One adversarial backend: how to build it and what the analysis must conclude."""

    name: str
    klass: str  # the hole class it attacks
    build: Callable[[State | None], Any]
    verdict: str  # "refused", "accepted" or "invisible"
    buffer: str | None = None  # the buffer read late, for refused and invisible cases
    mode: ForwardMode = M.DECODE
    captures: bool = False  # holds a reference to the live state: needs it to be built
    batch_size: int | None = None  # the batch size its race needs, where a smaller one does not race


def _declare(lens: ReadEnd = IN, r2t: ReadEnd = IN) -> dict[ForwardMode, ReadEffect]:
    effect = ReadEffect.of({"req_to_token": r2t, "seq_lens": lens})
    return {M.DECODE: effect, M.TARGET_VERIFY: effect}


def _rows(batch: Mapping[str, Tensor]) -> Tensor:
    return batch["req_pool_indices"]


def _gather(lens: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    return lens.index_select(0, _rows(batch)).long()


def _prep(mode, shared, batch, meta):
    return page_meta(shared, batch)


def body_reader(name: str, lens_fn: LensFn, *, declare: Mapping | None = None, prep: Callable | None = _prep,
                out: Callable | None = None) -> Any:
    """A paged leaf whose ``attend`` takes its lengths from ``lens_fn`` (a body read)."""

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = lens_fn(shared, batch, meta, layer, q)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    return leaf(name, attend, prepare_in_graph=prep, prepare_out_graph=out,
                declare=_declare() if declare is None else declare)


def _fixed(name: str, lens_fn: LensFn, **kw: Any) -> Callable[[State | None], Any]:
    return lambda state: body_reader(name, lens_fn, **kw)


# -- class 1: views and list views ---------------------------------------------------------
VIEWS: dict[str, LensFn] = {
    "slice": lambda s, b, m, layer, q: _gather(s["seq_lens"][:], b),
    "narrow": lambda s, b, m, layer, q: _gather(s["seq_lens"].narrow(0, 0, s["seq_lens"].shape[0]), b),
    "view": lambda s, b, m, layer, q: _gather(s["seq_lens"].view(-1), b),
    "t": lambda s, b, m, layer, q: _gather(s["seq_lens"].view(1, -1).t().squeeze(1), b),
    "expand": lambda s, b, m, layer, q: _gather(s["seq_lens"].unsqueeze(0).expand(2, -1)[1], b),
    "to_same_dtype": lambda s, b, m, layer, q: _gather(s["seq_lens"].to(torch.int32), b),
    "contiguous": lambda s, b, m, layer, q: _gather(s["seq_lens"].contiguous(), b),
    "detach": lambda s, b, m, layer, q: _gather(s["seq_lens"].detach(), b),
    "split": lambda s, b, m, layer, q: _gather(torch.cat(s["seq_lens"].split(1)), b),
    "chunk": lambda s, b, m, layer, q: _gather(torch.cat(s["seq_lens"].chunk(2)), b),
    "unbind": lambda s, b, m, layer, q: _gather(torch.stack(s["seq_lens"].unbind(0)), b),
    "split_with_sizes": lambda s, b, m, layer, q: _gather(
        torch.cat(s["seq_lens"].split_with_sizes([1, s["seq_lens"].shape[0] - 1])), b),
    "tensor_split": lambda s, b, m, layer, q: _gather(torch.cat(s["seq_lens"].tensor_split(3)), b),
    "iteration": lambda s, b, m, layer, q: _gather(torch.stack([x for x in s["seq_lens"]]), b),
    "piece_of_chunk": lambda s, b, m, layer, q: torch.cat(s["seq_lens"].chunk(2)).index_select(0, _rows(b)).long(),
}


# -- class 2: tensors captured from outside the stage's arguments ---------------------------
class _Holder:
    """An engine-style backend object keeping a reference to the live buffer."""

    def __init__(self, lens: Tensor) -> None:
        self.seq_lens = lens


_GLOBAL: dict[str, Tensor] = {}  # a module global the backend reads


def _closure(state: State | None, declare: Mapping | None = None) -> Any:
    lens = state["shared"]["seq_lens"] if state else torch.zeros(1, dtype=torch.int32)
    return body_reader("closure", lambda s, b, m, layer, q: _gather(lens, b), declare=declare)


def _attribute(state: State | None, declare: Mapping | None = None) -> Any:
    holder = _Holder(state["shared"]["seq_lens"] if state else torch.zeros(1, dtype=torch.int32))
    return body_reader("attribute", lambda s, b, m, layer, q: _gather(holder.seq_lens, b), declare=declare)


def _global(state: State | None, declare: Mapping | None = None) -> Any:
    _GLOBAL["seq_lens"] = state["shared"]["seq_lens"] if state else torch.zeros(1, dtype=torch.int32)
    return body_reader("global_ref", lambda s, b, m, layer, q: _gather(_GLOBAL["seq_lens"], b), declare=declare)


def _dlpack_live(state: State | None, declare: Mapping | None = None) -> Any:
    src = state["shared"]["seq_lens"] if state else torch.zeros(1, dtype=torch.int32)
    alias = torch.from_dlpack(torch.to_dlpack(src))  # a new storage object over the same memory
    return body_reader("dlpack_live", lambda s, b, m, layer, q: _gather(alias, b), declare=declare)


def _numpy_mirror(state: State | None, declare: Mapping | None = None) -> Any:
    # a numpy mirror of the live lengths kept by the backend (as engines keep host-side
    # mirrors); ``torch.tensor`` of it traces as a literal constant copied by
    # ``lift_fresh_copy`` on every run: a read of the live buffer's memory at that node
    mirror = (state["shared"]["seq_lens"] if state else torch.zeros(1, dtype=torch.int32)).numpy()
    return body_reader("numpy_mirror", lambda s, b, m, layer, q: _gather(torch.tensor(mirror), b), declare=declare)


def _dlpack_arg(s, b, m, layer, q):
    return _gather(torch.from_dlpack(torch.to_dlpack(s["seq_lens"])), b)


# -- class 3: trace-time state baked into the graph ----------------------------------------
def _stashed_clone(state: State | None) -> Any:
    stash: dict[str, Tensor] = {}

    def out(mode, shared, batch):
        stash["lens"] = shared["seq_lens"].clone()  # kept in a closure, not returned
        return {}

    return body_reader("stashed_clone", lambda s, b, m, layer, q: _gather(stash["lens"], b), out=out)


def _stashed_dlpack(state: State | None, declare: Mapping | None = None) -> Any:
    stash: dict[str, Tensor] = {}

    def out(mode, shared, batch):
        stash["lens"] = torch.from_dlpack(torch.to_dlpack(shared["seq_lens"]))
        return {}

    return body_reader("stashed_dlpack", lambda s, b, m, layer, q: _gather(stash["lens"], b), out=out,
                       declare=declare)


# -- class 4: escapes and data-dependent branches -------------------------------------------
def _host_read(s, b, m, layer, q):
    return torch.tensor([int(s["seq_lens"][r]) for r in b["req_pool_indices"].tolist()], dtype=torch.long)


def _host_iteration(s, b, m, layer, q):
    return _gather(torch.tensor([int(x) for x in s["seq_lens"]], dtype=torch.int32), b)


def _branch_on_content(s, b, m, layer, q):
    # taken only when some position is even: the path traced on one example may not take it
    if bool((b["positions"] % 2 == 0).any()):
        return _gather(s["seq_lens"], b)
    return m["kv_lens"]


def _every(end: ReadEnd) -> dict[ForwardMode, ReadEffect]:
    """One end for every shared buffer: what a stage that runs its Python reads."""
    effect = ReadEffect.of({}, default=end)
    return {M.DECODE: effect, M.TARGET_VERIFY: effect}


def _escaping_prep(mode, shared, batch, meta):
    # a host read makes the in-graph stage run as Python; what it returns is not copied: the
    # view of the live lengths is read in the body
    longest = int(shared["seq_lens"].max())
    return {"kv_indices": kv_indices(shared, batch), "lens_x": shared["seq_lens"][:],
            "longest": torch.tensor(longest)}


def _branching_prep(mode, shared, batch, meta):
    # the examples the trace runs on have positions[0] == 3 (a copy); on other steps the stage
    # hands the body a view of the live lengths, read in the last layer: after the body's
    # traced read of the buffer in layer 0, so EXACT must not release it there
    out = page_meta(shared, batch)
    out["late"] = shared["seq_lens"].clone() if int(batch["positions"][0]) == 3 else shared["seq_lens"][:]
    return out


def _branch_on_position(s, b, m, layer, q):
    # the examples the trace runs on have positions[0] == 3: the body reads no shared buffer
    # there (the last traced read of the lengths is prepare_in_graph's); on other steps it
    # reads the live lengths, so no event may follow prepare_in_graph's read of them
    return m["kv_lens"] if int(b["positions"][0]) == 3 else _gather(s["seq_lens"], b)


def _reads_late_in_the_last_layer(s, b, m, layer, q):
    return _gather(s["seq_lens"], b) if layer == 0 else _gather(m["late"], b)


def _branch_on_layer(s, b, m, layer, q):
    return _gather(s["seq_lens"], b) if layer == 1 else m["kv_lens"]


def _branch_on_batch_size(s, b, m, layer, q):
    return _gather(s["seq_lens"], b) if q.shape[0] > 2 else m["kv_lens"]


def _branch_on_mode(mode: ForwardMode) -> Any:
    def attend(mode_, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = _gather(shared["seq_lens"], batch) if mode_ is mode else meta["kv_lens"]
        return softmax_attention(mode_, q, pools, layer, meta["kv_indices"], lens)

    return leaf("branch_on_mode", attend, prepare_in_graph=_prep, declare=_declare())


# -- class 6: custom ops ---------------------------------------------------------------------
@torch.library.custom_op("readfence_adv::sneaky_bump", mutates_args=())
def sneaky_bump(lens: Tensor) -> Tensor:
    """A custom op that writes its argument in place though its schema claims it does not."""
    lens.add_(1)
    return lens.sum().reshape(1)


class _Plan:
    """FlashInfer-style plan: the wrapper keeps a *reference* to the engine's live lengths
    (planned once, as engines do with persistent buffers); a kernel then uses it, none of
    its arguments (the plan/run read is ``readfence.backends.fuzz.planned_gather``)."""

    lens: Tensor | None = None


PLAN = _Plan()


@torch.library.custom_op("readfence_adv::bump_planned", mutates_args=())
def bump_planned(rows: Tensor) -> Tensor:
    """A kernel that writes the live lengths it keeps (none of its arguments): no schema, no
    trace can see the write."""
    assert PLAN.lens is not None, "plan before run"
    PLAN.lens.index_add_(0, rows[:1], torch.ones(1, dtype=PLAN.lens.dtype))
    return rows.clone()


@bump_planned.register_fake
def _(rows: Tensor) -> Tensor:
    return torch.empty_like(rows)


def _hidden_write(state: State | None) -> Any:
    PLAN.lens = state["shared"]["seq_lens"] if state else torch.ones(64, dtype=torch.int32)
    return body_reader("hidden_write", lambda s, b, m, layer, q: m["kv_lens"] + 0 * bump_planned(_rows(b)))


def _plan_run(state: State | None) -> Any:
    handle = keep(state["shared"]["seq_lens"] if state else torch.ones(64, dtype=torch.int32))
    return body_reader("plan_run", lambda s, b, m, layer, q: planned_gather(_rows(b), handle))


class _Mirror:
    """What a compiled kernel keeps: the live lengths' memory as an array it was handed at plan
    time, before anything watched (a CUDA kernel keeps a pointer so)."""

    array: Any = None


MIRROR = _Mirror()


@torch.library.custom_op("readfence_adv::mirrored_lens", mutates_args=())
def mirrored_lens(rows: Tensor) -> Tensor:
    """The lengths of ``rows``, read from the kept array: no op of torch's touches the buffer."""
    return torch.from_numpy(MIRROR.array[rows.numpy()]).long()


@mirrored_lens.register_fake
def _(rows: Tensor) -> Tensor:
    return torch.empty_like(rows)


def _kept_pointer(state: State | None) -> Any:
    MIRROR.array = (state["shared"]["seq_lens"] if state else torch.ones(64, dtype=torch.int32)).numpy()
    return body_reader("kept_pointer", lambda s, b, m, layer, q: mirrored_lens(_rows(b)))


# -- writes ------------------------------------------------------------------------------------
def _writer(name: str, write: Callable[[Mapping[str, Tensor]], Any]) -> Callable[[State | None], Any]:
    def prep(mode, shared, batch, meta):
        write(shared)
        return page_meta(shared, batch)

    return lambda state: body_reader(name, lambda s, b, m, layer, q: m["kv_lens"], prep=prep)


def _clamp_chunks(shared: Mapping[str, Tensor]) -> None:
    for piece in shared["seq_lens"].chunk(2):
        piece.clamp_(max=8)


WRITES: dict[str, Callable[[Mapping[str, Tensor]], Any]] = {
    "write_chunk_pieces": _clamp_chunks,
    "write_unbind_piece": lambda s: s["seq_lens"].unbind(0)[0].add_(0),
    "write_split_piece": lambda s: s["seq_lens"].split(2)[1].mul_(1),
    "write_through_view": lambda s: s["req_to_token"][:, :2].zero_(),
    "write_custom_unknown": lambda s: gather_lens_unknown(s["seq_lens"], torch.zeros(1, dtype=torch.long)),
    "write_custom_undeclared": lambda s: sneaky_bump(s["seq_lens"]),
}


# -- what crosses into the graph ---------------------------------------------------------------
def _crossing(name: str, where: str, make: Callable[[Tensor], Tensor], lens_end: ReadEnd) -> Callable:
    """A leaf returning ``make(seq_lens)`` from the stage ``where`` and reading it in the body."""

    def out(mode, shared, batch):
        return {"lens_x": make(shared["seq_lens"])}

    def inn(mode, shared, batch, meta):
        got = {"kv_indices": kv_indices(shared, batch)}  # the lengths come only through lens_x
        if where == "in":
            got["lens_x"] = make(shared["seq_lens"])
        return got

    lens_fn: LensFn = lambda s, b, m, layer, q: _gather(m["lens_x"], b)  # noqa: E731
    return lambda state: body_reader(name, lens_fn, prep=inn, out=out if where == "out" else None,
                                     declare=_declare(lens=lens_end))


CROSSINGS = {
    "view": lambda t: t[:],
    "list_view": lambda t: t.split(t.shape[0])[0],
    "noop_copy": lambda t: t.contiguous(),
    "real_copy": lambda t: t.clone(),
}


# -- where the fences are decided: a node judged where the step runs it ---------------------
def _late_reader(name: str = "late_reader", declare: Mapping | None = None) -> Any:
    """Reads the live lengths in the body; declared IN_REPLAY: early, wherever it places a fence."""
    return body_reader(name, lambda s, b, m, layer, q: _gather(s["seq_lens"], b), declare=declare)


def _snapshot(name: str = "snapshot", lens: ReadEnd = IN) -> Any:
    """Reads the lengths only in prepare_in_graph (its snapshot, ``kv_lens``); declares ``lens``."""
    return body_reader(name, lambda s, b, m, layer, q: m["kv_lens"], declare=_declare(lens=lens))


def _prefill_only(mode, layer, q, k, v, pools, shared, batch, meta):
    # a backend an engine picks only for EXTEND: any other mode is a bug in whoever calls it
    if mode is not M.EXTEND:
        raise NotImplementedError(f"prefill_only does not run {mode.name}")
    return q


def _big_batch_reader(s, b, m, layer, q):
    # reads the live lengths in the body only for a batch of more than 3 requests
    return _gather(s["seq_lens"], b) if b["req_pool_indices"].shape[0] > 3 else m["kv_lens"]


def _verdict_cases() -> list[Case]:
    refused = "refused"
    return [
        # a child's own declaration below its read, under a join whose other child covers it
        Case("join_covered_child", "verdicts", lambda state: join(_late_reader(), _snapshot("covering", POST)),
             "accepted"),
        Case("join_uncovered_child", "verdicts", lambda state: join(_late_reader(), _snapshot()), refused,
             "seq_lens"),
        # an arm the mode never selects is neither run nor judged in it (this one raises there)
        Case("select_unselected_early_arm", "verdicts",
             lambda state: select({M.DECODE: _snapshot()}, default=_late_reader()), "accepted"),
        Case("select_unselected_raising_arm", "verdicts",
             lambda state: select({M.DECODE: _snapshot()}, default=leaf("prefill_only", _prefill_only)),
             "accepted"),
        Case("select_selected_early_arm", "verdicts",
             lambda state: select({M.TARGET_VERIFY: _late_reader()}, default=_snapshot()), refused, "seq_lens",
             mode=M.TARGET_VERIFY),
        # a tbo child only ever gets micro-batches: three children, at most 3 requests each
        Case("tbo_micro_batch_child", "verdicts",
             lambda state: tbo(_snapshot(), _fixed("big_batch", _big_batch_reader)(state), _snapshot(), _snapshot()),
             "accepted"),
        Case("tbo_whole_batch_child", "verdicts",
             lambda state: tbo(_snapshot(), _fixed("big_batch", _big_batch_reader)(state)), refused, "seq_lens"),
        # a per_stream member places its stream's own fence: the join over members does not cover it
        Case("per_stream_early_member", "verdicts",
             lambda state: per_stream(_late_reader(), _snapshot("covering", POST)), refused, "seq_lens"),
        # a per_stream member serves its share of the batch: three members, at most 3 requests each
        # (the first member is the one a direct run of the group runs on the whole batch)
        Case("per_stream_share_member", "verdicts",
             lambda state: per_stream(_snapshot(), _fixed("big_batch", _big_batch_reader)(state), _snapshot()),
             "accepted"),
        # (its race needs a share of more than 3 requests: the model's largest batch, 8)
        Case("per_stream_half_batch_member", "verdicts",
             lambda state: per_stream(_snapshot(), _fixed("big_batch", _big_batch_reader)(state)), refused, "seq_lens",
             batch_size=8),
    ]


# -- buffers that lend only their shape, dtype and strides -----------------------------------
def _shapes_only(s, b, m, layer, q):
    # a buffer as the template of a new tensor, or asked its sizes: none of its data is read
    zero = torch.zeros_like(s["seq_lens"]).index_select(0, _rows(b)).long()
    scratch = torch.empty_like(s["req_to_token"]).fill_(1)
    pad = s["seq_lens"].new_zeros(s["seq_lens"].size(0)).sum() + s["req_to_token"].new_full((2,), 3).sum()
    return m["kv_lens"] + zero + scratch[0, 0].long() - 1 + pad - 6


def _template_then_values(s, b, m, layer, q):
    # the same template, then the values themselves: a read
    return _gather(torch.zeros_like(s["seq_lens"]).add(s["seq_lens"]), b)


# -- tensors a backend keeps: its own, whatever their shape; another state's, when memory says so
def _own_constant(state: State | None) -> Any:
    # FlashInfer's kv_last_page_len: a persistent int32 tensor of max_reqs ones, made once by the
    # backend; it has seq_lens's shape and dtype and is no state's buffer
    last_page_len = torch.ones(8, dtype=torch.int32)
    return body_reader("own_constant", lambda s, b, m, layer, q: m["kv_lens"] + _gather(last_page_len, b) - 1)


def _other_states_buffer(state: State | None) -> Any:
    # the same line over another state's lengths, kept alive by the backend: memory says whose
    from readfence.core import make_shared_state
    from tests.conftest import SMALL

    lens = make_shared_state(SMALL)["seq_lens"]
    return body_reader("other_states_buffer", lambda s, b, m, layer, q: m["kv_lens"] + _gather(lens, b) * 0)


def _metadata_cases() -> list[Case]:
    return [
        Case("template_only", "metadata", _fixed("template_only", _shapes_only), "accepted"),
        Case("template_then_values", "metadata", _fixed("template_then_values", _template_then_values), "refused",
             "seq_lens"),
        Case("own_constant", "owned", _own_constant, "accepted"),
        Case("other_states_buffer", "owned", _other_states_buffer, "refused", "seq_lens"),
    ]


def _cases() -> list[Case]:
    cases: list[Case] = _verdict_cases() + _metadata_cases()
    for name, fn in VIEWS.items():
        cases.append(Case(name, "views", _fixed(name, fn), "refused", "seq_lens"))
    for name, make in (("closure", _closure), ("attribute", _attribute), ("global_ref", _global),
                       ("dlpack_live", _dlpack_live), ("numpy_mirror", _numpy_mirror)):
        cases.append(Case(name, "captured", make, "refused", "seq_lens", captures=True))
        honest = _declare(lens=POST)
        cases.append(Case(f"{name}_declared_post", "captured",
                          lambda state, make=make, honest=honest: make(state, honest), "accepted", captures=True))
    # a DLPack alias of the stage's own argument, made in the body or kept by an earlier stage at
    # every step, is a view of the buffer the step runs on: a read of it there
    cases.append(Case("dlpack_arg", "views", _fixed("dlpack_arg", _dlpack_arg), "refused", "seq_lens"))
    cases.append(Case("dlpack_arg_declared_post", "views",
                      _fixed("dlpack_arg_post", _dlpack_arg, declare=_declare(lens=POST)), "accepted"))
    cases.append(Case("stashed_dlpack", "captured", _stashed_dlpack, "refused", "seq_lens"))
    cases.append(Case("stashed_dlpack_declared_post", "captured",
                      lambda state: _stashed_dlpack(state, _declare(lens=POST)), "accepted"))
    cases.append(Case("stashed_clone", "baked", _stashed_clone, "refused", "seq_lens"))
    for name, fn in (("host_read", _host_read), ("host_iteration", _host_iteration),
                     ("branch_on_content", _branch_on_content)):
        cases.append(Case(name, "unfaithful", _fixed(name, fn), "refused", "seq_lens"))
    # the body runs as Python in the step: its reads, on any path, end with the replay
    for name, fn in (("host_read", _host_read), ("host_iteration", _host_iteration),
                     ("branch_on_content", _branch_on_content)):
        cases.append(Case(f"{name}_declared_post", "unfaithful",
                          _fixed(f"{name}_post", fn, declare=_every(POST)), "accepted"))
    cases.append(Case("branch_on_position_declared_post", "unfaithful",
                      _fixed("branch_on_position_post", _branch_on_position, declare=_every(POST)), "accepted"))
    cases.append(Case("host_read_declared_pre", "unfaithful",  # its metadata snapshot before the replay
                      _fixed("host_read_pre", _host_read, declare=_every(PRE), prep=None,
                             out=lambda mode, shared, batch: page_meta(shared, batch)), "refused", "seq_lens"))
    # an in-graph stage that runs as Python may hand the body a view of any buffer
    view_fn: LensFn = lambda s, b, m, layer, q: _gather(m["lens_x"], b)  # noqa: E731
    cases.append(Case("in_graph_escape_view", "unfaithful",
                      _fixed("in_graph_escape_view", view_fn, prep=_escaping_prep, declare=_every(IN)),
                      "refused", "seq_lens"))
    cases.append(Case("in_graph_escape_view_declared_post", "unfaithful",
                      _fixed("in_graph_escape_view_post", view_fn, prep=_escaping_prep, declare=_every(POST)),
                      "accepted"))
    cases.append(Case("in_graph_branch_view", "unfaithful",
                      _fixed("in_graph_branch_view", _reads_late_in_the_last_layer, prep=_branching_prep,
                             declare=_every(IN)), "refused", "seq_lens"))
    cases.append(Case("in_graph_branch_view_declared_post", "unfaithful",
                      _fixed("in_graph_branch_view_post", _reads_late_in_the_last_layer, prep=_branching_prep,
                             declare=_every(POST)), "accepted"))
    cases.append(Case("branch_on_layer", "conditional", _fixed("branch_on_layer", _branch_on_layer),
                      "refused", "seq_lens"))
    cases.append(Case("branch_on_mode", "conditional", lambda state: _branch_on_mode(M.TARGET_VERIFY),
                      "refused", "seq_lens", mode=M.TARGET_VERIFY))
    cases.append(Case("branch_on_mode_not_taken", "conditional", lambda state: _branch_on_mode(M.TARGET_VERIFY),
                      "accepted", mode=M.DECODE))
    cases.append(Case("branch_on_batch_size", "shape", _fixed("branch_on_batch_size", _branch_on_batch_size),
                      "refused", "seq_lens"))
    cases.append(Case("branch_on_batch_size_declared_post", "shape",
                      _fixed("branch_on_batch_size_post", _branch_on_batch_size, declare=_declare(lens=POST)),
                      "accepted"))
    cases.append(Case("custom_op", "custom_op",
                      _fixed("custom_op", lambda s, b, m, layer, q: gather_lens(s["seq_lens"], _rows(b))),
                      "refused", "seq_lens"))
    # a kernel reading or writing through torch ops a buffer it keeps: the audit's runs on the live state see it
    cases.append(Case("plan_run", "custom_op", _plan_run, "refused", "seq_lens", captures=True))
    cases.append(Case("hidden_write", "kept_write", _hidden_write, "refused", "seq_lens", captures=True))
    cases.append(Case("kept_pointer", "kept_pointer", _kept_pointer, "invisible", "seq_lens", captures=True))
    for name, write in WRITES.items():
        cases.append(Case(name, "writes", _writer(name, write), "refused"))
    for kind, make in CROSSINGS.items():
        # out of the graph: the copy into the graph is the last read (PRE_REPLAY): fine
        cases.append(Case(f"out_graph_{kind}", "crossing", _crossing(f"out_{kind}", "out", make, PRE), "accepted"))
        # in the graph a view stays a view (read in the body), a real copy does not
        late = kind != "real_copy"
        cases.append(Case(f"in_graph_{kind}", "crossing", _crossing(f"in_{kind}", "in", make, IN),
                          "refused" if late else "accepted", "seq_lens" if late else None))
    cases.append(Case("in_graph_view_declared_post", "crossing",
                      _crossing("in_view_post", "in", CROSSINGS["view"], POST), "accepted"))
    cases.append(Case("snapshot_clone", "fine", _fixed(
        "snapshot_clone", lambda s, b, m, layer, q: _gather(m["lens_copy"], b),
        prep=lambda mode, s, b, m: {**page_meta(s, b), "lens_copy": s["seq_lens"].clone()}), "accepted"))
    cases.append(Case("snapshot_index_select", "fine", _fixed(
        "snapshot_index_select", lambda s, b, m, layer, q: m["kv_lens"]), "accepted"))
    return cases


CASES: dict[str, Case] = {c.name: c for c in _cases()}


def blinded(monkeypatch: Any) -> None:
    """Break the memory side of the analysis on purpose (pytest's ``monkeypatch``): the memory
    probe sees nothing, wherever it runs (a graph's nodes as ``fx`` runs them, the ops of a
    layer as the recorder runs them)."""
    import readfence.core.tracing._probe as probe

    monkeypatch.setattr(probe.MemoryProbe, "run", lambda self, *args: None)
    monkeypatch.setattr(probe, "probe_op", lambda op, args, kwargs, buffers, shared, run, *rest, **kw: (run(), probe.NO_FACTS))
