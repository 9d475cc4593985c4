"""``--engine MODULE:FACTORY`` of ``readfence audit`` and ``readfence verify``: an engine's own
backend object (SGLang's contract), adapted by :mod:`readfence.engine`.

``FACTORY`` names an adapted backend, a function with no required argument returning one, a
backend class (or function) taking the model runner, or a list or mapping of them; the
reference engine is ``readfence.engine.reference:NAME`` (``:ENGINES`` for all of it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

from ._params import InputError, echo_json, importable_here, shell_word

if TYPE_CHECKING:
    from readfence.core import ForwardMode
    from readfence.engine import EngineBackend
    from readfence.graph import Policy


class Engine(click.ParamType):
    """``MODULE:FACTORY``: imported (from the current folder too, as ``python -m`` would) and
    built once every option has passed (bad input is one line).

    >>> Engine().convert("no-colon", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: --engine takes MODULE:FACTORY (e.g. readfence.engine.reference:triton_engine), got 'no-colon'
    """

    name = "MODULE:FACTORY"
    expects = "MODULE:FACTORY, e.g. readfence.engine.reference:triton_engine"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        module, sep, attribute = value.partition(":")
        if not sep or not module.strip() or not attribute.strip():  # the loader says the same (it imports torch)
            raise InputError(f"--engine takes MODULE:FACTORY (e.g. readfence.engine.reference:triton_engine), got {value!r}")
        return value

    def resolve(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """``[(name, adapted backend)]``: at least one."""
        if not isinstance(value, str):
            return value
        from readfence.engine.internal import load_engines

        try:
            with importable_here():
                engines = load_engines(value)
        except ValueError as e:
            message = str(e)
            if message.startswith("cannot import module") and "No module named" in message:
                message += f" (looked in the current folder, {os.getcwd()}, and on sys.path)"
            raise InputError(message) from None
        if not engines:
            raise InputError(f"--engine {value}: the factory gave no backend (an empty list or mapping); "
                             "return at least one adapted backend")
        return engines


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """The engine's own code raising (or breaking its contract) is one ``Error:`` line, exit status 2,
    naming the class, method, mode and the engine's source line; not a traceback."""
    from readfence.engine import ContractError, EngineError

    try:
        yield
    except EngineError as e:
        at = f" (at {e.where})" if e.where else ""
        raise InputError(f"{e}{at}") from None
    except ContractError as e:
        raise InputError(str(e)) from None


def _check_sizes(engines: Sequence[tuple[str, Any]], batch_sizes: Sequence[int]) -> None:
    for name, engine in engines:
        limit = engine.cfg.max_reqs
        for n in batch_sizes:
            if n > limit:
                raise InputError(f"invalid --batch-size {n!r}: {name} serves at most {limit} requests (its model "
                                 f"config's max_reqs); use 1..{limit}")


def audit_engines(engines: Sequence[tuple[str, EngineBackend]], modes: Sequence[ForwardMode], batch_sizes: Sequence[int],
                  as_json: bool) -> int:
    """Audit each engine backend; print the tables (or JSON rows); the exit status (1: unsound)."""
    from readfence.core import ForwardMode
    from readfence.engine import ENGINE_MODES, audit_engine

    if ForwardMode.IDLE in modes:
        raise InputError("invalid --mode 'idle': its steps carry no tokens, there is nothing to audit; allowed: "
                         + ", ".join(m.name.lower() for m in ENGINE_MODES))
    _check_sizes(engines, batch_sizes)
    # several modes: one whose engine code raises is that mode's error row, the others are still
    # audited; a lone mode has nothing else to report, and its error is the one Error: line
    errors = "report" if len(set(modes or ENGINE_MODES)) > 1 else "raise"
    with _engine_errors():
        reports = [(name, _whole(audit_engine(engine, modes or None, batch_sizes=batch_sizes or None, errors=errors)))
                   for name, engine in engines]
    if as_json:
        echo_json([{"engine": name, **item} for name, report in reports for item in _json_items(report)])
    else:
        click.echo("\n\n".join(f"engine: {name}\n{report.table()}" for name, report in reports))
        if len(reports) > 1:
            click.echo("\n" + summary(reports))
    return 1 if any(not report.sound or report.errors() for _, report in reports) else 0


def _whole(result: Any) -> Any:
    """The whole report of ``audit_engine``'s or ``verify_engine``'s result: a failure's carries it
    too (every row is printed, the exit status says whether any is a finding)."""
    from returns.pipeline import is_successful

    return result.unwrap() if is_successful(result) else result.failure().report


def _json_items(report: Any) -> list[dict[str, Any]]:
    """A report's rows as JSON objects, with one object per (node, mode) whose code raised, in order."""
    out: list[dict[str, Any]] = []
    for n in report.nodes:
        if n.error:
            out.append({"backend": n.path, "mode": n.mode.name, "buffer": None, "declared": n.declared.name,
                        "truth": None, "source": "error", "verdict": "error", "error": n.error})
        out += [row.as_json() for row in n.rows]
    return out


#: How the summary names the shared buffers.
SHORT = {"req_to_token": "r2t", "seq_lens": "lens", "swa_map": "swa", "state_slots": "state_slots"}


def _truth(rows: Sequence[Any]) -> str:
    """Each buffer's truth, grouped by end: ``r2t, lens PRE; state_slots IN`` (``*``: observed)."""
    groups: dict[tuple[str, bool], list[str]] = {}
    for r in rows:
        if r.truth.name != "NONE":
            key = (r.truth.name.removesuffix("_REPLAY"), r.source == "observed")
            groups.setdefault(key, []).append(SHORT.get(r.buffer, r.buffer))
    return "; ".join(f"{', '.join(dict.fromkeys(names))} {end}{'*' if seen else ''}"
                     for (end, seen), names in groups.items()) or "reads no shared buffer"


def _verdict(report: Any, root: Any) -> str:
    if root.error:
        return "error: its code raised (see its ERROR line)"
    bad = [r for r in report.unsound() if r.mode == root.mode]
    if bad:
        r = bad[0]
        if r.backend == root.path:
            return f"unsound: {r.method} reads {SHORT.get(r.buffer, r.buffer)} ({r.op.removesuffix('.default')}, {r.source})"
        return f"unsound: its child {r.backend.rsplit('/', 1)[-1]}"
    unused = [r for r in report.unused() if r.mode == root.mode and r.backend == root.path]
    if unused:
        return f"unsound, declaration unused ({SHORT.get(unused[0].buffer, unused[0].buffer)} read later)"
    gain = sum(max(r.steps, 0) for r in root.rows)
    return f"sound, conservative +{gain}" if gain else "sound, exact"


def summary(reports: Sequence[tuple[str, Any]]) -> str:
    """One line per engine backend and mode: its scalar declaration, each buffer's truth, the
    verdict; then the total (what ``audit --engine MODULE:ENGINES`` ends with)."""
    from readfence.effects.internal import table

    rows, unsound, failed = [], 0, 0
    for _, report in reports:
        unsound += not report.sound
        failed += report.sound and bool(report.errors())
        for root in (n for n in report.nodes if "/" not in n.path):
            rows.append({"backend": root.path, "mode": root.mode.name + ("" if not root.prefill else " (per batch)"),
                         "declares": root.declared.name, "truth": _truth(root.rows), "verdict": _verdict(report, root)})
    lines = ["summary: each engine backend's one declaration against each buffer's truth (* observed, not traced)",
             table(rows, ["backend", "mode", "declares", "truth", "verdict"]), "",
             f"{len(reports)} engine backends: {len(reports) - unsound - failed} sound, {unsound} unsound"
             + (f", {failed} not audited in every mode (their code raised)" if failed else "")
             + (" (exit status 1)" if unsound or failed else "")]
    return "\n".join(lines)


def verify_engines(engines: Sequence[tuple[str, Any]], mode: ForwardMode, *, policies: Sequence[Policy],
                   device: str, steps: int, batch_size: int, seed: int, as_json: bool) -> int:
    """Verify each engine backend under ``policies`` and its engine's runner model; print the
    report (or JSON rows); the exit status (1: any finding)."""
    from readfence.core.internal import tokens_per_request
    from readfence.engine import verify_engine
    from readfence.graph import open_device

    if tokens_per_request(mode) == 0:
        raise InputError(f"invalid --mode {mode.name.lower()!r}: its steps carry no tokens, there is nothing to verify")
    _check_sizes(engines, [batch_size])
    results = []
    with open_device(device) as dev, _engine_errors():
        for name, engine in engines:
            results.append((name, _whole(verify_engine(engine, mode, device=dev, policies=policies, steps=steps,
                                                       batch_size=batch_size, seed=seed))))
    if as_json:
        # ``policy`` as in spec verify's objects (the engine runner's is "ENGINE RUNNER"); ``fence`` is
        # the same name, kept for schema version 1
        echo_json([{"engine": name, "mode": r.mode.name, "device": r.device, "steps": r.steps,
                    "batch_size": r.batch_size, "seed": seed, "policy": row.name, **row.as_json()}
                   for name, r in results for row in r.rows])
    else:
        blocks = []
        for name, r in results:
            lines = [f"engine: {name}", str(r), ""]
            if r.ok:
                lines.append("every fence matched the serial run bit for bit; nothing read a buffer after its "
                             "release, and nothing wrote one")
            advice: dict[str, list[str]] = {}
            for row in r.rows:
                if row.finding is not None:
                    advice.setdefault(_advice(row.finding, name), []).append(row.name)
            lines += [f"{', '.join(names)}: {text}" for text, names in advice.items()]
            blocks.append("\n".join(lines))
        if len(results) > 1:
            bad = [_short_name(name) for name, r in results if not r.ok]
            blocks.append(f"{len(results)} engine backends: {len(results) - len(bad)} clean, {len(bad)} with findings"
                          + (f" (exit status 1): {', '.join(bad)}" if bad else ""))
        click.echo("\n\n".join(blocks))
    return 0 if all(r.ok for _, r in results) else 1


def _short_name(name: str) -> str:
    """``MODULE:FACTORY['key']`` -> ``key`` (a member of a list or mapping), else ``name``.

    >>> _short_name("readfence.engine.reference:ENGINES['triton']"), _short_name("m:f")
    ('triton', 'm:f')
    """
    if name.endswith("]") and "[" in name:
        return name[name.rindex("[") + 1:-1].strip("'\"")
    return name


def _advice(finding: Any, name: str) -> str:
    from readfence.core.internal import late_read_fix, stage_named

    if finding.evidence == "audit" and finding.kind == "unsound declaration":
        return (f"the lowering refuses the declaration (the traced code reads {finding.buffer!r} later; "
                f"`readfence audit --engine {shell_word(name)}` names the method, the line and the end); "
                f"{late_read_fix(finding.buffer)}")
    if finding.kind == "late read":
        end = stage_named(finding.stage).end if finding.stage in ("prepare_out_graph", "prepare_in_graph", "body") else None
        return f"{finding.buffer!r} is read after the fence that released it; {late_read_fix(finding.buffer, end)}"
    return finding.detail or finding.kind
