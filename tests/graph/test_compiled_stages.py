"""The compiled stages a lowering keeps (``graph.lowering._slot.CompileKey``): shared by the
lowerings of one program on one state, never by code compiled from anything else.

* lowered again on its state under another policy, a step runs the very code compiled before,
  and its outputs are those of the step lowered on a fresh state;
* another state, a check's poison hooks (which may write), the passes off, inputs that share
  memory, other hook sites: each is other code.
"""

from __future__ import annotations

import torch

from readfence.backends import paged
from readfence.core import BODY, ForwardMode, trace
from readfence.core.internal import CACHES, BufferMap
from readfence.graph import CheckState, CpuDevice, LowerOptions, Policy, Scheduler, lower, make_state
from readfence.graph.lowering._slot import compile_stages, record_sites
from tests.conftest import ONE_LAYER as CFG

M = ForwardMode.DECODE


def _body(low):
    return low._slots[0].stages[BODY].runner.graph


def _logits(low):
    nxt = Scheduler(low.cfg, M, low.batch_size, seed=3).next_step()
    for b, t in nxt.shared.items():
        low.shared[b].copy_(t)
    return low.run(nxt.batch, step=0).result(timeout=10)


def test_another_policy_on_the_same_state_runs_the_code_compiled_before_and_computes_alike() -> None:
    table = CACHES["compiled_stages"]
    with CpuDevice(timeout=10) as dev:
        state = make_state(CFG)
        coarse = lower(paged(), M, batch_size=2, device=dev, policy=Policy.COARSE, cfg=CFG, state=state)
        hits = table.stats.hits
        exact = lower(paged(), M, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG, state=state)
        assert table.stats.hits > hits and _body(exact) is _body(coarse)
        fresh = lower(paged(), M, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)  # another state
        assert _body(fresh) is not _body(exact)
        assert torch.equal(_logits(exact), _logits(fresh)) and torch.equal(_logits(coarse), _logits(fresh))
        # a check's poison may follow EXACT's nodes: code whose hooks may write is compiled apart
        check = CheckState(state["shared"], CFG)
        checked = lower(paged(), M, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG, state=state,
                        lowering=LowerOptions(check=check))
        assert _body(checked) is not _body(exact)
        plain = lower(paged(), M, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG, state=state,
                      lowering=LowerOptions(optimize=False))
        assert _body(plain) is not _body(exact) and not plain.optimized


def test_inputs_that_share_memory_or_other_sites_are_other_code() -> None:
    program = trace(paged(), M, cfg=CFG, batch_size=2)
    state = make_state(CFG)
    env = {f"shared.{k}": t for k, t in state["shared"].items()}
    sites = record_sites(program, {})
    live = BufferMap.of(state["shared"])
    code = compile_stages(program, sites, env, {}, live=live)
    assert compile_stages(program, sites, dict(env), {}, live=live) is code  # the same key: the same code
    lens = env["shared.seq_lens"]
    aliased = {**env, "shared.req_to_token": lens.view(-1)[:1].expand(*env["shared.req_to_token"].shape)}
    assert compile_stages(program, sites, aliased, {}, live=live) is not code  # one memory now: other code
    assert compile_stages(program, {s: frozenset() for s in sites}, env, {}, live=live) is not code
    assert compile_stages(program, sites, env, {}, live=None) is not code
    assert compile_stages(program, sites, env, {}, live=live, writes=True) is not code  # hooks that may write
    assert compile_stages(program, sites, env, {}, live=live, optimize=False) is not code
