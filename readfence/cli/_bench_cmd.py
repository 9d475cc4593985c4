"""``readfence bench``: run the repository's benchmarks and print their figures.

Each benchmark is a module ``benchmarks/bench_<name>.py`` of the source checkout with a
``main(quick=False, ...)`` that measures side by side and returns its figures as a (nested)
mapping; ``readfence bench`` imports it, calls ``main`` (with ``device=`` when it takes one)
and prints the mapping as ``name: value`` lines. ``--quick`` is each benchmark's smoke run
(seconds: it checks that everything runs, its ratios are noise).

``readfence bench races`` is not a file: it scores readfence on the races engines shipped
(``readfence.races``; ``--json``, ``--cases MODULE:ATTR``, ``--quick`` for the quick subset).
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

from readfence.effects import ReadfenceError
from readfence.effects.internal import one_line

from ._errors import InputError, OneLineCommand
from ._params import DeviceName, OneOf

#: Every benchmark under ``benchmarks/`` (``bench_<name>.py``), in the order ``readfence bench``
#: runs them: the cheap ones first. A test checks that no benchmark file is left out.
BENCHMARKS = ("effects", "audit", "scale", "check", "overhead", "overlap", "serve", "fuzz", "tp", "triton")

#: The name of the race suite among the benchmarks (``readfence.races``, not a file).
RACES = "races"


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
@click.argument("names", nargs=-1, type=OneOf((*BENCHMARKS, RACES), "benchmark"))
@click.option("--quick", is_flag=True, help="Each benchmark's smoke run (seconds; the ratios are noise); with races, "
                                             "the quick subset of cases.")
@click.option("--device", type=DeviceName(), default="cpu", show_default=True,
              help="cpu, cuda or auto (for the benchmarks that take a device).")
@click.option("--json", "as_json", is_flag=True, help="races: the scored table as a JSON document.")
@click.option("--cases", "case_refs", multiple=True, metavar="MODULE:ATTR",
              help="races: score these cases (a readfence.races.Case, a list or mapping of them, or a function "
                   "returning them) instead of readfence's suite; may be given more than once.")
def bench(names: Sequence[str], quick: bool, device: str, as_json: bool, case_refs: Sequence[str]) -> None:
    """Run the benchmarks (from the source checkout) and print their ratios.

    \b
    NAMES picks some (effects, audit, scale, check, overhead, overlap, serve, fuzz, tp); default: all of them,
    in that order. Exit status 1 if one fails (the others still run).
    `readfence bench races` scores readfence on the races engines shipped, each a buggy and a fixed
    version (--json, --cases MODULE:ATTR); exit status 1 unless every race is caught with no false alarm.
    """
    if RACES in names:
        if len(names) > 1:
            others = ", ".join(n for n in names if n != RACES)
            raise InputError(f"races is scored on its own: run `readfence bench races`, then `readfence bench "
                             f"{others}`")
        if device != "cpu":
            raise InputError(f"--device {device}: the race cases run on the CPU device (each version's races are "
                             f"shown there); leave --device out")
        from ._races_cmd import bench_races

        bench_races(quick=quick, as_json=as_json, refs=case_refs)
        return
    if as_json or case_refs:
        given = "--json" if as_json else "--cases"
        raise InputError(f"{given} goes with `readfence bench races`; the benchmarks print name: value lines")
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
            if isinstance(e, ReadfenceError):  # readfence's own error: one line, as every command says it
                click.echo(f"Error: benchmark {name}: {one_line(f'{type(e).__name__}: {e}')}", err=True)
            else:  # a bug in the benchmark: where it is
                traceback.print_exc(file=sys.stderr)
            click.echo(f"{name} FAILED: {type(e).__name__}: {one_line(str(e))}")
            failed.append(name)
            continue
        for line in format_ratios(figures):
            click.echo(line)
        click.echo(f"({name} took {time.perf_counter() - start:.1f} s)")
    if failed:
        click.echo(f"failed: {', '.join(failed)}")
        sys.exit(1)
