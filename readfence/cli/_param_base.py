"""What every option type stands on: the names and bounds a value is checked against before torch
is imported (a test keeps each equal to the library's own), and how a bad value reads in the one
error line.

>>> _fail(None, "fastest", "unknown policy" + _close("fastest", ("fast", "exact"))).message
"invalid value 'fastest': unknown policy (did you mean fast?)"
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import click

from ._errors import InputError, param_name

# What the options are checked against before torch is imported; a test keeps each equal to
# the library's own (``ForwardMode``, ``Policy``, ``DEVICE_KINDS``, ``ModelConfig()``, ``tp_sizes``).
MODE_NAMES = ("decode", "target_verify", "draft_extend", "extend", "idle")
POLICY_NAMES = ("coarse", "joined", "per_buffer", "exact")
DEVICE_KINDS = ("auto", "cpu", "cuda")
LEAF_NAMES = ("deepseek_v4", "dense", "linear", "paged", "sparse", "trtllm_mha")  # the reference leaves
COMBINATOR_NAMES = ("hybrid", "hybrid_linear", "join", "minimax", "per_stream", "select", "tbo")
STEP_SHAPE_NAMES = ("eagle", "multi_eagle", "ngram")
MAX_BATCH = 16  # ModelConfig().max_reqs: the requests the tiny model serves
TINY_HEADS, TINY_MLP = 2, 64  # ModelConfig().heads, .mlp: what a tensor-parallel size must divide
TP_SIZES = tuple(d for d in range(1, TINY_HEADS + 1) if TINY_HEADS % d == 0 and TINY_MLP % d == 0)

#: The demo's backend: a composition whose buffers end at different stages: trtllm_mha snapshots
#: its page-table metadata out of graph (PRE_REPLAY), linear reads its state-slot map in graph
#: (IN_REPLAY).
DEFAULT_SPEC = "hybrid_linear(trtllm_mha, linear)"

#: Longest value an error message repeats in full; past it, its start and its length.
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``value`` as an error message shows it: its ``repr``, cut short when long.

    >>> shown("   "), shown("x" * 1000)
    ("'   '", "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (1000 characters)")
    """
    text = repr(value)
    if isinstance(value, str) and len(text) > SHOWN_CHARS:
        return f"{value[:60]!r}... ({len(value)} characters)"
    return text


def shell_word(text: str) -> str:
    """``text`` as one word of a shell command line, quoted only where a shell would change it
    (what a printed command puts around a value, so that it runs as pasted).

    >>> print(shell_word("paged"), shell_word("tbo(deepseek_v4, paged)"), shell_word("m:ENGINES['triton']"))
    paged 'tbo(deepseek_v4, paged)' "m:ENGINES['triton']"
    """
    import shlex

    if re.fullmatch(r"[\w@%+=:,./-]+", text):
        return text
    if "'" in text and not re.search(r'["$`\\!]', text):
        return f'"{text}"'
    return shlex.quote(text)


def _close(name: str, names: Sequence[str]) -> str:
    """`` (did you mean x?)`` for the closest of ``names`` (a ``-`` read as ``_``), else ``""``.

    >>> _close("per-buffer", POLICY_NAMES), _close("fastest", POLICY_NAMES)
    (' (did you mean per_buffer?)', '')
    """
    import difflib

    close = difflib.get_close_matches(name.replace("-", "_"), list(names), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _fail(param: click.Parameter | None, value: object, why: str) -> InputError:
    return InputError(f"invalid {param_name(param)} {shown(value)}: {why}")
