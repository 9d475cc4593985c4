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

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
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


#: The layer whose run recorded a node (``node.meta[LAYER_KEY]``, an int): what
#: :func:`layers_marked` lets a recorder write.
LAYER_KEY = "readfence_layer"

#: Per thread, what :func:`run_scan` tells of the layer it runs (:func:`layers_marked`).
_MARKS = threading.local()


@contextlib.contextmanager
def layers_marked(mark: Callable[[int | None], None]) -> Iterator[None]:
    """While entered, :func:`run_scan` on this thread calls ``mark(index)`` as it starts layer
    ``index`` and ``mark(None)`` when that layer has returned (the recorder marks the nodes each
    layer made: a compile pass compiles the layers that compute alike once).

    >>> import torch
    >>> seen = []
    >>> with layers_marked(seen.append):
    ...     _ = run_scan(LayerScan(2, lambda inputs: 0, lambda i, c, inputs: c + i, lambda c, inputs: c), {})
    >>> seen
    [0, None, 1, None]
    """
    before = getattr(_MARKS, "mark", None)
    _MARKS.mark = mark
    try:
        yield
    finally:
        _MARKS.mark = before


def run_scan(scan: LayerScan, inputs: Mapping[str, Any]) -> Tensor:
    """The body ``scan`` describes, run on ``inputs`` (the fold, as written).

    >>> import torch
    >>> scan = LayerScan(2, lambda inputs: inputs["x"], lambda i, c, inputs: c + i, lambda c, inputs: c)
    >>> run_scan(scan, {"x": torch.tensor(0)})
    tensor(1)
    """
    mark = getattr(_MARKS, "mark", None)
    carry = scan.pre(inputs)
    for index in range(scan.count):
        if mark is not None:
            mark(index)
        carry = scan.layer(index, carry, inputs)
        if mark is not None:
            mark(None)
    return scan.post(carry, inputs)
