"""``readfence bench``: run the repository's benchmarks and print their ratios.

Each benchmark is a module under ``benchmarks/`` of the source checkout. When it has a
``main`` function, it is imported and called (with ``quick=`` if it takes it, else with an
argv list if it takes one); a mapping it returns is printed as ``name: value`` lines. A module
without ``main`` runs as a script (``python path [--quick]``).
"""

from __future__ import annotations

import importlib.util
import inspect
import numbers
import pathlib
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import click

from ._params import DeviceName

#: The benchmarks ``readfence bench`` runs, in order (files under ``benchmarks/``).
BENCHMARKS = ("bench_overlap.py", "bench_overhead.py")


def benchmarks_dir() -> pathlib.Path | None:
    """``benchmarks/`` of the source checkout this package runs from, if there is one.

    >>> d = benchmarks_dir()
    >>> d is None or d.name == "benchmarks"
    True
    """
    import readfence

    candidate = pathlib.Path(readfence.__file__).resolve().parents[1] / "benchmarks"
    return candidate if candidate.is_dir() else None


def _call_main(main: Any, quick: bool, device: str = "cpu") -> Any:
    params = inspect.signature(main).parameters
    if "quick" in params:
        return main(quick=quick, **({"device": device} if "device" in params else {}))
    argv = (["--quick"] if quick else []) + (["--device", device] if device != "cpu" else [])
    if params:
        return main(argv)
    saved = sys.argv
    sys.argv = [getattr(main, "__module__", "bench")] + argv
    try:
        return main()
    finally:
        sys.argv = saved


def format_ratios(result: Any, prefix: str = "") -> list[str]:
    """Lines ``name: value`` for a (nested) mapping of numbers; other values as text.

    >>> format_ratios({"per_buffer_vs_coarse": 1.234, "n": {"steps": 100}})
    ['per_buffer_vs_coarse: 1.23', 'n.steps: 100']
    """
    if isinstance(result, Mapping):
        lines = []
        for key, value in result.items():
            lines += format_ratios(value, f"{prefix}{key}.") if isinstance(value, Mapping) else \
                [f"{prefix}{key}: {_show(value)}"]
        return lines
    return [] if result is None else [f"{prefix.rstrip('.') or 'result'}: {_show(result)}"]


def _show(value: Any) -> str:
    if isinstance(value, numbers.Integral):
        return str(value)
    if isinstance(value, numbers.Real):
        return f"{value:.2f}"
    return str(value)


def run_benchmark(path: pathlib.Path, quick: bool, device: str = "cpu") -> int:
    """Run one benchmark (see the module docstring); returns an exit status."""
    spec = importlib.util.spec_from_file_location(f"readfence_bench_{path.stem}", path)
    module = None
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError:
            module = None
    main = getattr(module, "main", None)
    if not callable(main):
        cmd = [sys.executable, str(path)] + (["--quick"] if quick else []) + \
            (["--device", device] if device != "cpu" else [])
        return subprocess.run(cmd, check=False).returncode
    for line in format_ratios(_call_main(main, quick, device)):
        click.echo(line)
    return 0


@click.command()
@click.option("--quick", is_flag=True, help="Fewer steps and repeats: a smoke run.")
@click.option("--device", type=DeviceName(), default="cpu", show_default=True,
              help="cpu, cuda or auto (passed to each benchmark's main).")
def bench(quick: bool, device: str) -> None:
    """Run the benchmarks (from the source checkout) and print their ratios."""
    where = benchmarks_dir()
    if where is None:
        raise click.ClickException(
            "the benchmarks live in the source repository (benchmarks/), which is not next to this "
            "installed package; clone the repository, `pip install -e .` it and run `readfence bench` again")
    found = [where / name for name in BENCHMARKS if (where / name).is_file()]
    if not found:
        raise click.ClickException(f"no benchmark found in {where} (looked for {', '.join(BENCHMARKS)})")
    failed = 0
    for path in found:
        click.echo(f"== {path.stem}{' (quick)' if quick else ''}")
        sys.stdout.flush()
        failed += run_benchmark(path, quick, device) != 0
    if failed:
        sys.exit(1)
