"""Whose op an op is: torch's own, readfence's own, or one someone else registered.

The checks that take an op's schema at its word (the alias check at a replay passes over torch's
own ops; the read observer runs any other op's kernel under itself, to see its inner ops) must
know who wrote the op, and its namespace does not say: anyone may define an op in ``aten``
(``torch.library.Library("aten", "FRAGMENT")``) or register a kernel for one of torch's.
The dispatcher records where each registration was made (``torch._C._dispatch_dump``: the
schema's ``registered at file:line`` and each active kernel's), and :func:`torch_op` decides
from those: an op is torch's own when its schema and every kernel it has were registered by
torch itself, in the C++ sources torch was built from (the tree its own ``aten::add`` was
registered from) or in a Python file of the torch package, and every Python kernel set on the op
object (``py_kernels``) is a function of the torch package. A registration made through the entry
points that register for anyone (``torch.library``, ``torch._library``) is torch's only when the
definition behind it, a ``torch.library.custom_op``'s functions, lives in the torch package; one
whose maker is unknown (``torch.library.define``, ``torch.library.impl``) is not, unless it is a
kernel that computes nothing on a forward's real tensors (a meta kernel, an autograd formula:
torch's own collectives get theirs so). :func:`readfence_op` knows readfence's
own ops by their registration, recorded as readfence's code makes them (:func:`own_op`), never by
their namespace.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch._library.custom_ops import OPDEFS

_F = TypeVar("_F")

#: The torch package's directory; Python registrations made from a file under it are torch's.
_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__))
#: The files under it that register ops for anyone (``torch.library.define``, ``custom_op``).
_ENTRY_POINTS = (os.path.join(_TORCH_DIR, "library.py"), os.path.join(_TORCH_DIR, "_library") + os.sep)
#: Where a registration was made: ``registered at <file>:<line>`` (a line without one, ``registered
#: by RegisterOperators``, names no maker).
_AT = re.compile(r"registered at (.+?):(\d+)(?: ::|$)")
#: Namespaces whose C++ registrations count as torch's in a build that records no registration
#: files (a stripped build): the only case in which a namespace decides.
_STRIPPED_BUILD_NAMESPACES = frozenset({"aten", "prim", "prims", "_c10d_functional", "_c10d_functional_autograd"})


@functools.cache
def _cpp_root() -> str | None:
    """The directory of torch's C++ sources, as its registrations name it: the common root of
    where ``aten::add.Tensor``'s schema and its autograd kernel were registered (``None`` in a
    build that records no files)."""
    files = [m.group(1) for line in torch._C._dispatch_dump("aten::add.Tensor").splitlines()
             if (line.startswith("debug:") or line.startswith("Autograd")) and (m := _AT.search(line))]
    if len(files) < 2 or any(f.endswith(".py") for f in files):
        return None
    root = os.path.commonpath(files)
    return root + os.sep if root not in ("", os.sep) else None


@functools.lru_cache(maxsize=4096)  # by file name: a few hundred files register torch's ops
def _place(path: str) -> str:
    """Where a registration file is: ``"torch"`` (torch's C++ sources, or a Python file of the torch
    package), ``"entry"`` (an entry point that registers for anyone) or ``"other"``."""
    if path.startswith("<"):  # ``<stdin>``, ``<string>``: code typed or generated
        return "other"
    if not path.endswith(".py"):
        root = _cpp_root()
        return "torch" if root is not None and path.startswith(root) else "other"
    real = os.path.realpath(path)
    if any(real == e or real.startswith(e) for e in _ENTRY_POINTS):
        return "entry"
    return "torch" if real.startswith(_TORCH_DIR + os.sep) else "other"


def _torch_file(path: str) -> bool:
    """A Python file of the torch package, other than the entry points that register for anyone."""
    return path.endswith(".py") and _place(path) == "torch"


def _function_file(fn: Any) -> str | None:
    """The file a Python callable's code is in (through partials and bound methods)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return None if code is None else code.co_filename


def _definition_functions(op: Any) -> Iterator[Any]:
    """The functions of the ``torch.library.custom_op`` that defined ``op`` (its implementation
    and every kernel registered through it); nothing for an op defined otherwise."""
    opdef = OPDEFS.get(op._schema.name)
    if opdef is None:
        return
    for value in vars(opdef).values():
        if isinstance(value, dict):
            yield from (v for v in value.values() if callable(v))
        elif callable(value) and not isinstance(value, (type, torch.library.Library, torch._ops.OpOverload)):
            yield value


#: Kernels that never compute a value on the real tensors of a forward: a meta (fake tensor) kernel,
#: an autograd formula (it runs the op below autograd; its own code only where a gradient is wanted).
#: One registered through an entry point whose maker is unknown does not count against the op.
_INERT_KEYS = ("Meta", "Autograd")


def _torch_location(op: Any, key: str, where: str | None) -> bool:
    """Whether the registration of ``op``'s ``key`` (``debug``: its schema) made at ``where`` (a
    file, ``None`` when not said) is torch's, or is one that cannot matter."""
    if where is None:
        return False
    if not where.endswith(".py") and not where.startswith("<") and _cpp_root() is None:
        return op.namespace in _STRIPPED_BUILD_NAMESPACES
    place = _place(where)
    if place == "entry":  # made on someone's behalf: by whom?
        functions = list(_definition_functions(op))
        if functions:  # a ``custom_op``: its own functions say
            return all((f := _function_file(fn)) is not None and _torch_file(f) for fn in functions)
        return key != "debug" and key.startswith(_INERT_KEYS)
    return place == "torch"


def _registrations(op: Any) -> list[tuple[str, str | None]]:
    """``(key, where)`` of the schema (key ``debug``) and of each active kernel of ``op``, where
    being the file it was registered from (``None``: not said)."""
    name = op._schema.name + (f".{op._overloadname}" if op._overloadname != "default" else "")
    out: list[tuple[str, str | None]] = []
    for line in torch._C._dispatch_dump(name).splitlines():
        head = line.split(":", 1)[0]
        if head in ("name", "schema", "alias analysis kind") or "(inactive)" in head:
            continue
        m = _AT.search(line)
        out.append((head, m.group(1) if m else None))
    return out


def _decide(op: Any) -> bool:
    registered = _registrations(op)
    if not any(key == "debug" for key, _ in registered):
        return False
    if not all(_torch_location(op, key, where) for key, where in registered):
        return False
    return all((f := _function_file(fn)) is not None and _torch_file(f) for fn in op.py_kernels.values())


_LOCK = threading.Lock()
#: Per op, its verdict and the generation it was made at: the counts of the ops defined and the
#: kernels registered from Python, and of the op's Python kernels, which a later registration
#: changes. (A C++ extension that registers a kernel for an op after the op was asked about is not
#: seen: load extensions before lowering.)
_VERDICTS: dict[Any, tuple[tuple[int, ...], bool]] = {}
_IMPLS, _DEFS = torch.library._impls, torch.library._defs


def torch_op(op: object) -> bool:
    """Whether ``op`` is an op overload torch itself defined, with only torch's kernels (see the
    module docstring): its schema is torch's word, whatever namespace an op is in.

    >>> torch_op(torch.ops.aten.index_select.default), torch_op(torch.ops.prims.view_of.default)
    (True, True)
    >>> lib = torch.library.Library("aten", "FRAGMENT")
    >>> lib.define("origin_demo(Tensor x) -> Tensor")
    'origin_demo'
    >>> torch_op(torch.ops.aten.origin_demo.default)  # in aten, defined here
    False
    """
    known = _VERDICTS.get(op)
    if known is not None and known[0] == (len(_IMPLS), len(_DEFS), len(op.py_kernels)):  # type: ignore[attr-defined]
        return known[1]
    if not isinstance(op, torch._ops.OpOverload):
        return False
    generation = (len(_IMPLS), len(_DEFS), len(op.py_kernels))
    verdict = _decide(op)
    with _LOCK:
        _VERDICTS[op] = (generation, verdict)
    return verdict


#: The ops readfence's own code registered, with the definition each was registered as.
_OWN: dict[Any, Any] = {}


def own_op(definition: _F) -> _F:
    """Record ``definition`` (a ``torch.library.custom_op`` readfence's code makes) as readfence's
    own; return it. Its op counts as readfence's while that name is defined by this very object.

    >>> own_op(None) is None
    True
    """
    op = getattr(definition, "_opoverload", None)
    if op is not None:
        _OWN[op] = definition
    return definition


def readfence_op(op: object) -> bool:
    """Whether ``op`` is one readfence's own code registered (:func:`own_op`) and still defined by
    it (an op later defined over its name, in its namespace, is someone else's).

    >>> readfence_op(torch.ops.aten.add.Tensor)
    False
    """
    definition = _OWN.get(op)
    if definition is None:
        return False
    return OPDEFS.get(op._schema.name) is definition  # type: ignore[attr-defined]


def trusted_op(op: object) -> bool:
    """Whether ``op``'s schema is the word of its kernel's own authors, torch's or readfence's
    (:func:`torch_op`, :func:`readfence_op`): an op any other code registered may do what its
    schema does not say.

    >>> trusted_op(torch.ops.aten.add.Tensor), trusted_op(torch.ops.readfence.opaque.default)
    (True, True)
    """
    return torch_op(op) or readfence_op(op)


__all__ = ["own_op", "readfence_op", "torch_op", "trusted_op"]
