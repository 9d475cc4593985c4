"""``lower``'s verdict (``audit_failure``) is the audit's failure, computed from the root alone
where the nodes below it cannot change it.

Each case is judged twice: by ``audit_failure`` and by the whole audit (``audit``, every node of
the tree traced and observed), which shares none of its shortcut. They must agree, message for
message; and where the root is sound and no node below places a fence, the shortcut must not have
traced the nodes below.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from readfence.backends import hybrid_linear, join, linear, paged, per_stream, redeclare, select, sparse, tbo, trtllm_mha
from readfence.backends.strategies import trees
from readfence.core import ForwardMode, ModelConfig, audit, clear_trace_cache
from readfence.core.internal import audit_failure
from readfence.core.tracing import trace_cache_size
from readfence.effects import ReadEffect, ReadEnd

M = ForwardMode
CFG = ModelConfig(layers=2)


def _early(backend: Any, buffer: str) -> Any:  # the leaf with ``buffer`` declared released before the replay
    def effect(mode: ForwardMode) -> ReadEffect:
        declared = backend.read_effect(mode)
        return ReadEffect.of({**{b: declared[b] for b in declared.buffers}, buffer: ReadEnd.PRE_REPLAY})

    return redeclare(backend, effect)


EARLY_PAGED = _early(paged(), "req_to_token")

#: (name, backend, whether a node below the root places a fence of its own)
CASES = [
    ("sound leaf", paged(), False),
    ("sound combinator", hybrid_linear(trtllm_mha(), linear()), False),
    # the child's own declaration is early, a sibling's covers the read: latent, not refused
    ("latent child", join(EARLY_PAGED, sparse()), False),
    ("unsound leaf", EARLY_PAGED, False),
    # the root's join is early: the refusal names the child that reads past it
    ("early root", join(EARLY_PAGED, _early(sparse(), "req_to_token")), False),
    ("early child in tbo", tbo(EARLY_PAGED, EARLY_PAGED), False),
    ("select's arm", select({M.DECODE: EARLY_PAGED}, default=paged()), False),
    # a per-stream member places its own stream's fence: refused although the root's join covers it
    ("placed member", per_stream(EARLY_PAGED, paged()), True),
    ("sound members", per_stream(paged(), trtllm_mha()), True),
]


@pytest.mark.parametrize(("name", "backend", "placed"), CASES, ids=[c[0] for c in CASES])
def test_lowers_verdict_is_the_whole_audits(name: str, backend: Any, placed: bool) -> None:
    clear_trace_cache()
    shortcut = audit_failure(backend, M.DECODE, cfg=CFG, batch_sizes=[2])
    traced = trace_cache_size()
    clear_trace_cache()
    whole = audit(backend, M.DECODE, cfg=CFG, batch_sizes=[2])
    expected = whole.swap().value_or(None)
    assert (None if shortcut is None else shortcut.message) == (None if expected is None else expected.message)
    if shortcut is None and not placed:
        assert traced == 1  # the root's step alone: the nodes below it could not change the verdict


def test_a_latent_child_stays_in_the_whole_audit() -> None:
    # what the shortcut skips is reported where a user asks for it: the audit still finds the child
    report = audit(join(EARLY_PAGED, sparse()), M.DECODE, cfg=CFG, batch_sizes=[2]).unwrap()
    assert [(x.path, x.buffer) for x in report.latent()] == [("join/children[0]/paged", "req_to_token")]
    assert audit_failure(join(EARLY_PAGED, sparse()), M.DECODE, cfg=CFG, batch_sizes=[2]) is None


def test_the_placed_member_is_refused_although_the_root_is_sound() -> None:
    # the case a shortcut that ignored placed nodes would accept
    backend = per_stream(EARLY_PAGED, paged())
    assert backend.read_effect(M.DECODE)["req_to_token"] >= ReadEnd.IN_REPLAY  # the root's join covers it
    failure = audit_failure(backend, M.DECODE, cfg=CFG, batch_sizes=[2])
    assert failure is not None and failure.path == "per_stream/members[0]/paged"
    assert failure.buffer == "req_to_token"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees(st.sampled_from([paged(), EARLY_PAGED, sparse(), linear(), _early(linear(), "state_slots")]),
                  max_leaves=4, groups=True),
       mode=st.sampled_from([M.DECODE, M.TARGET_VERIFY]))
def test_lowers_verdict_is_the_whole_audits_on_random_trees(tree: Any, mode: ForwardMode) -> None:
    # every combinator (per_stream's members place fences; select and hybrid run one arm; tbo splits
    # the batch) over leaves whose declarations are early, sound, or early where a sibling covers them
    whole = audit(tree, mode, cfg=CFG, batch_sizes=[2]).swap().value_or(None)
    shortcut = audit_failure(tree, mode, cfg=CFG, batch_sizes=[2])
    event("refused" if whole is not None else "accepted with a latent node" if audit(
        tree, mode, cfg=CFG, batch_sizes=[2]).unwrap().latent() else "accepted")
    assert (None if shortcut is None else shortcut.message) == (None if whole is None else whole.message)
