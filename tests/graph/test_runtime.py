"""The ground truth: the overlapped decode loop is bit-identical to the serial run.

* every reference leaf and every reference composition, every policy, 40 DECODE steps with
  random delays on every stream: logits equal ``run_serial`` step by step, no sanitizer race;
* leaves that declare POST_REPLAY (TARGET_VERIFY / DRAFT_EXTEND) likewise;
* a declaration lowered one step too early (``UNSAFE_skip_soundness_check=True``) is caught
  twice: the sanitizer names the buffer and the reading node, and the outputs differ from
  serial under forward-stream delays. Without the unsafe flag ``lower`` refuses it; COARSE
  accepts it and is correct.

Each case is its own test; the serial reference is shared per (backend, mode) through a
module cache. Intra-op threads are pinned to 1 (streams are the parallelism; on 2 cores the
default thread pool makes small ops many times slower).
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

from readfence.backends import (
    REFERENCE_LEAVES,
    deepseek_v4,
    dense,
    hybrid,
    hybrid_linear,
    join,
    linear,
    minimax,
    paged,
    per_stream,
    redeclare,
    select,
    sparse,
    tbo,
    trtllm_mha,
)
from readfence.core import ForwardMode, ModelConfig
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import (
    CpuDevice,
    FaultInjector,
    LoopOptions,
    LoopResult,
    Policy,
    Sanitizer,
    UnsoundLowering,
    decode_loop,
    lower,
    run_overlapped,
    run_serial,
)
from tests.conftest import TWO_LAYERS as CFG

from ._live_state import LiveState

M = ForwardMode
# Every step overwrites the shared buffers the previous step read, every case's event ring has
# one slot (it wraps every step) and the delays are drawn per step: 40 steps reorder the work
# many times and retire requests in every mode (4 in DECODE, 6 and 8 in DRAFT_EXTEND and
# TARGET_VERIFY). An early fence is seen by the sanitizer at every step and changes the
# outputs of at least 17 of the 40 in every BROKEN case below.
STEPS = 40
BATCH = 2




# name -> factory; factories so that every test builds fresh values (equality is structural).
BACKENDS = {
    **REFERENCE_LEAVES,
    "tbo(deepseek_v4,paged)": lambda: tbo(deepseek_v4(), paged()),
    "hybrid_linear(trtllm_mha,linear)": lambda: hybrid_linear(trtllm_mha(), linear()),
    "minimax(sparse,dense)": lambda: minimax(sparse(), dense()),
    "hybrid(decode=paged,prefill=deepseek_v4)": lambda: hybrid(decode=paged(), prefill=deepseek_v4()),
    "join(paged,linear)": lambda: join(paged(), linear()),
    "select(DECODE:trtllm_mha,TARGET_VERIFY:deepseek_v4,default=paged)": lambda: select(
        {M.DECODE: trtllm_mha(), M.TARGET_VERIFY: deepseek_v4()}, default=paged()
    ),
    "per_stream(paged,trtllm_mha)": lambda: per_stream(paged(), trtllm_mha()),
}

# Modes in which some leaf reads a buffer until POST_REPLAY (re-reads in the layer body).
POST_REPLAY_CASES = [
    ("deepseek_v4", M.TARGET_VERIFY),  # page table re-read in every layer
    ("trtllm_mha", M.DRAFT_EXTEND),  # page table re-read in every layer
    ("sparse", M.TARGET_VERIFY),  # per-layer page selection
    ("tbo(deepseek_v4,paged)", M.TARGET_VERIFY),  # the join keeps deepseek_v4's POST_REPLAY
    ("select(DECODE:trtllm_mha,TARGET_VERIFY:deepseek_v4,default=paged)", M.TARGET_VERIFY),
]

# per_stream members share the KV and state pools: these cases caught a slot freed by one
# stream's request and reused at once by another stream's request while still being read
# (the sanitizer does not model pool writes; the logits differed). StreamGroup now orders
# each stream's step after the other streams' previous step.
CASES = [(name, M.DECODE) for name in BACKENDS] + POST_REPLAY_CASES


@functools.cache
def _serial(name: str, mode: ForwardMode, cfg: ModelConfig = CFG, batch_size: int = BATCH,
            finish_prob: float = 0.1):
    return run_serial(BACKENDS[name](), mode, steps=STEPS, batch_size=batch_size, cfg=cfg,
                      options=LoopOptions(finish_prob=finish_prob))


def _delays(seed: int, max_delay_s: float = 0.0005, streams=None) -> FaultInjector:
    return FaultInjector(seed=seed, max_delay_s=max_delay_s, streams=streams)


def test_post_replay_cases_really_end_after_the_replay():
    # The TARGET_VERIFY / DRAFT_EXTEND cases are only worth running if they publish POST_REPLAY.
    for name, mode in POST_REPLAY_CASES:
        assert BACKENDS[name]().read_effect(mode)["req_to_token"] is ReadEnd.POST_REPLAY, (name, mode)


# A few of them again under CUDA's event semantics (an event is only its latest record, no
# host wait during a capture): what the loop asks of events must be what CUDA offers.
CUDA_EVENT_CASES = [
    ("tbo(deepseek_v4,paged)", M.TARGET_VERIFY, Policy.EXACT),
    ("per_stream(paged,trtllm_mha)", M.DECODE, Policy.PER_BUFFER),
    ("trtllm_mha", M.DECODE, Policy.JOINED),
]
LOOP_CASES = [
    # the quick tier runs EXACT (the earliest fences); the full suite every policy that publishes
    # early (COARSE's wait for the whole forward runs for every target in the serving matrix)
    *(pytest.param(n, m, p, False, id=f"{n}-{m.name}-{p}", marks=[] if p is Policy.EXACT else [pytest.mark.slow])
      for n, m in CASES for p in Policy if p is not Policy.COARSE),
    *(pytest.param(n, m, p, True, id=f"{n}-{m.name}-{p}-cuda-events") for n, m, p in CUDA_EVENT_CASES),
]


@functools.cache
def _live(name: str, mode: ForwardMode) -> LiveState:
    # one live state per case, shared by its policies' runs (see ``_live_state``)
    return LiveState(CFG)


@pytest.mark.parametrize(("name", "mode", "policy", "cuda_events"), LOOP_CASES)
def test_overlapped_is_bit_identical_to_serial_and_clean(name, mode, policy, cuda_events):
    ref = _serial(name, mode)
    assert ref.steps == STEPS
    seed = zlib.crc32(f"{name}/{mode.name}/{policy.name}".encode()) % 10_000  # the same in every process
    with CpuDevice(timeout=30, faults=_delays(seed), cuda_events=cuda_events) as dev:
        res = run_overlapped(BACKENDS[name](), mode, steps=STEPS, policy=policy, device=dev,
                             batch_size=BATCH, cfg=CFG, state=_live(name, mode).fresh())
    assert res.steps == STEPS
    assert res.violations == (), "\n".join(map(str, res.violations[:5]))
    first_bad = next((i for i, (a, b) in enumerate(zip(res.logits, ref.logits)) if not _same(a, b)), None)
    assert first_bad is None, f"{name} {mode.name} {policy}: logits differ from serial at step {first_bad}"
    assert res.matches(ref)
    # The fence never fires before the last read it protects (ordering, not timing).
    assert all(s >= 0 for s in res.slack.values()), res.slack


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def test_matches_is_not_vacuous():
    # The comparison used above can fail: a perturbed copy of one step does not match.
    ref = _serial("paged", M.DECODE)
    logits = list(ref.logits)
    logits[STEPS // 2] = logits[STEPS // 2].clone()
    logits[STEPS // 2].view(-1)[0] += 1.0
    assert not type(ref)(None, logits, 0.0).matches(ref)
    assert not type(ref)(None, logits[:-1], 0.0).matches(ref)
    # ... and different schedules really produce different logits.
    assert not run_serial(paged(), steps=STEPS, batch_size=BATCH, cfg=CFG, options=LoopOptions(seed=1)).matches(ref)


# -- one step too early ------------------------------------------------------------------------

PRE, IN, POST = ReadEnd.PRE_REPLAY, ReadEnd.IN_REPLAY, ReadEnd.POST_REPLAY


def _too_early(leaf, mode: ForwardMode, buffer: str, end: ReadEnd):
    """``leaf`` redeclared so that ``buffer`` ends at ``end`` (one step early) in ``mode``."""
    true = leaf.read_effect(mode)

    def declare(m: ForwardMode) -> ReadEffect:
        e = leaf.read_effect(m)
        return ReadEffect.of({**e.as_dict(), buffer: end}, default=e.default) if m is mode else e

    broken = redeclare(leaf, declare)
    assert broken.read_effect(mode)[buffer] is end and end < true[buffer]
    return broken


# (id, backend factory, mode, buffer, early end): the true end is one stage later.
BROKEN = [
    ("paged-seq_lens-IN->PRE", lambda: _too_early(paged(), M.DECODE, "seq_lens", PRE), M.DECODE, "seq_lens", PRE),
    ("paged-req_to_token-IN->PRE", lambda: _too_early(paged(), M.DECODE, "req_to_token", PRE), M.DECODE,
     "req_to_token", PRE),
    ("deepseek_v4-TARGET_VERIFY-req_to_token-POST->IN",
     lambda: _too_early(deepseek_v4(), M.TARGET_VERIFY, "req_to_token", IN), M.TARGET_VERIFY, "req_to_token", IN),
    ("trtllm_mha-DRAFT_EXTEND-req_to_token-POST->IN",
     lambda: _too_early(trtllm_mha(), M.DRAFT_EXTEND, "req_to_token", IN), M.DRAFT_EXTEND, "req_to_token", IN),
    ("linear-state_slots-IN->PRE", lambda: _too_early(linear(), M.DECODE, "state_slots", PRE), M.DECODE,
     "state_slots", PRE),
    # Inside a combinator: the join computes its effect from the broken child, so it is broken too.
    ("hybrid_linear(trtllm_mha,linear*)-state_slots-IN->PRE",
     lambda: hybrid_linear(trtllm_mha(), _too_early(linear(), M.DECODE, "state_slots", PRE)), M.DECODE,
     "state_slots", PRE),
]
# Rows are reused every time a request finishes (batch == max_reqs), so an early overwrite of
# a row still being read changes what the step reads; churn is high so it happens often.
BROKEN_CFG = ModelConfig(layers=2, max_reqs=4)
BROKEN_BATCH = 4
BROKEN_CHURN = 0.3


@functools.cache
def _broken_serial(case_id: str):
    _, make, mode, _, _ = next(c for c in BROKEN if c[0] == case_id)
    return run_serial(make(), mode, steps=STEPS, batch_size=BROKEN_BATCH, cfg=BROKEN_CFG,
                      options=LoopOptions(finish_prob=BROKEN_CHURN))


@pytest.mark.parametrize(("case_id", "make", "mode", "buffer", "early"), BROKEN, ids=[c[0] for c in BROKEN])
def test_one_step_too_early_is_caught_by_sanitizer_and_by_outputs(case_id, make, mode, buffer, early):
    ref = _broken_serial(case_id)
    faults = _delays(seed=7, max_delay_s=0.002, streams=["forward"])
    with CpuDevice(timeout=30, faults=faults) as dev:
        loop = decode_loop(make(), mode, policy=Policy.PER_BUFFER, device=dev, batch_size=BROKEN_BATCH, cfg=BROKEN_CFG,
                           options=LoopOptions(finish_prob=BROKEN_CHURN, UNSAFE_skip_soundness_check=True))
        assert loop.lowered.plan.end(buffer) is early  # the fence really is one step early
        stage, node = loop.lowered.program.last_reader(buffer)
        san = Sanitizer()
        dev.add_observer(san)
        runs, _ = loop.run(STEPS)
        dev.remove_observer(san)
    logits = [r.logits for r in runs]

    # 1. the sanitizer reports it, naming the buffer and the node that last reads it
    assert san.count > 0, f"{case_id}: the sanitizer missed a fence published one step early"
    assert {v.buffer for v in san.violations} == {buffer}
    assert {v.kind for v in san.violations} == {"write-after-read"}
    reading = f"{stage}:{node}"
    assert {v.reading_node for v in san.violations} == {reading}
    v = san.violations[0]
    assert v.writer == "schedule" and v.reader == "forward" and v.write_step == v.read_step + 1
    assert buffer in str(v) and reading in str(v)

    # 2. the outputs differ from the serial run
    assert len(logits) == len(ref.logits) == STEPS
    differ = sum(not torch.equal(a, b) for a, b in zip(logits, ref.logits))
    assert differ > 0, f"{case_id}: outputs equal serial despite an early fence under delays"


@pytest.mark.parametrize(("case_id", "make", "mode", "buffer", "early"), BROKEN, ids=[c[0] for c in BROKEN])
def test_one_step_too_early_is_refused_without_the_unsafe_flag(case_id, make, mode, buffer, early):
    backend = make()
    true_end = ReadEnd(early.value + 1)  # every case is exactly one stage early
    with CpuDevice() as dev:
        for policy in (Policy.JOINED, Policy.PER_BUFFER, Policy.EXACT):
            if policy is Policy.JOINED and backend.read_effect(mode).end > early:
                continue  # the join hides the early end when another buffer ends later: sound
            with pytest.raises(UnsoundLowering) as err:
                lower(backend, mode, batch_size=BATCH, device=dev, policy=policy, cfg=CFG)
            msg = str(err.value)
            for part in (backend.name, mode.name, policy.name, repr(buffer), early.name, true_end.name):
                assert part in msg, f"{part!r} missing from: {msg}"
        # COARSE ignores declarations: it lowers without complaint.
        low = lower(backend, mode, batch_size=BATCH, device=dev, policy=Policy.COARSE, cfg=CFG)
        assert {p.end for p in low.plan.placements.values()} == {ReadEnd.UNKNOWN}


@pytest.mark.parametrize(("case_id", "make", "mode", "buffer", "early"), BROKEN, ids=[c[0] for c in BROKEN])
def test_one_step_too_early_is_correct_under_coarse(case_id, make, mode, buffer, early):
    ref = _broken_serial(case_id)
    faults = _delays(seed=7, max_delay_s=0.002, streams=["forward"])
    with CpuDevice(timeout=30, faults=faults) as dev:
        res = run_overlapped(make(), mode, steps=STEPS, policy=Policy.COARSE, device=dev, batch_size=BROKEN_BATCH,
                             cfg=BROKEN_CFG, options=LoopOptions(finish_prob=BROKEN_CHURN))
    assert res.violations == (), "\n".join(map(str, res.violations[:5]))
    assert res.matches(ref)


def test_joined_is_broken_too_when_the_early_buffer_decides_the_join():
    # linear reads only state_slots: the join is the early end itself, so JOINED is unsound too.
    backend = _too_early(linear(), M.DECODE, "state_slots", PRE)
    ref = _broken_serial("linear-state_slots-IN->PRE")
    with CpuDevice(timeout=30, faults=_delays(seed=3, max_delay_s=0.002, streams=["forward"])) as dev:
        res = run_overlapped(backend, M.DECODE, steps=STEPS, policy=Policy.JOINED, device=dev, batch_size=BROKEN_BATCH,
                             cfg=BROKEN_CFG,
                             options=LoopOptions(finish_prob=BROKEN_CHURN, UNSAFE_skip_soundness_check=True))
    assert res.violations and {v.buffer for v in res.violations} == {"state_slots"}
    assert not res.matches(ref)


def test_capabilities_without_in_graph_events_run_correctly():
    # IN_REPLAY falls back to POST_REPLAY (never earlier): still bit-identical and clean.
    for name in ("hybrid_linear(trtllm_mha,linear)", "minimax(sparse,dense)"):
        ref = _serial(name, M.DECODE)
        for policy in (Policy.JOINED, Policy.PER_BUFFER, Policy.EXACT):
            with CpuDevice(timeout=30, in_graph_events=False, faults=_delays(seed=11)) as dev:
                res = run_overlapped(BACKENDS[name](), M.DECODE, steps=STEPS, policy=policy, device=dev,
                                     batch_size=BATCH, cfg=CFG)
            assert res.violations == (), (name, policy, res.violations[:3])
            assert res.matches(ref), (name, policy)


# -- the serial reference runs on the run's device -------------------------------------------------
def test_serial_reference_runs_on_the_device_it_is_given(monkeypatch):
    # The meta device stands in for CUDA (a device that is not the host): state, batches and
    # logits of the reference must all live there, or they cannot be compared with the run's.
    import readfence.graph.lowering._live_state as live_state
    import readfence.graph.lowering._lower as lowering
    import readfence.graph.runtime._loop as runtime
    import readfence.graph.runtime._serial as serial

    monkeypatch.setattr(live_state, "torch_device", lambda device: "meta")
    monkeypatch.setattr(lowering, "torch_device", lambda device: "meta")
    monkeypatch.setattr(runtime, "torch_device", lambda device: "meta")
    monkeypatch.setattr(serial, "torch_device", lambda device: "meta")
    res = run_serial(paged(), steps=2, batch_size=BATCH, cfg=CFG, device="cuda")
    assert {t.device.type for t in res.logits} == {"meta"}


def test_comparing_logits_on_two_devices_asks_for_a_reference_on_the_run_device():
    ref = run_serial(paged(), steps=1, batch_size=BATCH, cfg=CFG, device="cpu")
    elsewhere = LoopResult(Policy.EXACT, [torch.zeros_like(ref.logits[0], device="meta")], 0.0)
    with pytest.raises(ValueError, match=r"run_serial\(\.\.\., device=\.\.\.\)"):
        elsewhere.matches(ref)


# -- how the scheduler waits: at every release point when watched, once per write with work otherwise --


class _CountingStream:
    """The schedule stream, counting the waits enqueued on it (an observer would watch the loop)."""

    def __init__(self, stream):
        self.stream, self.waits = stream, 0

    def wait(self, event):
        self.waits += 1
        self.stream.wait(event)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.mark.parametrize("policy", [Policy.PER_BUFFER, Policy.EXACT])
@pytest.mark.parametrize("write_wait_s", [0.0, 0.0002], ids=["copies", "page-table-work"])
def test_unwatched_loop_waits_once_per_write_with_work_and_stays_bit_identical(policy, write_wait_s):
    backend, steps = hybrid_linear(trtllm_mha(), linear()), 20
    ref = run_serial(backend, M.DECODE, steps=steps, batch_size=BATCH, cfg=CFG)
    waits = {}
    for watched in (False, True):
        san = Sanitizer()
        with CpuDevice(timeout=30, faults=_delays(11), observers=[san] if watched else ()) as dev:
            loop = decode_loop(backend, policy=policy, device=dev, batch_size=BATCH, cfg=CFG,
                               options=LoopOptions(write_wait_s=write_wait_s))
            loop.schedule_stream = counting = _CountingStream(loop.schedule_stream)
            runs, _ = loop.run(steps)
        assert all(torch.equal(r.logits, want) for r, want in zip(runs, ref.logits, strict=True))
        assert not san.violations
        waits[watched] = counting.waits / (steps - 1)  # the first step's writes wait for nothing
        groups = loop._wait_groups()
        if watched:
            assert groups == loop.write_groups
        elif write_wait_s == 0.0:
            assert groups == (loop.write_order,)
        else:  # the page-table write still waits at its own release point: its group ends there
            (with_work,) = [g for g in groups if "req_to_token" in g]
            assert loop.lowered.write_key(with_work[-1]) == loop.lowered.write_key("req_to_token")
    # the same fences, used at each release point only when a sanitizer must see the race
    assert waits[True] == len(loop.write_groups) >= 2
    assert waits[False] == (1 if write_wait_s == 0.0 else 2)


@pytest.mark.parametrize("entry", ["run_overlapped", "run_serve", "run_traced"])
def test_an_option_no_loop_takes_is_named_with_the_function_called_and_the_unit(entry):
    import readfence.graph as graph

    run = getattr(graph, entry)
    with graph.CpuDevice() as dev, pytest.raises(TypeError) as e:
        run(paged(), steps=1, policy=graph.Policy.EXACT, device=dev, write_wait_ms=5)
    record, kind = ("ServeOptions", "serving loop") if entry == "run_serve" else ("LoopOptions", "loop")
    assert str(e.value) == (f"{entry}() got an unexpected keyword argument 'write_wait_ms'; it is a {kind} option in "
                            f"seconds: pass options={record}(write_wait_s=0.005) for the command line's "
                            "--write-wait-ms 5")
    with graph.CpuDevice() as dev, pytest.raises(TypeError, match=rf"^{entry}\(\) got an unexpected keyword argument "
                                                                  r"'cfgg'; did you mean 'cfg'\?$"):
        run(paged(), steps=1, policy=graph.Policy.EXACT, device=dev, cfgg=None)
