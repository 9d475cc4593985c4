"""A wrapper's children, wherever the engine keeps them.

SGLang's wrappers keep their children under names of their own: ``attn_backend_list``
(HybridLinear), ``primary`` and ``children`` (TBO), ``prefill_backend`` and ``decode_backend``
(Hybrid), ``sparse``/``dense`` and ``dsa_backend``/``swa_backend`` (MiniMaxHybrid, DotsHybrid).
A child is any attribute of the object's own ``__dict__``, or item of a list or tuple there,
that is itself a backend object (it has ``shared_read_ends`` and a ``forward``); each child is
listed once, under the first name it has (an object kept twice, as HybridLinear keeps its
backends both by name and in ``attn_backend_list``, is one child).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: One step from a wrapper to a child: an attribute, and the index in it when it is a list.
Step = tuple[str, int | None]
Path = tuple[Step, ...]


def is_backend(value: object) -> bool:
    """Whether ``value`` looks like an engine backend object (a class is not one).

    >>> class Leaf:
    ...     def shared_read_ends(self, mode): ...
    ...     def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True): ...
    >>> is_backend(Leaf()), is_backend(Leaf), is_backend([Leaf()])
    (True, False, False)
    """
    if isinstance(value, type):
        return False
    return callable(getattr(value, "shared_read_ends", None)) and (
        callable(getattr(value, "forward", None)) or callable(getattr(value, "forward_decode", None)))


def step_text(step: Step) -> str:
    """``primary``, ``children[1]``."""
    name, index = step
    return name if index is None else f"{name}[{index}]"


def children(obj: object, seen: set[int] | None = None) -> list[tuple[Step, Any]]:
    """``[(step, child)]``: the backend objects ``obj`` keeps (see the module docstring), but those
    in ``seen`` (ids; updated), so that walking a tree with one ``seen`` lists each object once.

    >>> class Leaf:
    ...     def shared_read_ends(self, mode): ...
    ...     def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True): ...
    >>> class Wrapper:
    ...     def __init__(self):
    ...         self.primary, self.children = Leaf(), [Leaf(), Leaf()]
    ...         self.attn_backend_list = [self.primary]
    >>> [step_text(s) for s, _ in children(Wrapper())]
    ['primary', 'children[0]', 'children[1]']
    """
    found: list[tuple[Step, Any]] = []
    seen = set() if seen is None else seen  # shared across a tree: a child kept by two nodes is listed once
    seen.add(id(obj))
    names = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    listed = getattr(obj, "attn_backend_list", None)
    if "attn_backend_list" not in names and isinstance(listed, (list, tuple)):
        names["attn_backend_list"] = listed  # a class attribute, or a property
    for name, value in _items(names):
        for step, child in _candidates(name, value):
            if id(child) not in seen:
                seen.add(id(child))
                found.append((step, child))
    return found


def _items(names: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    # named attributes first, then the list a generic walker would use: a child is named by its role
    yield from ((k, v) for k, v in names.items() if k != "attn_backend_list")
    if "attn_backend_list" in names:
        yield "attn_backend_list", names["attn_backend_list"]


def _candidates(name: str, value: Any) -> Iterator[tuple[Step, Any]]:
    if is_backend(value):
        yield (name, None), value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if is_backend(item):
                yield (name, i), item


def follow(root: object, path: Path) -> Any:
    """The object at ``path`` under ``root``."""
    obj = root
    for name, index in path:
        obj = vars(obj)[name] if name in getattr(obj, "__dict__", {}) else getattr(obj, name)
        if index is not None:
            obj = obj[index]
    return obj


__all__ = ["Path", "Step", "children", "follow", "is_backend", "step_text"]
