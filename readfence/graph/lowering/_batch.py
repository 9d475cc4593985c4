"""A lowered step's inputs: taken from the caller's mapping and checked on the host, per step.

A captured graph reads its inputs from static buffers, so every step copies the caller's
tensors in. ``copy_`` broadcasts: a batch of the wrong size would be copied in silently
(a ``(1,)`` tensor fills every row), so each tensor's shape must equal its buffer's before
anything is enqueued. This runs on the host for every step (a lowered step issues in about
17 us there): :func:`gather_code` emits straight-line code for the graph's keys, one item
lookup and one shape comparison per input, like ``_fx_compile`` does for a stage (for the
demo's four inputs 0.39 us, against 0.51 us for a tuple of their shapes compared with the
static ones; each ``shape`` is a new ``torch.Size``, most of either). The step issuer
(``_issue``) inlines it; :func:`batch_gatherer` is the same code as a function of its own.

>>> import torch
>>> gather = batch_gatherer("b0", {"ids": torch.zeros(4), "pos": torch.zeros(4)})
>>> ids, pos = gather({"ids": torch.ones(4), "pos": torch.arange(4.0)})
>>> pos.tolist()
[0.0, 1.0, 2.0, 3.0]
>>> gather({"ids": torch.ones(1), "pos": torch.ones(4)})
Traceback (most recent call last):
ValueError: b0: batch['ids'] has shape (1,), the lowered graph was captured for (4,)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, NoReturn

from torch import Tensor

from readfence.core.internal import define

BatchGatherer = Callable[[Mapping[str, Tensor]], tuple[Tensor, ...]]


class GatherCode(NamedTuple):
    """Straight-line statements that bind ``staged`` from ``batch`` (or raise), and the
    globals they use: :func:`batch_gatherer` wraps them in a function of their own, the step
    issuer (``_issue``) inlines them."""

    lines: tuple[str, ...]
    scope: dict[str, object]


def gather_code(owner: str, static: Mapping[str, Tensor], detail: str = "") -> GatherCode:
    """The gather of :func:`batch_gatherer`, as code to emit into a generated function."""
    keys, shapes = tuple(static), tuple(t.shape for t in static.values())

    def missing(batch: Mapping[str, Tensor]) -> NoReturn:
        raise KeyError(f"{owner}: batch is missing {sorted(set(keys) - set(batch))}") from None

    def wrong_shape(staged: tuple[Tensor, ...]) -> NoReturn:
        key, given, want = next((k, t.shape, s) for k, t, s in zip(keys, staged, shapes) if t.shape != s)
        raise ValueError(f"{owner}: batch[{key!r}] has shape {tuple(given)}, the lowered graph was captured "
                         f"for {tuple(want)}{detail}")

    # each key and shape a global of its own: a specialised LOAD_GLOBAL, no subscript
    scope: dict[str, Any] = {"missing_keys": missing, "wrong_shape": wrong_shape,
                             **{f"key{i}": k for i, k in enumerate(keys)},
                             **{f"shape{i}": s for i, s in enumerate(shapes)}}
    lookups = "".join(f"batch[key{i}], " for i in range(len(keys)))
    same = " and ".join(f"staged[{i}].shape == shape{i}" for i in range(len(keys))) or "True"
    lines = ("try:", f"    staged = ({lookups})", "except KeyError:", "    missing_keys(batch)",
             f"if not ({same}):", "    wrong_shape(staged)")
    return GatherCode(lines, scope)


def batch_gatherer(owner: str, static: Mapping[str, Tensor], detail: str = "") -> BatchGatherer:
    """A function from a step's batch mapping to its tensors in ``static``'s key order.

    It raises ``KeyError`` naming the missing keys, or ``ValueError`` naming the first key
    whose tensor's shape differs from its static buffer's (``owner`` and ``detail`` open and
    close the message). Extra keys are ignored.
    """
    code = gather_code(owner, static, detail)
    source = "def gather(batch):\n" + "".join(f"    {line}\n" for line in code.lines) + "    return staged\n"
    gather: BatchGatherer = define("gather", source, dict(code.scope), f"<batch gatherer of {owner}>")
    return gather
