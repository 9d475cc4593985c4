"""The package imports only downwards: each layer imports only the layers before it.

    effects <- core <- backends <- graph (devices <- lowering <- steps <- runtime <- verification) <- engine <- parallel
    <- races <- cli
    <- __main__ (``python -m readfence``)

Every import statement of every module under ``readfence/`` is read with ``ast``: module-level
ones, and those inside functions, classes and ``if TYPE_CHECKING`` blocks (a function-level
import of a later layer is the same dependency, only hidden). Relative imports are resolved
against the importing module. A module whose package is in no layer is an error too: a new
package must be given its place here.

The checker is fed deliberately bad modules below, so these tests can fail.
"""

from __future__ import annotations

import ast
import functools
import importlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "readfence"

#: The layers, first to last; a module belongs to the longest prefix that names it. The
#: ``readfence.graph`` entry holds what sits on top of graph's subpackages: its re-exporting
#: ``__init__`` and ``readfence.graph.fuzz`` (which runs ``lower`` and ``verify``).
LAYERS: tuple[str, ...] = (
    "readfence.effects",
    "readfence.core",
    "readfence.backends",
    "readfence.graph.devices",
    "readfence.graph.lowering",
    "readfence.graph.steps",
    "readfence.graph.runtime",
    "readfence.graph.verification",
    "readfence.graph",
    "readfence.engine",
    "readfence.parallel",
    "readfence.races",
    "readfence.cli",
    "readfence.__main__",
)

GRAPH_SUBPACKAGES = ("devices", "lowering", "steps", "runtime", "verification")


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``, ``-1`` for the root package (its version
    string: anything may import it), ``None`` for a module that no layer names."""
    if module == "readfence" or (module.startswith("readfence.__") and module not in LAYERS):
        return -1
    best = None
    for i, prefix in enumerate(LAYERS):
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(LAYERS[best])):
            best = i
    return best


def modules(root: Path) -> Iterator[tuple[str, Path]]:
    """``(dotted name, path)`` of every module under the package directory ``root``."""
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def imported(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``module`` imports, wherever the statement is.

    ``from X import a`` yields ``X.a`` (``a`` may be a submodule: ``from . import _cuda``), so
    the layer is that of the longest known prefix.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    yield from _imports(package, path.read_text())


@functools.cache
def _imports(package: str, source: str) -> tuple[tuple[int, str], ...]:
    # keyed by the text read: every check here reads every module, and a planted copy differs
    # from the package in one file, so each distinct source is parsed once
    return tuple(_statements(package, ast.parse(source)))


def _statements(package: str, tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                yield node.lineno, source if alias.name == "*" else f"{source}.{alias.name}"


def violations(root: Path) -> list[str]:
    """One line per import of a later layer (or per module in no layer) under ``root``."""
    found = []
    for module, path in modules(root):
        own = layer_of(module)
        where = path.relative_to(root.parent)
        if own is None:
            found.append(f"{where}: module {module} is in no layer; give its package a place in LAYERS")
            continue
        for line, target in imported(module, path):
            if not target.startswith("readfence"):
                continue
            theirs = layer_of(target)
            if theirs is None or theirs > own:
                layer = "no layer" if theirs is None else LAYERS[theirs]
                found.append(f"{where}:{line}: {module} ({LAYERS[own] if own >= 0 else 'readfence'}) "
                             f"imports {target} ({layer}), a later layer")
    return found


def import_cycle(root: Path) -> list[str] | None:
    """A chain of modules under ``root`` that ends where it starts (each imports the next,
    function-level imports included), or ``None``."""
    found = dict(modules(root))

    def module_of(target: str) -> str:
        while target and target not in found:
            target = target.rpartition(".")[0]
        return target

    edges = {m: sorted({module_of(t) for _, t in imported(m, p)} - {"", m}) for m, p in found.items()}
    done: set[str] = set()
    for start in edges:
        path, stack = [start], [iter(edges[start])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(edges[nxt]))
    return None


def test_every_module_imports_only_earlier_layers() -> None:
    assert violations(PACKAGE) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert import_cycle(PACKAGE) is None


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "readfence"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_catches_later_layers_at_any_depth_and_by_any_spelling(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "core/_ok.py": "from readfence.effects import ReadEnd\nfrom readfence import __version__\n",
        "core/_late.py": "def f():\n    from readfence.backends import parse\n",            # in a function
        "graph/steps/_rel.py": "from ..runtime import decode_loop\n",                       # relative
        "graph/devices/_open.py": "from . import _cuda\nclass C:\n    import readfence.cli\n",  # in a class
        "graph/lowering/_typing.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from readfence.graph import Policy\n",            # the facade
        "backends/_star.py": "from readfence.graph.devices import *\n",
        "engines/_new.py": "x = 1\n",
    })
    found = violations(root)
    assert len(found) == 6, "\n".join(found)
    expected = [("backends/_star.py:1", "readfence.graph.devices"), ("core/_late.py:2", "readfence.backends.parse"),
                ("engines/_new.py", "in no layer"), ("graph/devices/_open.py:3", "readfence.cli"),
                ("graph/lowering/_typing.py:3", "readfence.graph.Policy (readfence.graph)"),
                ("graph/steps/_rel.py:1", "readfence.graph.runtime.decode_loop")]
    for line, (where, what) in zip(sorted(found), expected):
        assert line.startswith(f"readfence/{where}") and what in line, line


def test_the_cycle_check_finds_a_protocol_that_imports_its_implementation(tmp_path: Path) -> None:
    # the shape of the cycle the device protocol once had: a function-level import of an
    # implementation that imports the protocol at module level
    root = _package(tmp_path, {
        "graph/devices/_protocol.py": "class Device: ...\ndef default_device():\n    from ._cpu import CpuDevice\n",
        "graph/devices/_cpu.py": "from ._protocol import Device\n",
        "graph/devices/_open.py": "from ._cpu import CpuDevice\nfrom ._protocol import Device\n",
    })
    assert violations(root) == []  # one layer: only the cycle check sees it
    assert import_cycle(root) in (["readfence.graph.devices._cpu", "readfence.graph.devices._protocol",
                                   "readfence.graph.devices._cpu"],
                                  ["readfence.graph.devices._protocol", "readfence.graph.devices._cpu",
                                   "readfence.graph.devices._protocol"])
    (root / "graph/devices/_protocol.py").write_text("class Device: ...\n")
    assert import_cycle(root) is None


def test_a_bad_import_planted_in_a_copy_of_the_package_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "readfence"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(copy) == [] and import_cycle(copy) is None
    shapes = copy / "graph" / "steps" / "_shapes.py"
    shapes.write_text(shapes.read_text() + "\n\ndef _late():\n    from readfence.graph.runtime import run_serial\n")
    (found,) = violations(copy)
    assert "readfence/graph/steps/_shapes.py" in found and "readfence.graph.runtime.run_serial" in found


def _exports(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


def test_graph_exports_a_selection_of_its_subpackages_public_names_as_the_same_objects() -> None:
    import readfence.graph as graph

    names = [n for sub in GRAPH_SUBPACKAGES for n in _exports(f"readfence.graph.{sub}")]
    assert len(set(names)) == len(names)  # no name is public in two subpackages
    assert set(graph.__all__) <= set(names) and len(set(graph.__all__)) == len(graph.__all__)
    for sub in GRAPH_SUBPACKAGES:
        package = importlib.import_module(f"readfence.graph.{sub}")
        for name in set(package.__all__) & set(graph.__all__):
            assert getattr(graph, name) is getattr(package, name), (sub, name)
    # what the top level leaves out is not reachable from it by accident
    left_out = set(names) - set(graph.__all__)
    assert left_out and not any(hasattr(graph, n) for n in left_out), sorted(n for n in left_out if hasattr(graph, n))


@pytest.mark.parametrize("package", ["readfence.effects", "readfence.core", "readfence.backends", "readfence.graph",
                                     "readfence.engine", "readfence.parallel"])
def test_no_public_name_means_two_things(package: str) -> None:
    # a name exported by two public packages is the same object in both
    module = importlib.import_module(package)
    others = ["readfence.effects", "readfence.core", "readfence.backends", "readfence.graph", "readfence.engine",
              "readfence.engine.reference", "readfence.parallel", *(f"readfence.graph.{s}" for s in GRAPH_SUBPACKAGES)]
    clashes = []
    for other in others:
        theirs = importlib.import_module(other)
        for name in set(module.__all__) & set(theirs.__all__):
            if getattr(module, name) is not getattr(theirs, name):
                clashes.append(f"{package}.{name} is not {other}.{name}")
    assert clashes == []


@pytest.mark.parametrize("package", ["readfence.effects", "readfence.core", "readfence.backends",
                                     *(f"readfence.graph.{sub}" for sub in GRAPH_SUBPACKAGES)])
def test_every_exported_name_exists(package: str) -> None:
    module = importlib.import_module(package)
    assert [n for n in module.__all__ if not hasattr(module, n)] == []


def private_reaches(root: Path) -> list[str]:
    """One line per import of another layer's private module (a ``_name`` module): what a
    layer shares with the later ones is its public ``__init__`` or its ``internal`` module."""
    found = []
    for module, path in modules(root):
        own = layer_of(module)
        for line, target in imported(module, path):
            if not target.startswith("readfence.") or layer_of(target) == own:
                continue
            parts = target.split(".")
            private = [p for p in parts[1:] if p.startswith("_") and not p.startswith("__")]
            if private:
                found.append(f"{path.relative_to(root.parent)}:{line}: {module} imports {target}, a private module "
                             f"of {LAYERS[layer_of(target) or 0]}; import it from that layer's internal module")
    return found


def test_no_layer_reaches_into_another_layers_private_modules() -> None:
    assert private_reaches(PACKAGE) == []


def test_the_private_import_check_sees_a_private_reach(tmp_path: Path) -> None:
    root = tmp_path / "readfence"
    shutil.copytree(PACKAGE / "core", root / "core")
    (root / "__init__.py").write_text("")
    (root / "backends").mkdir()
    (root / "backends" / "__init__.py").write_text("from readfence.core._checks import positive_int\n")
    found = private_reaches(root)
    assert len(found) == 1 and "readfence.core._checks.positive_int" in found[0], found


TRACER = "readfence.core.tracing"


def _in_tracer(module: str) -> bool:
    return module == TRACER or module.startswith(TRACER + ".")


def tracer_private_reaches(root: Path) -> list[str]:
    """One line per import of one of the tracer's private modules (``core.tracing._x``) from
    outside its folder: the rest of readfence uses what ``readfence.core.tracing`` exports."""
    found = []
    for module, path in modules(root):
        if _in_tracer(module):
            continue
        for line, target in imported(module, path):
            if _in_tracer(target) and target[len(TRACER):].lstrip(".").startswith("_"):
                found.append(f"{path.relative_to(root.parent)}:{line}: {module} imports {target}, a private module "
                             f"of the tracer; import it from {TRACER}")
    return found


def below_the_tracer(root: Path) -> set[str]:
    """The core modules outside the tracer that it imports, directly or through one another:
    the step's data it is built on."""
    found = dict(modules(root))

    def module_of(target: str) -> str:
        while target and target not in found:
            target = target.rpartition(".")[0]
        return target

    def core_imports(module: str) -> set[str]:
        targets = {module_of(t) for _, t in imported(module, found[module])}
        return {t for t in targets if t.startswith("readfence.core.") and not _in_tracer(t)}

    below: set[str] = set()
    todo = [t for m in found if _in_tracer(m) for t in core_imports(m)]
    while todo:
        module = todo.pop()
        if module not in below:
            below.add(module)
            todo.extend(core_imports(module))
    return below


def tracer_imported_from_below(root: Path) -> list[str]:
    """One line per import of the tracer by a core module the tracer itself imports (see
    :func:`below_the_tracer`): the step's data never depends on how a step is traced."""
    found = dict(modules(root))
    return [f"{found[module].relative_to(root.parent)}:{line}: {module} is below the tracer (the tracer imports it) "
            f"and imports {target}"
            for module in sorted(below_the_tracer(root))
            for line, target in imported(module, found[module]) if _in_tracer(target)]


def test_nothing_outside_the_tracer_imports_its_private_modules() -> None:
    assert tracer_private_reaches(PACKAGE) == []


def test_no_core_module_below_the_tracer_imports_it() -> None:
    below = below_the_tracer(PACKAGE)
    # the step's data is below; the model and the example state, which a trace runs on, are above
    assert {"readfence.core._step", "readfence.core._program", "readfence.core._protocol"} <= below
    assert not {"readfence.core._model", "readfence.core._state", "readfence.core._audit"} & below
    assert tracer_imported_from_below(PACKAGE) == []


def test_the_tracer_checks_catch_a_private_reach_and_an_import_from_below(tmp_path: Path) -> None:
    copy = tmp_path / "readfence"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert tracer_private_reaches(copy) == [] and tracer_imported_from_below(copy) == []
    audit = copy / "core" / "_audit.py"  # above the tracer: it may use the face, not a private module
    audit.write_text(audit.read_text() + "\n\ndef _late():\n    from .tracing._memory import span_of\n")
    step = copy / "core" / "_step.py"  # below the tracer: even its face is out of reach
    step.write_text(step.read_text() + "\n\ndef _late():\n    from readfence.core.tracing import span_of\n")
    (reach,) = tracer_private_reaches(copy)
    assert reach.startswith("readfence/core/_audit.py:") and "readfence.core.tracing._memory.span_of" in reach
    (below,) = tracer_imported_from_below(copy)
    assert below.startswith("readfence/core/_step.py:") and "readfence.core.tracing.span_of" in below


#: The most lines a module of the package may have: past it, a module does more than one job.
MODULE_LINES = 600


def long_modules(root: Path) -> list[str]:
    """The modules under ``root`` over :data:`MODULE_LINES` lines, with their sizes."""
    return sorted(f"{p.relative_to(root.parent)}: {n} lines" for p in root.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MODULE_LINES)


def test_no_module_is_over_600_lines(tmp_path: Path) -> None:
    assert long_modules(PACKAGE) == []
    grown = tmp_path / "readfence"
    grown.mkdir()
    (grown / "big.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    assert long_modules(grown) == [f"readfence/big.py: {MODULE_LINES + 1} lines"]
