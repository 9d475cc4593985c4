"""Attention backends as values: pure stage functions with declared or computed read effects.

>>> from readfence.backends import parse, tbo, deepseek_v4, paged
>>> from readfence.core import ForwardMode
>>> b = parse("tbo(deepseek_v4, paged)").unwrap()
>>> b == tbo(deepseek_v4(), paged()), b.read_end(ForwardMode.TARGET_VERIFY)
(True, <ReadEnd.POST_REPLAY: 3>)
"""

from ._attention import (
    causal_mask,
    kv_indices,
    kv_lens,
    linear_attention,
    page_meta,
    remap,
    softmax_attention,
    store_kv,
    top_pages,
)
from ._backend import MODES, Backend, Leaf, default_declaration, leaf, redeclare, to_spec
from ._combinators import (
    Join,
    PerStream,
    Select,
    Tbo,
    hybrid,
    hybrid_linear,
    join,
    minimax,
    per_stream,
    select,
    tbo,
)
from ._leaves import REFERENCE_LEAVES, deepseek_v4, dense, linear, paged, sparse, trtllm_mha
from ._spec import CallForm, SpecError, parse, parse_call


def reference_compositions() -> dict[str, Backend]:
    """Named compositions of reference leaves, as deployed (the wrapper table's rows).

    >>> from readfence.core import ForwardMode
    >>> {k: b.read_end(ForwardMode.DECODE).name for k, b in reference_compositions().items()}
    ... # doctest: +NORMALIZE_WHITESPACE
    {'tbo_deepseek': 'IN_REPLAY', 'hybrid_trtllm': 'PRE_REPLAY', 'qwen_next': 'IN_REPLAY',
     'minimax': 'POST_REPLAY', 'per_stream': 'IN_REPLAY'}
    """
    return {
        "tbo_deepseek": tbo(deepseek_v4(), paged()),
        "hybrid_trtllm": hybrid(decode=trtllm_mha(), prefill=deepseek_v4()),
        "qwen_next": hybrid_linear(trtllm_mha(), linear(), pattern="0111"),
        "minimax": minimax(sparse(), dense()),
        "per_stream": per_stream(paged(), trtllm_mha()),
    }


__all__ = [
    "MODES",
    "REFERENCE_LEAVES",
    "Backend",
    "CallForm",
    "Join",
    "Leaf",
    "PerStream",
    "Select",
    "SpecError",
    "Tbo",
    "causal_mask",
    "deepseek_v4",
    "default_declaration",
    "dense",
    "hybrid",
    "hybrid_linear",
    "join",
    "kv_indices",
    "kv_lens",
    "leaf",
    "linear",
    "linear_attention",
    "minimax",
    "page_meta",
    "paged",
    "parse",
    "parse_call",
    "per_stream",
    "redeclare",
    "reference_compositions",
    "remap",
    "select",
    "softmax_attention",
    "sparse",
    "store_kv",
    "tbo",
    "to_spec",
    "top_pages",
    "trtllm_mha",
]
