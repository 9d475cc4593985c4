"""Differential fuzzing of the analysis: what the static analysis accepts must pass the
dynamic checks, and what it traces must cover what really runs.

For one generated program (``readfence.backends.fuzz``) :func:`check_program` runs the three
checking lines of the design against each other:

* **P1** (soundness): accepted by ``core.audit`` *and* by ``lower`` under PER_BUFFER and
  EXACT (no exception) implies ``verify`` clean under both (poison on release, the write
  guard and the runtime read observer against the serial run), without the unsafe flag;
* **P2** (the trace covers the run): for faithful stages, the reads the runtime observer sees
  lie within the traced reads: ``cross_check(trace(...), observe(...))`` is empty;
* **P3** (precision, measured, never asserted): refused by the analysis but clean under
  ``verify(..., UNSAFE_skip_soundness_check=True)`` is a false alarm.

The oracle of P3 models a CUDA engine, not only the CPU device it runs on: a program that brings
a device value to the host inside the captured graph (``.item()``, ``bool()``, ``.tolist()``... in
``prepare_in_graph`` or ``attend``: :meth:`FuzzProgram.uncapturable`) cannot be captured on
CUDA at all, since CUDA forbids a device-to-host copy while a stream is captured. The CPU device
runs such a stage's Python in the step, so it may run clean there; it is still no correct
backend for a CUDA engine. Its refusal is counted as *uncapturable* (with how many ran clean on
the CPU device), not as a runnable refusal nor a false alarm.

A read no static analysis can see (a plan/run kernel reading a buffer it keeps by reference)
is accepted by the audit by design; when it reads after the declared end, ``verify`` must
catch it. Such a program counts as *invisible, caught by verify*, not as a P1 violation, and
``invisible_missed`` flags a late invisible read that ``verify`` let through.

A read handed to a thread the stage starts (joined in the stage, left running past it, or a
thread-pool job) is covered by no fence, whatever the declaration: the trace and the read
observer follow the stage's own thread, so they refuse any such thread (``StageThreadError``),
and a stage whose Python runs in the step fails it when the thread outlives it (``verify``'s
kind ``"thread"``). Such a program must be refused or caught that way; one accepted with
``verify`` clean counts as ``thread_missed``, never as accepted.

This module sits in ``graph`` because it runs ``lower`` and ``verify``; the programs and their
strategies live with the backends.

>>> from readfence.backends.fuzz import VOCABULARY, FuzzLeaf, FuzzProgram, Placement, declared
>>> from readfence.graph import CpuDevice
>>> chunk = VOCABULARY["chunk"]
>>> early = FuzzLeaf("early", (Placement(chunk, "prepare_in_graph", "seq_lens", carry=True),),
...                  declared(IN_REPLAY=["req_to_token", "seq_lens"]))
>>> with CpuDevice() as dev:
...     outcome = check_program(FuzzProgram(early), device=dev)
>>> outcome.verdict, outcome.refused_by.split(":")[0], outcome.false_alarm
('refused', 'audit', False)
>>> print(outcome.unsafe)  # doctest: +ELLIPSIS
late read of 'seq_lens' at step 0 by body: ...
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor

from readfence.backends.fuzz import FuzzProgram, FuzzTree
from readfence.core import (
    BODY,
    BackendLike,
    Disagreement,
    ForwardMode,
    ModelConfig,
    Observation,
    StageThreadError,
    StageWriteError,
    Unsound,
    audit,
    bind,
    cross_check,
    observe,
    step_functions,
    trace,
)
from readfence.core.internal import example_step, observe_step

from .devices import Device
from .lowering import Policy, make_state
from .lowering.internal import audit_verdict
from .verification import WORKLOAD, LateRead, verify

State = Mapping[str, Mapping[str, Tensor]]

#: The policies P1 is checked under: those whose fences come from the analysis per buffer.
FUZZ_POLICIES: tuple[Policy, ...] = (Policy.PER_BUFFER, Policy.EXACT)

#: The model programs run on by default: one layer (more when a combinator needs them), tiny.
FUZZ_CONFIG = ModelConfig(layers=1, max_reqs=8, max_ctx=16)


@attrs.frozen
class Outcome:
    """What the three checking lines concluded on one program.

    ``refused_by`` says which check refused it (``None``: accepted by the audit and by
    ``lower`` under every policy of P1); ``finding`` is ``verify``'s finding on an accepted
    program (``None``: clean); ``unsafe`` is ``verify``'s finding with the unsafe flag on a
    refused one (``None``: clean, a false alarm), ``unsafe_ran`` whether it could run at all
    (writes and trace-time state are refused before any run); ``disagreements`` are P2's.
    ``invisible`` are the buffers a plan/run kernel reads in the leaves that run,
    ``invisible_late`` those it reads after the declared end; ``threads`` the buffers read on
    a thread a stage starts, in the leaves that run; ``uncapturable`` whether a running leaf
    brings a device value to the host inside the captured graph (no CUDA graph can hold it).
    """

    program: FuzzProgram
    refused_by: str | None
    finding: LateRead | None
    unsafe: LateRead | None
    unsafe_ran: bool
    disagreements: tuple[Disagreement, ...]
    invisible: frozenset[str]
    invisible_late: frozenset[str]
    threads: frozenset[str]
    seconds: float
    uncapturable: bool = False

    @property
    def accepted(self) -> bool:
        return self.refused_by is None

    @property
    def explained_by_invisible(self) -> bool:
        """``verify``'s finding is a buffer a plan/run kernel reads (the documented limit)."""
        f = self.finding
        return f is not None and bool(self.invisible) and (f.buffer is None or f.buffer in self.invisible)

    @property
    def p1_violation(self) -> bool:
        """Accepted, yet ``verify`` found a late read or a write no invisible read explains."""
        return (self.accepted and self.finding is not None and not self.explained_by_invisible
                and not self.thread_caught)

    @property
    def invisible_caught(self) -> bool:
        return self.accepted and self.explained_by_invisible

    @property
    def invisible_clean(self) -> bool:
        """Accepted with an invisible read, and ``verify`` clean under every policy: the fences
        covered it (EXACT places from what the lowering's rehearsal saw it read)."""
        return self.accepted and self.finding is None and bool(self.invisible)

    @property
    def invisible_missed(self) -> bool:
        """An invisible read after the declared end that ``verify`` let through (must not be)."""
        return self.accepted and self.finding is None and bool(self.invisible_late)

    @property
    def thread_refused(self) -> bool:
        """Refused because a stage hands work to another thread (the trace, the read observer)."""
        kind = self.refusal_kind
        return kind is not None and kind.partition(": ")[2] in ("StageThreadError", "thread")

    @property
    def thread_caught(self) -> bool:
        """Accepted, and a step failed: a stage's Python left a thread running as it returned."""
        return self.accepted and self.finding is not None and self.finding.kind == "thread"

    @property
    def thread_missed(self) -> bool:
        """A read on a thread a stage starts, accepted and ``verify`` clean (must not be)."""
        return self.accepted and self.finding is None and bool(self.threads)

    @property
    def p2_violation(self) -> bool:
        return bool(self.disagreements)

    @property
    def runnable(self) -> bool:
        """Refused, and a CUDA engine could run it: ``verify`` with the unsafe flag ran, and no
        stage it captures reads a device value on the host."""
        return not self.accepted and self.unsafe_ran and not self.uncapturable

    @property
    def false_alarm(self) -> bool:
        return self.runnable and self.unsafe is None

    @property
    def clean_on_cpu_only(self) -> bool:
        """Refused, clean under the unsafe flag on the CPU device, but uncapturable on CUDA."""
        return not self.accepted and self.unsafe_ran and self.unsafe is None and self.uncapturable

    @property
    def refusal_kind(self) -> str | None:
        """Why the analysis refused, in a few words: the kind of error, and for an unsound
        declaration whether the refused fence is one placed below the root (a ``per_stream``
        member's), an escape in the graph or a captured tensor made every buffer late (an escape:
        until the replay's end, in a stage a CUDA graph cannot capture anyway; a captured tensor
        matching nothing: ``UNKNOWN``), or a stage's Python read it on a varied state (a path the
        trace's example did not take: a host read before the replay counts only for what it
        reaches, ``core.Stage``)."""
        why = self.refused_by
        if why is None:
            return None
        head, _, rest = why.partition(": ")
        kind, _, message = rest.partition(": ")
        if kind != "unsound declaration":
            return f"{head}: {kind}"
        path = message.split(" in mode ")[0]
        fence = message.partition("; the fence of ")[2].partition(" is placed from")[0] or path
        if "/" in fence:
            return f"{head}: a fence below the root"
        # an escape in the graph gives its stage every buffer until POST_REPLAY; one before the
        # replay counts for what it reaches, and its Python's other paths are run on varied states
        if "a CUDA graph cannot capture it" in message:
            return f"{head}: escape in the graph (every buffer; uncapturable on CUDA)"
        if "no graph captures this mode" in message:
            return f"{head}: escape in a step no graph captures (every buffer)"
        if "on a varied state" in message:
            return f"{head}: read by a stage's Python on a varied state"
        if any(why in message for why in ("captured tensor", "tracer cannot see")):
            return f"{head}: captured tensor or unseen op (every buffer)"
        return f"{head}: unsound declaration"

    @property
    def verdict(self) -> str:
        """``accepted`` or ``refused``, and what went wrong, if anything, in words."""
        if self.p1_violation:
            return "P1 violation"
        if self.p2_violation:
            return "P2 violation"
        if self.invisible_missed:
            return "invisible read missed by verify"
        if self.invisible_caught:
            return "invisible, caught by verify"
        if self.thread_missed:
            return "thread missed"
        if self.thread_caught:
            return "thread, caught by verify"
        return "accepted" if self.accepted else "refused"

    def report(self) -> str:
        """The program and every finding, for a failing property or a benchmark log."""
        lines = [f"{self.verdict}: {self.program}"]
        if self.refused_by:
            lines.append(f"refused by {self.refused_by}")
        if self.finding is not None:
            lines.append(f"verify: {self.finding}")
        if not self.accepted and self.unsafe_ran:
            clean = "clean on the CPU device (no false alarm: uncapturable on CUDA)" if self.uncapturable else \
                "clean (a false alarm)"
            lines.append(f"verify with the unsafe flag: {self.unsafe or clean}")
        if self.uncapturable:
            lines.append("a captured stage reads a device value on the host: no CUDA graph can hold it")
        lines += [f"P2: {d}" for d in self.disagreements]
        if self.invisible:
            lines.append(f"invisible reads of {sorted(self.invisible)}, late: {sorted(self.invisible_late)}")
        if self.threads:
            lines.append(f"reads of {sorted(self.threads)} on another thread")
        return "\n".join(lines)


def _refusal(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def observe_live(backend: BackendLike, mode: ForwardMode, *, cfg: ModelConfig, state: State, batch_size: int,
                 steps: int, seed: int = 0) -> Observation:
    """What ``backend``'s steps read of the *live* shared buffers in ``state``, run eagerly
    under a ``ReadObserver``: ``core.observe`` on the live memory rather than the example's.

    ``core.observe`` runs fresh example states, so a leaf that keeps a reference to the live
    buffers (a closure, an attribute, a global, a DLPack alias) reads memory it does not
    watch. Here each step's example values are copied into the live buffers (and put back
    afterwards), so those reads are seen; the trace to hold against it is the one bound to
    ``state`` (``core.bind``).

    >>> from readfence.backends.fuzz import VOCABULARY, FuzzLeaf, FuzzProgram, Placement, declared
    >>> state = make_state(FUZZ_CONFIG)
    >>> kept = FuzzLeaf("kept", (Placement(VOCABULARY["clone"], "attend", "seq_lens", via="closure"),),
    ...                 declared(POST_REPLAY=["req_to_token", "seq_lens"]), meta_stage=None)
    >>> backend = FuzzProgram(kept).build(state)
    >>> observe_live(backend, ForwardMode.DECODE, cfg=FUZZ_CONFIG, state=state, batch_size=2, steps=1).observed()
    ReadEffect({'seq_lens': POST_REPLAY}, default=NONE)
    """
    shared = state["shared"]
    saved = {k: v.clone() for k, v in shared.items()}
    accesses = []
    try:
        for i in range(steps):
            step = example_step(cfg, mode, batch_size, seed=seed + i, device=next(iter(shared.values())).device)
            for k, v in step.shared.items():
                shared[k].copy_(v)
            accesses += observe_step(step_functions(backend, mode, cfg),
                                     {**step.groups(), "shared": shared}, step=i)
    finally:
        for k, v in saved.items():
            shared[k].copy_(v)
    return Observation(backend.name, mode, tuple(shared), tuple(accesses), steps, (batch_size,))


def _live_disagreements(program: FuzzProgram, backend: Any, traced: Any, cfg: ModelConfig, state: State,
                        batch_size: int, steps: int, seed: int) -> tuple[Disagreement, ...]:
    try:
        live_program = bind(traced, state)
    except StageWriteError:  # a write through a kept reference: refused, nothing to cross-check
        return ()
    live = observe_live(backend, mode=program.mode, cfg=cfg, state=state, batch_size=batch_size, steps=steps,
                        seed=seed)
    # a plan/run kernel's read of the buffer it keeps is invisible to the trace by design
    invisible = {(p.buffer, BODY.name if p.stage == "attend" else p.stage)
                 for leaf in program.active_leaves() for p in leaf.placements if p.pattern.invisible}
    return tuple(d for d in cross_check(live_program, live) if (d.buffer, d.stage) not in invisible)


def _audited(backend: BackendLike, mode: ForwardMode, cfg: ModelConfig, sizes: Sequence[int],
             state: State) -> Unsound | None:
    # at the one batch size lowered, the audit lower itself asks (and caches): one audit per
    # program, not one here and one more in lower
    if len(set(sizes)) == 1:
        return audit_verdict(backend, mode, cfg=cfg, batch_size=sizes[0], device="cpu", state=state)
    return audit(backend, mode, cfg=cfg, batch_sizes=sizes, state=state).swap().value_or(None)


def _refused_by_lower(finding: LateRead) -> bool:
    # verify reports what lower refuses (an unsound declaration, a write found while tracing,
    # trace-time state, an uncapturable stage) as a finding whose evidence is the audit, a capture
    # its replay check refuses as the replay's, and a thread that lowering's rehearsal meets under
    # the read observer as the observer's
    return finding.evidence in ("audit", "replay") or (finding.kind == "thread" and finding.evidence == "observer")


def check_program(
    program: FuzzProgram,
    *,
    device: Device,
    cfg: ModelConfig = FUZZ_CONFIG,
    steps: int = 3,
    batch_size: int = 4,
    audit_batch_sizes: Sequence[int] | None = None,
    seed: int = 0,
    false_alarms: bool = True,
) -> Outcome:
    """Hold the analysis of ``program`` to the dynamic checks (P1, P2; P3 when
    ``false_alarms``).

    The program is built against a fresh live state of ``program.config(cfg)``, which the
    audit (at ``audit_batch_sizes``, default ``[batch_size]``: the shape ``lower`` and
    ``verify`` use), ``lower`` and ``verify`` (``steps`` steps at ``batch_size``) all get.
    Exceptions other than the refusals the analysis is meant to raise propagate: a program
    that crashes is a bug in the generator or in readfence.

    >>> from readfence.backends.fuzz import VOCABULARY, FuzzLeaf, FuzzProgram, Placement, declared
    >>> from readfence.graph import CpuDevice
    >>> snap = FuzzLeaf("snap", (Placement(VOCABULARY["clone"], "prepare_in_graph", "seq_lens", carry=True),),
    ...                 declared(IN_REPLAY=["req_to_token", "seq_lens"]))
    >>> with CpuDevice() as dev:
    ...     check_program(FuzzProgram(snap), device=dev).verdict
    'accepted'
    """
    t0 = time.perf_counter()
    cfg = program.config(cfg)
    mode = program.mode
    state = make_state(cfg, device)
    backend = program.build(state)
    sizes = [batch_size] if audit_batch_sizes is None else list(audit_batch_sizes)

    disagreements: tuple[Disagreement, ...] = ()
    try:
        traced = trace(backend, mode, cfg=cfg, batch_size=batch_size)
    except (StageWriteError, StageThreadError):
        traced = None  # refused while tracing: nothing to cross-check
    if traced is not None:
        seen = observe(backend, mode, batch_size=batch_size, steps=steps, cfg=cfg, seed=seed)
        disagreements = cross_check(traced, seen)
        if program.needs_state():  # its references reach the live buffers only
            disagreements += _live_disagreements(program, backend, traced, cfg, state, batch_size, steps, seed)
            disagreements = tuple(dict.fromkeys(disagreements))

    refused_by: str | None = None
    try:
        failure = _audited(backend, mode, cfg, sizes, state)
        if failure is not None:
            refused_by = f"audit: {failure.message}"
    except (StageWriteError, StageThreadError) as e:
        refused_by = f"audit: {_refusal(e)}"

    common: dict[str, Any] = {"policy": FUZZ_POLICIES, "steps": steps, "batch_size": batch_size,
                              "device": device, "cfg": cfg, "state": state}
    workload = attrs.evolve(WORKLOAD, seed=seed)
    finding = unsafe = None
    unsafe_ran = False
    if refused_by is None:
        # verify lowers under each policy itself: a refusal there is lower's, not a finding
        finding = verify(backend, mode, options=workload, **common).swap().value_or(None)
        if finding is not None and _refused_by_lower(finding):
            refused_by, finding = f"lower under {finding.policy.name}: {finding.kind}: {finding.detail}", None
    if refused_by is not None and false_alarms:
        unsafe = verify(backend, mode, options=attrs.evolve(workload, UNSAFE_skip_soundness_check=True),
                        **common).swap().value_or(None)
        # refused before any run (a write, trace-time state): nothing ran to tell a false alarm
        unsafe_ran = unsafe is None or not _refused_by_lower(unsafe)

    invisible = program.invisible_reads()
    declared = backend.read_effect(mode)
    late = frozenset(b for b, end in invisible.items() if declared[b] < end)
    return Outcome(program, refused_by, finding, unsafe, unsafe_ran, disagreements, frozenset(invisible), late,
                   program.thread_reads(), time.perf_counter() - t0, bool(program.uncapturable()))


@attrs.define
class Tally:
    """Counts over many outcomes: verdicts, violations, false alarms, the programs that read on
    another thread and how each ended, and how often each pattern, stage, way of reaching a
    buffer, combinator and mode was generated.

    >>> Tally().as_dict()["programs"]
    0
    """

    programs: int = 0
    accepted: int = 0
    refused: int = 0
    refused_runnable: int = 0  # refused, yet verify with the unsafe flag ran it, and CUDA could capture it
    false_alarms: int = 0
    uncapturable: int = 0  # programs a captured stage of which reads a device value on the host
    uncapturable_refused: int = 0
    uncapturable_clean_on_cpu: int = 0  # of those refused, clean under the unsafe flag on the CPU device
    p1_violations: int = 0
    p2_violations: int = 0
    invisible_caught: int = 0
    invisible_clean: int = 0
    invisible_missed: int = 0
    threads: int = 0  # programs whose running leaves read on a thread a stage starts
    thread_refused: int = 0
    thread_caught: int = 0
    thread_missed: int = 0
    seconds: float = 0.0
    patterns: Counter[str] = attrs.Factory(Counter)
    stages: Counter[str] = attrs.Factory(Counter)
    vias: Counter[str] = attrs.Factory(Counter)
    combinators: Counter[str] = attrs.Factory(Counter)
    modes: Counter[str] = attrs.Factory(Counter)
    refusals: Counter[str] = attrs.Factory(Counter)
    false_alarm_kinds: Counter[str] = attrs.Factory(Counter)
    by_pattern: dict[str, Counter[str]] = attrs.Factory(dict)  # pattern -> verdict -> programs
    violations: list[Outcome] = attrs.Factory(list)

    def add(self, outcome: Outcome) -> None:
        self.programs += 1
        self.seconds += outcome.seconds
        self.accepted += outcome.accepted
        self.refused += not outcome.accepted
        self.refused_runnable += outcome.runnable
        self.uncapturable += outcome.uncapturable
        self.uncapturable_refused += outcome.uncapturable and not outcome.accepted
        self.uncapturable_clean_on_cpu += outcome.clean_on_cpu_only
        self.false_alarms += outcome.false_alarm
        self.p1_violations += outcome.p1_violation
        self.p2_violations += outcome.p2_violation
        self.invisible_caught += outcome.invisible_caught
        self.invisible_clean += outcome.invisible_clean
        self.invisible_missed += outcome.invisible_missed
        if outcome.threads:
            self.threads += 1
            self.thread_refused += outcome.thread_refused
            self.thread_caught += outcome.thread_caught
            self.thread_missed += outcome.thread_missed
        if outcome.refusal_kind:
            self.refusals[outcome.refusal_kind] += 1
            if outcome.false_alarm:
                self.false_alarm_kinds[outcome.refusal_kind] += 1
        program = outcome.program
        self.modes[program.mode.name] += 1
        for p in program.placements():
            self.patterns[p.pattern.name] += 1
            self.stages[p.stage] += 1
            self.vias[p.via] += 1
        verdict = "false alarm" if outcome.false_alarm else outcome.verdict
        for name in {p.pattern.name for p in program.placements()}:
            self.by_pattern.setdefault(name, Counter())[verdict] += 1
        stack: list[Any] = [program.root]
        while stack:
            node = stack.pop()
            if isinstance(node, FuzzTree):
                self.combinators[node.combinator] += 1
                stack.extend(node.children)
        if outcome.p1_violation or outcome.p2_violation or outcome.invisible_missed or outcome.thread_missed:
            self.violations.append(outcome)

    @property
    def false_alarm_rate(self) -> float:
        """False alarms over the refused programs a CUDA engine could run under the unsafe flag."""
        return self.false_alarms / self.refused_runnable if self.refused_runnable else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "programs": self.programs, "accepted": self.accepted, "refused": self.refused,
            "refused_runnable": self.refused_runnable, "false_alarms": self.false_alarms,
            "uncapturable": self.uncapturable, "uncapturable_refused": self.uncapturable_refused,
            "uncapturable_clean_on_cpu": self.uncapturable_clean_on_cpu,
            "false_alarm_rate": round(self.false_alarm_rate, 4), "p1_violations": self.p1_violations,
            "p2_violations": self.p2_violations, "invisible_caught": self.invisible_caught,
            "invisible_clean": self.invisible_clean, "invisible_missed": self.invisible_missed, "threads": self.threads,
            "thread_refused": self.thread_refused, "thread_caught": self.thread_caught,
            "thread_missed": self.thread_missed, "seconds": round(self.seconds, 2),
            "refusals": dict(self.refusals), "false_alarm_kinds": dict(self.false_alarm_kinds),
            "patterns": dict(sorted(self.patterns.items())),
            "by_pattern": {k: dict(v) for k, v in sorted(self.by_pattern.items())},
            "stages": dict(self.stages), "vias": dict(self.vias), "combinators": dict(self.combinators),
            "modes": dict(self.modes),
        }


__all__ = ["FUZZ_CONFIG", "FUZZ_POLICIES", "Outcome", "Tally", "check_program", "observe_live"]
