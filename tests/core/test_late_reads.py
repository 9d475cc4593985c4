"""What a message about a read later than declared says: the user's ``file:line in function``, the
kind of read in the guide's words, and one fix, the same from every path that reports it (the
audit, ``readfence audit``, ``lower``, ``plan``, ``verify``, an engine's audit).

The leaf is written here, so the line each message must name is a line of this file.
"""

from __future__ import annotations

import inspect
import re

import pytest

from readfence.backends import leaf, page_meta, softmax_attention, store_kv
from readfence.cli._plan_data import placements
from readfence.core import ForwardMode, audit
from readfence.core.internal import ReadKind, late_read_fix
from readfence.effects import Capabilities, ReadEffect, ReadEnd
from readfence.graph import CpuDevice, Policy, UnsoundLowering, lower
from tests.conftest import ONE_LAYER
from tests.core import test_observe

M = ForwardMode
PRE = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})


def _snapshot(mode, shared, batch):
    return page_meta(shared, batch)


def _attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    rows = shared["req_to_token"].index_select(0, batch["req_pool_indices"])  # the late read
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"] + 0 * rows[:, :1], meta["kv_lens"])


#: The late read's ``file:line in function``: the line of ``_attend`` that says so.
LINE = next(f"{__file__}:{inspect.getsourcelines(_attend)[1] + i} in _attend"
            for i, text in enumerate(inspect.getsourcelines(_attend)[0]) if "# the late read" in text)
FIX = late_read_fix("req_to_token", ReadEnd.POST_REPLAY)

#: Declares the page table read before the replay, reads it in the body: unsound in DECODE.
late = leaf("late", _attend, prepare_out_graph=_snapshot, declare={M.DECODE: PRE})


@pytest.fixture
def cli():
    """``cli(*args)`` runs ``readfence args`` in this process."""
    from click.testing import CliRunner

    from readfence.cli import main

    return lambda *args: CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def failure():
    return audit(late, M.DECODE, cfg=ONE_LAYER, batch_sizes=[2]).failure()


def test_a_leafs_unsound_read_names_the_users_line_in_function_the_kind_and_the_fix(failure):
    assert failure.buffer == "req_to_token" and failure.observed is ReadEnd.POST_REPLAY
    assert re.search(rf"last read by node '\w+' in stage body at {re.escape(LINE)}: {ReadKind.TRACED}",
                     failure.message), failure.message
    assert failure.message.endswith(FIX), failure.message
    entry = next(b for b in failure.report.buffers if b.buffer == "req_to_token")
    assert entry.source == LINE and not entry.observer


def test_the_table_row_and_the_json_name_the_function_and_file(failure):
    line = next(r for r in failure.report.table().splitlines() if "req_to_token" in r)
    number = LINE.rsplit(":", 1)[1].split()[0]
    assert f"unsound: read by _attend at test_late_reads.py:{number} (body:" in line, line
    row = next(r for r in failure.report.rows(detail=True) if r["buffer"] == "req_to_token")
    assert row["source"] == LINE


def test_the_command_lines_unsound_line_says_it_too(cli):
    result = cli("audit", "tests.core.test_late_reads:late", "--mode", "decode", "--batch-size", "2")
    assert result.exit_code == 1, result.output
    (unsound,) = [x for x in result.output.splitlines() if x.startswith("UNSOUND: ")]
    assert unsound.startswith("UNSOUND: late in DECODE: req_to_token declared PRE_REPLAY but read until "
                              "POST_REPLAY (last read by node "), unsound
    assert f" in stage body at {LINE}: " in unsound, unsound
    assert f": {ReadKind.TRACED}" in unsound and unsound.endswith(f"); {FIX}"), unsound


def test_lower_and_plan_refuse_it_with_the_same_line_and_fix():
    with CpuDevice() as dev, pytest.raises(UnsoundLowering) as refused:
        lower(late, M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=ONE_LAYER)
    assert LINE in str(refused.value) and str(refused.value).endswith(FIX), str(refused.value)
    planned = placements(late, M.DECODE, Capabilities())
    assert f"read until POST_REPLAY at {LINE}" in planned["EXACT"]["refused"]
    assert planned["EXACT"]["refused"].endswith(FIX)


def test_verify_gives_the_same_fix(cli):
    result = cli("verify", "tests.core.test_late_reads:late", "--steps", "1", "--batch-size", "2", "--policy",
                 "exact", "--device", "cpu")
    assert result.exit_code == 1, result.output
    assert f"what to do: late: {FIX}" in result.output, result.output
    assert LINE in result.output  # the audit's line names it


def test_an_engines_unsound_read_gives_the_same_fix():
    from readfence.engine import audit_engine
    from readfence.engine.reference import minimax_sparse_engine

    failed = audit_engine(minimax_sparse_engine(), M.DECODE, batch_sizes=[2], steps=1).failure()
    row = failed.row
    assert row.where.endswith(" in page_rows") and ".py:" in row.where, row.where
    assert failed.message.endswith(late_read_fix(row.buffer, row.truth)), failed.message
    assert f"({ReadKind.TRACED}," in failed.message
    (line,) = [x for x in failed.report.table().splitlines() if x.startswith("UNSOUND: MiniMaxSparseBackend")]
    assert line.endswith(late_read_fix(row.buffer, row.truth)) and row.where in line, line


def test_one_function_words_the_fix():
    # every path above quotes it: a path with a fix of its own would fail them
    assert FIX.startswith("fix: declare 'req_to_token' ending at POST_REPLAY (or later), or end the read earlier")
    assert late_read_fix("seq_lens").startswith("fix: declare 'seq_lens' ending where its last read ends")


# -- a kernel reading what an earlier stage kept: a read only the observer sees ---------------------
PLAN_RUN = test_observe.CASES["plan_run"].backend  # its run kernel reads the page table its plan kept


def test_a_plan_run_read_is_a_read_only_the_observer_sees_not_an_analysis_bug(cli):
    from readfence.core.internal import audit_report

    report = audit_report(PLAN_RUN, M.DECODE, cfg=ONE_LAYER, batch_sizes=[2])
    (seen,) = report.disagreements
    source = inspect.getsource(test_observe).splitlines()
    kernel = next(i + 1 for i, text in enumerate(source) if "_PLAN.pages.index_select" in text)
    assert seen.by_reference and seen.message.startswith(f"{ReadKind.OBSERVER_ONLY}: backend 'plan_run'")
    assert seen.source == f"{test_observe.__file__}:{kernel} in _run", seen.source  # the kernel's read
    entry = next(b for b in report.buffers if b.buffer == "req_to_token")
    assert entry.observer and entry.observed is ReadEnd.POST_REPLAY and entry.source == seen.source
    assert f"{ReadKind.OBSERVER_ONLY}" in report.where("plan_run", "req_to_token")
    result = cli("audit", "tests.core.test_late_reads:PLAN_RUN", "--mode", "decode", "--batch-size", "2")
    (line,) = [x for x in result.output.splitlines() if x.startswith(("OBSERVED ONLY: ", "ANALYSIS BUG: "))]
    assert line == f"OBSERVED ONLY: {seen.message}", line


def test_a_read_the_analysis_misses_through_an_argument_is_still_an_analysis_bug(monkeypatch):
    # the analysis broken on purpose (a view whose pieces alias nothing, a blind memory probe): the
    # observer sees a plain op read what its arguments give it, which is a bug, not a kept reference
    import readfence.core.tracing._alias as alias
    from readfence.core import clear_trace_cache
    from tests.adversarial import CASES, blinded

    real = alias.op_aliasing

    class Blind:
        name, writes, outputs, opaque, is_view, metadata_args = "split", (), ((),), False, True, ()

    monkeypatch.setattr(alias, "op_aliasing", lambda op: Blind() if "split" in str(op) else real(op))
    blinded(monkeypatch)
    clear_trace_cache()
    try:
        report = audit(CASES["split"].build(None), M.DECODE, cfg=ONE_LAYER, batch_sizes=[2]).failure().report
    finally:
        clear_trace_cache()
    (bug,) = [d for d in report.disagreements if d.buffer == "seq_lens"]
    assert not bug.by_reference and bug.message.startswith("readfence's static analysis missed a read")
    entry = next(b for b in report.buffers if b.buffer == "seq_lens")
    assert not entry.observer and ReadKind.OBSERVER_ONLY not in report.where(report.path, "seq_lens")


def test_a_latent_finding_gives_the_same_fix():
    from readfence.backends import join, paged, redeclare, sparse

    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.IN_REPLAY}))
    (latent,) = audit(join(early, sparse()), M.DECODE, cfg=ONE_LAYER, batch_sizes=[2]).unwrap().latent()
    assert latent.message.endswith(late_read_fix("req_to_token", ReadEnd.IN_REPLAY)), latent.message
    assert f": {ReadKind.TRACED}" in latent.message and ".py:" in latent.message
