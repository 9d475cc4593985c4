"""``readfence verify``: the audit, then poison on release, the write guard and the runtime read
observer, per fence policy, against the serial run (``_verify_run``, imported once the options
have passed: this module imports no torch).
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import click

from ._engine_cmd import Engine
from ._errors import InputError, OneLineCommand
from ._params import (
    BATCH_SIZE,
    MAX_BATCH,
    MAX_STEPS,
    DeviceName,
    Integer,
    Mode,
    Policies,
    Positive,
    Spec,
    check_shares,
    echo_json,
    merge_policies,
    refuse_mode_for_shape,
    spec_text,
)

#: Modes ``verify`` cannot take, and why (the errors list the others as allowed).
NO_TOKENS = {"idle": "its steps carry no tokens, there is nothing to verify"}


def _tp_rank(rank: Any, spec: str, mode: str, policies: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """``readfence verify`` on one tensor-parallel rank (``readfence.parallel.Rank``)."""
    from readfence.core import ForwardMode
    from readfence.graph import Policy

    from ._params import parse_spec
    from ._verify_run import render, run_verify

    result = run_verify(parse_spec(spec), ForwardMode[mode], policies=[Policy[p] for p in policies],
                        device=rank.device, rank=rank, **options)
    return {"ok": result.ok, "text": render(result), "rows": result.rows()}


def _precheck(params: dict[str, Any]) -> None:
    """What ``verify`` refuses before it imports anything heavy: option combinations."""
    from ._tp_cmd import check_tp, check_world

    spec, engines, tp = params.get("spec"), params.get("engines"), params.get("tp")
    if engines is not None:
        if spec is not None:
            raise InputError(f"give SPEC or --engine MODULE:FACTORY, not both (got SPEC {spec!r})")
        if params.get("unsafe"):
            raise InputError("--unsafe-skip-soundness-check is for SPEC; with --engine the ENGINE RUNNER row "
                             "already runs the declaration as the engine does")
        if tp is not None:
            raise InputError("--tp runs readfence's own sharded model: give SPEC, not --engine")
    elif spec is None:
        raise InputError("give SPEC (a backend spec or step shape) or --engine MODULE:FACTORY")
    check_world(tp)
    if tp is not None:
        check_tp(tp)


@attrs.frozen(kw_only=True)
class VerifyArgs:
    """What ``readfence verify`` was given, one field per option, as click hands them to the
    command (an option added to the command and not here fails its first run)."""

    spec: Any
    mode: Any
    policies: tuple[Any, ...]
    steps: int
    batch_size: int
    device: str
    seed: int
    unsafe: bool
    tp: int | None
    as_json: bool
    engines: Any = None


@click.command("verify", cls=OneLineCommand, precheck=_precheck)
@click.argument("spec", type=Spec(), required=False)
@click.option("--mode", type=Mode(refused=NO_TOKENS), default="decode", show_default=True,
              help="decode, target_verify, draft_extend or extend (not for a step shape: its phases fix their own modes).")
@click.option("--policy", "policies", type=Policies(), default=("all",), multiple=True,
              callback=merge_policies, show_default=True,
              help="coarse, joined, per_buffer, exact or all; a comma list or repeated.")
@click.option("--steps", type=Positive(at_most=MAX_STEPS), default=8, show_default=True, help="Steps verified per policy.")
@click.option("--batch-size", type=BATCH_SIZE, default=4, show_default=True, help=f"Requests per step (1..{MAX_BATCH}).")
@click.option("--device", type=DeviceName(), default="auto", show_default=True,
              help="auto, cpu or cuda (on CUDA only poison and the guard watch: a replayed graph runs no Python).")
@click.option("--seed", type=Integer(), default=0, show_default=True, help="Scheduler seed (request churn).")
@click.option("--unsafe-skip-soundness-check", "unsafe", is_flag=True,
              help="UNSAFE: lower a declaration the audit refuses anyway, to watch poison and the observer "
                   "catch its late read at run time. The audit's finding still fails the run (exit 1); "
                   "never deploy fences placed this way.")
@click.option("--tp", type=Positive(), default=None,
              help="Tensor parallelism: verify on N ranks (torch.distributed), each rank its own shard, fences and "
                   "checks, against a serial run with the same sharding.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per policy.")
@click.option("--engine", "engines", type=Engine(), default=None,
              help="Verify an engine's own backend object instead of SPEC, under each policy and its engine's "
                   "runner model: MODULE:FACTORY (see readfence.engine).")
def verify_cmd(**given: Any) -> None:
    """Audit SPEC, then check each policy's fences at run time, against the serial run.

    \b
    SPEC is a backend spec, e.g. 'hybrid_linear(trtllm_mha, linear)', per_stream(...), or a
    step shape (eagle, multi_eagle, ngram). The audit traces the declarations first (batch
    sizes 1, 2, the model's maximum and --batch-size). Then, per policy, every release point
    poisons what it releases (a read after it, through any code, changes the outputs), a
    guard checks nothing wrote a shared buffer, and on a CPU device a runtime read observer
    names the stage and op of any read after a release.
    Exit status 0 clean, 1 on any finding, 2 for bad input.

    \b
    --engine MODULE:FACTORY verifies an engine's stateful backend object instead (adapted by
    readfence.engine; e.g. readfence.engine.reference:minimax_hybrid_engine): each policy, then the
    ENGINE RUNNER (SGLang's runner: one event from the scalar declaration, trusted as the
    engine trusts it), with the same checks.
    """
    a = VerifyArgs(**given)
    spec, mode, policies, device, steps, batch_size, seed = a.spec, a.mode, a.policies, a.device, a.steps, \
        a.batch_size, a.seed
    if spec is not None:
        check_shares(spec, batch_size)
    unsafe, tp, as_json = a.unsafe, a.tp, a.as_json
    if a.engines is not None:
        from ._engine_cmd import verify_engines

        sys.exit(verify_engines(a.engines, mode, policies=policies, device=device, steps=steps,
                                batch_size=batch_size, seed=seed, as_json=as_json))
    refuse_mode_for_shape(spec)
    if tp is not None:
        from ._tp_cmd import run_on_ranks

        options = dict(steps=steps, batch_size=batch_size, seed=seed, unsafe=unsafe)
        run_on_ranks(_tp_rank, spec_text(spec), mode.name, [p.name for p in policies], options, tp=tp, device=device,
                     as_json=as_json, what="clean under every policy: outputs bit-identical to the serial run with "
                                           "the same sharding, nothing read a buffer after its release, and nothing "
                                           "wrote one")
        return
    from ._verify_run import render, run_verify

    result = run_verify(spec, mode, policies=policies, device=device, steps=steps, batch_size=batch_size,
                        seed=seed, unsafe=unsafe, progress=not as_json)
    echo_json(result.rows()) if as_json else click.echo(render(result))
    if not result.ok:
        sys.exit(1)
