"""Tensor parallelism of the step program: the shard of the model a rank holds, and the
all-reduce that sums the ranks' partial results.

Rank ``r`` of ``n`` holds, in every layer, attention heads ``[r*H/n, (r+1)*H/n)`` (its columns
of ``wqkv``, its rows of ``wo``, its heads of the KV caches and of the linear-attention state)
and MLP columns ``[r*M/n, (r+1)*M/n)`` (of ``w_up``, and the same rows of ``w_down``). The
attention output projection and the MLP's down projection then give partial sums of the
hidden state; one all-reduce after each makes every rank's hidden state the whole model's.
The embedding, the norms and the LM head are replicated. Every rank draws the same seeded full
weights and keeps its shard, so the shards of all ranks make up the unsharded model.

The all-reduce is torch's functional collective: ``make_fx`` traces it to a
``_c10d_functional.all_reduce`` node and a ``wait_tensor`` node, so a sharded step is traced,
audited and lowered like any other, and the collective runs inside the lowered graph. With one
rank it is the identity and adds no node: the unsharded model, exactly.

>>> tp = TensorParallel(size=2, rank=1, group="0")
>>> tp.span(64)
(32, 32)
>>> TensorParallel(size=2, rank=2, group="0")
Traceback (most recent call last):
...
ValueError: TensorParallel.rank must be an int in 0..1 (one of 2 ranks), got 2 (int)
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

from ._checks import positive_int


def _check_rank(inst: TensorParallel, _attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < inst.size:
        raise ValueError(f"TensorParallel.rank must be an int in 0..{inst.size - 1} (one of {inst.size} ranks), "
                         f"got {value!r} ({type(value).__name__})")


def _check_group(inst: TensorParallel, _attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or (inst.size > 1 and not value):
        raise ValueError(f"TensorParallel.group must name the ranks' process group (a str such as "
                         f"torch.distributed.group.WORLD.group_name), got {value!r} ({type(value).__name__})")


@attrs.frozen
class TensorParallel:
    """Which of ``size`` ranks this is, and the process group (by name) they all-reduce over.

    A value (hashable, picklable): it is part of the model's config, so traces and lowerings of
    different ranks never mix. ``TensorParallel()`` is the single process.

    >>> TensorParallel()
    TensorParallel(size=1, rank=0, group='')
    """

    size: int = attrs.field(default=1, validator=lambda _i, _a, v: positive_int("TensorParallel.size", v))
    rank: int = attrs.field(default=0, validator=_check_rank)
    group: str = attrs.field(default="", validator=_check_group)

    def span(self, total: int) -> tuple[int, int]:
        """``(start, length)`` of this rank's shard of ``total`` items (heads, MLP columns).

        >>> TensorParallel(size=2, rank=0, group="0").span(3)
        Traceback (most recent call last):
        ...
        ValueError: cannot shard 3 over 2 ranks: the tensor-parallel size must divide it
        """
        if total % self.size:
            raise ValueError(f"cannot shard {total} over {self.size} ranks: the tensor-parallel size must divide it")
        length = total // self.size
        return self.rank * length, length


def all_reduce(partial: Tensor, tp: TensorParallel) -> Tensor:
    """The sum of ``partial`` over the ranks of ``tp`` (a functional collective); with one rank,
    ``partial`` itself.

    >>> x = torch.ones(2)
    >>> all_reduce(x, TensorParallel()) is x
    True
    """
    if tp.size == 1:
        return partial
    from torch.distributed import _functional_collectives  # noqa: F401 (registers the ops)

    # the ops themselves, not funcol.all_reduce: eagerly that returns an AsyncCollectiveTensor
    # (a wrapper without storage of its own) and waits when it is first used; traced, it is
    # these two nodes either way
    ops = torch.ops._c10d_functional
    return ops.wait_tensor.default(ops.all_reduce.default(partial, "sum", tp.group))


def _narrow(t: Tensor, dim: int, span: tuple[int, int]) -> Tensor:
    return t.narrow(dim, span[0], span[1]).contiguous().clone()


def shard_heads(t: Tensor, dim: int, heads: int, tp: TensorParallel) -> Tensor:
    """This rank's heads of ``t``, whose dimension ``dim`` has ``heads`` heads (a copy).

    >>> kv = torch.arange(8.0).view(1, 4, 2)          # [slots, heads, head_dim]
    >>> shard_heads(kv, 1, 4, TensorParallel(size=2, rank=1, group="0")).tolist()
    [[[4.0, 5.0], [6.0, 7.0]]]
    """
    return t if tp.size == 1 else _narrow(t, dim, tp.span(heads))


def shard_params(params: Mapping[str, Tensor], *, layers: int, heads: int, head_dim: int, mlp: int,
                 tp: TensorParallel) -> dict[str, Tensor]:
    """This rank's shard of the full weights ``params`` (see the module docstring).

    >>> import torch
    >>> full = {"layers.0.wqkv": torch.randn(4, 3 * 2 * 2), "layers.0.wo": torch.randn(2 * 2, 4),
    ...         "layers.0.w_up": torch.randn(4, 6), "layers.0.w_down": torch.randn(6, 4), "embed": torch.randn(5, 4)}
    >>> parts = [shard_params(full, layers=1, heads=2, head_dim=2, mlp=6, tp=TensorParallel(size=2, rank=r, group="0"))
    ...          for r in range(2)]
    >>> h = torch.randn(3, 4)
    >>> out = lambda p: (h @ p["layers.0.wqkv"]).view(3, 3, -1, 2).unbind(1)[2].reshape(3, -1) @ p["layers.0.wo"]
    >>> torch.allclose(out(full), out(parts[0]) + out(parts[1]), atol=1e-6)   # the shards sum to the whole
    True
    >>> [tuple(parts[0][k].shape) for k in ("layers.0.wqkv", "layers.0.w_down", "embed")]
    [(4, 6), (3, 4), (5, 4)]
    """
    if tp.size == 1:
        return dict(params)
    out = dict(params)
    heads_span, mlp_span = tp.span(heads), tp.span(mlp)
    for layer in range(layers):
        pre = f"layers.{layer}."
        wqkv = params[pre + "wqkv"]
        hidden = wqkv.shape[0]
        out[pre + "wqkv"] = _narrow(wqkv.view(hidden, 3, heads, head_dim), 2, heads_span).view(hidden, -1)
        wo = params[pre + "wo"]
        out[pre + "wo"] = _narrow(wo.view(heads, head_dim, -1), 0, heads_span).view(-1, wo.shape[-1])
        out[pre + "w_up"] = _narrow(params[pre + "w_up"], 1, mlp_span)
        out[pre + "w_down"] = _narrow(params[pre + "w_down"], 0, mlp_span)
    return out
