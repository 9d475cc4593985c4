"""The tiny decoder as pure functions over explicit parameters, and the serial eager step.

The model body never reads a shared buffer: it hands ``shared`` to ``backend.attend`` and
nothing else, so the reads of a step are exactly its backend's. Everything is traceable by
``make_fx(functionalize(...))``: static shapes, no ``.item()``, no ``[]`` indexing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ._invariant import matmul_rows
from ._modes import ForwardMode
from ._parallel import all_reduce
from ._protocol import BackendLike, replayed
from ._scan import LayerScan, run_scan
from ._state import ModelConfig, StepInputs, check_mode, example_step  # noqa: F401 (doctests)
from ._step import BODY, EAGER, Eager, StageCall, StepFunctions, check_stage_output, eval_step
from .tracing import Segment

_EPS = 1e-6


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """Root-mean-square normalisation over the last dimension.

    >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2)).pow(2).mean().round(decimals=4)
    tensor(1.)
    """
    return x * x.pow(2).mean(-1, keepdim=True).add(_EPS).rsqrt() * weight


def rotary_tables(positions: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` ``[T, 1, dim // 2]`` of the rotary embedding at integer ``positions`` ``[T]``:
    the same for every layer and head, so a step computes them once.

    >>> cos, sin = rotary_tables(torch.zeros(3, dtype=torch.long), 4)
    >>> cos.shape, bool((cos == 1).all() and (sin == 0).all())
    (torch.Size([3, 1, 2]), True)
    """
    half = dim // 2
    freq = 10000.0 ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angle = positions.to(torch.float32).unsqueeze(-1) * freq.unsqueeze(0)  # [T, half]
    return angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``[T, H, D]`` rotated by the tables of :func:`rotary_tables`.

    >>> x = torch.randn(3, 2, 4)
    >>> torch.equal(apply_rotary(x, *rotary_tables(torch.arange(3), 4)), rotary(x, torch.arange(3)))
    True
    """
    half = x.shape[-1] // 2
    x1, x2 = x.narrow(-1, 0, half), x.narrow(-1, half, half)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotary(x: Tensor, positions: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` ``[T, H, D]`` at integer ``positions`` ``[T]``.

    >>> x = torch.randn(3, 2, 4)
    >>> torch.allclose(rotary(x, torch.zeros(3, dtype=torch.long)), x)
    True
    """
    return apply_rotary(x, *rotary_tables(positions, x.shape[-1]))


def decoder_scan(cfg: ModelConfig, backend: BackendLike, mode: ForwardMode) -> LayerScan:
    """The tiny decoder's body as a :class:`~readfence.core._scan.LayerScan`: embedding, then per
    layer norm, QKV, rotary, ``backend.attend``, output projection and MLP, then the head.

    Under tensor parallelism (``cfg.tp``) the step is one rank's: attention runs on its heads,
    the MLP on its columns, and the partial outputs of both are all-reduced over the ranks.

    >>> from readfence.backends import paged
    >>> decoder_scan(ModelConfig(layers=3), paged(), ForwardMode.DECODE).count
    3
    """
    mode = check_mode(mode)
    heads, dim = cfg.local_heads, cfg.head_dim

    # the carry: the residual stream and the step's rotary tables (one pair for every layer)
    Carry = tuple[Tensor, tuple[Tensor, Tensor]]

    def pre(inputs: Mapping[str, Any]) -> Carry:
        batch = inputs["batch"]
        return F.embedding(batch["input_ids"], inputs["params"]["embed"]), rotary_tables(batch["positions"], dim)

    def attention_in(x: Tensor, cos: Tensor, sin: Tensor, norm: Tensor, wqkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = matmul_rows(rms_norm(x, norm), wqkv).view(x.shape[0], 3, heads, dim).unbind(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attention_out(x: Tensor, o: Tensor, wo: Tensor, norm: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        x = x + all_reduce(matmul_rows(o.reshape(x.shape[0], heads * dim), wo), cfg.tp)
        h = rms_norm(x, norm)
        return x + all_reduce(matmul_rows(F.silu(matmul_rows(h, w_up)), w_down), cfg.tp)

    # the model's own pieces around ``attend``: recorded once per shape, not in every layer
    # of every backend's trace (``_segment``)
    qkv = Segment("attention_in", attention_in, key=(heads, dim))
    out = Segment("attention_out", attention_out, key=(heads, dim, cfg.tp))

    def layer(index: int, carry: Carry, inputs: Mapping[str, Any]) -> Carry:
        (x, rope), params, pre = carry, inputs["params"], f"layers.{index}."
        q, k, v = qkv(x, *rope, params[pre + "attn_norm"], params[pre + "wqkv"])
        args = (mode, index, q, k, v, inputs["pools"], inputs["shared"], inputs["batch"], inputs["meta"])
        # a wrong return is named here (backend, layer, the line that returned it), not by a reshape deep in the model
        o = check_stage_output(BODY, backend.attend(*args), backend=backend.name, like=q, layer=index,
                               fn=lambda: backend.attend(*args))
        return out(x, o, params[pre + "wo"], params[pre + "mlp_norm"], params[pre + "w_up"], params[pre + "w_down"]), rope

    def post(carry: Carry, inputs: Mapping[str, Any]) -> Tensor:
        return matmul_rows(rms_norm(carry[0], inputs["params"]["final_norm"]), inputs["params"]["lm_head"])

    return LayerScan(cfg.layers, pre, layer, post)


def forward(
    cfg: ModelConfig,
    params: Mapping[str, Tensor],
    pools: dict[str, Tensor],
    shared: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    meta: Mapping[str, Tensor],
    backend: BackendLike,
    mode: ForwardMode,
) -> Tensor:
    """Logits ``[T, vocab]`` of one step; attention is ``backend.attend`` in every layer (the
    fold of :func:`decoder_scan`).

    >>> from readfence.backends import paged
    >>> cfg = ModelConfig()
    >>> step = example_step(cfg, ForwardMode.DECODE, 2)
    >>> meta = paged().prepare_in_graph(ForwardMode.DECODE, step.shared, step.batch, {})
    >>> forward(cfg, step.params, step.pools, step.shared, step.batch, meta, paged(),
    ...         ForwardMode.DECODE).shape
    torch.Size([2, 64])
    """
    inputs = {"shared": shared, "batch": batch, "pools": pools, "params": params, "meta": meta}
    return run_scan(decoder_scan(cfg, backend, mode), inputs)


def step_functions(backend: BackendLike, mode: ForwardMode, cfg: ModelConfig) -> StepFunctions:
    """``backend``'s step in ``mode`` on the tiny model: its two prepare stages, and the body
    :func:`forward` calling its ``attend`` in every layer (what :func:`~readfence.core.eval_step`
    runs).

    >>> from readfence.backends import paged
    >>> cfg = ModelConfig()
    >>> step = example_step(cfg, ForwardMode.DECODE, 2)
    >>> fns = step_functions(paged(), ForwardMode.DECODE, cfg)
    >>> eval_step(EAGER, fns, step.groups()).shape
    torch.Size([2, 64])
    """

    scan = decoder_scan(cfg, backend, mode)

    def body(shared: Mapping[str, Tensor], batch: Mapping[str, Tensor], pools: dict[str, Tensor],
             params: Mapping[str, Tensor], meta: Mapping[str, Tensor]) -> Tensor:
        return run_scan(scan, {"shared": shared, "batch": batch, "pools": pools, "params": params, "meta": meta})

    return StepFunctions(
        prepare_out_graph=lambda shared, batch: backend.prepare_out_graph(mode, shared, batch),
        prepare_in_graph=lambda shared, batch, meta: backend.prepare_in_graph(mode, shared, batch, meta),
        body=body,
        backend=backend.name,
        replayed=replayed(backend, mode),
    )


class _Prepared(Eager):
    """Runs the prepare stages; the body's call returns the metadata it would receive."""

    def call(self, call: StageCall) -> Any:
        return dict(call.kwargs["meta"]) if call.stage is BODY else call()


def prepare(backend: BackendLike, mode: ForwardMode, shared: Mapping[str, Tensor],
            batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The metadata ``attend`` receives: the step's prepare stages, run as :func:`eval_step`
    runs them (``prepare_out_graph``'s outputs copied into the graph, ``prepare_in_graph``'s
    merged over them).

    >>> from readfence.backends import paged
    >>> step = example_step(ModelConfig(), ForwardMode.DECODE, 2)
    >>> sorted(prepare(paged(), ForwardMode.DECODE, step.shared, step.batch))
    ['kv_indices', 'kv_lens']
    """
    fns = step_functions(backend, mode, ModelConfig())  # the body is never run
    return cast(dict[str, Tensor], eval_step(_Prepared(), fns, {"shared": shared, "batch": batch}))


def run_step(backend: BackendLike, mode: ForwardMode, cfg: ModelConfig, step: StepInputs) -> Tensor:
    """The serial eager reference: :func:`~readfence.core.eval_step` run as written. Writes
    ``step.pools``.

    >>> from readfence.backends import paged
    >>> cfg = ModelConfig()
    >>> run_step(paged(), ForwardMode.TARGET_VERIFY, cfg,
    ...          example_step(cfg, ForwardMode.TARGET_VERIFY, 2)).shape
    torch.Size([6, 64])
    """
    mode = check_mode(mode)
    return cast(Tensor, eval_step(EAGER, step_functions(backend, mode, cfg), step.groups()))
