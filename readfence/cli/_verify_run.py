"""What ``readfence verify`` runs and prints: the audit, then poison on release, the write guard
and the runtime read observer, per fence policy, against the serial run.

The audit checks the declarations against traced code before anything runs; :func:`verify`
then runs each policy's lowered step in check mode, which trusts no analysis: a read after a
release, through any code, changes the outputs (poison) or is named by the observer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from readfence.core import STAGES, ForwardMode, ModelConfig, StageThreadError, StageWriteError, audit, default_batch_sizes
from readfence.core.internal import ReadKind, late_read_fix, stage_named
from readfence.effects.internal import one_line
from readfence.graph import LateRead, Policy, StepShape, VerifyReport, open_device, verify
from readfence.graph.lowering import torch_device
from readfence.graph.verification import WORKLOAD, PolicyCheck, phase_modes

if TYPE_CHECKING:
    from readfence.parallel import Rank

#: What to do about a finding, by its kind (a late read's advice depends on the audit).
_ADVICE = {
    "write": "the forward changes a shared buffer the scheduler owns, and no fence makes that correct: "
             "stages may only read shared buffers (write a copy, or a pool)",
    "thread": "a stage hands work to another thread, and no fence covers what it reads (COARSE "
              "included): do the work in the stage itself",
    "refused": "no fence makes this step correct (see the detail): keep no trace-time state in the "
               "graph, and no host read inside it",
    "differs": "the outputs differ from the serial run with nothing poisoned: the step is not a "
               "deterministic function of what the scheduler wrote; `readfence demo` shows the "
               "sanitizer's view",
    "unsound declaration": "fix the declaration (see the detail)",
    "padding": "a request's outputs depend on the padding rows of the captured size its batch runs in (a "
               "reduction over the whole batch): mask the padding out of what reaches a request",
    "miscompiled": "readfence's own compile passes computed something else (a bug in readfence, not in the "
                   "backend): report it; LowerOptions(optimize=False) lowers the step without them",
}
def _unseen(finding: LateRead) -> str:
    """What to do about a late read no static analysis saw (the audit passed)."""
    end = stage_named(finding.stage).end if finding.stage in {s.name for s in STAGES} else None
    return (f"{ReadKind.RUN}, which no static analysis saw: code the tracer does not see (a kernel reading state "
            f"kept by reference, a raw pointer) or a path it did not trace reads {finding.buffer!r} after its "
            f"release; {late_read_fix(finding.buffer, end)}")


@attrs.frozen
class AuditFinding:
    """What the audit refused before anything ran: an unsound declaration, a stage that writes,
    or one that hands work to another thread.

    An unsound declaration concerns every policy but COARSE (which waits for the whole forward
    whatever the declarations); a write or a thread concerns them all.

    >>> f = AuditFinding("unsound declaration", "req_to_token", "prepare_in_graph", "index_select", "...", "...")
    >>> [p.name for p in Policy if f.concerns(p)]
    ['JOINED', 'PER_BUFFER', 'EXACT']
    """

    kind: str
    buffer: str | None
    stage: str | None
    op: str | None
    message: str
    fix: str

    def concerns(self, policy: Policy) -> bool:
        return self.kind in ("write", "thread") or policy is not Policy.COARSE

    def late_read(self, target: str, mode: ForwardMode, policy: Policy) -> LateRead:
        return LateRead(target, mode, policy, self.kind, "audit", self.buffer, None, self.stage, self.op,
                        self.message)


def audit_targets(spec: Any, mode: ForwardMode) -> list[tuple[Any, ForwardMode]]:
    """The (backend, mode) pairs to audit: one per distinct phase of a step shape.

    >>> from readfence.cli._params import parse_spec
    >>> [(str(b), m.name) for b, m in audit_targets(parse_spec("ngram(paged)"), ForwardMode.DECODE)]
    [('paged', 'TARGET_VERIFY')]
    """
    if isinstance(spec, StepShape):
        return list(dict.fromkeys((p.backend, p.mode) for p in spec.phases))
    return [(spec, mode)]


def audit_spec(spec: Any, mode: ForwardMode, batch_sizes: Sequence[int], *,
               unsafe: bool = False, cfg: ModelConfig | None = None) -> AuditFinding | None:
    """The first declaration the audit refuses at any of ``batch_sizes``, else ``None``.

    >>> from readfence.backends import paged
    >>> audit_spec(paged(), ForwardMode.DECODE, [2]) is None
    True
    """
    for backend, m in audit_targets(spec, mode):
        try:
            result = audit(backend, m, batch_sizes=batch_sizes, cfg=cfg)
        except StageWriteError as e:
            return AuditFinding("write", e.buffer, e.stage, e.op, one_line(str(e)), _ADVICE["write"])
        except StageThreadError as e:
            return AuditFinding("thread", None, e.stage, e.what, one_line(str(e)), _ADVICE["thread"])
        if result.map(lambda _: True).value_or(False):
            continue
        bad = result.failure()
        stage, op = bad.reader if bad.reader else (None, None)
        fix = f"{bad.path}: {late_read_fix(bad.buffer, bad.observed)}"
        if not unsafe:
            fix += ("; to watch the race caught at run time, rerun with --unsafe-skip-soundness-check "
                    "(never deploy those fences)")
        return AuditFinding("unsound declaration", bad.buffer, stage, op, bad.message, fix)
    return None


@attrs.frozen
class Verified:
    """What ``readfence verify`` found: the audit's refusal (if any), then per policy either a
    clean check (in ``report``) or a finding."""

    spec: str
    mode: str  # the forward mode's name, or "phases" for a step shape
    seed: int
    audited: tuple[int, ...]  # the batch sizes the audit traced
    audit: AuditFinding | None
    report: VerifyReport  # the policies that ran clean
    findings: tuple[LateRead, ...]
    ran: frozenset[Policy]  # the policies whose lowered step ran (the rest the audit refused)
    phases: str = ""  # a step shape's phases, "name:MODE -> ..."

    @property
    def ok(self) -> bool:
        return not self.findings

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready object per policy, in policy order."""
        common = {"device": self.report.device, "steps": self.report.steps,
                  "batch_size": self.report.batch_size, "seed": self.seed}
        clean = {r["policy"]: {**r, "evidence": None, "detail": ""} for r in self.report.rows()}
        found = {f.policy.name: f.as_json() for f in self.findings}
        rows = {**clean, **found}
        mode = {"mode": self.mode, **({"phases": self.phases} if self.phases else {})}
        return [{**rows[p.name], **mode, **common} for p in Policy if p.name in rows]

    def advice(self, finding: LateRead) -> str:
        """What to do about ``finding``."""
        if finding.evidence == "audit" and self.audit is not None and finding.kind == self.audit.kind:
            return self.audit.fix
        if finding.kind == "late read":
            audit = self.audit
            if audit is not None and audit.kind == "unsound declaration" and audit.buffer == finding.buffer:
                return "the race the audit predicted, caught at run time: fix the declaration (see above)"
            return _unseen(finding)
        return _ADVICE.get(finding.kind, "see the detail")


def _line(finding: LateRead, ran: bool) -> str:
    text = finding.policy.name + ": " + finding.kind
    text += f" of {finding.buffer!r}" if finding.buffer else ""
    text += f" at step {finding.step}" if finding.step is not None else ""
    text += f" in stage {finding.stage}" if finding.stage else ""
    text += f", op {finding.op}" if finding.op else ""
    if finding.evidence == "audit":
        return text + (" (evidence: audit; the run itself was clean)" if ran else " (evidence: audit; not run)")
    return text + f" (evidence: {finding.evidence})"


def render(result: Verified) -> str:
    """The text report: the audit, the clean policies, then one line per finding and what to do.

    >>> report = VerifyReport("paged", ForwardMode.DECODE, "cpu", 4, 2,
    ...                       (PolicyCheck(Policy.COARSE, (), 0.1, 10),), True)
    >>> late = LateRead("paged", ForwardMode.DECODE, Policy.EXACT, "late read", "poison", "seq_lens", 1)
    >>> print(render(Verified("paged", "DECODE", 0, (1, 2), None, report, (late,),
    ...                       frozenset(Policy))))  # doctest: +NORMALIZE_WHITESPACE
    spec: paged  mode: DECODE  steps: 4  batch size: 2  seed: 0
    audit: every declaration sound at batch sizes 1, 2
    verified paged in DECODE on cpu: 4 steps, batch size 2, checks: poison, guard and the runtime read observer
      COARSE     clean; poisoned on release: nothing (released after the whole forward)
    <BLANKLINE>
    EXACT: late read of 'seq_lens' at step 1 (evidence: poison)
      what to do: a read after its release, caught at run time, which no static analysis saw: code the
      tracer does not see (a kernel reading state kept by reference, a raw pointer) or a path it did not
      trace reads 'seq_lens' after its release; fix: declare 'seq_lens' ending where its last read ends,
      or end the read earlier: snapshot what it reads before the replay (in the out-of-graph stage:
      prepare_out_graph, an engine's init_forward_metadata_out_graph)
    """
    r = result.report
    sizes = ", ".join(map(str, result.audited))
    how = f"phases: {result.phases}" if result.phases else f"mode: {result.mode}"
    lines = [f"spec: {result.spec}  {how}  steps: {r.steps}  batch size: {r.batch_size}  seed: {result.seed}"]
    if result.audit is None:
        lines.append(f"audit: every declaration sound at batch sizes {sizes}")
    else:
        lines.append(f"audit: {result.audit.message}")
        if result.audit.kind == "unsound declaration" and result.ran - {Policy.COARSE}:
            lines.append("UNSAFE: --unsafe-skip-soundness-check: lowering the refused declaration anyway, "
                         "to watch the checks catch it")
    lines.append(str(r))
    if result.ok:
        lines += ["", "every policy matched the serial run bit for bit; nothing read a buffer after its "
                      "release, and nothing wrote one"]
        return "\n".join(lines)
    lines.append("")
    advice: list[str] = []
    for f in result.findings:
        lines.append(_line(f, f.policy in result.ran))
        if f.detail and f.evidence != "audit":
            lines.append(f"  {f.detail}")
        text = result.advice(f)
        if text not in advice:
            advice.append(text)
            lines.append(f"  what to do: {text}")
    return "\n".join(lines)


def run_verify(spec: Any, mode: ForwardMode, *, policies: Sequence[Policy], device: str, steps: int,
               batch_size: int, seed: int, unsafe: bool = False, progress: bool = False,
               rank: Rank | None = None) -> Verified:
    """Audit ``spec`` (1, 2, the model's maximum and ``batch_size``), then verify each policy.

    ``rank`` (a ``readfence.parallel.Rank``) verifies one tensor-parallel rank: its shard of the
    model and its device's options (a timeout, a GPU index).

    A policy the audit's refusal concerns is not run unless ``unsafe``; its finding stands
    even when the run is clean (the verified steps may not take the path that reads late).

    >>> from readfence.backends import paged
    >>> v = run_verify(paged(), ForwardMode.DECODE, policies=[Policy.PER_BUFFER], device="cpu",
    ...                steps=2, batch_size=2, seed=0)
    >>> [(r["policy"], r["verdict"]) for r in v.rows()]
    [('PER_BUFFER', 'clean')]
    """
    from tqdm import tqdm

    cfg = ModelConfig() if rank is None else rank.cfg
    device_options: dict[str, Any] = {} if rank is None else dict(rank.device_options())
    sizes = tuple(sorted({*default_batch_sizes(cfg), batch_size}))
    refused = audit_spec(spec, mode, sizes, unsafe=unsafe, cfg=cfg)
    name = str(spec)
    checks: list[PolicyCheck] = []
    findings: list[LateRead] = []
    ran: set[Policy] = set()
    with open_device(device, **device_options) as dev:
        observer = torch_device(dev) == "cpu"
        for policy in tqdm(policies, file=sys.stderr, unit="policy", leave=False,
                           disable=not (progress and sys.stderr.isatty())):
            predicted = refused.late_read(name, mode, policy) if refused is not None and refused.concerns(policy) else None
            if predicted is not None and not unsafe:
                findings.append(predicted)
                continue
            ran.add(policy)
            result = verify(spec, mode, policy=policy, steps=steps, batch_size=batch_size, device=dev, cfg=cfg,
                            options=attrs.evolve(WORKLOAD, seed=seed, UNSAFE_skip_soundness_check=unsafe))
            if not result.map(lambda _: True).value_or(False):
                findings.append(result.failure())
            elif predicted is not None:
                findings.append(predicted)
            else:
                checks.extend(result.unwrap().checks)
        report = VerifyReport(name, mode, dev.name, steps, batch_size, tuple(checks), observer, phase_modes(spec))
    if isinstance(spec, StepShape):
        return Verified(name, "phases", seed, sizes, refused, report, tuple(findings), frozenset(ran), report.phases)
    return Verified(name, mode.name, seed, sizes, refused, report, tuple(findings), frozenset(ran))
