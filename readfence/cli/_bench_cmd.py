"""``readfence bench``: run the repository's benchmarks and print their figures.

Each benchmark is a module ``benchmarks/bench_<name>.py`` of the source checkout with a
``main(quick=False, ...)`` that measures side by side and returns its figures as a (nested)
mapping; ``readfence bench`` imports it, calls ``main`` (with ``device=`` when it takes one)
and prints the mapping as ``name: value`` lines. ``--quick`` is each benchmark's smoke run
(seconds: it checks that everything runs, its ratios are noise).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import numbers
import pathlib
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import click

from ._errors import OneLineCommand
from ._params import DeviceName, OneOf

#: Every benchmark under ``benchmarks/`` (``bench_<name>.py``), in the order ``readfence bench``
#: runs them: the cheap ones first. A test checks that no benchmark file is left out.
BENCHMARKS = ("effects", "audit", "scale", "check", "overhead", "overlap", "serve", "fuzz", "tp", "triton")


def benchmarks_dir() -> pathlib.Path | None:
    """``benchmarks/`` of the source checkout this package runs from, if there is one.

    >>> d = benchmarks_dir()
    >>> d is None or d.name == "benchmarks"
    True
    """
    import readfence

    candidate = pathlib.Path(readfence.__file__).resolve().parents[1] / "benchmarks"
    return candidate if candidate.is_dir() else None


def format_ratios(result: object, prefix: str = "") -> list[str]:
    """Lines ``name: value`` for a (nested) mapping of numbers; other values as text.

    >>> format_ratios({"per_buffer_vs_coarse": 1.234, "n": {"steps": 100}, "rate": None})
    ['per_buffer_vs_coarse: 1.23', 'n.steps: 100', 'rate: n/a (too few samples)']
    """
    if isinstance(result, Mapping):
        lines = []
        for key, value in result.items():
            lines += format_ratios(value, f"{prefix}{key}.") if isinstance(value, Mapping) else \
                [f"{prefix}{key}: {_show(value)}"]
        return lines
    return [] if result is None else [f"{prefix.rstrip('.') or 'result'}: {_show(result)}"]


def _show(value: Any) -> str:
    if value is None:
        return "n/a (too few samples)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(value)
    return f"{value:.2f}"


def load_main(path: pathlib.Path) -> Callable[..., Mapping[str, object]]:
    """The ``main`` of the benchmark module at ``path``; ``TypeError`` if it has none that
    takes ``quick``. The module is imported under its own name (``bench_tp``), so a benchmark
    that starts processes can hand them its functions by reference (see :func:`run_benchmark`)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import benchmark {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if not callable(main) or "quick" not in inspect.signature(main).parameters:
        raise TypeError(f"benchmark {str(path)!r} has no main(quick=...) to call")
    return main


@contextlib.contextmanager
def _importable_from(folder: pathlib.Path) -> Iterator[None]:
    """``folder`` on ``sys.path`` for the duration: a spawned process (the tensor-parallel ranks)
    unpickles a benchmark's function by importing its module by name, with this ``sys.path``."""
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)


def run_benchmark(path: pathlib.Path, quick: bool, device: str = "cpu") -> Mapping[str, object]:
    """Run one benchmark's ``main``; returns its figures."""
    with _importable_from(path.parent):
        main = load_main(path)
        if "device" in inspect.signature(main).parameters:
            return main(quick=quick, device=device)
        if device != "cpu":
            click.echo(f"({path.stem} runs on the CPU whatever --device says)")
        return main(quick=quick)


@click.command(cls=OneLineCommand)
@click.argument("names", nargs=-1, type=OneOf(BENCHMARKS, "benchmark"))
@click.option("--quick", is_flag=True, help="Each benchmark's smoke run (seconds; the ratios are noise).")
@click.option("--device", type=DeviceName(), default="cpu", show_default=True,
              help="cpu, cuda or auto (for the benchmarks that take a device).")
def bench(names: Sequence[str], quick: bool, device: str) -> None:
    """Run the benchmarks (from the source checkout) and print their ratios.

    \b
    NAMES picks some (effects, audit, scale, check, overhead, overlap, serve, fuzz, tp); default: all of them,
    in that order. Exit status 1 if one fails (the others still run).
    """
    where = benchmarks_dir()
    if where is None:
        raise click.ClickException(
            "the benchmarks live in the source repository (benchmarks/), which is not next to this "
            "installed package; clone the repository, `pip install -e .` it and run `readfence bench` again")
    chosen = [n for n in BENCHMARKS if not names or n in names]
    missing = [n for n in chosen if not (where / f"bench_{n}.py").is_file()]
    if missing:
        raise click.ClickException(f"no benchmark file for {', '.join(missing)} in {where} "
                                   f"(looked for {', '.join(f'bench_{n}.py' for n in missing)})")
    failed = []
    if quick:
        click.echo("quick: each benchmark's smoke run; its figures show that it runs, they measure nothing")
    for name in chosen:
        click.echo(f"== {name}{' (quick)' if quick else ''}")
        sys.stdout.flush()
        start = time.perf_counter()
        try:
            figures = run_benchmark(where / f"bench_{name}.py", quick, device)
        except (click.ClickException, KeyboardInterrupt):
            raise
        except Exception as e:  # report it, run the others
            traceback.print_exc(file=sys.stderr)
            click.echo(f"{name} FAILED: {type(e).__name__}: {e}")
            failed.append(name)
            continue
        for line in format_ratios(figures):
            click.echo(line)
        click.echo(f"({name} took {time.perf_counter() - start:.1f} s)")
    if failed:
        click.echo(f"failed: {', '.join(failed)}")
        sys.exit(1)
