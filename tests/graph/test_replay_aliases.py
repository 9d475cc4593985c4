"""Aliasing checked where it happens: an opaque op's outputs, at every replay on the CPU device.

A kernel registered with ``torch.library.Library`` and no alias annotation returns a copy of the
batch's lengths, except on a fast path (three rows or more, all even: a batch the scheduler
packed) where it returns a strided view of the live buffer. No example the analysis runs takes the
fast path; the decode loop's batch does. Every replay checks
the op's outputs against the shared buffers' address ranges, and a hit refuses the step naming
the op, before a consumer reads the live buffer after its release.
"""

from __future__ import annotations

import pytest
import torch
from returns.pipeline import is_successful

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode, audit
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import CpuDevice, DeviceError, LoopOptions, Policy, ReplayAliasError, decode_loop, run_serial, verify
from tests.conftest import ONE_LAYER as CFG
from tests.conftest import first_of_each

M = ForwardMode.DECODE
STEPS, BATCH = 4, 3

_LIB = torch.library.Library("rf_replay_alias", "FRAGMENT")
_LIB.define("rows_of(Tensor lens, Tensor rows) -> Tensor")  # no alias annotation: taken to copy


def _rows_of(lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] >= 3 and all(r % 2 == 0 for r in rows.tolist()):  # the fast path: a strided view
        return lens.as_strided((rows.shape[0],), (2,), 0)
    return lens.index_select(0, rows)


_LIB.impl("rows_of", _rows_of, "CPU")


def _fast_path(name: str = "fast_path") -> object:
    def prep(mode, shared, batch, meta):
        return {**page_meta(shared, batch), "lens": torch.ops.rf_replay_alias.rows_of(shared["seq_lens"],
                                                                                       batch["req_pool_indices"])}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["lens"].long().clamp(min=1))

    declared = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf(name, attend, prepare_in_graph=prep, declare={M: declared})


def test_the_fast_path_is_taken_in_the_run_and_by_no_example_the_analysis_ran() -> None:
    # not vacuous: the audit, from the trace's example, takes the op for a copy
    assert audit(_fast_path(), M, cfg=CFG).map(lambda r: r.sound).value_or(None)
    lens = torch.arange(8)
    assert _rows_of(lens, torch.tensor([0, 6, 2])).untyped_storage().data_ptr() == lens.untyped_storage().data_ptr()
    from readfence.graph import Scheduler

    assert Scheduler(CFG, M, BATCH).next_step().batch["req_pool_indices"].tolist() == [0, 6, 2]


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT, Policy.JOINED], ids=str)
def test_a_view_an_opaque_op_returns_at_a_replay_refuses_the_step_naming_the_op(policy: Policy) -> None:
    with CpuDevice(timeout=30.0) as dev:
        loop = decode_loop(_fast_path(), M, policy=policy, device=dev, batch_size=BATCH, cfg=CFG)
        with pytest.raises(DeviceError) as info:
            loop.run(STEPS)
    cause = info.value.__cause__
    assert isinstance(cause, ReplayAliasError), repr(info.value)
    assert (cause.stage, cause.op, cause.buffers) == ("prepare_in_graph", "rf_replay_alias.rows_of.default",
                                                      frozenset({"seq_lens"}))


def test_verify_reports_it_as_a_refused_step() -> None:
    with CpuDevice(timeout=30.0) as dev:
        finding = verify(_fast_path(), M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                         policy=Policy.PER_BUFFER).failure()
    assert (finding.kind, finding.evidence, finding.buffer, finding.op) == (
        "refused", "run", "seq_lens", "rf_replay_alias.rows_of.default"), str(finding)


def test_without_the_check_the_late_read_is_caught_by_poison_and_by_the_observer(monkeypatch) -> None:
    # broken on purpose: no alias check at the replays. The body reads the live lengths through
    # the view after their IN_REPLAY release: poison on release and the read observer, each on
    # its own, catch it
    import readfence.graph.lowering._slot as slot

    monkeypatch.setattr(slot, "insert_alias_checks", lambda gm, live, **kw: gm)
    with CpuDevice(timeout=30.0) as dev:
        for check in ("poison", "observer"):
            finding = verify(_fast_path("unchecked"), M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG,
                             policy=Policy.PER_BUFFER, options=LoopOptions(checks={check})).failure()
            assert (finding.kind, finding.buffer, finding.evidence) == ("late read", "seq_lens", check), str(finding)


def test_the_copy_path_alone_runs_clean_and_bit_identical() -> None:
    # the same op on rows that are never all even: no alias at any replay, nothing refused
    def prep(mode, shared, batch, meta):
        rows = (batch["req_pool_indices"] + 1) % shared["seq_lens"].shape[0]  # odd rows: the copy path
        lens = torch.ops.rf_replay_alias.rows_of(shared["seq_lens"], rows)
        return {**page_meta(shared, batch), "lens": lens}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["lens"].long().clamp(min=1))

    declared = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    backend = leaf("copy_path", attend, prepare_in_graph=prep, declare={M: declared})
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        loop = decode_loop(backend, M, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=CFG)
        runs, _ = loop.run(STEPS)
    assert all(torch.equal(r.logits, s) for r, s in zip(runs, serial.logits))


# -- every tensor of every op whose kernel is not torch's own ----------------------------------
# The same data-dependent kernels, registered in several namespaces (torch's own among them: anyone
# may define an op in ``aten``) and in two ways. A kernel that re-points the ``out`` it is given
# at the live lengths on the fast path (``set_`` of a tensor or of a storage, ``as_strided_`` after
# ``set_``, a DLPack round trip: a new storage object over the same memory) leaves its caller's
# tensor aliasing the buffer; one that returns such a view aliases it through its output. Each is
# caught at the replay by the memory of every tensor of the op, whatever its schema claims.

NAMESPACES = ("rf_replay_user", "aten", "prims", "readfence")


def _aliasing_rows(lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return lens.as_strided((rows.shape[0],), (2,), 0)  # the rows the scheduler packed: 0, 2, 4...


def _fast(rows: torch.Tensor) -> bool:
    return rows.shape[0] >= 3 and all(r % 2 == 0 for r in rows.tolist())


def _via_dlpack(lens: torch.Tensor) -> torch.Tensor:
    return torch.from_dlpack(torch.utils.dlpack.to_dlpack(lens))  # another storage object, the same bytes


REPOINTS = {
    "set_ of a tensor": lambda lens, rows, out: out.set_(_aliasing_rows(lens, rows)),
    "set_ of a storage": lambda lens, rows, out: out.set_(lens.untyped_storage(), 0, (rows.shape[0],), (2,)),
    "as_strided_": lambda lens, rows, out: out.set_(lens).as_strided_((rows.shape[0],), (2,), 0),
    "a DLPack round trip": lambda lens, rows, out: out.set_(_aliasing_rows(_via_dlpack(lens), rows)),
}
RETURNS = {
    "as_strided": _aliasing_rows,
    "a DLPack round trip": lambda lens, rows: _aliasing_rows(_via_dlpack(lens), rows),
}


def _into_kernel(spelling: str):
    def into(lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        if _fast(rows):
            REPOINTS[spelling](lens, rows, out)
        else:
            out.copy_(lens.index_select(0, rows))

    return into


def _of_kernel(spelling: str):
    def of(lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return RETURNS[spelling](lens, rows) if _fast(rows) else lens.index_select(0, rows)

    return of


_KEEP: list[object] = []  # the libraries, alive as long as the module


def _op(namespace: str, how: str, name: str, schema: str, kernel):
    """``namespace::name`` defined by ``Library.define`` and ``impl`` (``how="library"``) or by
    ``torch.library.custom_op`` (``how="custom_op"``)."""
    if how == "library":
        lib = torch.library.Library(namespace, "FRAGMENT")
        lib.define(f"{name}{schema}")
        lib.impl(name, kernel, "CPU")
        _KEEP.append(lib)
    else:
        mutates = ("out",) if "out" in schema else ()
        _KEEP.append(torch.library.custom_op(f"{namespace}::{name}", kernel, mutates_args=mutates, schema=schema))
    return getattr(getattr(torch.ops, namespace), name).default


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


INTO = {(ns, how, spelling): _op(ns, how, f"rf_into_{how}_{_slug(spelling)}",
                                 "(Tensor lens, Tensor rows, Tensor(a!) out) -> ()", _into_kernel(spelling))
        for ns in NAMESPACES for how in ("library", "custom_op") for spelling in REPOINTS}
OF = {(ns, spelling): _op(ns, "library", f"rf_of_{_slug(spelling)}", "(Tensor lens, Tensor rows) -> Tensor",
                          _of_kernel(spelling)) for ns in NAMESPACES for spelling in RETURNS}


def _into_backend(op, name: str = "into", declared: ReadEnd = ReadEnd.IN_REPLAY, *, copied: bool = False) -> object:
    def prep(mode, shared, batch, meta):
        out = torch.empty(batch["req_pool_indices"].shape[0], dtype=shared["seq_lens"].dtype)
        op(shared["seq_lens"], batch["req_pool_indices"], out)  # the caller's tensor, handed to the kernel
        return {**page_meta(shared, batch), "lens": out * 1 if copied else out}  # (copied: read in this stage)

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["lens"].long().clamp(min=1))

    return leaf(name, attend, prepare_in_graph=prep,
                declare={M: ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": declared})})


def _of_backend(op, name: str = "of") -> object:
    def prep(mode, shared, batch, meta):
        return {**page_meta(shared, batch), "lens": op(shared["seq_lens"], batch["req_pool_indices"])}

    def attend(mode, layer, q, k, v, pools, shared, batch, meta):
        store_kv(pools, layer, batch["out_cache_loc"], k, v)
        return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["lens"].long().clamp(min=1))

    declared = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
    return leaf(name, attend, prepare_in_graph=prep, declare={M: declared})


def _refusal(backend) -> ReplayAliasError:
    with CpuDevice(timeout=30.0) as dev:
        loop = decode_loop(backend, M, policy=Policy.PER_BUFFER, device=dev, batch_size=BATCH, cfg=CFG)
        with pytest.raises(DeviceError) as info:
            loop.run(STEPS)
    cause = info.value.__cause__
    assert isinstance(cause, ReplayAliasError), repr(info.value)
    return cause


@pytest.mark.parametrize("key", first_of_each(list(INTO), lambda k: k[0]), ids=lambda k: "/".join(k))
def test_an_op_that_points_the_tensor_it_is_given_at_a_shared_buffer_is_refused_in_any_namespace(key) -> None:
    op = INTO[key]
    # not vacuous: no example the analysis ran took the fast path
    assert audit(_into_backend(op), M, cfg=CFG).map(lambda r: r.sound).value_or(None)
    cause = _refusal(_into_backend(op))
    assert (cause.stage, cause.op, cause.buffers) == ("prepare_in_graph", str(op), frozenset({"seq_lens"}))
    assert "its argument 'out'" in str(cause), str(cause)


@pytest.mark.parametrize("key", first_of_each(list(OF), lambda k: k[0]), ids=lambda k: "/".join(k))
def test_a_view_an_op_defined_in_any_namespace_returns_at_a_replay_is_refused(key) -> None:
    cause = _refusal(_of_backend(OF[key]))
    assert (cause.stage, cause.op, cause.buffers, cause.value) == ("prepare_in_graph", str(OF[key]),
                                                                  frozenset({"seq_lens"}), "its output")


@pytest.mark.slow
@pytest.mark.parametrize("key", [("aten", "custom_op", "set_ of a storage"), ("prims", "library", "as_strided_"),
                                 ("readfence", "library", "a DLPack round trip")], ids=lambda k: "/".join(k))
def test_without_the_check_a_repointed_argument_is_a_late_read_poison_and_the_observer_see(key, monkeypatch) -> None:
    # broken on purpose: no alias check at the replays. The body reads the live lengths through the
    # re-pointed tensor after their IN_REPLAY release: poison and the observer, each on its own, see it
    import readfence.graph.lowering._slot as slot

    monkeypatch.setattr(slot, "insert_alias_checks", lambda gm, live, **kw: gm)
    with CpuDevice(timeout=30.0) as dev:
        for check in ("poison", "observer"):
            finding = verify(_into_backend(INTO[key], "unchecked"), M, steps=STEPS, batch_size=BATCH, device=dev,
                             cfg=CFG, policy=Policy.PER_BUFFER, options=LoopOptions(checks={check})).failure()
            assert (finding.kind, finding.buffer, finding.evidence) == ("late read", "seq_lens", check), str(finding)


# -- no false alarms: correct custom ops, in torch's namespaces too ------------------------------
def _fresh_rows(lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return lens.index_select(0, rows)


def _into_fresh(lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    out.resize_(rows.shape[0])  # the out= idiom: resized in place (it may get new memory: its own)
    out.copy_(lens.index_select(0, rows))


CORRECT = {
    "a pure op returning fresh memory (custom_op in aten)":
        lambda: _of_backend(_op("aten", "custom_op", "rf_fresh_rows", "(Tensor lens, Tensor rows) -> Tensor",
                                _fresh_rows), "fresh"),
    "an out= op writing its own buffer in place (Library in aten)":
        lambda: _into_backend(_op("aten", "library", "rf_into_fresh", "(Tensor lens, Tensor rows, Tensor(a!) out) -> ()",
                                  _into_fresh), "into_fresh"),
    "an out= op writing its own buffer in place (custom_op in a user namespace)":
        lambda: _into_backend(_op("rf_replay_user", "custom_op", "rf_into_fresh",
                                  "(Tensor lens, Tensor rows, Tensor(a!) out) -> ()", _into_fresh), "into_fresh_user"),
}


@pytest.mark.parametrize("name", first_of_each(list(CORRECT), lambda n: "quick"))
def test_a_correct_custom_op_runs_bit_identical_and_verifies_clean(name) -> None:
    backend = CORRECT[name]()
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        runs, _ = decode_loop(backend, M, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG).run(STEPS)
        assert all(torch.equal(r.logits, s) for r, s in zip(runs, serial.logits))
        verified = verify(backend, M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.PER_BUFFER)
        assert is_successful(verified), str(verified)


def _into_always(lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    out.set_(lens).as_strided_((rows.shape[0],), (1,), 0)  # every step: the first rows of the live lengths


_ALWAYS = _op("aten", "library", "rf_into_always", "(Tensor lens, Tensor rows, Tensor(a!) out) -> ()", _into_always)


@pytest.mark.parametrize("copied", [False, True], ids=["read in the body", "read in its own stage"])
def test_an_argument_repointed_on_every_step_is_counted_by_the_analysis(copied: bool) -> None:
    # the example shows it: the analysis follows the re-pointed tensor from that op on (from memory),
    # so a read through it is a read of the buffer where it happens: in the body, an IN_REPLAY
    # declaration is unsound and POST_REPLAY exact; in the stage itself, IN_REPLAY is exact and
    # EXACT releases the buffer after that read, not after the op's (poison would see it)
    if not copied:
        found = audit(_into_backend(_ALWAYS, "always"), M, cfg=CFG)
        assert not found.map(lambda r: r.sound).value_or(False), str(found)
    end = ReadEnd.IN_REPLAY if copied else ReadEnd.POST_REPLAY
    backend = _into_backend(_ALWAYS, f"always_{end.name}", end, copied=copied)
    report = audit(backend, M, cfg=CFG).unwrap()
    assert report.sound and report.observed["seq_lens"] is end, str(report)
    serial = run_serial(backend, M, steps=STEPS, batch_size=BATCH, cfg=CFG)
    with CpuDevice(timeout=30.0) as dev:
        runs, _ = decode_loop(backend, M, policy=Policy.EXACT, device=dev, batch_size=BATCH, cfg=CFG).run(STEPS)
        assert all(torch.equal(r.logits, s) for r, s in zip(runs, serial.logits))
        verified = verify(backend, M, steps=STEPS, batch_size=BATCH, device=dev, cfg=CFG, policy=Policy.EXACT)
        assert is_successful(verified), str(verified)
