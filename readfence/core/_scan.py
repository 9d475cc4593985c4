"""A model body as a scan over its layers.

A decoder's body is ``pre`` (embedding), then ``layer(i, carry)`` for every layer ``i``, then
``post`` (the head), each over the step's input groups (``shared``, ``batch``, ``pools``,
``params``, ``meta``). Written as a :class:`LayerScan`, the structure is a value, as a
``lax.scan`` body is for JAX; running it is :func:`run_scan`, a plain fold, so the serial step
and every interpreter compute exactly what the body written as one loop would.

>>> import torch
>>> scan = LayerScan(count=3,
...                  pre=lambda inputs: inputs["batch"]["x"],
...                  layer=lambda i, carry, inputs: carry + inputs["params"][f"layers.{i}.w"],
...                  post=lambda carry, inputs: carry * 2)
>>> params = {f"layers.{i}.w": torch.tensor(float(i)) for i in range(3)}
>>> run_scan(scan, {"batch": {"x": torch.tensor(1.0)}, "params": params})
tensor(8.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
from torch import Tensor

from ._checks import positive_int


@attrs.frozen
class LayerScan:
    """A body as ``post(layer(count - 1, ... layer(0, pre(inputs)) ...))``.

    ``pre(inputs) -> carry``, ``layer(index, carry, inputs) -> carry`` and ``post(carry, inputs)
    -> logits`` take the body's keyword groups as one mapping ``inputs``; ``carry`` is what a
    layer hands the next (the tiny decoder's: the residual stream and the step's rotary tables).

    >>> LayerScan(0, lambda i: i, lambda i, c, inputs: c, lambda c, inputs: c)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LayerScan count (layers) must be a positive int, got 0 (int)
    """

    count: int = attrs.field(validator=lambda _, __, n: positive_int("LayerScan count (layers)", n))
    pre: Callable[[Mapping[str, Any]], Any]
    layer: Callable[[int, Any, Mapping[str, Any]], Any]
    post: Callable[[Any, Mapping[str, Any]], Tensor]


def run_scan(scan: LayerScan, inputs: Mapping[str, Any]) -> Tensor:
    """The body ``scan`` describes, run on ``inputs`` (the fold, as written).

    >>> import torch
    >>> scan = LayerScan(2, lambda inputs: inputs["x"], lambda i, c, inputs: c + i, lambda c, inputs: c)
    >>> run_scan(scan, {"x": torch.tensor(0)})
    tensor(1)
    """
    carry = scan.pre(inputs)
    for index in range(scan.count):
        carry = scan.layer(index, carry, inputs)
    return scan.post(carry, inputs)
