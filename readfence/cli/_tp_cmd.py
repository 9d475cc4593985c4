"""``readfence demo --tp N`` and ``readfence verify --tp N``: the same run on every rank of a
tensor-parallel group (each command brings its job, a function of the rank).

Each rank (``readfence.parallel.launch``) runs its own scheduler, its own copy of the shared
buffers and its own lowered step of its shard of the model; the report of each rank is the one
the command prints without ``--tp``, under a ``[rank r]`` line, and its reference is a serial
run with the same sharding. Under torchrun each process prints its own rank's report.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVarTuple

import click

from ._params import TINY_HEADS, TINY_MLP, TP_SIZES, InputError, echo_json

if TYPE_CHECKING:
    from readfence.core import ModelConfig

#: What torchrun (or another ``env://`` launcher) sets in each rank's environment.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_world() -> int | None:
    """``WORLD_SIZE`` when this process is one rank started by torchrun, else ``None``
    (the same test as ``readfence.parallel.under_torchrun``, without importing torch).

    >>> torchrun_world() is None or torchrun_world() >= 1
    True
    """
    if not all(os.environ.get(k) for k in TORCHRUN_ENV):
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise InputError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of ranks (set by the "
                         f"launcher that started this process)") from None


def check_world(tp: int | None) -> None:
    """Refuse ``--tp`` that does not match the torchrun group this process is a rank of, or a
    group of several ranks without ``--tp`` (each would run its own unsharded model, unlabelled).
    Only rank 0 prints the error (every rank exits with status 2).

    >>> check_world(2) if torchrun_world() is None else None
    """
    world = torchrun_world()
    if world is None or (tp is None and world == 1) or tp == world:
        return
    n = tp if tp is not None else world
    if tp is None:
        why = (f"torchrun started {world} ranks (WORLD_SIZE={world}), but --tp is not given: each rank would "
               f"run its own unsharded model; add --tp {world}, or run without torchrun")
    else:
        why = (f"invalid --tp {tp}: torchrun started this process in a group of {world} rank"
               f"{'s' if world != 1 else ''} (WORLD_SIZE={world}); give --tp {world}, or start torchrun with "
               f"--nproc-per-node {n}")
    if os.environ.get("RANK", "0") != "0":
        raise click.exceptions.Exit(2)  # rank 0 says why: one line, not one per rank
    raise InputError(why)


if TYPE_CHECKING:
    from readfence.parallel import Rank

_Ts = TypeVarTuple("_Ts")


def shard_line(cfg: ModelConfig, size: int, backend: str, device: str) -> str:
    """What each rank holds and does, in one line.

    >>> from readfence.core import ModelConfig
    >>> print(shard_line(ModelConfig(), 2, "gloo", "cpu"))  # doctest: +NORMALIZE_WHITESPACE
    tensor parallel: 2 ranks (gloo on cpu), each with its own scheduler, shared buffers and lowered
    step; a rank holds 1 of 2 attention heads and 32 of 64 MLP columns and all-reduces after
    attention and after the MLP, inside its graph
    """
    return (f"tensor parallel: {size} ranks ({backend} on {device}), each with its own scheduler, shared buffers and "
            f"lowered step; a rank holds {cfg.heads // size} of {cfg.heads} attention heads and {cfg.mlp // size} of "
            f"{cfg.mlp} MLP columns and all-reduces after attention and after the MLP, inside its graph")


def _launch(job: Any, *args: Any, tp: int, device: str) -> tuple[dict[int, Any], str]:
    from readfence.parallel import TensorParallelError, launch, resolve_device

    kind = resolve_device(device, tp)
    try:
        return launch(job, *args, tp=tp, device=kind), kind
    except TensorParallelError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)


def _report(results: dict[int, Any], *, tp: int, device: str, as_json: bool, what: str) -> None:
    from readfence.core import ModelConfig

    if as_json:
        echo_json([{**row, "rank": r, "tp": tp} for r, res in sorted(results.items()) for row in res["rows"]])
    else:
        lines = [shard_line(ModelConfig(), tp, "nccl" if device == "cuda" else "gloo", device),
                 "reference: on every rank, a serial run with the same sharding", ""] if 0 in results else []
        for r, res in sorted(results.items()):
            lines += [f"[rank {r}]", res["text"], ""]
        bad = [r for r, res in sorted(results.items()) if not res["ok"]]
        if bad:
            lines.append(f"rank {', '.join(map(str, bad))}: see the findings above")
        elif len(results) == tp:  # (under torchrun each rank reports for itself)
            lines.append(f"every rank: {what}")
        click.echo("\n".join(lines).rstrip())
    if not all(res["ok"] for res in results.values()):
        sys.exit(1)


def run_on_ranks(job: Callable[[Rank, *_Ts], Mapping[str, Any]], *args: *_Ts, tp: int, device: str, as_json: bool, what: str) -> None:
    """Run ``job(rank, *args)`` on ``tp`` ranks and print each rank's report; ``job`` returns
    ``{"ok", "text", "rows"}``, ``what`` is the last line when every rank is ok."""
    results, kind = _launch(job, *args, tp=tp, device=device)
    _report(results, tp=tp, device=kind, as_json=as_json, what=what)


def check_tp(tp: int) -> None:
    """Refuse a tensor-parallel size the tiny model cannot be sharded by (exit status 2).

    >>> check_tp(3)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid --tp 3: the tiny model has 2 attention heads and 64 MLP
    columns, which 3 ranks cannot share evenly; allowed: 1, 2
    """
    if tp not in TP_SIZES:
        raise InputError(f"invalid --tp {tp}: the tiny model has {TINY_HEADS} attention heads and {TINY_MLP} MLP "
                         f"columns, which {tp} ranks cannot share evenly; allowed: {', '.join(map(str, TP_SIZES))}")
