"""``verify``: checks of a lowered step that do not trust the analysis that placed its fences.

For each policy the step is lowered in check mode (``graph.lowering._poison``) and run against the
serial reference:

* **poison on release**: every release point overwrites what it releases with in-range
  poison, so any read after it, through any code, changes the outputs deterministically;
  four poisons take turns step by step (``graph.lowering._poison.POISONS``: two constant, two
  distinct-valued and order-reversing), so a reader that uses the values only through
  equalities, order, a sum or a maximum is changed too. The outputs must be bit-identical to
  the serial run.
* **guard**: at its release point every buffer must still hold what the scheduler wrote
  (a forward that writes shared state is caught).
* **runtime read observer** (CpuDevice): a ``ReadObserver`` watches every op the forward
  stream really executes and reports any read of a buffer after the point that released it,
  naming the stage and the op, whatever the outputs (a late read that happens not to change
  them is still reported). On CUDA a replayed graph runs no Python: only poison and guard
  apply there, and the report says so.

A finding is a :class:`LateRead` naming the policy, the buffer, the first step that differed
and, when the observer saw it, the stage and op. When poison changes the outputs but the
observer saw nothing, the buffer is found by poisoning one buffer at a time while every other
one is held until the step's end (after a run that poisons none: outputs that differ even then
are not a late read of any buffer). Outputs that differ with nothing poisoned are readfence's
own miscompile when the same step lowered without its compile passes (``optimize=False``: every
captured node as traced) matches the serial run, and the backend's (it is not deterministic, or
keeps Python state a graph bakes) when that step differs too. Every run (the reference, each
policy's, each rerun that attributes a difference) starts from the same live state and the same
random numbers: a step that samples is compared with the serial run that drew what it draws.

The loop's record's ``checks`` selects the checks (:data:`CHECKS`), so each can be shown to
catch its own case with the others off.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from returns.result import Result
from torch import Tensor

from readfence.backends import PerStream
from readfence.core import (
    CapturedStateError,
    ForwardMode,
    ModelConfig,
    NotGraphSafe,
    ReadObserver,
    StageOutputError,
    StageThreadError,
    StageWriteError,
)
from readfence.core.internal import BufferMap, Ledger, RunKind, cuda_devices, model_config, positive_int, random_kept, random_state, set_random_state
from readfence.effects import Failure, Success  # unwrap() says why; neither is a bool

from ..devices import Device, DeviceError
from ..devices.internal import check_device
from ..lowering import (
    CheckState,
    LowerOptions,
    Policy,
    ReplayAliasError,
    UncapturableStage,
    UnsoundLowering,
    make_state,
    torch_device,
)
from ..lowering.internal import for_a_loop, names_keywords, poison_points, restore, snapshot
from ..runtime import (
    DEFAULT_CAPTURE_SIZES,
    LoopOptions,
    ServeOptions,
    Traffic,
    decode_loop,
    run_serial,
    run_serve_serial,
    serve_loop,
)
from ..runtime.internal import CHECKS, Options, options_of, said_in, same_logits
from ..steps import StepShape
from ..steps.internal import Target, check_run
from ._finding import LateRead as LateRead

State = Mapping[str, dict[str, Tensor]]



@attrs.frozen
class PolicyCheck:
    """One policy verified: which buffers its release points poisoned, how long it took."""

    policy: Policy
    poisoned: tuple[str, ...]
    seconds: float
    observed_ops: int  # shared-buffer accesses the observer saw (0 where it cannot watch)


@attrs.frozen
class VerifyReport:
    """What :func:`verify` checked and found clean."""

    target: str
    mode: ForwardMode
    device: str
    steps: int
    batch_size: int
    checks: tuple[PolicyCheck, ...]
    observer: bool  # whether the runtime read observer watched (CpuDevice)
    phases: str = ""  # a step shape's phases, "name:MODE -> ...": they bring their own modes
    checks_run: tuple[str, ...] = ("poison", "guard")  # names from CHECKS (the observer: see ``observer``)
    serving: str = ""  # the serving loop's traffic and capture sizes, when it was the loop checked

    def ran(self) -> list[str]:
        """The checks that ran, in the order of :data:`CHECKS`."""
        return [c for c in CHECKS if c in self.checks_run or (c == "observer" and self.observer)]

    def rows(self) -> list[dict[str, Any]]:
        mode = {"mode": "phases", "phases": self.phases} if self.phases else {"mode": self.mode.name}
        return [{"spec": self.target, **mode, "policy": c.policy.name, "verdict": "clean",
                 "buffer": None, "step": None, "stage": None, "op": None, "poisoned": list(c.poisoned),
                 "observed_accesses": c.observed_ops, "seconds": round(c.seconds, 3),
                 "checks": self.ran()}
                for c in self.checks]

    def __str__(self) -> str:
        names = {"poison": "poison", "guard": "guard", "observer": "the runtime read observer"}
        ran = [names[c] for c in self.ran()]
        watch = ran[0] if len(ran) == 1 else ", ".join(ran[:-1]) + " and " + ran[-1]
        if not self.observer and self.device != "cpu":
            watch += " (no op-by-op observer on this device: a replayed graph runs no Python)"
        where = f"in phases {self.phases}" if self.phases else f"in {self.mode.name}"
        size = f"serving {self.serving}" if self.serving else f"batch size {self.batch_size}"
        lines = [f"verified {self.target} {where} on {self.device}: {self.steps} steps, {size}, checks: {watch}"]
        for c in self.checks:
            poisoned = ", ".join(c.poisoned) or "nothing (released after the whole forward)"
            lines.append(f"  {c.policy.name:<10} clean; poisoned on release: {poisoned}")
        return "\n".join(lines)


class LateReadWatch:
    """The runtime read observer, told by the check when each buffer was released (what
    :func:`verify` watches with; give it to a :class:`CheckState` as its ``watcher``).

    One :class:`~readfence.core.ReadObserver` per forward stream thread (dispatch modes are
    thread-local); a read of a buffer after the release point that poisoned it, before the
    step restored it, is a late read: ``found`` lists them as ``(step, buffer, stage, op)``.

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig
    >>> from readfence.graph import CheckState, CpuDevice, LoopOptions, Policy, decode_loop, make_state
    >>> cfg = ModelConfig()
    >>> state = make_state(cfg)
    >>> watch = LateReadWatch(state["shared"])
    >>> with CpuDevice() as dev:
    ...     loop = decode_loop(paged(), policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=cfg, state=state,
    ...                        options=LoopOptions(check=CheckState(state["shared"], cfg, watcher=watch)))
    ...     _ = loop.run(2)
    >>> watch.found, watch.accesses > 0
    ([], True)
    """

    def __init__(self, shared: Mapping[str, Tensor]) -> None:
        self.buffers, self.held = BufferMap.of(shared), tuple(shared.values())
        self.local = threading.local()
        self.lock = threading.Lock()
        self.found: list[tuple[int, str, str, str]] = []  # (step, buffer, stage, op)
        self.accesses = 0

    def _observer(self) -> ReadObserver:
        obs = getattr(self.local, "observer", None)
        if obs is None:
            obs = self.local.observer = ReadObserver(self.buffers, held=self.held)
            self.local.released, self.local.step = {}, -1
        return obs

    @contextlib.contextmanager
    def stage(self, name: str, ledger: Ledger | None = None) -> Iterator[None]:
        """Watch stage ``name`` (a run of the lowered step's ``ledger``, when given: check mode's)."""
        obs = self._observer()
        recorded = contextlib.nullcontext() if ledger is None else ledger.watch(RunKind.CHECK, "check", {}, observer=obs)
        with recorded, obs, obs.stage(name):
            yield

    def started(self, step: int) -> None:
        obs = self._observer()
        obs.accesses.clear()
        self.local.released, self.local.step = {}, step

    def released(self, check: CheckState, buffers: tuple[str, ...]) -> None:
        obs = self._observer()
        for b in buffers:
            if check.is_armed(b):
                self.local.released.setdefault(b, len(obs.accesses))

    def restored(self) -> None:
        obs = self._observer()
        found = []
        for b, since in self.local.released.items():
            late = next((a for a in obs.accesses[since:] if a.buffer == b and a.kind != "write"), None)
            if late is not None:
                found.append((self.local.step, b, late.stage, late.op))
        with self.lock:
            self.found += found
            self.accesses += len(obs.accesses)
        obs.accesses.clear()
        self.local.released = {}


def phase_modes(target: Target) -> str:
    """A step shape's phases with their modes (``""`` for a backend or a ``per_stream`` group).

    >>> from readfence.backends import paged
    >>> from readfence.graph import ngram
    >>> phase_modes(ngram(paged())), phase_modes(paged())
    ('target_verify:TARGET_VERIFY', '')
    """
    if not isinstance(target, StepShape):
        return ""
    return " -> ".join(f"{p.name}:{p.mode.name}" for p in target.phases)


def _name(target: Target) -> str:
    # a spec where it has one (a readfence backend), else its name (a user's class need not print as one)
    return getattr(target, "spec", None) or getattr(target, "name", None) or str(target)


def _policies(policy: Policy | Iterable[Policy] | None) -> tuple[Policy, ...]:
    if policy is None:
        return tuple(Policy)
    items = (policy,) if isinstance(policy, Policy) else tuple(policy)
    bad = [p for p in items if not isinstance(p, Policy)]
    if bad or not items:
        raise TypeError(f"policy must be a readfence.graph.Policy or a list of them, got {policy!r}")
    return items


def _first_difference(logits: Sequence[Any], reference: Sequence[Any]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(logits, reference)) if not same_logits(a, b)), None)


def _graphs(step: Any) -> list[Any]:
    return getattr(step, "lowered", None) or list(getattr(step, "graphs", {}).values()) or [step]


def _poisoned(loop: Any) -> tuple[str, ...]:
    steps = loop.lowered_steps() if hasattr(loop, "lowered_steps") else [loop.lowered]
    parts = [g for step in steps for g in _graphs(step)]
    names: set[str] = set()
    for low in parts:
        for bs in poison_points(low.plan.placements).values():
            names.update(bs)
    return tuple(sorted(names))


#: verify's workload when its record gives none: requests finish often (the loop's default is
#: 0.1), so a few steps reuse slots and pages.
WORKLOAD = LoopOptions(finish_prob=0.3)


@names_keywords(options=LoopOptions)
def verify(
    target: Target,
    mode: ForwardMode = ForwardMode.DECODE,
    *,
    policy: Policy | Iterable[Policy] | None = None,
    steps: int = 8,
    batch_size: int = 4,
    device: Device,
    cfg: ModelConfig | None = None,
    state: State | None = None,
    options: LoopOptions | None = None,
    lowering: LowerOptions | None = None,
) -> Result[VerifyReport, LateRead]:
    """Check ``target`` (a backend, a ``per_stream`` group or a step shape) in the decode loop
    with poison on release, the write guard and the runtime read observer, for each policy
    (default: all). ``mode`` is any mode but ``IDLE`` (a step shape brings its own modes),
    ``steps`` a positive int and ``batch_size`` an int in ``1..cfg.max_reqs``; the keywords are
    :func:`~readfence.graph.run_overlapped`'s.

    ``Success(VerifyReport)`` when every policy's outputs are bit-identical to the serial run
    and nothing read after a release or wrote shared state; else ``Failure(LateRead)``
    naming the policy, the buffer, the first step that differed and, when the observer saw
    it, the stage and op. ``state`` is the live state to run on (fresh by default): pass the one
    a backend holds references to; it is reset between runs.

    ``options`` (a :class:`~readfence.graph.LoopOptions`; default :data:`WORKLOAD`) is the
    loop's record, which the loop and its serial reference both run: the workload (``seed``,
    ``finish_prob``, synthetic write work), ``checks`` (names from :data:`CHECKS`; default: all,
    the observer where it can watch: ``checks={"poison"}`` shows what poison alone catches) and
    ``UNSAFE_skip_soundness_check``: a declaration ``lower`` refuses is a finding, unless that
    lowers it anyway (to show it failing). The check mode is verify's own: a record that sets
    ``check`` is refused. ``lowering`` (a :class:`LowerOptions`: ring size, event factory...)
    goes to every graph's lowering; the measuring is the loop's. The serving loop is
    :func:`verify_serve`.

    >>> from readfence.backends import paged, redeclare
    >>> from readfence.effects import ReadEffect, ReadEnd
    >>> from readfence.graph import CpuDevice
    >>> with CpuDevice() as dev:
    ...     print(verify(paged(), steps=3, batch_size=2, device=dev, policy=Policy.PER_BUFFER).unwrap())
    ...     early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
    ...                                                           "seq_lens": ReadEnd.IN_REPLAY}))
    ...     bad = verify(early, steps=3, batch_size=2, device=dev, policy=Policy.PER_BUFFER,
    ...                  options=LoopOptions(UNSAFE_skip_soundness_check=True)).failure()
    ...     print(bad.kind, bad.buffer, bad.step, bad.stage, bad.evidence)  # doctest: +ELLIPSIS
    verified paged in DECODE on cpu: 3 steps, batch size 2, checks: poison, guard and the runtime read observer
      PER_BUFFER clean; poisoned on release: req_to_token, seq_lens, state_slots, swa_map
    late read req_to_token 0 prepare_in_graph observer
    """
    check_run(target, mode, "verify", "target")
    check_device(device)
    opts = _record(options, LoopOptions, WORKLOAD, "verify")
    cfg = model_config(cfg)
    positive_int("batch_size", batch_size, at_most=cfg.max_reqs, limit="cfg.max_reqs")
    return _verify(target, mode, policy, steps, device, cfg, state, opts, for_a_loop(lowering, "verify", said_in(LoopOptions)),
                   {"batch_size": batch_size})


@names_keywords(options=ServeOptions)
def verify_serve(
    target: Target,
    *,
    policy: Policy | Iterable[Policy] | None = None,
    steps: int = 8,
    device: Device,
    traffic: Traffic | None = None,
    capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
    cfg: ModelConfig | None = None,
    state: State | None = None,
    options: ServeOptions | None = None,
    lowering: LowerOptions | None = None,
) -> Result[VerifyReport, LateRead]:
    """:func:`verify` on the serving loop (``readfence.graph.serve_loop``: ``traffic``, a graph
    per batch size of ``capture_sizes``, prefill steps between decode steps); the keywords are
    :func:`~readfence.graph.run_serve`'s, and ``options`` (a :class:`~readfence.graph.ServeOptions`)
    is the loop's record, as :func:`verify` takes the decode loop's.

    >>> from readfence.backends import paged
    >>> from readfence.graph import CpuDevice, Traffic
    >>> with CpuDevice() as dev:
    ...     report = verify_serve(paged(), steps=6, device=dev, policy=Policy.EXACT, capture_sizes=[1, 2],
    ...                           traffic=Traffic(rate=1.0, prompt=(2, 4), output=(1, 3))).unwrap()
    >>> report.serving.endswith("capture sizes 1,2"), [c.policy.name for c in report.checks]
    (True, ['EXACT'])
    """
    check_run(target, ForwardMode.DECODE, "verify_serve", "target")
    check_device(device)
    opts = _record(options, ServeOptions, ServeOptions(), "verify_serve")
    traffic = Traffic() if traffic is None else traffic
    if not isinstance(traffic, Traffic):
        raise TypeError(f"traffic must be a readfence.graph.Traffic, got {traffic!r}")
    cfg = model_config(cfg)
    return _verify(target, ForwardMode.DECODE, policy, steps, device, cfg, state, opts,
                   for_a_loop(lowering, "verify_serve", said_in(ServeOptions)),
                   {"traffic": traffic, "capture_sizes": tuple(capture_sizes)})


def _record(options: object, kind: type[Options], default: Options, caller: str) -> Options:
    # the loop's record as verify takes it: the check mode is verify's own
    opts = default if options is None else options_of(options, kind, caller)
    if opts.check is not False:
        raise TypeError(f"{caller}() runs the loop in its own check mode: leave check out of its "
                        f"{kind.__name__} (its checks= picks the checks it runs)")
    return opts


@random_kept()
def _verify(target: Target, mode: ForwardMode, policy: Policy | Iterable[Policy] | None, steps: int, device: Device,
            cfg: ModelConfig, state: State | None, opts: Options, options: LowerOptions,
            size: dict[str, Any]) -> Result[VerifyReport, LateRead]:
    # verify and verify_serve: ``size`` is the decode loop's batch size or the serving loop's traffic
    policies = _policies(policy)
    positive_int("steps", steps)
    where = torch_device(device)
    live = make_state(cfg, device) if state is None else state
    kept, generators = snapshot(live), cuda_devices()
    drawn = random_state(generators)

    def rewind() -> None:
        # every run starts where the first did: the same live state and the same random numbers
        restore(live, kept)
        set_random_state(drawn, generators)

    name = _name(target)
    common: dict[str, Any] = dict(steps=steps, cfg=cfg, record=opts, **size)
    chosen = frozenset(CHECKS) if opts.checks is None else opts.checks
    if where != "cpu" and opts.checks is not None and "observer" in chosen:
        raise ValueError(f"the runtime read observer cannot watch {device.name}: a replayed graph runs no Python")
    observe = "observer" in chosen and where == "cpu"
    poison, guard = "poison" in chosen, "guard" in chosen
    ran = tuple(c for c in CHECKS if c in chosen and (c != "observer" or observe))
    traffic = size.get("traffic")

    try:
        if where == "cpu" and isinstance(opts, ServeOptions):
            reference = run_serve_serial(target, state=live, steps=steps, cfg=cfg, options=opts, **size).logits
        elif where == "cpu" and isinstance(opts, LoopOptions):
            reference = run_serial(target, mode, state=live, steps=steps, cfg=cfg, options=opts, **size).logits
        else:  # float results differ between devices: the reference is COARSE on this device
            reference = _run(target, mode, Policy.COARSE, device, live, None, options, **common)[0]
    except StageWriteError as e:  # (an engine's capture-time call, watched in the serial run too)
        return Failure(LateRead.refused_write(name, mode, policies[0], e))
    done = []
    for pol in policies:
        rewind()
        t0 = time.perf_counter()
        watch = LateReadWatch(live["shared"]) if observe else None
        try:
            logits, check, loop = _run(target, mode, pol, device, live, watch, options, poison=poison, guard=guard,
                                       **common)
        except UnsoundLowering as e:
            return Failure(_refused(name, mode, pol, e))
        except StageWriteError as e:
            return Failure(LateRead.refused_write(name, mode, pol, e))
        except StageOutputError as e:  # refused by the lowering: a value the graphs cannot carry
            return Failure(LateRead(name, mode, pol, "refused", "audit", stage=e.stage, detail=str(e)))
        except (StageThreadError, DeviceError) as e:  # a stage hands work to another thread
            t = e if isinstance(e, StageThreadError) else e.__cause__
            if isinstance(t, ReplayAliasError):  # an opaque op returned a view no example showed
                return Failure(LateRead(name, mode, pol, "refused", "run", min(t.buffers), None, t.stage, t.op, str(t)))
            if isinstance(t, StageOutputError):  # a step returned what the graphs after it were not traced on
                return Failure(LateRead(name, mode, pol, "refused", "run", stage=t.stage, detail=str(t)))
            if not isinstance(t, StageThreadError):
                raise
            evidence = {"the trace": "audit", "the read observer": "observer"}.get(t.watcher or "", "run")
            return Failure(LateRead(name, mode, pol, "thread", evidence, None, None, t.stage, t.what, str(t)))
        except (CapturedStateError, UncapturableStage) as e:  # no fence makes these correct
            return Failure(LateRead(name, mode, pol, "refused", "audit", detail=str(e)))
        except NotGraphSafe as e:  # the capture computes other than the code: not a fence question
            return Failure(LateRead(name, mode, pol, "refused", "replay", stage=e.stage, op=e.output, detail=str(e)))
        seconds = time.perf_counter() - t0
        moved = check.moved_buffers()
        if moved:
            step, buffer = moved[0]
            return Failure(LateRead(name, mode, pol, "write", "guard", buffer, step,
                                    detail="the forward changed a shared buffer the scheduler owns"))
        if watch is not None and watch.found:
            step, buffer, stage, op = min(watch.found)
            return Failure(LateRead(name, mode, pol, "late read", "observer", buffer, step, stage, op,
                                    "read after the release point of its fence"))
        differs = _first_difference(logits, reference)
        if differs is not None:
            candidates = _poisoned(loop) if poison else ()
            return Failure(_attribute(target, mode, pol, device, live, rewind, reference, differs, options,
                                      candidates, loop, **common))
        done.append(PolicyCheck(pol, _poisoned(loop) if poison else (), seconds,
                                0 if watch is None else watch.accesses))
    restore(live, kept)
    serving = "" if traffic is None else _serving(traffic, common["capture_sizes"])
    return Success(VerifyReport(name, mode, device.name, steps, size.get("batch_size", 0), tuple(done), observe,
                                phase_modes(target), ran, serving))


def _serving(traffic: Traffic, sizes: Sequence[int]) -> str:
    return (f"{traffic.rate:g} requests/step, prompts {traffic.prompt[0]}..{traffic.prompt[1]}, outputs "
            f"{traffic.output[0]}..{traffic.output[1]}, seed {traffic.seed}, capture sizes {','.join(map(str, sizes))}")


def _run(target: Target, mode: ForwardMode, policy: Policy, device: Device, state: State, watch: Any,
         lowering: LowerOptions, *, steps: int, cfg: ModelConfig, record: Options, batch_size: int = 0,
         traffic: Traffic | None = None, capture_sizes: Sequence[int] = (), only: Iterable[str] | None = None,
         poison: bool = True, guard: bool = True) -> tuple[list[Any], Any, Any]:
    # the loop with the caller's record, in verify's check mode
    check = CheckState(state["shared"], cfg, watcher=watch, only=only, poison=poison, guard=guard)
    if isinstance(record, ServeOptions):
        serve = serve_loop(target, policy=policy, device=device, traffic=traffic, capture_sizes=capture_sizes, cfg=cfg,
                           state=state, options=attrs.evolve(record, check=check), lowering=lowering)
        outputs = serve.run(steps, timeout=device.timeout)[2]
        return outputs, serve.check, serve
    decode = decode_loop(target, mode, policy=policy, device=device, batch_size=batch_size, cfg=cfg, state=state,
                         options=attrs.evolve(record, check=check), lowering=lowering)
    runs, _ = decode.run(steps, timeout=device.timeout)
    return [r.logits for r in runs], decode.check, decode


#: What a difference no poison explains means: the lowered program is not the serial step.
NOTHING_POISONED = ("the lowered step differs from the serial step with nothing poisoned: not a race, the lowered "
                    "program computes something else (a backend that is not deterministic, or keeps Python state "
                    "that the traced graph baked in)")

#: What it means when the step lowered without readfence's compile passes matches the serial run.
MISCOMPILED = ("the lowered step differs from the serial step with nothing poisoned, and the same step lowered "
               "without readfence's compile passes (constant folding, shared subexpressions, Python bindings: "
               "LowerOptions(optimize=False)) matches it: readfence's compile passes computed something else. "
               "This is a bug in readfence, not in the backend: please report it; optimize=False runs the step "
               "correctly meanwhile")


#: What it means when the serial run with each batch padded as the loop pads it matches the loop.
PADDING = ("the lowered step differs from the serial step with nothing poisoned, and the serial step with each decode "
           "batch padded as the serving loop pads it (to the captured size it runs in: run_serve_serial(padded=True)) "
           "matches it: a request's outputs depend on the padding rows, as from a reduction over the whole batch; an "
           "engine replaying a graph captured for a larger batch computes the same. Mask the padding rows out of "
           "what reaches a request, or compare with the padded reference")


def _attribute(target: Target, mode: ForwardMode, policy: Policy, device: Device, state: State, rewind: Callable[[], None],
               reference: Sequence[Any], differs: int, lowering: LowerOptions,
               poisoned: tuple[str, ...], loop: Any, **common: Any) -> LateRead:
    # The outputs differ and the observer named nothing. A run that poisons nothing holds every
    # buffer until the step's end: if it differs too, no late read explains it. Else each buffer
    # is poisoned alone while every other one is held: a run that differs then read that buffer
    # late (whatever the others are read as), and each buffer is blamed only on its own run. The
    # reader is the one the step's ledger saw read it past its release, if any run did.
    name = _name(target)

    def first_difference(only: Sequence[str], options: LowerOptions = lowering, against: Sequence[Any] = reference,
                         ) -> int | None:
        rewind()
        logits = _run(target, mode, policy, device, state, None, options, only=only, guard=False, **common)[0]
        return _first_difference(logits, against)

    def padding_explains() -> bool:
        # the serving loop runs a batch in a larger captured graph, padded: the serial step padded
        # the same way, against the loop with nothing poisoned
        record, traffic = common["record"], common.get("traffic")
        if not isinstance(record, ServeOptions) or traffic is None or isinstance(target, PerStream):
            return False
        rewind()
        padded = run_serve_serial(target, state=state, steps=common["steps"], cfg=common["cfg"], options=record,
                                  traffic=traffic, capture_sizes=common["capture_sizes"], padded=True).logits
        return _first_difference(padded, reference) is not None and first_difference((), against=padded) is None

    def unpoisoned(step: int, held: str = "") -> LateRead:
        # no late read explains it: readfence's compile passes, the padding, or the backend? The
        # step again, lowered without the passes and nothing poisoned, then the serial step padded
        # as the loop pads it, tell them apart
        if lowering.optimize and first_difference((), attrs.evolve(lowering, optimize=False)) is None:
            return LateRead(name, mode, policy, "miscompiled", "rerun", None, step, detail=MISCOMPILED)
        if padding_explains():
            return LateRead(name, mode, policy, "padding", "rerun", None, step, detail=PADDING)
        return LateRead(name, mode, policy, "differs", "output", None, step, detail=NOTHING_POISONED + held)

    if not poisoned:
        return unpoisoned(differs)
    held = first_difference(())
    if held is not None:
        return unpoisoned(held, ", even with every buffer held until the step's end")
    late = {b: step for b in poisoned if (step := first_difference((b,))) is not None}
    if late:
        buffer = min(late, key=lambda b: (late[b], poisoned.index(b)))
        also = [b for b in poisoned if b in late and b != buffer]
        more = f"; poisoned alone, {', '.join(also)} also change the outputs" if also else ""
        seen = ledger_witness(loop, buffer)
        by = (f"; the step's ledger saw {seen[1]} in {seen[0]} read it after its release" if seen else
              "; no run of the step saw it read after its release: a read no observer sees (memory a kernel kept)")
        stage, op = seen or (None, None)
        return LateRead(name, mode, policy, "late read", "poison", buffer, late[buffer], stage, op,
                        detail="outputs differ from the serial run when this buffer alone is poisoned on release "
                               f"and every other one is held{more}{by}")
    return LateRead(name, mode, policy, "late read", "poison", None, differs,
                    detail=f"outputs differ when {', '.join(poisoned)} are poisoned together, not one at a time")


def ledger_witness(loop: Any, buffer: str) -> tuple[str, str] | None:
    """``(stage, node or op)`` where the ledger of a graph ``loop`` lowered last saw ``buffer`` read,
    when that is after the point the graph's fence releases it (``None``: no run of the step saw a
    read that late): who read it late, as far as any run of the step could see."""
    steps = loop.lowered_steps() if hasattr(loop, "lowered_steps") else [loop.lowered]
    for low in (g for step in steps for g in _graphs(step)):
        placement, seen = low.plan.placements.get(buffer), low.ledger.last_reader(buffer)
        if seen is not None and placement is not None and seen.end > placement.end:
            return seen.stage.name, seen.node
    return None


def _refused(name: str, mode: ForwardMode, policy: Policy, error: UnsoundLowering) -> LateRead:
    failure = getattr(error, "failure", None)
    if failure is None:
        return LateRead(name, mode, policy, "unsound declaration", "audit", detail=str(error))
    stage, op = failure.reader if failure.reader else (None, None)
    # the mode refused: the serving loop's prefill steps are lowered in EXTEND, whatever its decode mode
    return LateRead(name, failure.mode, policy, "unsound declaration", "audit", failure.buffer, None, stage, op,
                    str(error))


__all__ = ["CHECKS", "MISCOMPILED", "WORKLOAD", "LateRead", "LateReadWatch", "PolicyCheck", "VerifyReport", "phase_modes",
           "verify", "verify_serve"]
