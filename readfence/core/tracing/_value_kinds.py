"""How the walk of a backend's values (:func:`~readfence.core.tracing.reach`) takes each type:
by value, by layout, as code to follow, as a namespace walked by name, or by identity.

>>> _classify(int), _classify(type(lambda: 0)), _classify(type(torch.nn.Linear(1, 1)))
('atom', 'function', 'opaque')
"""

from __future__ import annotations

import collections
import enum
import functools
import os
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from ._reached import Path

#: Packages whose objects are taken by identity, unwalked: torch's, the standard library's and
#: readfence's own machinery (the tracer, the model, the lattice: none of them is a backend's
#: setting). readfence's backends and engine adapters are walked like any user's code.
_OPAQUE_PACKAGES = frozenset({"torch", "triton", "numpy", "attr", "attrs", "returns", "hypothesis", "sympy", "typing_extensions",
                              "functorch", "jinja2", "_pytest", "pytest", "builtins", *sys.stdlib_module_names})
_STDLIB = frozenset({"builtins", "types", *sys.stdlib_module_names})
_OPAQUE_READFENCE = ("readfence.core", "readfence.effects", "readfence.graph", "readfence.cli", "readfence.parallel")
_MACHINERY_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                     *name.split(".")[1:]) + os.sep for name in _OPAQUE_READFENCE)

_ATOMS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


_ATOM_TYPES = frozenset(_ATOMS)
#: Objects that stand for the function they wrap, and the attribute that holds it.
_WRAPPERS: dict[type, str] = {property: "fget", staticmethod: "__func__", classmethod: "__func__",
                              functools.cached_property: "func"}


#: How the walk takes a value of each type (:func:`_classify`).
_KINDS: dict[type, str] = {}


def _classify(kind: type) -> str:
    """How the walk takes a value of type ``kind``: by value, by layout (a tensor), as a function,
    a container, a class, a module, an object to walk, or by identity (``opaque``)."""
    if kind in _ATOM_TYPES:
        how = "atom"
    elif issubclass(kind, (enum.Enum, *_TORCH_VALUES)):
        how = "value"
    elif issubclass(kind, torch.Tensor):
        how = "tensor"
    elif kind is types.ModuleType:
        how = "module"
    elif kind is types.FunctionType:
        how = "function"
    elif kind is types.MethodType:
        how = "method"
    elif kind is functools.partial:
        how = "partial"
    elif issubclass(kind, tuple(_WRAPPERS)):
        how = "wrapper"
    elif issubclass(kind, (list, tuple, collections.deque)):  # (a deque indexes as a list does)
        how = "sequence"
    elif issubclass(kind, dict):
        how = "mapping"
    elif issubclass(kind, (set, frozenset)):
        how = "set"
    elif issubclass(kind, type):
        how = "class"
    else:
        how = _classify_module(kind)
    if len(_KINDS) < 65536:
        _KINDS[kind] = how
    return how


def _classify_module(kind: type) -> str:
    """``opaque`` for a class of torch, the standard library or readfence's machinery, else ``object``;
    but ``kernel`` for a triton kernel's class, and ``record`` for a standard library class whose
    instances hold a ``__dict__`` of their own (``types.SimpleNamespace``, ``argparse.Namespace``:
    a config as often as not)."""
    module = getattr(kind, "__module__", None) or ""
    top = module.partition(".")[0]
    if top in _STDLIB and getattr(kind, "__dictoffset__", False):
        return "record"
    if top == "triton" and any(b.__name__ == "KernelInterface" for b in kind.__mro__):
        return "kernel"
    opaque = top in _OPAQUE_PACKAGES or module.startswith(_OPAQUE_READFENCE)
    return "opaque" if opaque else "object"


@functools.lru_cache(maxsize=1024)  # by class: its slots are fixed when it is made
def _slots_of(kind: Any) -> tuple[str, ...]:
    names = [s for cls in kind.__mro__ for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
    return tuple(n for n in dict.fromkeys(names) if n not in ("__dict__", "__weakref__"))


@attrs.define(eq=False)
class _Space:
    """A namespace walked by name: its entries named by some reached code."""

    path: Path
    mapping: Mapping[str, Any]
    keys: Any  # its keys (a view: ``keys & names`` looks up the smaller side)
    kind: str  # the path step that reads an entry
    depth: int


class _Slots(Mapping[str, Any]):
    """An object's slots as a mapping (the filled ones)."""

    def __init__(self, obj: object, names: tuple[str, ...]) -> None:
        self.obj, self.slots = obj, names

    def __getitem__(self, name: str) -> Any:
        if name not in self.slots:
            raise KeyError(name)
        try:
            return getattr(self.obj, name)
        except AttributeError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def keys(self) -> Any:
        return frozenset(self.slots)
