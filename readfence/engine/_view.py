"""readfence's step state as an engine sees it: a model runner, its pools, a forward batch.

An engine backend is built from a *model runner* and keeps references to its pools from
construction (``self.req_to_token = runner.req_to_token_pool.req_to_token``); each call gets a
*forward batch*. :class:`ModelRunnerView` and :class:`ForwardBatch` present readfence's shared
buffers, pools and batch in that shape (SGLang's names):

=========================================  =====================================================
``runner.req_to_token_pool.req_to_token``  the page table ``[max_reqs, max_ctx]`` int32 (shared)
``runner.req_to_token_pool.seq_lens``      lengths per request row ``[max_reqs]`` int32 (shared)
``runner.req_to_token_pool.state_slots``   linear-attention state slot per row (shared)
``runner.token_to_kv_pool``                the KV cache: ``get_key_buffer(layer)``,
                                           ``set_kv_buffer(layer, loc, k, v)``, the sliding
                                           window's ``set_swa_kv_buffer``...;
                                           ``.full_to_swa_index_mapping`` (shared ``swa_map``)
``runner.state_pool``                      linear-attention states: ``get_state(layer)``
``runner.model_config``, ``runner.device``  sizes (heads, head_dim, layers, context), device
``runner.server_args``                     what :func:`~readfence.engine.adapt` was given
=========================================  =====================================================

Where each shared buffer appears is a *layout*: ``{buffer: dotted path}`` (the table's defaults,
:data:`DEFAULT_LAYOUT`); name your engine's attributes instead, e.g. ``{"state_slots":
"req_to_token_pool.req_index_to_mamba_index_mapping"}``, and ``None`` for a buffer the engine
does not have (SGLang's request pool holds only the page table: its ``seq_lens`` is the batch's
own tensor, which its graph runner copies into a static buffer before the replay; readfence's
runner copies it so too, out of the graph, and no row of the audit is about it). The forward
batch carries the same pools, over the tensors of the call (so a read through it is traced as a
read of its argument).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.core.internal import did_you_mean, not_user_code, tokens_per_request

from ._contract import ContractError

#: Where each shared buffer appears on the runner (and on the forward batch) by default.
DEFAULT_LAYOUT: dict[str, str] = {
    "req_to_token": "req_to_token_pool.req_to_token",
    "seq_lens": "req_to_token_pool.seq_lens",
    "swa_map": "token_to_kv_pool.full_to_swa_index_mapping",
    "state_slots": "req_to_token_pool.state_slots",
}

#: Attributes of the runner and the forward batch that a layout path may not replace.
_RESERVED = frozenset({
    "device", "model_config", "cfg", "server_args", "max_batch_size", "forward_mode", "batch_size",
    "num_tokens", "tokens_per_request", "input_ids", "positions", "req_pool_indices", "out_cache_loc",
    "seq_lens", "seq_lens_cpu", "seq_lens_sum", "spec_info", "narrow", "split",
})
_POOLS = ("req_to_token_pool", "token_to_kv_pool", "state_pool")


def check_layout(buffers: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """The layout with ``buffers`` overriding :data:`DEFAULT_LAYOUT`; a ``ValueError`` names an
    unknown buffer (with the closest name), a path that is not dotted identifiers, a path that
    would replace a fixed attribute, or two buffers at one path.

    >>> check_layout({"state_slots": "req_to_token_pool.mamba_index"})["state_slots"]
    'req_to_token_pool.mamba_index'
    >>> check_layout({"req_to_tokn": "page_table"})  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: buffers names unknown buffer 'req_to_tokn'; shared buffers are req_to_token, seq_lens,
    swa_map, state_slots; did you mean 'req_to_token'?
    """
    if buffers is None:
        out: dict[str, str | None] = dict(DEFAULT_LAYOUT)
        return out
    if not isinstance(buffers, Mapping):
        raise TypeError(f"buffers must be a mapping {{shared buffer: dotted path}}, got {buffers!r} "
                        f"({type(buffers).__name__})")
    layout: dict[str, str | None] = dict(DEFAULT_LAYOUT)
    for buffer, path in buffers.items():
        if buffer not in SHARED_BUFFERS:
            raise ValueError(f"buffers names unknown buffer {buffer!r}; shared buffers are "
                             f"{', '.join(SHARED_BUFFERS)}{did_you_mean(buffer, SHARED_BUFFERS)}")
        if path is None:  # the engine does not have this buffer
            layout[buffer] = None
            continue
        parts = path.split(".") if isinstance(path, str) else []
        if not parts or not all(p.isidentifier() for p in parts):
            raise ValueError(f"buffers[{buffer!r}] must be a dotted attribute path such as "
                             f"'req_to_token_pool.req_to_token', got {path!r}")
        if parts[0] in _RESERVED or (len(parts) == 1 and parts[0] in _POOLS):
            raise ValueError(f"buffers[{buffer!r}] = {path!r} would replace the runner's {parts[0]!r}; "
                             f"put the buffer under a pool (e.g. 'req_to_token_pool.{parts[-1]}') or a new name")
        layout[buffer] = path
    if layout["req_to_token"] is None:
        raise ValueError("buffers['req_to_token'] cannot be None: every engine backend reads a page table")
    seen: dict[str, str] = {}
    for buffer, path in layout.items():
        if path is None:
            continue
        if path in seen:
            raise ValueError(f"buffers {seen[path]!r} and {buffer!r} are both at {path!r}; give each its own path")
        seen[path] = buffer
    return layout


def absent(layout: Mapping[str, str | None]) -> tuple[str, ...]:
    """The shared buffers a layout says the engine does not have.

    >>> absent(check_layout({"seq_lens": None}))
    ('seq_lens',)
    """
    return tuple(b for b in SHARED_BUFFERS if layout.get(b, "") is None)


def _place(root: Any, path: str, tensor: Tensor) -> None:
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        nxt = getattr(node, name, None)
        if nxt is None:
            nxt = types.SimpleNamespace()
            setattr(node, name, nxt)
        node = nxt
    setattr(node, leaf, tensor)


class ReqToTokenPool:
    """The request-to-token pool: the page table (``req_to_token``), its row count and context."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.size = cfg.max_reqs
        self.max_context_len = cfg.max_ctx


class TokenToKVPool:
    """The KV cache of every layer (full, and the sliding window's through ``swa_map``).

    ``pools`` are readfence's model-owned caches (``k_cache`` ``[layers, slots, heads, dim]``...).
    """

    def __init__(self, cfg: ModelConfig, pools: Mapping[str, Tensor]) -> None:
        self.size = cfg.num_slots
        self.swa_size = cfg.num_swa_slots
        self.head_num = cfg.heads
        self.head_dim = self.v_head_dim = cfg.head_dim
        self.layer_num = cfg.layers
        self.start_layer = 0  # the first layer this pool holds (a pipeline stage's; here every layer)
        self.page_size = 1
        self._pools = pools

    @property
    def k_buffer(self) -> Tensor:
        """Keys of every layer ``[layers, slots, heads, dim]`` (``k_buffer[layer]`` is one layer's)."""
        return self._pools["k_cache"]

    @property
    def v_buffer(self) -> Tensor:
        return self._pools["v_cache"]

    @property
    def swa_k_buffer(self) -> Tensor:
        """The sliding window's keys ``[layers, swa slots, heads, dim]``."""
        return self._pools["swa_k_cache"]

    @property
    def swa_v_buffer(self) -> Tensor:
        return self._pools["swa_v_cache"]

    @property
    def dtype(self) -> torch.dtype:
        return self._pools["k_cache"].dtype

    def get_v_head_dim(self) -> int:
        return self.v_head_dim

    def get_key_buffer(self, layer_id: int) -> Tensor:
        return self._pools["k_cache"].select(0, layer_id)

    def get_value_buffer(self, layer_id: int) -> Tensor:
        return self._pools["v_cache"].select(0, layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer: Any, loc: Any, cache_k: Tensor, cache_v: Tensor, *args: Any, **kwargs: Any) -> None:
        """Write ``cache_k``/``cache_v`` (``[T, heads, dim]`` or ``[T, heads * dim]``) of ``layer``
        (a layer id, or a layer object with ``layer_id``) at slots ``loc`` (a tensor, or a write
        location with ``loc`` and an optional ``full_loc``, as SGLang's ``KVWriteLoc``). Scales and
        other engine arguments after them are accepted and have no effect (the pool is not quantized).

        >>> from readfence.core import ModelConfig
        >>> from readfence.graph import make_state
        >>> cfg = ModelConfig(layers=1, max_reqs=2, max_ctx=8)
        >>> pool = TokenToKVPool(cfg, make_state(cfg)["pools"])
        >>> k = torch.ones(1, cfg.heads * cfg.head_dim)
        >>> pool.set_kv_buffer(0, torch.tensor([3]), k, k); float(pool.get_key_buffer(0)[3].sum()) == k.numel()
        True
        """
        layer_id = _layer_id(layer)
        slots = _slots(loc, "full_loc")
        self.get_key_buffer(layer_id).index_copy_(0, slots, cache_k.reshape(slots.shape[0], self.head_num, -1))
        self.get_value_buffer(layer_id).index_copy_(0, slots, cache_v.reshape(slots.shape[0], self.head_num, -1))

    def get_swa_key_buffer(self, layer_id: int) -> Tensor:
        return self._pools["swa_k_cache"].select(0, layer_id)

    def get_swa_value_buffer(self, layer_id: int) -> Tensor:
        return self._pools["swa_v_cache"].select(0, layer_id)

    def set_swa_kv_buffer(self, layer: Any, swa_loc: Any, cache_k: Tensor, cache_v: Tensor, *args: Any,
                          **kwargs: Any) -> None:
        """Write the sliding-window cache at its own slots ``swa_loc`` (``swa_map[full slot]``; a
        tensor or a write location with ``swa_loc``)."""
        layer_id = _layer_id(layer)
        slots = _slots(swa_loc, "swa_loc")
        self.get_swa_key_buffer(layer_id).index_copy_(0, slots, cache_k.reshape(slots.shape[0], self.head_num, -1))
        self.get_swa_value_buffer(layer_id).index_copy_(0, slots, cache_v.reshape(slots.shape[0], self.head_num, -1))


def _layer_id(layer: Any) -> int:
    layer_id = layer if isinstance(layer, int) else getattr(layer, "layer_id", None)
    if not isinstance(layer_id, int):
        raise TypeError(f"set_kv_buffer takes a layer id or a layer with an int layer_id, got {layer!r} "
                        f"({type(layer).__name__})")
    return layer_id


def _slots(loc: Any, preferred: str) -> Tensor:
    if isinstance(loc, Tensor):
        return loc
    for name in (preferred, "loc"):
        value = getattr(loc, name, None)
        if isinstance(value, Tensor):
            return value
    raise TypeError(f"set_kv_buffer takes the slots as a tensor or a write location with a tensor 'loc', got "
                    f"{loc!r} ({type(loc).__name__})")


class StatePool:
    """Linear-attention recurrent states ``[slots, heads, dim, dim]`` per layer."""

    def __init__(self, cfg: ModelConfig, pools: Mapping[str, Tensor]) -> None:
        self.size = cfg.num_state_slots
        self._pools = pools

    def get_state(self, layer_id: int) -> Tensor:
        return self._pools["state"].select(0, layer_id)


class _Pools:
    """The three pool objects over one set of shared buffers and pools, laid out."""

    def __init__(self, cfg: ModelConfig, shared: Mapping[str, Tensor], pools: Mapping[str, Tensor],
                 layout: Mapping[str, str | None]) -> None:
        self.req_to_token_pool = ReqToTokenPool(cfg)
        self.token_to_kv_pool = TokenToKVPool(cfg, pools)
        self.state_pool = StatePool(cfg, pools)
        for buffer, path in layout.items():
            if path is not None:
                _place(self, path, shared[buffer])


class ModelConfigView:
    """The model's sizes under an engine's names (``num_attention_heads``, ``head_dim``...)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.num_attention_heads = cfg.heads
        self.num_key_value_heads = cfg.heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden
        self.num_hidden_layers = cfg.layers
        self.context_len = cfg.max_ctx
        self.vocab_size = cfg.vocab


class ModelRunnerView(_Pools):
    """What an engine backend's factory receives: readfence's live state as a model runner.

    ``factory(runner) -> backend object`` may keep any of it (the pools hold the very tensors
    the step reads; readfence matches them by memory). See the module docstring for the names.
    """

    def __init__(self, cfg: ModelConfig, state: Mapping[str, Mapping[str, Tensor]],
                 layout: Mapping[str, str | None], server_args: Mapping[str, object] | None = None) -> None:
        super().__init__(cfg, state["shared"], state["pools"], layout)
        self.cfg = cfg
        self.model_config = ModelConfigView(cfg)
        self.device = next(iter(state["shared"].values())).device
        self.max_batch_size = cfg.max_reqs
        self.dtype = self.kv_cache_dtype = state["pools"]["k_cache"].dtype
        self.kv_index_translator = None  # SGLang's unified-pool translator: readfence's pools are not unified
        self.server_args = types.SimpleNamespace(**dict(server_args or {}))
        # a one-GPU, full-attention, one-token-per-slot runner of a target model
        self.sliding_window_size: int | None = None
        self.page_size = 1
        self.gpu_id = 0
        self.is_draft_worker = False
        self.token_to_kv_pool_allocator = None  # slots are the batch's out_cache_loc: nothing allocates here


class AttentionLayer:
    """The ``layer`` argument of ``forward``: SGLang's ``RadixAttention``'s fields, for a decoder
    layer with no quantization (``attn_type`` is the string value of SGLang's
    ``AttentionType.DECODER``; an engine profile can hand the engine's own layer objects instead).

    >>> layer = AttentionLayer(ModelConfig(), 1)
    >>> layer.layer_id, layer.is_cross_attention, layer.attn_type, layer.k_scale
    (1, False, 'decoder', None)
    """

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        self.layer_id = layer_id
        self.tp_q_head_num = self.tp_k_head_num = self.tp_v_head_num = cfg.heads
        self.head_dim = self.qk_head_dim = self.v_head_dim = cfg.head_dim
        self.scaling = cfg.head_dim ** -0.5
        self.sliding_window_size = -1
        self.logit_cap = 0.0
        self.is_cross_attention = False
        self.attn_type = "decoder"
        self.use_irope = False
        self.use_prefill_attention_wrapper = False
        self.k_scale = self.v_scale = None
        self.k_scale_float = self.v_scale_float = self.q_scale_float = None
        self.quant_method = None
        self.pos_encoding_mode = "NONE"
        self.logit_capping_method = "tanh"
        self.xai_temperature_len = -1


class ForwardBatch(_Pools):
    """One call's batch: readfence's step inputs under an engine's names (SGLang's).

    ``forward_mode`` (and ``logical_forward_mode``) is the engine's own mode member;
    ``batch_size``, ``num_tokens`` and ``tokens_per_request`` are host ints (static shapes);
    ``input_ids``, ``positions``, ``req_pool_indices``, ``out_cache_loc`` the batch's tensors;
    ``seq_lens`` gathers this batch's lengths from the shared ``seq_lens`` *where it is read*
    (a read of the shared buffer there and then), or is the runner's copy when the engine does not
    share ``seq_lens``; ``seq_lens_cpu`` and ``seq_lens_sum`` read them on the host. In the modes
    with several tokens per request, ``extend_seq_lens`` (``_cpu``: on the host) is the new tokens
    of each request and ``extend_prefix_lens`` the tokens already cached. No encoder
    (``encoder_lens`` is ``None``), no two-batch-overlap split (``tbo_children``); ``spec_info`` is
    what the profile's ``spec_info(forward_batch)`` makes in TARGET_VERIFY (``None`` otherwise).
    Any other field of the engine's own batch (``fields``: name -> its default, from the profile) is
    that default (SGLang's ``kv_loc_plan`` is ``None``, ``out_cache_loc_is_physical`` ``False``...).
    The pools (``req_to_token_pool``...) are over this call's tensors.
    ``split(parts)`` gives micro-batches of consecutive requests (two-batch overlap).
    """

    def __init__(self, cfg: ModelConfig, mode: ForwardMode, shared: Mapping[str, Tensor], batch: Mapping[str, Tensor],
                 pools: Mapping[str, Tensor], layout: Mapping[str, str | None], engine_mode: Any = None,
                 seq_lens: Tensor | None = None, spec: Callable[[ForwardBatch], Any] | None = None,
                 fields: Mapping[str, Callable[[], Any]] | None = None) -> None:
        super().__init__(cfg, shared, pools, layout)
        self.cfg, self.mode, self._shared, self._layout = cfg, mode, shared, layout
        self._fields = fields or {}
        self.forward_mode: Any = mode if engine_mode is None else engine_mode
        self.logical_forward_mode: Any = self.forward_mode
        self._seq_lens, self._spec, self._spec_info = seq_lens, spec, None
        self.input_ids = batch["input_ids"]
        self.positions = batch["positions"]
        self.req_pool_indices = batch["req_pool_indices"]
        self.out_cache_loc = batch["out_cache_loc"]
        self.batch_size = self._original_batch_size = int(self.req_pool_indices.shape[0])
        self.num_tokens = self.extend_num_tokens = int(self.input_ids.shape[0])
        self.tokens_per_request = tokens_per_request(mode)
        self.encoder_lens = self.encoder_lens_cpu = self.encoder_out_cache_loc = None
        self.max_seq_len_override = None
        self.tbo_children = None
        self.extend_seq_lens_cpu = [self.tokens_per_request] * self.batch_size
        self.extend_seq_lens = torch.full((self.batch_size,), self.tokens_per_request, dtype=torch.int32,
                                          device=self.req_pool_indices.device)
        self.extend_start_loc = torch.arange(0, self.num_tokens, max(self.tokens_per_request, 1), dtype=torch.int32,
                                             device=self.req_pool_indices.device)

    def __getattr__(self, name: str) -> Any:
        # a field of the engine's own batch that readfence's step does not set: the engine's default
        make = self.__dict__.get("_fields", {}).get(name)
        if make is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = make()
        setattr(self, name, value)
        return value

    @property
    def seq_lens(self) -> Tensor:
        """``[batch_size]`` int32: this batch's lengths (new tokens included), read from the shared
        ``seq_lens`` now (or the runner's copy, when the engine does not share it)."""
        if self._seq_lens is not None:
            return self._seq_lens
        return self._shared["seq_lens"].index_select(0, self.req_pool_indices)

    @property
    def spec_info(self) -> Any:
        """The speculative input (``None`` unless the profile makes one for TARGET_VERIFY), made when
        first asked: it may read the batch's lengths on the host, so only the stages that use it do."""
        if self._spec is not None and self._spec_info is None:
            self._spec_info = self._spec(self)
        return self._spec_info

    @property
    def seq_lens_cpu(self) -> Tensor:
        """The lengths, for host reads: where the engine does not share ``seq_lens``, the runner's copy
        (a read of it on the host reads nothing the step shares), else the shared buffer's rows."""
        return self.seq_lens.cpu()

    @property
    def seq_lens_sum(self) -> int:
        """The total length of the batch, on the host (see :meth:`host_lens`)."""
        host = self.host_lens()
        return int(self.seq_lens.sum()) if host is None else sum(host)

    def host_lens(self) -> list[int] | None:
        """The lengths as the scheduler knows them on the host, where the engine does not share
        ``seq_lens``: the runner's copy, taken out of the shared buffer before the replay (that
        read is the step's), holds what the scheduler wrote, so the host has it without a read of
        anything the step shares (SGLang's ``seq_lens_cpu``, ``seq_lens_sum``). ``None`` where the
        engine shares ``seq_lens``: then a host value is a read of the shared buffer, there and then."""
        if self._seq_lens is None:
            return None
        with _quiet():
            return [int(n) for n in self._seq_lens.tolist()]

    @property
    def extend_prefix_lens(self) -> Tensor:
        """``[batch_size]`` int32: the tokens of each request already in the cache."""
        return self.seq_lens - self.extend_seq_lens

    @property
    def extend_prefix_lens_cpu(self) -> list[int]:
        """The cached tokens per request, on the host (see :meth:`host_lens`)."""
        host = self.host_lens()
        if host is None:
            return [int(n) for n in self.extend_prefix_lens.tolist()]
        return [n - new for n, new in zip(host, self.extend_seq_lens_cpu, strict=True)]

    def narrow(self, lo: int, hi: int) -> ForwardBatch:
        """The micro-batch of requests ``lo..hi`` (the same pools and shared buffers)."""
        n = self.tokens_per_request
        batch = {"input_ids": self.input_ids.narrow(0, lo * n, (hi - lo) * n),
                 "positions": self.positions.narrow(0, lo * n, (hi - lo) * n),
                 "req_pool_indices": self.req_pool_indices.narrow(0, lo, hi - lo),
                 "out_cache_loc": self.out_cache_loc.narrow(0, lo * n, (hi - lo) * n)}
        lens = None if self._seq_lens is None else self._seq_lens.narrow(0, lo, hi - lo)
        return ForwardBatch(self.cfg, self.mode, self._shared, batch, self.token_to_kv_pool._pools, self._layout,
                            self.forward_mode, lens, self._spec, self._fields)

    def split(self, parts: int) -> list[ForwardBatch]:
        """``parts`` micro-batches of consecutive requests (sizes as ``torch.tensor_split``)."""
        from readfence.core.internal import request_ranges

        return [self.narrow(lo, hi) for lo, hi in request_ranges(self.batch_size, parts)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # what the host knows without a read of the step's tensors: no op the tracer or observer sees
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def check_state(cfg: ModelConfig, state: Mapping[str, Mapping[str, Tensor]], who: str) -> None:
    """``state`` has the shared buffers, pools and params of ``cfg``'s shapes."""
    for group in ("shared", "pools", "params"):
        if group not in state:
            raise ValueError(f"{who}: state must have 'shared', 'pools' and 'params' (readfence.graph.make_state), "
                             f"it lacks {group!r}")
    missing = [b for b in SHARED_BUFFERS if b not in state["shared"]]
    if missing:
        raise ValueError(f"{who}: state['shared'] lacks {missing}")
    table = state["shared"]["req_to_token"]
    if tuple(table.shape) != (cfg.max_reqs, cfg.max_ctx):
        raise ContractError(f"{who}: the state's page table is {tuple(table.shape)}, but the model config has "
                            f"max_reqs={cfg.max_reqs}, max_ctx={cfg.max_ctx}: pass the state made for this cfg")


# the views are readfence's: an op one runs is named after the engine's line that read the view
not_user_code(__file__)
