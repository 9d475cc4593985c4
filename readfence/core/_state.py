"""The shared-state schema, the per-step inputs, the model's pools and a consistent example.

Conventions (every backend and the model rely on them):

* ``shared`` (scheduler-owned, read-only for every stage), see :data:`SHARED_BUFFERS`:

  - ``req_to_token`` ``[max_reqs, max_ctx]`` int32: page table; row = request pool index,
    entry ``p`` = KV slot of that request's token at position ``p``.
  - ``seq_lens`` ``[max_reqs]`` int32: length of each request INCLUDING this step's new tokens.
  - ``swa_map`` ``[num_slots]`` int32: full-KV slot -> sliding-window-KV slot.
  - ``state_slots`` ``[max_reqs]`` int32: linear-attention state slot of each request.

* ``batch`` (per-step inputs): ``B`` requests with ``n = tokens_per_request(mode)`` new tokens
  each, request-major (token ``t`` belongs to request ``t // n``), ``T = B * n``:

  - ``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 (``seq_len - n + i`` for the
    ``i``-th new token of a request), ``req_pool_indices`` ``[B]`` int64,
    ``out_cache_loc`` ``[T]`` int64 (``= req_to_token[req, position]``, where the new K/V go).
  - ``IDLE`` is the empty step: ``B = T = 0``; every stage returns without reading ``shared``.

* ``pools`` (model-owned, stages may write them in place):

  - ``k_cache``/``v_cache`` ``[layers, num_slots, heads, head_dim]``: full paged KV cache.
  - ``swa_k_cache``/``swa_v_cache`` ``[layers, num_swa_slots, heads, head_dim]``:
    sliding-window KV cache, indexed by ``swa_map[full_slot]``.
  - ``state`` ``[layers, num_state_slots, heads, head_dim, head_dim]``: linear-attention
    recurrent state, indexed by ``state_slots[req]``.

Everything here builds tensors with factory functions on ``device`` and never indexes with
``[]`` (which needs a real CUDA runtime even under ``FakeTensorMode``), so
``example_step(cfg, mode, 2, device="cuda")`` works inside ``FakeTensorMode`` on a CPU build.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable

import attrs
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ._checks import check_mode, positive_int
from ._mixed_batch import mixed_batch, power_of_two
from ._modes import ForwardMode
from ._parallel import TensorParallel, shard_heads, shard_params
from .tracing import meet_shared

#: The scheduler-owned buffers, in a fixed order.
SHARED_BUFFERS: tuple[str, ...] = ("req_to_token", "seq_lens", "swa_map", "state_slots")

#: The per-step input tensors.
BATCH_FIELDS: tuple[str, ...] = ("input_ids", "positions", "req_pool_indices", "out_cache_loc")

#: The model-owned pools.
POOL_NAMES: tuple[str, ...] = ("k_cache", "v_cache", "swa_k_cache", "swa_v_cache", "state")

_TOKENS_PER_REQUEST: dict[ForwardMode, int] = {
    ForwardMode.DECODE: 1,
    ForwardMode.TARGET_VERIFY: 3,
    ForwardMode.DRAFT_EXTEND: 2,
    ForwardMode.EXTEND: 4,
    ForwardMode.IDLE: 0,
}


def tokens_per_request(mode: ForwardMode) -> int:
    """New tokens per request in one step of ``mode`` (static, so shapes are static).

    >>> [tokens_per_request(m) for m in ForwardMode]
    [1, 3, 2, 4, 0]
    """
    return _TOKENS_PER_REQUEST[check_mode(mode)]


def _positive(name: str) -> Callable[[object, attrs.Attribute, object], None]:
    def check(_inst: object, attribute: attrs.Attribute, value: object) -> None:
        positive_int(f"ModelConfig.{attribute.name}", value)

    return check


#: The seeds a config may draw from: the weights' and (plus one) the caches' generator seeds.
SEED_LIMIT = 2**63 - 2


def _seed(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= SEED_LIMIT):
        raise ValueError(f"ModelConfig.seed must be an int in 0..2**63-2, got {value!r} ({type(value).__name__})")


@attrs.frozen
class ModelConfig:
    """Sizes of the tiny decoder and of the scheduler's buffers (small: fast CPU tests).

    ``tp`` is the rank's place in tensor parallelism (:class:`TensorParallel`): the sizes are
    the whole model's, ``local_heads`` and ``local_mlp`` what one rank holds.

    >>> cfg = ModelConfig()
    >>> cfg.num_slots, cfg.num_state_slots
    (1024, 17)
    >>> ModelConfig(hidden=0)
    Traceback (most recent call last):
    ...
    ValueError: ModelConfig.hidden must be a positive int, got 0 (int)
    """

    vocab: int = attrs.field(default=64, validator=_positive("vocab"))
    hidden: int = attrs.field(default=32, validator=_positive("hidden"))
    heads: int = attrs.field(default=2, validator=_positive("heads"))
    head_dim: int = attrs.field(default=16, validator=_positive("head_dim"))
    layers: int = attrs.field(default=4, validator=_positive("layers"))
    mlp: int = attrs.field(default=64, validator=_positive("mlp"))
    max_reqs: int = attrs.field(default=16, validator=_positive("max_reqs"))
    max_ctx: int = attrs.field(default=64, validator=_positive("max_ctx"))
    seed: int = attrs.field(default=0, validator=_seed)
    tp: TensorParallel = attrs.field(factory=TensorParallel, validator=attrs.validators.instance_of(TensorParallel))

    def __attrs_post_init__(self) -> None:
        for what, total in (("heads", self.heads), ("mlp", self.mlp)):
            if total % self.tp.size:
                raise ValueError(f"ModelConfig.{what}={total} cannot be sharded over {self.tp.size} tensor-parallel "
                                 f"ranks: the size must divide it")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (rotary), got {self.head_dim}")
        if self.max_ctx < max(_TOKENS_PER_REQUEST.values()):
            raise ValueError(
                f"ModelConfig.max_ctx must hold one step of every mode "
                f"(>= {max(_TOKENS_PER_REQUEST.values())}), got {self.max_ctx}"
            )
        _check_bijections(self)

    @property
    def local_heads(self) -> int:
        """Attention heads one tensor-parallel rank holds (all of them with one rank)."""
        return self.heads // self.tp.size

    @property
    def local_mlp(self) -> int:
        """MLP columns one tensor-parallel rank holds."""
        return self.mlp // self.tp.size

    @property
    def num_slots(self) -> int:
        """Slots of the full KV cache: every request can hold ``max_ctx`` tokens."""
        return self.max_reqs * self.max_ctx

    @property
    def num_swa_slots(self) -> int:
        """Slots of the sliding-window cache (``swa_map`` is a bijection onto them)."""
        return self.num_slots

    @property
    def num_state_slots(self) -> int:
        """Linear-attention state slots: one per request plus a spare."""
        return self.max_reqs + 1


@attrs.define
class StepInputs:
    """Everything one step needs: ``shared`` (scheduler), ``batch``, ``pools`` (model), ``params``.

    >>> step = example_step(ModelConfig(), ForwardMode.DECODE, 2)
    >>> sorted(step.shared) == sorted(SHARED_BUFFERS), step.num_tokens
    (True, 2)
    """

    shared: dict[str, Tensor]
    batch: dict[str, Tensor]
    pools: dict[str, Tensor]
    params: dict[str, Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.batch["input_ids"].shape[0])

    def groups(self) -> dict[str, dict[str, Tensor]]:
        """The step's input groups by name, as stages receive them (``core.eval_step``)."""
        return {"shared": self.shared, "batch": self.batch, "pools": self.pools, "params": self.params}

    @property
    def batch_size(self) -> int:
        return int(self.batch["req_pool_indices"].shape[0])

    def clone(self) -> StepInputs:
        """A deep copy (a step writes ``pools`` in place; clone to compare two runs)."""
        return StepInputs(*({k: v.clone() for k, v in d.items()} for d in
                            (self.shared, self.batch, self.pools, self.params)))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _on(device: str | torch.device, drawn: Tensor) -> Tensor:
    """``drawn`` (made with a CPU generator) on ``device``: a CUDA factory refuses a CPU
    generator, and moving the draw gives the same values on every device."""
    if torch.device(device).type == "cpu":
        return drawn
    if isinstance(drawn, FakeTensor):  # tracing for CUDA on a CPU-only build: no values to move
        return torch.empty(drawn.shape, dtype=drawn.dtype, device=device)
    return drawn.to(device)


def _randn(*shape: int, generator: torch.Generator, device: str | torch.device) -> Tensor:
    return _on(device, torch.randn(*shape, generator=generator))


#: Seeded draws already made on the CPU, by what they were drawn for; a caller gets a copy.
_DRAWN: collections.OrderedDict[Hashable, dict[str, Tensor]] = collections.OrderedDict()
#: A lowering's draws: the weights and the seeded caches of the trace's example and of the three
#: generated states (fewer drew them again on every lowering; a 64-layer model's caches are 36 MB)
_DRAWN_LIMIT = 5
_DRAWN_LOCK = threading.Lock()


def _drawn_once(key: Hashable, device: str | torch.device, draw: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """``draw()``, made once per ``key`` on a plain CPU (no mode active: under a fake mode there
    is nothing to keep) and copied for each caller: a seeded draw is the same every time, and
    copying is cheaper than drawing (every audit, trace and check builds example steps)."""
    if torch.device(device).type != "cpu" or _get_current_dispatch_mode_stack() or _get_current_function_mode_stack():
        return draw()
    with _DRAWN_LOCK:  # (a device's stream threads may build steps too)
        kept = _DRAWN.get(key)
        if kept is None:
            kept = _DRAWN[key] = draw()
            if len(_DRAWN) > _DRAWN_LIMIT:
                _DRAWN.popitem(last=False)
        else:
            _DRAWN.move_to_end(key)
    return {k: v.clone() for k, v in kept.items()}


def init_params(cfg: ModelConfig, *, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Seeded random weights of the tiny decoder (``cfg.seed``; no downloads); under tensor
    parallelism, this rank's shard of the same full weights (``cfg.tp``).

    >>> p = init_params(ModelConfig())
    >>> tuple(p["embed"].shape), tuple(p["layers.0.wqkv"].shape)
    ((64, 32), (32, 96))
    >>> torch.equal(p["lm_head"], init_params(ModelConfig())["lm_head"])
    True
    """
    return _drawn_once(("params", cfg), device, lambda: _init_params(cfg, device))


def _init_params(cfg: ModelConfig, device: str | torch.device) -> dict[str, Tensor]:
    g = _generator(cfg.seed)
    qkv = 3 * cfg.heads * cfg.head_dim

    def w(*shape: int, fan_in: int) -> Tensor:
        return _randn(*shape, generator=g, device=device) * (fan_in**-0.5)

    params = {"embed": _randn(cfg.vocab, cfg.hidden, generator=g, device=device)}
    for layer in range(cfg.layers):
        pre = f"layers.{layer}."
        params[pre + "attn_norm"] = torch.ones(cfg.hidden, device=device)
        params[pre + "wqkv"] = w(cfg.hidden, qkv, fan_in=cfg.hidden)
        params[pre + "wo"] = w(cfg.heads * cfg.head_dim, cfg.hidden, fan_in=cfg.heads * cfg.head_dim)
        params[pre + "mlp_norm"] = torch.ones(cfg.hidden, device=device)
        params[pre + "w_up"] = w(cfg.hidden, cfg.mlp, fan_in=cfg.hidden)
        params[pre + "w_down"] = w(cfg.mlp, cfg.hidden, fan_in=cfg.mlp)
    params["final_norm"] = torch.ones(cfg.hidden, device=device)
    params["lm_head"] = w(cfg.hidden, cfg.vocab, fan_in=cfg.hidden)
    return shard_params(params, layers=cfg.layers, heads=cfg.heads, head_dim=cfg.head_dim, mlp=cfg.mlp, tp=cfg.tp)


def make_pools(
    cfg: ModelConfig, *, device: str | torch.device = "cpu", seed: int | None = None
) -> dict[str, Tensor]:
    """The model-owned caches: zeros, or seeded random history when ``seed`` is given.

    The sliding-window cache holds the same history as the full cache, moved through the
    example ``swa_map`` (see :func:`make_shared_state`). Under tensor parallelism each cache
    holds this rank's heads of the same history (``cfg.tp``).

    >>> pools = make_pools(ModelConfig())
    >>> tuple(pools["k_cache"].shape), tuple(pools["state"].shape)
    ((4, 1024, 2, 16), (4, 17, 2, 16, 16))
    """
    if seed is None:  # zeros are made faster than copied, and kept they would push out a seeded draw
        return _make_pools(cfg, device, None)
    return _drawn_once(("pools", cfg, seed), device, lambda: _make_pools(cfg, device, seed))


def _make_pools(cfg: ModelConfig, device: str | torch.device, seed: int | None) -> dict[str, Tensor]:
    kv = (cfg.layers, cfg.num_slots, cfg.heads, cfg.head_dim)
    state = (cfg.layers, cfg.num_state_slots, cfg.heads, cfg.head_dim, cfg.head_dim)
    if seed is None:
        k = torch.zeros(kv, device=device)
        v = torch.zeros(kv, device=device)
        s = torch.zeros(state, device=device)
    else:
        g = _generator(seed + 1)
        k = _randn(*kv, generator=g, device=device)
        v = _randn(*kv, generator=g, device=device)
        s = _randn(*state, generator=g, device=device) * (cfg.head_dim**-0.5)
    k, v, s = (shard_heads(t, 2, cfg.heads, cfg.tp) for t in (k, v, s))
    swa = _example_swa_map(cfg, device).long()
    swa_k = torch.zeros(cfg.layers, cfg.num_swa_slots, cfg.local_heads, cfg.head_dim, device=device)
    swa_v = torch.zeros_like(swa_k)
    swa_k.index_copy_(1, swa, k)
    swa_v.index_copy_(1, swa, v)
    return {"k_cache": k, "v_cache": v, "swa_k_cache": swa_k, "swa_v_cache": swa_v, "state": s}


def _example_slot(cfg: ModelConfig, req: Tensor, pos: Tensor) -> Tensor:
    # A bijection (req, pos) -> slot that is not the identity: 5 is odd, num_slots a power of
    # two in the default config; otherwise still distinct because gcd is checked below.
    return ((req * cfg.max_ctx + pos) * _SLOT_STRIDE + 1) % cfg.num_slots


_SLOT_STRIDE = 5


def _example_swa_map(cfg: ModelConfig, device: str | torch.device) -> Tensor:
    full = torch.arange(cfg.num_slots, device=device, dtype=torch.int64)
    return ((full * 3 + 7) % cfg.num_swa_slots).to(torch.int32)


def make_shared_state(cfg: ModelConfig, *, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The scheduler's buffers with every request row allocated to distinct KV slots.

    ``seq_lens`` is all zero (no request is running); :func:`example_step` fills it in.

    >>> s = make_shared_state(ModelConfig())
    >>> s["req_to_token"].unique().numel() == s["req_to_token"].numel()
    True
    """
    _check_bijections(cfg)
    req = torch.arange(cfg.max_reqs, device=device, dtype=torch.int64).unsqueeze(1)
    pos = torch.arange(cfg.max_ctx, device=device, dtype=torch.int64).unsqueeze(0)
    req_to_token = _example_slot(cfg, req, pos).to(torch.int32)
    seq_lens = torch.zeros(cfg.max_reqs, device=device, dtype=torch.int32)
    slots = torch.arange(cfg.max_reqs, device=device, dtype=torch.int64)
    state_slots = ((slots * 7 + 2) % cfg.num_state_slots).to(torch.int32)
    shared = {
        "req_to_token": req_to_token,
        "seq_lens": seq_lens,
        "swa_map": _example_swa_map(cfg, device),
        "state_slots": state_slots,
    }
    meet_shared(shared)  # a backend that keeps one of these, run on another state, is told so
    return shared


def model_config(cfg: object) -> ModelConfig:
    """``cfg``, or the default model where it is ``None``; anything else than a :class:`ModelConfig`
    is refused naming it (every entry point that takes ``cfg=`` asks here).

    >>> model_config(None) == ModelConfig()
    True
    >>> model_config({"layers": 2})
    Traceback (most recent call last):
    ...
    TypeError: cfg must be a readfence.core.ModelConfig (e.g. ModelConfig(layers=2)), got {'layers': 2} (dict)
    """
    if cfg is None:
        return ModelConfig()
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a readfence.core.ModelConfig (e.g. ModelConfig(layers=2)), got {cfg!r} "
                        f"({type(cfg).__name__})")
    return cfg


def shared_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each shared buffer's shape and dtype in a state of ``cfg`` (what :func:`make_shared_state`
    makes, without making it).

    >>> made = make_shared_state(ModelConfig(max_reqs=4, max_ctx=8))
    >>> {k: (tuple(t.shape), t.dtype) for k, t in made.items()} == shared_shapes(ModelConfig(max_reqs=4, max_ctx=8))
    True
    """
    return {"req_to_token": ((cfg.max_reqs, cfg.max_ctx), torch.int32), "seq_lens": ((cfg.max_reqs,), torch.int32),
            "swa_map": ((cfg.num_slots,), torch.int32), "state_slots": ((cfg.max_reqs,), torch.int32)}


def buffer_ranges(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The values each shared buffer may hold, ``[lo, hi)``: a KV slot, a length, a state slot.

    Any value in range is safe to read (an index stays within its pool), so a check that
    overwrites a buffer with other in-range values gets wrong results, never a crash.

    >>> buffer_ranges(ModelConfig(max_reqs=4, max_ctx=8))["seq_lens"]
    (1, 9)
    """
    return {
        "req_to_token": (0, cfg.num_slots),
        "seq_lens": (1, cfg.max_ctx + 1),
        "swa_map": (0, cfg.num_swa_slots),
        "state_slots": (0, cfg.num_state_slots),
    }


def _check_bijections(cfg: ModelConfig) -> None:
    import math

    for stride, n, what in ((_SLOT_STRIDE, cfg.num_slots, "num_slots"),
                            (3, cfg.num_swa_slots, "num_swa_slots"),
                            (7, cfg.num_state_slots, "num_state_slots")):
        if math.gcd(stride, n) != 1:
            raise ValueError(f"ModelConfig(max_reqs={cfg.max_reqs}, max_ctx={cfg.max_ctx}): its {what} ({n}) is a "
                             f"multiple of {stride}, the step by which the example states lay out their slots; "
                             f"choose another max_reqs or max_ctx")


def example_batch_layout(
    cfg: ModelConfig, mode: ForwardMode, batch_size: int, *, seed: int = 0
) -> tuple[list[int], list[int]]:
    """``(request pool indices, prefix lengths)`` of the example step, as python ints.

    >>> example_batch_layout(ModelConfig(), ForwardMode.DECODE, 3)
    ([0, 3, 6], [3, 10, 17])
    """
    mode = check_mode(mode)
    if mode is ForwardMode.IDLE:
        return [], []
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    n = tokens_per_request(mode)
    span = cfg.max_ctx - n + 1
    reqs = [(b * 3 + seed) % cfg.max_reqs for b in range(batch_size)]
    if len(set(reqs)) != batch_size:  # gcd(3, max_reqs) > 1: fall back to consecutive rows
        reqs = [(b + seed) % cfg.max_reqs for b in range(batch_size)]
    prefix = [(b * 7 + 3 + seed) % span for b in range(batch_size)]
    return reqs, prefix


def example_step(
    cfg: ModelConfig,
    mode: ForwardMode,
    batch_size: int,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    parts: tuple[str, ...] | None = None,
) -> StepInputs:
    """A consistent step: rows allocated, ``seq_lens`` set, history in the caches.

    ``IDLE`` ignores ``batch_size`` and gives the empty batch. ``parts`` names the input groups
    to build, as :func:`varied_step`'s (default: all; a caller that takes only the batch's shapes
    need not copy a deep model's caches): the others are left empty.

    >>> step = example_step(ModelConfig(), ForwardMode.TARGET_VERIFY, 2)
    >>> step.batch["positions"].tolist(), step.shared["seq_lens"][[0, 3]].tolist()
    ([3, 4, 5, 10, 11, 12], [6, 13])
    >>> example_step(ModelConfig(), ForwardMode.IDLE, 4).num_tokens
    0
    >>> example_step(ModelConfig(), ForwardMode.DECODE, 2, parts=("shared", "batch")).pools
    {}
    """
    mode = check_mode(mode)
    reqs, prefix = example_batch_layout(cfg, mode, batch_size, seed=seed)
    return _step_of(cfg, mode, reqs, prefix, make_shared_state(cfg, device=device), seed=seed, device=device,
                    parts=parts)


#: What the generated states are (``varied_step``'s seeds 1, 2, 3, in that order): the layouts of
#: the batches engines run, whose values a step's data-dependent values and paths depend on.
TRAFFIC_STATES: tuple[str, ...] = ("first_tokens", "longest_context", "mixed_batch")


def varied_step(
    cfg: ModelConfig,
    mode: ForwardMode,
    batch_size: int,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    parts: tuple[str, ...] | None = None,
) -> StepInputs:
    """A consistent step with :func:`example_step`'s shapes and other values everywhere: a state
    of the kind engines' traffic has, which a replayed capture is checked on
    (``core.validate_replay``) and a step's Python is observed on (``core.internal.Ledger``).

    * seed 1, ``first_tokens``: every request at its first tokens, in consecutive rows from 0, the
      other rows empty (as a loop starts);
    * seed 2, ``longest_context``: every request at the longest context, rows from the top down;
    * seed 3, ``mixed_batch``: a mixed batch, as a prefill batch always is and a decode batch is
      once a request finished and its row was reused: requests at their first tokens and others
      into their context side by side (the deepest about the middle of the context: its longest
      length is neither the first tokens' nor the longest context's, and a power of two where the
      example's is not, and the other way round), in random rows, with stale rows of
      finished requests; with 3 or more requests its last two are padding (one row, twice, at its
      first tokens, token id 0), as a graph captured for a larger batch runs a smaller one;
    * any other seed: a random one of the three, with random rows and depths.

    From seed 2 on the page table, sliding-window map and state-slot map are permuted too
    (bijections drawn from the seed), and every seed draws its own batch and caches. A data-
    dependent value of a step (a count of new requests, the longest length, whether any row is
    stale) is, wherever traffic can make it differ from the trace's example, different on one of
    seeds 1 to 3 for most steps' code: the docs (``What the analysis sees``) say what is left.
    ``parts`` names the input groups to build (default: all; an out-of-graph stage takes
    ``shared`` and ``batch`` only): the others are left empty.

    >>> young, old, mixed = (varied_step(ModelConfig(), ForwardMode.DECODE, 4, seed=s) for s in (1, 2, 3))
    >>> young.batch["req_pool_indices"].tolist(), young.shared["seq_lens"][:4].tolist()
    ([0, 1, 2, 3], [1, 1, 1, 1])
    >>> old.shared["seq_lens"][old.batch["req_pool_indices"]].tolist()
    [64, 64, 64, 64]
    >>> lens = mixed.shared["seq_lens"][mixed.batch["req_pool_indices"]].tolist()
    >>> 1 in lens[:2] and max(lens[:2]) > 1, lens[2:], len(set(mixed.batch["req_pool_indices"].tolist()))
    (True, [1, 1], 3)
    >>> bool((old.shared["req_to_token"] != example_step(ModelConfig(), ForwardMode.DECODE, 3).shared["req_to_token"]).any())
    True
    """
    mode = check_mode(mode)
    if mode is ForwardMode.IDLE:
        return example_step(cfg, mode, batch_size, seed=seed, device=device, parts=parts)
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    span = cfg.max_ctx - tokens_per_request(mode) + 1
    g = _generator(7919 + seed)
    kind = TRAFFIC_STATES[seed - 1] if 1 <= seed <= len(TRAFFIC_STATES) else \
        TRAFFIC_STATES[int(torch.randint(0, len(TRAFFIC_STATES), (1,), generator=g))]
    random = not 1 <= seed <= len(TRAFFIC_STATES)
    rows = torch.randperm(cfg.max_reqs, generator=g).tolist()
    pad = 0
    if kind == "first_tokens":
        reqs, prefix = (rows[:batch_size], [0] * batch_size) if random else (list(range(batch_size)), [0] * batch_size)
    elif kind == "longest_context":
        top = list(range(cfg.max_reqs - 1, cfg.max_reqs - 1 - batch_size, -1))
        reqs, prefix = (rows[:batch_size] if random else top), [span - 1] * batch_size
    else:
        _, example = example_batch_layout(cfg, mode, batch_size)
        longest = max(example) + tokens_per_request(mode)
        reqs, prefix, pad = mixed_batch(rows, batch_size, span, tokens_per_request(mode), g,
                                        longest_power_of_two=not power_of_two(longest))
    shared = make_shared_state(cfg, device=device)
    slots = None
    if seed != 1:  # other bijections: a slot, a window slot, a state slot of another layout
        for name, n in (("req_to_token", cfg.num_slots), ("swa_map", cfg.num_swa_slots),
                        ("state_slots", cfg.num_state_slots)):
            perm = _on(device, torch.randperm(n, generator=g))
            shared[name] = perm[shared[name].long()].to(torch.int32)
            slots = perm if name == "req_to_token" else slots
    if kind == "mixed_batch":  # rows of finished requests keep their lengths (an engine does not clear them)
        stale = torch.tensor([r for r in range(cfg.max_reqs) if r not in reqs], dtype=torch.int64)
        lens = torch.randint(1, cfg.max_ctx + 1, (len(stale),), generator=g, dtype=torch.int32)
        shared["seq_lens"].index_copy_(0, _on(device, stale), _on(device, lens))
    step = _step_of(cfg, mode, reqs, prefix, shared, seed=seed, device=device, slots=slots, parts=parts)
    if pad:  # padding rows carry the pad id, as engines fill them
        step.batch["input_ids"][(batch_size - pad) * tokens_per_request(mode):] = 0
    return step


def _step_of(cfg: ModelConfig, mode: ForwardMode, reqs: list[int], prefix: list[int], shared: dict[str, Tensor], *,
             seed: int, device: str | torch.device, slots: Tensor | None = None,
             parts: tuple[str, ...] | None = None) -> StepInputs:
    # the step of requests ``reqs`` with ``prefix`` tokens each over ``shared`` (rows allocated;
    # its page table the example's, its slots permuted by ``slots`` when given); pools and
    # parameters only where ``parts`` (None: all) names either
    owned = parts is None or "pools" in parts or "params" in parts
    n = tokens_per_request(mode)
    i64 = torch.int64
    req_t = torch.tensor(reqs, dtype=i64, device=device)
    prefix_t = torch.tensor(prefix, dtype=i64, device=device)
    step_t = torch.arange(n, dtype=i64, device=device)
    positions = (prefix_t.unsqueeze(1) + step_t.unsqueeze(0)).reshape(-1)
    req_per_token = req_t.repeat_interleave(n)
    shared["seq_lens"].index_copy_(0, req_t, (prefix_t + n).to(torch.int32))
    g = _generator(seed + 2)
    loc = _example_slot(cfg, req_per_token, positions)
    batch = {
        "input_ids": _on(device, torch.randint(0, cfg.vocab, (len(reqs) * n,), generator=g, dtype=i64)),
        "positions": positions,
        "req_pool_indices": req_t,
        "out_cache_loc": loc if slots is None else slots[loc],
    }
    return StepInputs(
        shared=shared,
        batch=batch,
        pools=make_pools(cfg, device=device, seed=seed) if owned else {},
        params=init_params(cfg, device=device) if owned else {},
    )
