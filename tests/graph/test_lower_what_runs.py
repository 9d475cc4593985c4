"""The code ``lower`` validates is the code every ring slot runs, after every pass.

Correct, stateless backends that keep memory of their own and reach it by more than one tensor:
a workspace and a view of it, a handle ``set_`` onto another tensor, two tensors over one
storage, an in-place op on an alias between two equal computations, a constant folded and then
written. A compile pass that takes two tensors for two memories (the simplifier's folding and
sharing) computes something else than their Python under every policy, COARSE included. Each
case is shown three ways:

* with the compile passes blind to aliasing (each tensor its own memory, ``set_`` aliasing
  nothing, as the passes once were) and no validation, the lowered step differs from the eager
  step: the case attacks the passes;
* as it is, the lowered step equals the eager step bit for bit, through the passes
  (``Lowered.optimized``): they see the aliasing, from the real storages and the ops' schemas;
* with the passes blind again but the validation on, the validation of the code that runs sees
  it differ, and the step runs the plain translation (itself validated): still equal, still
  accepted.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator

import pytest
import torch

import readfence.graph.lowering._fx_compile as fx_compile
import readfence.graph.lowering._fx_memory as fx_memory
import readfence.graph.lowering._lower as lowering
from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig, NotGraphSafe, StepInputs, audit, run_step
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, Scheduler, lower, run_overlapped, run_serial
from readfence.graph.lowering import UnsoundLowering
from tests.conftest import SMALL as CFG
from tests.conftest import first_of_each

M = ForwardMode
T = 30.0
BATCH = 4

Scratch = Callable[[torch.Tensor], torch.Tensor]


def _backend(name: str, scratch: Scratch, prep_extra: Callable[[], dict] | None = None) -> object:
    """A paged leaf whose attention output gets ``scratch(out, meta)`` added: a stateless
    computation over memory the backend keeps (each call writes it before reading it)."""

    def prep(mode, shared, batch, meta):
        return {**page_meta(shared, batch), **(prep_extra() if prep_extra else {})}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out + scratch(out, meta)

    return leaf(name, attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])


# -- a workspace and a view of it ------------------------------------------------------------
def _write_view_read_base():
    ws = torch.zeros(4, 8)
    flat = ws.view(-1)

    def scratch(out, meta):
        base = ws[:]  # one value, read before and after the write through the view
        flat.zero_()
        a = base.sum()
        flat.add_(out.sum())
        return base.sum() - a

    return _backend("write_view_read_base", scratch)


def _write_base_read_view():
    ws = torch.zeros(4, 8)
    rows = ws[1:3]

    def scratch(out, meta):
        r = rows.view(-1)
        ws.zero_()
        a = r.sum()
        ws.add_(out.sum())
        return r.sum() - a

    return _backend("write_base_read_view", scratch)


def _out_argument_into_view():
    ws = torch.zeros(4, 8)
    flat = ws.view(-1)

    def scratch(out, meta):
        base = ws[:]
        flat.zero_()
        a = base.sum()
        torch.mul(flat + 1, out.sum(), out=flat)  # an out= op writes the view
        return base.sum() - a

    return _backend("out_argument_into_view", scratch)


def _view_handed_across_stages():
    # the in-graph stage hands a view of the workspace to the body as metadata: the body's input
    # and the tensor it captured are one memory, which only the first stage's analysis shows
    ws = torch.zeros(8)

    def scratch(out, meta):
        rows = meta["rows"]
        ws.zero_()
        a = rows * 2
        ws.add_(out.sum())
        return (rows * 2 - a).sum()

    return _backend("view_handed_across_stages", scratch, lambda: {"rows": ws[2:6]})


# -- a handle set_ onto another tensor ---------------------------------------------------------
def _set_kept_handle():
    src, handle = torch.zeros(8), torch.empty(0)

    def scratch(out, meta):
        s = src[:]
        handle.set_(src)
        handle.zero_()
        a = s.sum()
        handle.add_(out.sum())
        return s.sum() - a

    return _backend("set_kept_handle", scratch)


def _set_fresh_handle():
    src = torch.zeros(3, 4)

    def scratch(out, meta):
        s = src.view(-1)
        handle = torch.empty(0)
        handle.set_(src)
        handle.fill_(1.0)
        a = s * 3
        handle.mul_(out.mean())
        return (s * 3 - a).sum()

    return _backend("set_fresh_handle", scratch)


# -- two tensors over one storage ----------------------------------------------------------------
def _overlapping_slices():
    buf = torch.zeros(16)
    p, q = buf[0:12], buf[4:16]

    def scratch(out, meta):
        r = q[:]
        p.zero_()
        a = r.sum()
        p.add_(out.sum())
        return r.sum() - a

    return _backend("overlapping_slices", scratch)


def _dlpack_alias():
    ws = torch.zeros(8)
    other = torch.from_dlpack(torch.to_dlpack(ws))  # another storage object over the same memory

    def scratch(out, meta):
        r = ws[:]
        other.zero_()
        a = r.sum()
        other.add_(out.sum())
        return r.sum() - a

    return _backend("dlpack_alias", scratch)


def _disjoint_slices_one_storage():
    # elements apart, one storage: a view made from one reaches the other's elements
    buf = torch.zeros(12)
    p, q = buf[0:4], buf[8:12]

    def scratch(out, meta):
        r = q[:]
        p.as_strided((12,), (1,), 0).zero_()
        a = r.sum()
        p.as_strided((4,), (1,), 8).add_(out.sum())
        return r.sum() - a

    return _backend("disjoint_slices_one_storage", scratch)


# -- an in-place op on an alias, then an equal computation -----------------------------------
def _in_place_on_alias():
    ws = torch.zeros(8)
    alias = ws[:]

    def scratch(out, meta):
        r = ws.view(2, 4)
        alias.copy_(out.reshape(-1)[:8])
        a = r * 2
        alias.mul_(3)
        return (r * 2 - a).sum()

    return _backend("in_place_on_alias", scratch)


def _index_copy_on_alias():
    ws = torch.zeros(8)
    alias = ws.view(2, 4)

    def scratch(out, meta):
        rows = torch.arange(1, -1, -1)  # one index for both selections
        r = ws.view(2, 4)
        alias.zero_()
        a = r.index_select(0, rows)
        alias.index_copy_(0, rows, out.reshape(-1)[:8].view(2, 4))
        return (r.index_select(0, rows) - a).sum()

    return _backend("index_copy_on_alias", scratch)


# -- a constant folded, then written ------------------------------------------------------------
def _fold_then_set():
    def scratch(out, meta):
        t = torch.arange(4.0)  # depends on no input: a pass may compute it once, at compile time
        h = torch.empty(0)
        h.set_(t)
        h.add_(out.sum())
        return (h - torch.arange(4.0)).sum()

    return _backend("fold_then_set", scratch)


def _fold_then_set_kept_handle():
    handle = torch.empty(0)

    def scratch(out, meta):
        handle.set_(torch.ones(4))
        torch.add(handle, out.sum(), out=handle)
        return (handle * torch.ones(4)).sum()

    return _backend("fold_then_set_kept_handle", scratch)


CASES: dict[str, tuple[str, Callable[[], object]]] = {
    "write_view_read_base": ("workspace and view", _write_view_read_base),
    "write_base_read_view": ("workspace and view", _write_base_read_view),
    "out_argument_into_view": ("workspace and view", _out_argument_into_view),
    "view_handed_across_stages": ("workspace and view", _view_handed_across_stages),
    "set_kept_handle": ("set_", _set_kept_handle),
    "set_fresh_handle": ("set_", _set_fresh_handle),
    "overlapping_slices": ("one storage", _overlapping_slices),
    "dlpack_alias": ("one storage", _dlpack_alias),
    "disjoint_slices_one_storage": ("one storage", _disjoint_slices_one_storage),
    "in_place_on_alias": ("in-place on an alias", _in_place_on_alias),
    "index_copy_on_alias": ("in-place on an alias", _index_copy_on_alias),
    "fold_then_set": ("folding across a write", _fold_then_set),
    "fold_then_set_kept_handle": ("folding across a write", _fold_then_set_kept_handle),
}


@contextlib.contextmanager
def blind_passes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The compile passes as they were: every tensor its own memory, ``set_`` aliasing nothing."""
    with monkeypatch.context() as m:
        fresh = itertools.count()
        m.setattr(fx_memory, "storage_token", lambda t: ("own", next(fresh)))
        m.setattr(fx_memory.GraphMemory, "_union", lambda self, tokens: None)
        yield


@contextlib.contextmanager
def no_validation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(lowering, "validate_replay", lambda *args, **kwargs: None)
        yield


def lowered_against_eager(backend: object, policy: Policy = Policy.COARSE, steps: int = 2,
                          cfg: ModelConfig = CFG) -> tuple[bool, object]:
    """``backend`` lowered and run ``steps`` steps (the second replay meets what the first left in
    the graph's constants), each against its eager step on the same state: all equal?"""
    with CpuDevice(timeout=T) as dev:
        low = lower(backend, M.DECODE, batch_size=BATCH, device=dev, policy=policy, cfg=cfg)
        scheduler = Scheduler(cfg, M.DECODE, BATCH, seed=3)
        equal = True
        for step in range(steps):
            nxt = scheduler.next_step()
            for b in SHARED_BUFFERS:
                low.shared[b].copy_(nxt.shared[b])
            pools = {k: v.clone() for k, v in low.pools.items()}
            shared = {k: v.clone() for k, v in low.shared.items()}
            out = low.run(nxt.batch, step=step).result(T)
            expected = run_step(backend, M.DECODE, cfg, StepInputs(shared=shared, batch=nxt.batch, pools=pools,
                                                                   params=low.params))
            equal = equal and torch.equal(out, expected)
    return equal, low


@contextlib.contextmanager
def layers_node_by_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No class of layers compiled once: every node of the body goes through the simplifying pass."""
    with monkeypatch.context() as m:
        m.setattr(fx_compile, "outline_layers", lambda gm, compile_layer, hoistable=None: (gm, 0, frozenset()))
        yield


@pytest.mark.parametrize("name", first_of_each(list(CASES), lambda n: CASES[n][0]))
def test_a_correct_backend_over_aliased_memory_runs_what_its_python_computes(name, monkeypatch) -> None:
    make = CASES[name][1]
    with layers_node_by_node(monkeypatch):  # (inside a class of layers nothing is shared or folded)
        with blind_passes(monkeypatch), no_validation(monkeypatch):
            equal, _ = lowered_against_eager(make())
        assert not equal, f"{name}: the blind passes computed it right: the case attacks nothing"
        equal, low = lowered_against_eager(make())
        assert equal and low.optimized, f"{name}: the passes that see aliasing must compute it, and keep it optimized"
        with blind_passes(monkeypatch):
            equal, low = lowered_against_eager(make())
        assert equal and not low.optimized, f"{name}: the validation of the code that runs must catch the blind passes"
    equal, low = lowered_against_eager(make())  # its layers one function where they compute alike
    assert equal and low.optimized, f"{name}: the passes with layers compiled once must compute it"


@pytest.mark.parametrize("policy", [Policy.EXACT, Policy.PER_BUFFER], ids=str)
def test_every_policy_runs_the_validated_code(policy) -> None:
    equal, low = lowered_against_eager(_set_kept_handle(), policy=policy)
    assert equal and low.optimized


def _padded_metadata() -> object:
    """A metadata buffer allocated with ``torch.empty`` for the largest batch, its first rows written
    and only those read (cu_seqlens-style padding): the tail holds whatever memory held."""

    def prep(mode, shared, batch, meta):
        page = page_meta(shared, batch)
        n = page["kv_lens"].shape[0]
        padded = torch.empty(CFG.max_reqs * 4, dtype=torch.float32)
        padded[:n].copy_(page["kv_lens"].float())
        return {**page, "padded": padded}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out + meta["padded"][: out.shape[0]].sum() * 1e-3

    return leaf("padded_metadata", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])


@pytest.mark.parametrize("policy", [Policy.COARSE, Policy.EXACT], ids=str)
def test_a_padded_buffer_s_unwritten_tail_is_no_difference_between_a_capture_and_its_python(policy) -> None:
    # the validation compares what the two runs computed: memory both leave unwritten holds the same
    # fill in each (were it compared as left, a correct backend would be refused as not graph-safe)
    equal, low = lowered_against_eager(_padded_metadata(), policy=policy)
    assert equal and low.optimized


# -- a buffer an in-graph stage makes on its first call and keeps for the body -----------------------
class _MadeOnFirstCall:
    """``prepare_in_graph`` fills a lengths buffer the body reads, kept between the two (``how``): on
    ``self`` (``attribute``), in a dict (``dict``), in a one-entry ``functools.lru_cache``
    (``cache``), made on the first call (the trace's: its graph makes a new one at every replay,
    while the body's graph captured the first); ``made_before`` makes it in ``__init__``."""

    def __init__(self, how: str, made_before: bool = False) -> None:
        self.how, self.slots = how, {}
        self.ws = torch.zeros(CFG.max_reqs, dtype=torch.int64) if made_before else None
        self.sized = functools.lru_cache(maxsize=1)(lambda n: torch.zeros(n, dtype=torch.int64))

    def buffer(self) -> torch.Tensor:
        if self.how == "cache":
            return self.sized(CFG.max_reqs)
        if self.how == "dict":
            return self.slots.setdefault("lens", torch.zeros(CFG.max_reqs, dtype=torch.int64))
        if self.ws is None:
            self.ws = torch.zeros(CFG.max_reqs, dtype=torch.int64)
        return self.ws

    def prepare_in_graph(self, mode, shared, batch, meta):
        page = page_meta(shared, batch)
        self.buffer()[: page["kv_lens"].shape[0]].copy_(page["kv_lens"])
        return page

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        n = meta["kv_indices"].shape[0]
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], self.buffer()[:n])


def _made_on_first_call(how: str, made_before: bool = False) -> object:
    kernel = _MadeOnFirstCall(how, made_before)
    return leaf(f"made_{how}", kernel.attend, prepare_in_graph=kernel.prepare_in_graph,
                reads=["req_to_token", "seq_lens"])


@pytest.mark.parametrize("how", ["attribute", "dict", "cache"])
def test_a_buffer_an_in_graph_stage_made_on_its_traced_call_is_refused_and_its_replay_differs(how, monkeypatch) -> None:
    with CpuDevice(timeout=T) as dev, pytest.raises(NotGraphSafe) as refused:
        lower(_made_on_first_call(how), M.DECODE, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)
    assert refused.value.stage == "prepare_in_graph" and "of stage body" in refused.value.output
    with no_validation(monkeypatch):  # the refusal off: the body's graph reads a buffer no replay writes
        equal, _ = lowered_against_eager(_made_on_first_call(how))
    assert not equal


def test_a_buffer_made_before_the_trace_and_filled_in_the_graph_runs_what_its_python_computes() -> None:
    equal, _ = lowered_against_eager(_made_on_first_call("attribute", made_before=True))
    assert equal


# -- readfence's own runs draw no random numbers the program would draw ----------------------------
def _sampling(how: str) -> object:
    """A leaf whose attention output gets a little noise drawn from torch's global generator."""

    def noise(out, meta):
        if how == "rand":
            return torch.rand(1) * 1e-3
        return torch.nn.functional.dropout(out, p=0.5, training=True) * 1e-3

    return _backend(f"sampling_{how}", noise)


@pytest.mark.parametrize("how", ["rand", "dropout"])
def test_lowering_and_auditing_leave_the_random_generator_where_the_program_left_it(how) -> None:
    before = torch.get_rng_state()
    assert audit(_sampling(how), M.DECODE, cfg=CFG).map(lambda r: r.sound).value_or(False)
    with CpuDevice(timeout=T) as dev:
        lower(_sampling(how), M.DECODE, batch_size=BATCH, device=dev, policy=Policy.EXACT, cfg=CFG)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(0)
    serial = run_serial(_sampling(how), M.DECODE, steps=3, batch_size=BATCH, cfg=CFG)
    for policy in (Policy.COARSE, Policy.EXACT):  # the loop's steps draw what the serial steps drew
        torch.manual_seed(0)
        with CpuDevice(timeout=T) as dev:
            run = run_overlapped(_sampling(how), M.DECODE, steps=3, policy=policy, device=dev, batch_size=BATCH, cfg=CFG)
        assert run.matches(serial), policy


# -- a view of a shared buffer an earlier stage keeps on an object for the body -------------------------
def _kept_view(mode: ForwardMode, end: object) -> object:
    """``prepare_out_graph`` keeps a view of the lengths on an object; the body reads through it."""

    class Plan:
        lens: torch.Tensor | None = None

    plan = Plan()

    def out(mode, shared, batch):
        plan.lens = shared["seq_lens"][:]
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        lens = plan.lens.index_select(0, batch["req_pool_indices"]).long()
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], lens)

    effect = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": end})
    return leaf(f"kept_view_{mode.name.lower()}", attend, prepare_out_graph=out, declare={mode: effect})


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE])
def test_a_view_kept_for_the_body_is_lowered_and_runs_as_serial(mode) -> None:
    # in EXTEND nothing is replayed: the body reads what the hook kept now; in DECODE the replayed
    # body reads that view of the state it runs on (the trace records the kept view as a view of
    # the body's own input), which is what the hook keeps at every step
    serial = run_serial(_kept_view(mode, ReadEnd.POST_REPLAY), mode, steps=3, batch_size=BATCH, cfg=CFG)
    for policy in (Policy.COARSE, Policy.PER_BUFFER, Policy.EXACT):
        with CpuDevice(timeout=T) as dev:
            run = run_overlapped(_kept_view(mode, ReadEnd.POST_REPLAY), mode, steps=3, policy=policy,
                                 device=dev, batch_size=BATCH, cfg=CFG)
        assert run.matches(serial) and run.violations == (), policy
    with CpuDevice(timeout=T) as dev:
        with pytest.raises(UnsoundLowering, match="'seq_lens' ends at PRE_REPLAY"):  # the read counts all the same
            lower(_kept_view(mode, ReadEnd.PRE_REPLAY), mode, batch_size=BATCH, device=dev,
                  policy=Policy.PER_BUFFER, cfg=CFG)


# -- a live state laid out otherwise than the trace's example ---------------------------------------
def _padded_state() -> dict:
    """A live state whose page table is a view of a wider allocation (rows padded: stride 24 for 16
    columns) and whose lengths sit at an offset into a larger buffer, as an engine may allocate them."""
    from readfence.graph import make_state

    state = make_state(CFG)
    table, lens = state["shared"]["req_to_token"], state["shared"]["seq_lens"]
    wide = torch.zeros(table.shape[0], table.shape[1] + 8, dtype=table.dtype)
    wide[:, : table.shape[1]] = table
    arena = torch.zeros(lens.numel() + 32, dtype=lens.dtype)
    arena[32:] = lens
    state["shared"]["req_to_token"], state["shared"]["seq_lens"] = wide[:, : table.shape[1]], arena[32:]
    return state


def _layout_reader(how: str) -> object:
    """Reads a layout as a Python value: ``stride`` gathers the page rows through ``as_strided`` with
    the table's row stride, ``offset`` branches on where the lengths start in their storage."""

    def prep(mode, shared, batch, meta):
        table = shared["req_to_token"]
        if how == "stride":  # the rows as the stride says they lie: the table itself, on any layout
            table = torch.as_strided(table, table.shape, (table.stride(0), 1))
        return page_meta({**shared, "req_to_token": table}, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        out = softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])
        return out * (2.0 if how == "offset" and shared["seq_lens"].storage_offset() > 0 else 1.0)

    return leaf(f"layout_{how}", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])


@pytest.mark.parametrize("how", ["stride", "offset"])
def test_a_layout_the_trace_s_example_did_not_have_is_checked_on_the_live_one(how, monkeypatch) -> None:
    # the generated states are laid out as the live buffers are: the replay of a graph that baked
    # the example's layout differs from its Python there (with the check off, from the serial step)
    with CpuDevice(timeout=T) as dev, pytest.raises(NotGraphSafe):
        lower(_layout_reader(how), M.DECODE, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG,
              state=_padded_state())
    state = _padded_state()
    with no_validation(monkeypatch), CpuDevice(timeout=T) as dev:
        serial = run_serial(_layout_reader(how), M.DECODE, steps=2, batch_size=BATCH, cfg=CFG, state=_padded_state())
        run = run_overlapped(_layout_reader(how), M.DECODE, steps=2, policy=Policy.COARSE, device=dev,
                             batch_size=BATCH, cfg=CFG, state=state)
    assert not run.matches(serial)


def test_a_backend_that_reads_no_layout_runs_on_a_padded_live_state_as_serial() -> None:
    from readfence.backends import paged

    serial = run_serial(paged(), M.DECODE, steps=3, batch_size=BATCH, cfg=CFG, state=_padded_state())
    with CpuDevice(timeout=T) as dev:
        run = run_overlapped(paged(), M.DECODE, steps=3, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG,
                             state=_padded_state())
    assert run.matches(serial) and run.violations == ()


# -- a replay that leaves other bytes than the Python, its outputs alike ------------------------------
def _writes_where_the_trace_said(memory: str) -> object:
    """The body adds one where a Python value of the out-of-graph stage says (the step's deepest
    position), into the state pool it is handed (``argument``) or a workspace it captured
    (``captured``); its outputs do not depend on it. The graph bakes the traced position."""
    kept: dict[str, int] = {}
    ws = torch.zeros(64)

    def out_graph(mode, shared, batch):
        kept["n"] = int(batch["positions"].max())
        return {}

    def prep(mode, shared, batch, meta):
        return page_meta(shared, batch)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        target = ws if memory == "captured" else pools["state"].view(-1)
        target[kept["n"]].add_(1.0)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])

    return leaf(f"writes_where_the_trace_said_{memory}", attend, prepare_out_graph=out_graph, prepare_in_graph=prep,
                reads=["req_to_token", "seq_lens"])


@pytest.mark.parametrize(("memory", "named"), [("argument", "pools.state"), ("captured", "captured _tensor_constant")])
def test_a_replay_that_writes_other_bytes_than_its_python_is_not_graph_safe(memory, named) -> None:
    # the replay runs on copies of the arguments' memory and on the captured memory itself; both are
    # compared with what the Python left
    with CpuDevice(timeout=T) as dev, pytest.raises(NotGraphSafe, match="other bytes than its Python writes") as e:
        lower(_writes_where_the_trace_said(memory), M.DECODE, batch_size=BATCH, device=dev, policy=Policy.COARSE,
              cfg=CFG)
    assert named in str(e.value)


def test_a_graph_that_cannot_run_on_the_live_layout_is_refused_naming_its_stage() -> None:
    # reshape(-1) of the example's contiguous page table records as a view, which the padded live
    # layout cannot take: refused as a stage whose graph is not its Python there, not a raw error
    def prep(mode, shared, batch, meta):
        flat = shared["req_to_token"].reshape(-1)
        return {**page_meta(shared, batch), "first": flat[:1].clone()}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"]) + meta["first"] * 0

    backend = leaf("flat_table", attend, prepare_in_graph=prep, reads=["req_to_token", "seq_lens"])
    assert run_serial(backend, M.DECODE, steps=2, batch_size=BATCH, cfg=CFG, state=_padded_state()).logits
    with CpuDevice(timeout=T) as dev, pytest.raises(NotGraphSafe, match="stage prepare_in_graph .*RuntimeError"):
        lower(backend, M.DECODE, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG, state=_padded_state())
