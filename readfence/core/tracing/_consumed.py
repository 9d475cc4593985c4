"""Which keys of its metadata a stage reads while it is traced: the Python values its graph may bake.

A captured graph bakes the Python values its stage's code used on the traced step (an ``int``
bound, a ``float`` scale, a flag it branched on); the earlier stage that returned them runs its
Python every step and may return others. Only the values some captured stage reads need holding
to their traced ones (``core.OutputGuard.consuming``). While a stage is traced its ``meta`` is a
:class:`ReadKeys`: a ``dict`` that notes the key of every value read from it, by any of the dict's
own ways of handing out a value (subscript, ``get``, ``values``, ``items``, ``**`` unpacking,
copies, comparison, printing, pickling, pytree flattening). What reaches a value without asking
the dict for it (``dict.__getitem__(meta, k)`` called unbound, a C extension reading the dict's
slots) is not noted: translation validation (``core.validate_replay``), which compares each capture
with its Python on varied states where such values differ, is the independent check.

>>> read = set()
>>> meta = ReadKeys({"kv_lens": 1, "max_seq_len_k": 9}, read)
>>> meta["kv_lens"] + 1, sorted(read)
(2, ['kv_lens'])
>>> _ = {**meta}; sorted(read)
['kv_lens', 'max_seq_len_k']
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils import _pytree as pytree


class ReadKeys(dict):
    """A stage's ``meta`` while it is traced: a ``dict`` that adds to ``read`` the key of every
    value the stage reads from it (every key, where it reads them all at once)."""

    def __init__(self, data: Any = (), read: set[Any] | None = None) -> None:
        super().__init__(data)
        self._read = set() if read is None else read  # (one a stage builds as type(meta)(...) is its own)

    def _all(self) -> None:
        self._read.update(super().keys())

    def __getitem__(self, key: Any) -> Any:
        self._read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._read.add(key)
        return super().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._read.add(key)
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._read.add(key)
        return super().setdefault(key, default)

    def popitem(self) -> tuple[Any, Any]:
        self._all()
        return super().popitem()

    def __iter__(self) -> Iterator[Any]:
        # a slot of its own: ``{**meta}``, ``dict(meta)`` and ``f(**meta)`` then read each value
        # through ``__getitem__`` rather than the dict's own storage
        return super().__iter__()

    def values(self) -> Any:
        self._all()
        return super().values()

    def items(self) -> Any:
        self._all()
        return super().items()

    def copy(self) -> dict[Any, Any]:
        self._all()
        return dict(super().items())

    def __or__(self, other: Any) -> Any:
        self._all()
        return dict(super().items()) | other

    def __ror__(self, other: Any) -> Any:
        self._all()
        return other | dict(super().items())

    def __eq__(self, other: object) -> bool:
        self._all()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        self._all()
        return super().__ne__(other)

    __hash__ = None

    def __repr__(self) -> str:
        self._all()
        return super().__repr__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # ``copy.copy``, ``copy.deepcopy`` and pickling: a plain dict of every value
        self._all()
        return (dict, (dict(super().items()),))


def _flatten(d: ReadKeys) -> tuple[list[Any], Any]:
    return list(d.values()), list(d.keys())


def _unflatten(values: Any, keys: Any) -> dict[Any, Any]:
    return dict(zip(keys, values, strict=True))


# pytree takes a dict subclass it does not know for a leaf: flattened, a ``ReadKeys`` is its values
pytree.register_pytree_node(ReadKeys, _flatten, _unflatten)
