"""Every ``@triton.jit`` kernel of SGLang's tree and of these tests, decided by triton's IR and by the
source walk, side by side: where the source walk finds less than the IR, and where they disagree
on whether a kernel's memory is bounded by its arguments.

No launch gives these kernels their arguments, so each is made up from the kernel's source: a
``constexpr`` gets its default or a guess by name (16, ``tl.float32``, ``False``), a parameter
used as a load's, a store's or a cast's base is a tensor, any other an integer. A guess triton
rejects leaves that kernel's IR unbuilt (counted, by reason); the comparison is over the others.
Importing SGLang's ~400 kernel modules takes a while and leaves them in ``sys.modules``: the test
runs this in a process of its own (``--shard I/N`` runs the I-th of N runs of the modules in
order, so that several processes can share the census).

    python -m tests.core.kernel_census [--json] [--shard I/N]
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import importlib
import inspect
import json
import os
import pathlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

#: The test modules whose kernels are compared too.
TEST_MODULES = ("tests.core.test_kernel_access", "tests.core.test_triton", "tests.core.test_kernel_ir",
                "tests.core.kernel_helpers")
_BASES = {"load", "store", "atomic_add", "atomic_max", "atomic_min", "atomic_cas", "atomic_xchg", "atomic_or",
          "atomic_and", "atomic_xor", "make_block_ptr", "make_tensor_descriptor", "cast"}
_INDEX_WORDS = ("loc", "idx", "ind", "len", "ids", "slot", "table", "map", "offset", "count", "seq", "pos", "req",
                "token", "page", "start", "num", "cu_", "cnt", "rank", "expert")
_NAMED_POINTERS = ("ptr", "dst", "src", "out", "buf", "cache")
_FLAGS = ("IS_", "HAS_", "USE_", "ENABLE", "EVEN", "SKIP", "CAUSAL", "APPLY", "DO_", "SAVE", "RETURN", "NEED", "WITH")


def module_names(sglang_tree: bool = True) -> list[str]:
    """The modules whose kernels are compared: SGLang's that define one (``sglang_tree``), then the tests'."""
    import sglang

    root = pathlib.Path(sglang.__file__).parent
    names = sorted("sglang." + ".".join(p.relative_to(root).with_suffix("").parts) for p in root.rglob("*.py")
                   if sglang_tree and "@triton.jit" in p.read_text(errors="ignore"))
    return [*names, *TEST_MODULES]


def shard_of(names: list[str], index: int, count: int) -> list[str]:
    """The ``index``-th of ``count`` runs of ``names`` in order: a module imports after the ones before
    it, as in one process (a package that some module's import leaves loaded is there for the next).

    >>> [shard_of(list("abcde"), i, 2) for i in range(2)]
    [['a', 'b'], ['c', 'd', 'e']]
    """
    return names[len(names) * index // count:len(names) * (index + 1) // count]


def kernels(names: list[str]) -> Iterator[tuple[str, str, Any]]:
    """``(module, name, kernel)`` for every interpreted kernel defined in the modules ``names`` (one
    that cannot be imported here has none)."""
    from triton.runtime.interpreter import InterpretedFunction

    from tests.engine.sglang_standins import standins_installed

    modules = []
    with standins_installed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                modules.append(importlib.import_module(name))
            except BaseException:  # noqa: B036 (a module that needs a GPU library, or exits, is not a kernel here)
                continue
    for module in modules:
        for name, value in sorted(vars(module).items()):
            if isinstance(value, InterpretedFunction) and value.fn.__module__ == module.__name__:
                yield module.__name__, name, value


def _leftmost(e: ast.expr) -> ast.expr:
    while isinstance(e, (ast.BinOp, ast.Subscript)):
        e = e.left if isinstance(e, ast.BinOp) else e.value
    return e


def _pointers(fn: Any) -> set[str]:
    """The parameters the kernel's source uses as the base of an address (through plain assignments)."""
    from readfence.core.tracing._kernel_access import parsed_source

    tree = fdef = parsed_source(fn).node  # parsed once for this guess and the source walk alike
    assert isinstance(fdef, ast.FunctionDef)
    params = {a.arg for a in fdef.args.args}
    alias: dict[str, set[str]] = collections.defaultdict(set)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            left = _leftmost(n.value)
            if isinstance(left, ast.Name):
                alias[n.targets[0].id].add(left.id)

    def bases(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        return {name}.union(*(bases(a, seen | {name}) for a in alias.get(name, ()) if a not in seen))

    found: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            called = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            given = [n.args[0]] if called in _BASES and n.args else []
            given += [k.value for k in n.keywords if k.arg in ("base", "pointer", "ptr")]
            for e in given:
                left = _leftmost(e)
                if isinstance(left, ast.Name):
                    found |= bases(left.id)
        if isinstance(n, ast.Attribute) and n.attr == "dtype" and isinstance(n.value, ast.Name):
            found |= bases(n.value.id)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "to"
                and "pointer_type" in ast.unparse(n)):  # ``p.to(tl.pointer_type(...))``
            left = _leftmost(n.func.value)
            if isinstance(left, ast.Name):
                found |= bases(left.id)
    return params & found


def _tensor_for(name: str) -> torch.Tensor:
    """A tensor for parameter ``name``: integers where the name says it holds indices or lengths."""
    lowered = name.lower()
    return torch.empty(4, dtype=torch.int32 if any(w in lowered for w in _INDEX_WORDS) else torch.float32)


def guess(fn: Any) -> dict[str, Any]:
    """Arguments for a launch of ``fn``, made up from its source (see the module docstring)."""
    import triton.language as tl

    pointers = _pointers(fn)
    out: dict[str, Any] = {}
    for name, p in inspect.signature(fn).parameters.items():
        const = p.annotation is tl.constexpr or "constexpr" in str(p.annotation)
        upper = name.upper()
        if p.default is not inspect.Parameter.empty and (const or p.default is None):
            out[name] = p.default
        elif const and ("DTYPE" in upper or "TYPE" in upper):
            out[name] = tl.float32
        elif const and upper.startswith(_FLAGS):
            out[name] = False
        elif const:
            out[name] = 16
        else:
            named = any(w in name.lower() for w in _NAMED_POINTERS)
            out[name] = _tensor_for(name) if name in pointers or named else 7
    return out


def census(sglang_tree: bool = True, shard: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """The comparison over the ``shard`` ``(I, N)`` of the modules: counts, the kernels whose IR was
    not built (by reason), and the differences; ``every`` names all shards' modules, ``modules``
    this shard's."""
    from readfence.core.tracing._kernel_access import source_access
    from readfence.core.tracing._kernel_ir import ir_access

    out: dict[str, Any] = {"kernels": 0, "built": 0, "sglang": 0, "sglang_built": 0, "source_misses": [],
                           "ir_only_unbounded": [], "source_only_unbounded": []}
    unbuilt: collections.Counter[str] = collections.Counter()
    every = module_names(sglang_tree)
    index, count = shard
    out["every"], out["modules"] = every, shard_of(every, index, count)
    for module, name, kernel in kernels(out["modules"]):
        arguments = guess(kernel.fn)
        ir, source = ir_access(kernel, arguments), source_access(kernel, arguments)
        sglang = module.startswith("sglang.")
        out["kernels"] += 1
        out["sglang"] += sglang
        if not ir.decided:
            unbuilt[ir.basis.split(":")[0][:60]] += 1
            continue
        out["built"] += 1
        out["sglang_built"] += sglang
        tensors = {n for n, v in arguments.items() if isinstance(v, torch.Tensor)}
        missed = sorted((ir.writes - source.writes) & tensors)
        if missed:
            out["source_misses"].append([module, name, missed])
        if ir.unbounded and not source.unbounded:
            out["ir_only_unbounded"].append([module, name])
        if source.unbounded and not ir.unbounded:
            out["source_only_unbounded"].append([module, name])
    out["unbuilt"] = dict(unbuilt.most_common())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tests-only", action="store_true", help="the tests' kernels, not SGLang's")
    parser.add_argument("--shard", default="0/1", help="I/N: the I-th of N runs of the modules (default: all)")
    args = parser.parse_args()
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        parser.error(f"--shard must be I/N with 0 <= I < N, got {args.shard!r}")
    with contextlib.redirect_stdout(sys.stderr):  # (triton prints an IR that fails to verify)
        result = census(not args.tests_only, (int(index), int(count)))
    if args.json:
        json.dump(result, sys.stdout)
        return
    print(f"{result['built']} of {result['kernels']} kernels' IR built ({result['sglang_built']} of SGLang's "
          f"{result['sglang']})")
    for key in ("source_misses", "ir_only_unbounded", "source_only_unbounded"):
        print(f"{key}: {len(result[key])}")
        for row in result[key]:
            print("   ", *row)


if __name__ == "__main__":
    main()
