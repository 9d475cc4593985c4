"""SGLang's contract as a profile: what its attention backends need to be built and called as in SGLang.

* the mode enum: SGLang's own ``ForwardMode`` (found from the backend's base class module);
* the layers: SGLang's ``RadixAttention``, built with the model's sizes;
* the runtime context: SGLang reads its configuration from a process-wide context
  (``get_spec()``, ``get_exec()``...), which its scheduler publishes from ``ServerArgs``. The
  profile builds a ``ServerArgs`` (``model_path``: by default a folder with a ``config.json`` of
  the model config's sizes; ``device``; and the ``server_args`` given to
  :func:`~readfence.engine.adapt`), makes a context of it with ``create_context(...,
  role="scheduler")`` and enters it with ``use_context`` around every call into the object;
* the buffers: SGLang's request pool holds the page table only; the batch's ``seq_lens`` is its
  own tensor, copied by the graph runner before the replay (``seq_lens`` is absent, as are
  ``swa_map`` and ``state_slots`` unless the pools are SWA or hybrid ones: name them in
  ``buffers`` to give them);
* the speculative input: a TARGET_VERIFY batch's ``spec_info`` is an ``EagleVerifyInput`` (a chain
  of draft tokens per request), which TBO splits between its children;
* what it replays: SGLang turns CUDA graphs off (decode and prefill) when the attention backend
  is torch-native or flex attention (``handle_attention_backend_compatibility``), so no backend of such a tree is
  ever graph-replayed: each mode runs eagerly, through ``init_forward_metadata``.

SGLang is imported only when a profile's hook runs.

>>> profile = sglang_profile()
>>> sorted(b for b, path in profile.buffers.items() if path is None)
['seq_lens', 'state_slots', 'swa_map']
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from ._profile import EngineProfile

#: SGLang's backends for which it disables CUDA graphs (its server args' compatibility rules).
EAGER_ONLY: frozenset[str] = frozenset({"TorchNativeAttnBackend", "TorchFlexAttnBackend"})


def _layer(runner: Any, layer_id: int) -> Any:
    RadixAttention = importlib.import_module("sglang.srt.layers.radix_attention").RadixAttention

    cfg = runner.cfg
    return RadixAttention(cfg.heads, cfg.head_dim, cfg.head_dim ** -0.5, cfg.heads, layer_id)


def _verify_input(forward_batch: Any) -> Any:
    """SGLang's ``EagleVerifyInput`` of a TARGET_VERIFY batch: a chain of ``tokens_per_request``
    draft tokens per request (topk 1, no tree mask), its lengths read on the host."""
    verify = importlib.import_module("sglang.srt.speculative.eagle_info").EagleVerifyInput
    n, lens = forward_batch.tokens_per_request, forward_batch.seq_lens_cpu
    return verify(draft_token=forward_batch.input_ids, custom_mask=None, positions=forward_batch.positions,
                  retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
                  spec_steps=max(n - 1, 1), topk=1, draft_token_num=n, capture_hidden_mode=None,
                  seq_lens_sum=forward_batch.seq_lens_sum, seq_lens_cpu=lens)


def _replays(obj: object) -> bool:
    return type(obj).__name__ not in EAGER_ONLY


def model_dir(cfg: Any) -> str:
    """A folder holding a Hugging Face ``config.json`` of ``cfg``'s sizes (a Llama-style decoder):
    what SGLang's server args resolve the model from, on this machine, with no download."""
    key = (cfg.layers, cfg.heads, cfg.head_dim, cfg.hidden, cfg.vocab, cfg.max_ctx)
    if key not in _MODEL_DIRS:
        folder = tempfile.mkdtemp(prefix="readfence-model-")
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden,
                  "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads, "head_dim": cfg.head_dim,
                  "num_hidden_layers": cfg.layers, "vocab_size": cfg.vocab, "intermediate_size": 4 * cfg.hidden,
                  "max_position_embeddings": cfg.max_ctx, "torch_dtype": "float32"}
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        _MODEL_DIRS[key] = folder
    return _MODEL_DIRS[key]


_MODEL_DIRS: dict[tuple[int, ...], str] = {}


def _server_args(runner: Any, model_path: str | None, extra: Mapping[str, Any]) -> Any:
    """SGLang's ``ServerArgs`` of ``runner`` (made once per runner)."""
    made = getattr(runner, "_sglang_server_args", None)
    if made is None:
        ServerArgs = importlib.import_module("sglang.srt.server_args").ServerArgs

        path = model_dir(runner.cfg) if model_path is None else model_path
        args = {"model_path": path, "device": runner.device.type, **extra, **vars(runner.server_args)}
        made = runner._sglang_server_args = ServerArgs(**args)
    return made


def _context_for(model_path: str | None, extra: Mapping[str, Any]) -> Any:
    def context(runner: Any) -> contextlib.AbstractContextManager[Any]:
        made = getattr(runner, "_sglang_context", None)
        if made is None:
            runtime_context = importlib.import_module("sglang.srt.runtime_context")
            made = runtime_context.create_context(_server_args(runner, model_path, extra), role="scheduler")
            runner._sglang_context = made
        return _entered(made)

    return context


def _runner_for(model_path: str | None, extra: Mapping[str, Any]) -> Any:
    def complete(runner: Any) -> None:
        # what SGLang's ModelRunner holds that a backend's constructor reads: the model's config as
        # SGLang resolves it from the server args, the speculative algorithm, tokens per request
        args = _server_args(runner, model_path, extra)
        ModelConfig = importlib.import_module("sglang.srt.configs.model_config").ModelConfig
        algorithm = importlib.import_module("sglang.srt.speculative.spec_info").SpeculativeAlgorithm
        runner.model_config = ModelConfig.from_server_args(args)
        runner.spec_algorithm = algorithm.from_string(args.speculative_algorithm)
        steps = args.speculative_num_draft_tokens if runner.spec_algorithm.is_speculative() else None
        runner.decode_num_tokens_per_req = lambda: steps or 1
        # the one object that turns the page table's entries into the ids a kernel reads
        translator = importlib.import_module("sglang.srt.mem_cache.kv_index_translator").KVIndexTranslator
        runner.kv_index_translator = translator(
            req_to_token=runner.req_to_token_pool.req_to_token, token_to_kv_pool_allocator=None,
            token_to_kv_pool=runner.token_to_kv_pool, page_size=runner.page_size, device=runner.device,
            is_draft_worker=runner.is_draft_worker)

    return complete


def _capture(runner: Any) -> contextlib.AbstractContextManager[Any]:
    return importlib.import_module("sglang.srt.model_executor.runner_utils.capture_mode").model_capture_mode()


def _bind_batch(forward_batch: Any, runner: Any) -> None:
    """What ``ForwardBatch.init_new`` does last: the batch's own KV plan (its write window is its
    ``out_cache_loc``), bound by the runner's translator."""
    translator = runner.kv_index_translator
    translator.own_plan(forward_batch).bind(forward_batch, translator)


def _batch_fields() -> dict[str, Any]:
    """Every field of SGLang's ``ForwardBatch`` that has a default: its dataclass fields and the
    plain values its mixins declare."""
    forward_batch = importlib.import_module("sglang.srt.model_executor.forward_batch_info").ForwardBatch
    out: dict[str, Any] = {}
    for cls in reversed(forward_batch.__mro__[:-1]):
        for name, value in vars(cls).items():
            if not name.startswith("__") and not callable(value) and not isinstance(
                    value, (property, staticmethod, classmethod, functools.cached_property)):
                out[name] = functools.partial(_same, value)
    for f in dataclasses.fields(forward_batch):
        if f.default is not dataclasses.MISSING:
            out[f.name] = functools.partial(_same, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory
    return out


def _same(value: Any) -> Any:
    return value


@contextlib.contextmanager
def _entered(made: Any) -> Iterator[None]:
    runtime_context = importlib.import_module("sglang.srt.runtime_context")
    with runtime_context.use_context(made):
        yield


def sglang_profile(*, model_path: str | None = None, buffers: Mapping[str, str | None] | None = None,
                   **server_args: Any) -> EngineProfile:
    """The profile of SGLang's contract (see the module docstring); ``model_path`` is the model
    SGLang's server args resolve (default: a local ``config.json`` of the model config's sizes,
    :func:`model_dir`); ``server_args`` are SGLang ``ServerArgs`` fields (``speculative_attention_mode="decode"``...), ``buffers`` override the
    layout (``{"state_slots": "req_to_token_pool.req_index_to_mamba_index_mapping"}``).

    >>> sglang_profile(speculative_algorithm="EAGLE").buffers["seq_lens"] is None
    True
    """
    layout: dict[str, str | None] = {"seq_lens": None, "swa_map": None, "state_slots": None}
    layout.update(buffers or {})
    return EngineProfile(layer=_layer, context=_context_for(model_path, server_args), buffers=layout,
                         replays=_replays, spec_info=_verify_input, runner=_runner_for(model_path, server_args),
                         batch_fields=_batch_fields, bind_batch=_bind_batch, capture=_capture)


__all__ = ["EAGER_ONLY", "sglang_profile"]
