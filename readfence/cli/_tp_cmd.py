"""``readfence demo --tp N`` and ``readfence verify --tp N``: the same run on every rank of a
tensor-parallel group.

Each rank (``readfence.parallel.launch``) runs its own scheduler, its own copy of the shared
buffers and its own lowered step of its shard of the model; the report of each rank is the one
the command prints without ``--tp``, under a ``[rank r]`` line, and its reference is a serial
run with the same sharding. Under torchrun each process prints its own rank's report.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from readfence.core import ForwardMode, ModelConfig
from readfence.graph import Policy

from ._params import echo_json


def shard_line(cfg: ModelConfig, size: int, backend: str, device: str) -> str:
    """What each rank holds and does, in one line.

    >>> print(shard_line(ModelConfig(), 2, "gloo", "cpu"))  # doctest: +NORMALIZE_WHITESPACE
    tensor parallel: 2 ranks (gloo on cpu), each with its own scheduler, shared buffers and lowered
    step; a rank holds 1 of 2 attention heads and 32 of 64 MLP columns and all-reduces after
    attention and after the MLP, inside its graph
    """
    return (f"tensor parallel: {size} ranks ({backend} on {device}), each with its own scheduler, shared buffers and "
            f"lowered step; a rank holds {cfg.heads // size} of {cfg.heads} attention heads and {cfg.mlp // size} of "
            f"{cfg.mlp} MLP columns and all-reduces after attention and after the MLP, inside its graph")


def _demo_rank(rank: Any, spec: str, policies: Sequence[str], options: dict[str, Any]) -> dict[str, Any]:
    from ._demo_cmd import phases_of, render
    from ._demo_run import run_demo
    from ._params import parse_spec

    backend = parse_spec(spec)
    result = run_demo(backend, policies=[Policy[p] for p in policies], device=rank.device, cfg=rank.cfg,
                      device_options=rank.device_options(), **options)
    text = render(result, spec=spec, steps=options["steps"], batch_size=options["batch_size"], seed=options["seed"],
                  phases=phases_of(backend), write_wait_ms=options["write_wait_s"] * 1e3)
    return {"ok": result.ok, "text": text, "rows": result.rows, "device": result.device, "mode": result.mode.name}


def _verify_rank(rank: Any, spec: str, mode: str, policies: Sequence[str], options: dict[str, Any]) -> dict[str, Any]:
    from ._params import parse_spec
    from ._verify_cmd import render, run_verify

    result = run_verify(parse_spec(spec), ForwardMode[mode], policies=[Policy[p] for p in policies],
                        device=rank.device, cfg=rank.cfg, device_options=rank.device_options(), **options)
    return {"ok": result.ok, "text": render(result), "rows": result.rows()}


def _launch(job: Any, *args: Any, tp: int, device: str) -> tuple[dict[int, Any], str]:
    from readfence.parallel import TensorParallelError, launch, resolve_device

    kind = resolve_device(device, tp)
    try:
        return launch(job, *args, tp=tp, device=kind), kind
    except TensorParallelError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)


def _report(results: dict[int, Any], *, tp: int, device: str, as_json: bool, what: str) -> None:
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


def demo_tp(spec: Any, *, tp: int, device: str, policies: Sequence[Policy], as_json: bool,
            **options: Any) -> None:
    """Run the demo on ``tp`` ranks and print each rank's report."""
    results, kind = _launch(_demo_rank, str(spec), [p.name for p in policies], options, tp=tp, device=device)
    _report(results, tp=tp, device=kind, as_json=as_json,
            what="every policy matched the serial run with the same sharding bit for bit; the sanitizer found no race")


def verify_tp(spec: Any, mode: ForwardMode, *, tp: int, device: str, policies: Sequence[Policy], as_json: bool,
              **options: Any) -> None:
    """Run ``readfence verify`` on ``tp`` ranks and print each rank's report."""
    results, kind = _launch(_verify_rank, str(spec), mode.name, [p.name for p in policies], options, tp=tp,
                            device=device)
    _report(results, tp=tp, device=kind, as_json=as_json,
            what="clean under every policy: outputs bit-identical to the serial run with the same sharding, "
                 "nothing read a buffer after its release, and nothing wrote one")


def check_tp(tp: int) -> None:
    """Refuse a tensor-parallel size the tiny model cannot be sharded by (exit status 2).

    >>> check_tp(3)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.cli._params.InputError: invalid --tp 3: the tiny model has 2 attention heads and 64 MLP
    columns, which 3 ranks cannot share evenly; allowed: 1, 2
    """
    from readfence.parallel import tp_sizes

    from ._params import InputError

    cfg = ModelConfig()
    allowed = tp_sizes(cfg)
    if tp not in allowed:
        raise InputError(f"invalid --tp {tp}: the tiny model has {cfg.heads} attention heads and {cfg.mlp} MLP "
                         f"columns, which {tp} ranks cannot share evenly; allowed: {', '.join(map(str, allowed))}")
