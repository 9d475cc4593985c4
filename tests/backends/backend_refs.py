"""Independent references for the leaves' attention: python loops, float64, no shared code.

Each reference reads the example's shared state with plain indexing, inserts the new K/V
itself, and computes dense softmax attention (or the closed-form linear attention) per
request, per new token, per head.
"""

from __future__ import annotations

import math

import torch

from readfence.core import ForwardMode
from readfence.core.internal import tokens_per_request

#: float32 kernels vs float64 references.
ATOL, RTOL = 2e-5, 1e-4


def _with_new(cache: torch.Tensor, layer: int, loc: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    c = cache[layer].double().clone()
    c[loc] = new.double()
    return c


def softmax_reference(step, mode: ForwardMode, layer: int, q, k, v, *, window=None, swa=False,
                      top_k=None, page_size=None):
    """Dense softmax attention of every new token over its request's keys (positions <= own)."""
    n = tokens_per_request(mode)
    shared, batch, pools = step.shared, step.batch, step.pools
    loc = batch["out_cache_loc"]
    prefix = "swa_" if swa else ""
    if swa:
        loc = shared["swa_map"][loc].long()
    keys = _with_new(pools[prefix + "k_cache"], layer, loc, k)
    values = _with_new(pools[prefix + "v_cache"], layer, loc, v)
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, dim = q.shape[1], q.shape[2]
    for b, req in enumerate(batch["req_pool_indices"].tolist()):
        length = int(shared["seq_lens"][req])
        for i in range(n):
            t = b * n + i
            pos = length - n + i
            assert pos == int(batch["positions"][t])
            visible = list(range(max(0, pos - window + 1) if window else 0, pos + 1))
            for h in range(heads):
                qh = q[t, h].double()

                def score(p: int, h: int = h, qh: torch.Tensor = qh, req: int = req) -> float:
                    slot = int(shared["req_to_token"][req, p])
                    if swa:
                        slot = int(shared["swa_map"][slot])
                    return float(keys[slot, h] @ qh) / math.sqrt(dim)

                chosen = visible
                if top_k is not None:
                    pages = sorted({p // page_size for p in visible},
                                   key=lambda pg: -max(score(p) for p in visible if p // page_size == pg))
                    keep = set(pages[:top_k])
                    chosen = [p for p in visible if p // page_size in keep]
                scores = torch.tensor([score(p) for p in chosen], dtype=torch.float64)
                probs = torch.softmax(scores, 0)
                slots = []
                for p in chosen:
                    slot = int(shared["req_to_token"][req, p])
                    slots.append(int(shared["swa_map"][slot]) if swa else slot)
                out[t, h] = probs @ values[slots, h]
    return out


def linear_reference(step, mode: ForwardMode, layer: int, q, k, v, *, decay: float):
    """Closed form: ``o_i = q_i/sqrt(D) (decay^(i+1) S0 + sum_j decay^(i-j) k_j v_j^T)``."""
    n = tokens_per_request(mode)
    shared, batch, pools = step.shared, step.batch, step.pools
    dim = q.shape[-1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    finals = {}
    for b, req in enumerate(batch["req_pool_indices"].tolist()):
        slot = int(shared["state_slots"][req])
        s0 = pools["state"][layer, slot].double()
        for i in range(n):
            t = b * n + i
            state = decay ** (i + 1) * s0
            for j in range(i + 1):
                tj = b * n + j
                state = state + decay ** (i - j) * torch.einsum(
                    "hd,he->hde", k[tj].double(), v[tj].double())
            out[t] = torch.einsum("hd,hde->he", q[t].double() / math.sqrt(dim), state)
            finals[slot] = state
    return out, finals
