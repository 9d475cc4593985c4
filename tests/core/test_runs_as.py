"""A backend that runs as another is traced and observed as that one: the same audit, made once."""

from __future__ import annotations

import pytest

import readfence.core._audit as audit_module
from readfence.backends import dense, hybrid, paged, per_stream, reference_compositions, select, tbo, trtllm_mha
from readfence.core import ForwardMode, audit, clear_trace_cache
from readfence.core._protocol import runs_as
from readfence.core.internal import audit_report, trace_cache_size
from readfence.graph import CpuDevice, Policy, lower
from readfence.graph.lowering import UnsoundLowering
from tests.conftest import ONE_LAYER, first_of_each
from tests.core.test_observe import CASES

M = ForwardMode


def findings(report):
    """Everything the audit says of a tree: its rows (readers and batch sizes included), each
    node's opaque notes and analysis bugs, and its counts (what ``readfence audit`` prints)."""
    notes = [(n.path, n.mode, n.opaque, tuple(d.message for d in n.disagreements)) for n in report.walk()]
    return report.rows(detail=True), notes, report.counts()


def _audited(backend, mode, cfg, *, shared: bool):
    clear_trace_cache()
    if shared:
        return findings(audit_report(backend, mode, cfg=cfg, batch_sizes=[1, 2]))
    # the audit as it was: every node traced and observed as itself
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(audit_module, "runs_as", lambda b, m: b)
        return findings(audit_report(backend, mode, cfg=cfg, batch_sizes=[1, 2]))


# (backend, mode, id); the quick tier runs the first
WRAPPED = [
    # a kernel reading what its plan kept: a read only the observer sees (an OBSERVED ONLY line)
    (select({M.DECODE: CASES["plan_run"].backend}, default=paged()), M.DECODE, "select-plan_run"),
    (hybrid(decode=trtllm_mha(), prefill=paged()), M.DECODE, "hybrid-decode"),
    (per_stream(paged(), trtllm_mha()), M.TARGET_VERIFY, "per_stream-verify"),
    (tbo(paged(), dense()), M.IDLE, "tbo-idle"),
]


@pytest.mark.parametrize("case", first_of_each(WRAPPED, lambda case: "all"), ids=lambda case: case[2])
def test_a_shared_trace_gives_the_findings_of_tracing_each_node(case):
    backend, mode, _ = case
    shared = _audited(backend, mode, ONE_LAYER, shared=True)
    assert shared == _audited(backend, mode, ONE_LAYER, shared=False)
    clear_trace_cache()


def test_the_read_only_the_observer_sees_of_a_shared_observation_names_the_wrapper():
    report = audit_report(select({M.DECODE: CASES["plan_run"].backend}, default=paged()), M.DECODE,
                          cfg=ONE_LAYER, batch_sizes=[2])
    (bug, *_) = report.disagreements
    assert bug.by_reference and bug.backend == "select" and "backend 'select' in mode DECODE" in bug.message
    assert report.find("select/decode/plan_run").disagreements[0].backend == "plan_run"


def test_a_wrapper_that_runs_as_its_child_is_not_traced_again():
    clear_trace_cache()
    audit_report(hybrid(decode=paged(), prefill=dense()), M.DECODE, cfg=ONE_LAYER, batch_sizes=[1])
    assert trace_cache_size() == 1  # paged: hybrid's step in DECODE is paged's, and dense does not run in it
    clear_trace_cache()
    audit_report(tbo(paged(), dense()), M.DECODE, cfg=ONE_LAYER, batch_sizes=[1])
    assert trace_cache_size() == 3  # tbo runs its own step


def test_every_leaf_runs_one_idle_step():
    runners = {runs_as(b, M.IDLE) for b in [paged(), trtllm_mha(), dense()]}
    assert len(runners) == 1
    assert runs_as(paged(), M.DECODE) is paged()


def test_a_backend_without_runs_as_runs_as_itself():
    class Plain:  # core asks only for what BackendLike has
        name = "plain"

        def __getattr__(self, attr):
            if attr == "runs_as":
                raise AttributeError(attr)
            return getattr(paged(), attr)

    plain = Plain()
    assert runs_as(plain, M.DECODE) is plain


def test_runs_as_must_name_a_backend():
    class Wrong:
        name = "wrong"

        def __getattr__(self, attr):
            return (lambda mode: "paged") if attr == "runs_as" else getattr(paged(), attr)

    with pytest.raises(TypeError, match=r"wrong.runs_as\(DECODE\) must return a backend, got 'paged'"):
        runs_as(Wrong(), M.DECODE)


@pytest.mark.parametrize("mode", first_of_each(list(M), lambda mode: "all"), ids=lambda m: m.name)
def test_what_a_reference_composition_runs_as_traces_to_its_own_program(mode):
    # the claim runs_as makes, checked on the code: the same graphs and the same reads
    from readfence.core import trace

    for backend in reference_compositions().values():
        runner = runs_as(backend, mode)
        if runner is backend:
            continue
        mine, theirs = (trace(b, mode, cfg=ONE_LAYER, batch_size=2) for b in (backend, runner))
        assert [(s.stage, s.graph.gm.code, s.graph.inputs, s.graph.outputs) for s in mine] == [
            (s.stage, s.graph.gm.code, s.graph.inputs, s.graph.outputs) for s in theirs], (str(backend), mode)
        assert [mine.reads(s.stage) for s in mine] == [theirs.reads(s.stage) for s in theirs]


class _Wrapper:
    """A user's wrapper that says it hands the whole step to its child (``runs_as``), declares the
    child's effect, and, ``lies``, reads the lengths in its own body after the child's attention."""

    name = "user_wrapper"

    def __init__(self, lies: bool) -> None:
        self.child, self.lies = paged(), lies

    def read_effect(self, mode):
        return self.child.read_effect(mode)

    def read_end(self, mode):
        return self.child.read_end(mode)

    def children(self):
        return (("inner", self.child),)

    def runs_as(self, mode):
        return self.child

    def prepare_out_graph(self, mode, shared, batch):
        return self.child.prepare_out_graph(mode, shared, batch)

    def prepare_in_graph(self, mode, shared, batch, meta):
        return self.child.prepare_in_graph(mode, shared, batch, meta)

    def attend(self, mode, layer, q, k, v, pools, shared, batch, meta):
        out = self.child.attend(mode, layer, q, k, v, pools, shared, batch, meta)
        if self.lies:
            out = out + 1e-2 * shared["seq_lens"].index_select(0, batch["req_pool_indices"]).float().sum()
        return out


@pytest.mark.parametrize("lies", [True, False])
def test_a_user_s_wrapper_is_traced_as_itself_whatever_it_says_it_runs_as(lies) -> None:
    # the audit and lower trace its own step: one verdict, which its own read decides
    wrapper = _Wrapper(lies)
    assert runs_as(wrapper, M.DECODE) is wrapper
    sound = audit(wrapper, M.DECODE, cfg=ONE_LAYER, batch_sizes=[2]).map(lambda r: r.sound).value_or(False)
    assert sound is not lies
    with CpuDevice() as dev:
        if lies:
            with pytest.raises(UnsoundLowering, match="'seq_lens'"):
                lower(wrapper, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=ONE_LAYER)
        else:
            lower(wrapper, M.DECODE, batch_size=2, device=dev, policy=Policy.PER_BUFFER, cfg=ONE_LAYER)
