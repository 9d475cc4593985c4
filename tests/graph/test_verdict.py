"""The audit's verdict and the bound program, asked once per step and place in memory."""

from __future__ import annotations

import functools

import pytest

from readfence.backends import paged, redeclare
from readfence.backends.fuzz import VOCABULARY, FuzzLeaf, FuzzProgram, Placement, declared
from readfence.core import ForwardMode, audit, bind, clear_trace_cache, trace
from readfence.core.internal import audit_failure
from readfence.core.tracing import _bind as binding
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import Policy, lower
from readfence.graph.fuzz import FUZZ_CONFIG, check_program
from readfence.graph.lowering import _verdict as verdicts
from readfence.graph.lowering import make_state
from readfence.graph.lowering.internal import audit_verdict

M = ForwardMode


@pytest.fixture
def audits(monkeypatch):
    """The audits run (backend names), counted where lowering and the fuzzer ask them."""
    ran: list[str] = []

    def counted(backend, mode, **kw):
        ran.append(backend.name)
        return audit_failure(backend, mode, **kw)

    clear_trace_cache()
    monkeypatch.setattr(verdicts, "audit_failure", counted)
    yield ran
    clear_trace_cache()


def test_lowering_under_two_policies_audits_the_step_once(dev, audits) -> None:
    state = make_state(FUZZ_CONFIG)
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        lower(paged(), M.DECODE, batch_size=2, device=dev, policy=policy, cfg=FUZZ_CONFIG, state=state)
    assert audits == ["paged"]
    lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=FUZZ_CONFIG, state=make_state(FUZZ_CONFIG))
    assert audits == ["paged", "paged"]  # another state: asked again


def test_the_fuzzer_audits_a_program_once_and_lower_refuses_what_it_refuses(dev, audits) -> None:
    snap = FuzzLeaf("snap", (Placement(VOCABULARY["clone"], "prepare_in_graph", "seq_lens", carry=True),),
                    declared(IN_REPLAY=["req_to_token", "seq_lens"]))
    assert check_program(FuzzProgram(snap), device=dev).verdict == "accepted"
    assert audits == ["snap"]
    early = FuzzLeaf("early", snap.placements, declared(PRE_REPLAY=["req_to_token", "seq_lens"]))
    outcome = check_program(FuzzProgram(early), device=dev)
    assert outcome.refused_by.startswith("audit: ") and audits == ["snap", "early"]


def test_a_cached_verdict_is_the_audits_and_depends_on_the_declaration(audits) -> None:
    state = make_state(FUZZ_CONFIG)
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    ask = functools.partial(audit_verdict, mode=M.DECODE, cfg=FUZZ_CONFIG, batch_size=2, device="cpu", state=state)
    assert ask(paged()) is None and ask(paged()) is None
    refused = ask(early)
    assert refused is not None and refused.buffer == "req_to_token" and ask(early) is refused
    assert refused.message == audit(early, M.DECODE, cfg=FUZZ_CONFIG, batch_sizes=[2], state=state).failure().message
    assert audits == ["paged", "paged"]  # once per declaration
    clear_trace_cache()  # forgotten with the traces
    ask(paged())
    assert audits == ["paged", "paged", "paged"]


def _kept() -> FuzzLeaf:
    # a leaf whose attend reads the live lengths through a closure: only binding finds the read
    return FuzzLeaf("kept", (Placement(VOCABULARY["clone"], "attend", "seq_lens", via="closure"),),
                    declared(POST_REPLAY=["req_to_token", "seq_lens"]), meta_stage=None)


def test_a_program_is_bound_once_per_program_and_place_in_memory() -> None:
    state = make_state(FUZZ_CONFIG)
    program = trace(FuzzProgram(_kept()).build(state), M.DECODE, cfg=FUZZ_CONFIG, batch_size=2)
    once = bind(program, state)
    assert once is not program and bind(program, state) is once
    fresh = binding._bind(program, state)  # computed again, uncached: the same reads
    assert fresh is not once and once.traced() == fresh.traced()
    assert once.traced()["seq_lens"] is ReadEnd.POST_REPLAY and program.traced()["seq_lens"] is ReadEnd.UNKNOWN
    assert bind(program, make_state(FUZZ_CONFIG)) is not once  # other memory
    clear_trace_cache()  # forgotten with the traces
    assert bind(program, state) is not once


def test_the_audit_and_lowering_on_one_state_bind_the_program_once(dev, monkeypatch) -> None:
    binds: list[str] = []

    def counted(program, state):
        binds.append(program.backend)
        return computed(program, state)

    computed = binding._bind
    monkeypatch.setattr(binding, "_bind", counted)
    clear_trace_cache()
    state = make_state(FUZZ_CONFIG)
    backend = FuzzProgram(_kept()).build(state)
    audit(backend, M.DECODE, cfg=FUZZ_CONFIG, batch_sizes=[2], state=state).unwrap()
    assert binds == ["kept"]
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        lower(backend, M.DECODE, batch_size=2, device=dev, policy=policy, cfg=FUZZ_CONFIG, state=state)
    assert binds == ["kept"]  # lowering asked the audit's bound program, not a second run
