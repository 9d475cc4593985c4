"""LoopOptions and ServeOptions: one record per loop, taken whole by the loop, the helpers that
run it and its serial reference; a keyword given to the wrong place says where it goes."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from readfence.backends import paged
from readfence.core import ForwardMode, ModelConfig
from readfence.graph import (
    CheckState,
    CpuDevice,
    LoopOptions,
    LowerOptions,
    Policy,
    ServeOptions,
    Timeline,
    Traffic,
    decode_loop,
    make_state,
    run_overlapped,
    run_serial,
    run_serve,
    run_serve_serial,
    run_traced,
    serve_loop,
)
from readfence.graph.runtime import CappedTimeline, Staging
from readfence.graph.runtime.internal import as_record
from tests.graph.test_runtime import BROKEN, BROKEN_BATCH, BROKEN_CFG, BROKEN_CHURN

CFG = ModelConfig(layers=1, max_reqs=8, max_ctx=32)
TRAFFIC = Traffic(rate=1.0, prompt=(2, 4), output=(1, 3))
DECODE_ENTRIES = (decode_loop, run_overlapped, run_traced, run_serial)
SERVE_ENTRIES = (serve_loop, run_serve, run_serve_serial)


# -- the records ----------------------------------------------------------------------------
@pytest.mark.parametrize("record", [LoopOptions, ServeOptions])
@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("write_cost", -1, ValueError, "write_cost must be an int >= 0, got -1 (int)"),
    ("write_cost", 2.0, ValueError, "write_cost must be an int >= 0, got 2.0 (float)"),
    ("write_wait_s", -0.5, ValueError, "write_wait_s must be a finite number of seconds >= 0, got -0.5 (float)"),
    ("write_wait_s", float("inf"), ValueError, "write_wait_s must be a finite number of seconds >= 0, got inf (float)"),
    ("write_wait_s", True, ValueError, "write_wait_s must be a finite number of seconds >= 0, got True (bool)"),
    ("timeline", "trace.json", TypeError, "timeline must be a Timeline or None, got 'trace.json' (str)"),
    ("check", "poison", TypeError, "check must be a bool or a CheckState, got 'poison' (str)"),
    ("sanitize", 1, TypeError, "sanitize must be a bool, got 1 (int)"),
    ("progress", 3, TypeError, "progress must be a function of the step's index or None, got 3 (int)"),
    ("UNSAFE_skip_soundness_check", "yes", TypeError, "UNSAFE_skip_soundness_check must be a bool"),
])
def test_a_bad_value_is_refused_naming_the_field(record, field, value, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        record(**{field: value})


@pytest.mark.parametrize(("record", "field", "value", "error", "message"), [
    (LoopOptions, "seed", 1.5, TypeError, "seed must be an int, got 1.5 (float)"),
    (LoopOptions, "finish_prob", 1.5, ValueError, "finish_prob must be a probability in [0, 1], got 1.5 (float)"),
    (LoopOptions, "staging", 2, TypeError, "staging must be a readfence.graph.runtime.Staging or an object with"),
    (ServeOptions, "max_prefill", 0, ValueError, "max_prefill must be a positive int, got 0 (int)"),
])
def test_a_bad_value_of_one_loop_is_refused_naming_the_field(record, field, value, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        record(**{field: value})


@pytest.mark.parametrize("record", [LoopOptions, ServeOptions])
def test_the_record_is_a_frozen_keyword_only_value(record):
    a = record(write_wait_s=0.001)
    assert a == record(write_wait_s=0.001) != record()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.write_wait_s = 0.002  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional"):
        record(0)  # type: ignore[misc]
    with pytest.raises(ValueError, match="^give write_cost \\(a matmul\\) or write_wait_s \\(a wait\\), not both$"):
        record(write_cost=8, write_wait_s=0.001)


def test_as_record_takes_the_fields_of_a_record_and_leaves_the_rest():
    values = {"seed": 3, "write_wait_s": 0.002, "steps": 9, "batch_size": 2, "max_prefill": 4}
    assert as_record(values, LoopOptions) == LoopOptions(seed=3, write_wait_s=0.002)
    assert as_record(values, ServeOptions) == ServeOptions(write_wait_s=0.002, max_prefill=4)


# -- a keyword in the wrong place -----------------------------------------------------------
def _kw(entry) -> dict:
    base = {"steps": 1} if entry not in (decode_loop, serve_loop) else {}
    if entry not in (run_serial, run_serve_serial):
        base |= {"policy": Policy.EXACT, "device": "unused"}
    return base


@pytest.mark.parametrize("entry", DECODE_ENTRIES)
@pytest.mark.parametrize("field", [f.name for f in attrs.fields(LoopOptions)])
def test_a_loop_option_given_as_a_keyword_says_where_it_goes(entry, field):
    with pytest.raises(TypeError, match=rf"^{entry.__name__}\(\) got an unexpected keyword argument '{field}'; it is a "
                                        rf"loop option: pass options=LoopOptions\({field}=\.\.\.\)$"):
        entry(paged(), **_kw(entry), **{field: None})


@pytest.mark.parametrize("entry", SERVE_ENTRIES)
@pytest.mark.parametrize("field", [f.name for f in attrs.fields(ServeOptions)])
def test_a_serving_loop_option_given_as_a_keyword_says_where_it_goes(entry, field):
    with pytest.raises(TypeError, match=rf"^{entry.__name__}\(\) got an unexpected keyword argument '{field}'; it is a "
                                        rf"serving loop option: pass options=ServeOptions\({field}=\.\.\.\)$"):
        entry(paged(), **_kw(entry), **{field: None})


@pytest.mark.parametrize("entry", [run_overlapped, run_serve])
def test_milliseconds_say_the_unit_and_the_record(entry):
    record = "LoopOptions" if entry is run_overlapped else "ServeOptions"
    with pytest.raises(TypeError, match=rf"'write_wait_ms'; it is a (serving )?loop option in seconds: pass "
                                        rf"options={record}\(write_wait_s=0\.005\) for the command line's "
                                        rf"--write-wait-ms 5$"):
        entry(paged(), **_kw(entry), write_wait_ms=5)


def test_a_keyword_that_is_no_option_gets_the_closest_one():
    with pytest.raises(TypeError, match=r"^run_overlapped\(\) got an unexpected keyword argument 'batchsize'; did you "
                                        r"mean 'batch_size'\?$"):
        run_overlapped(paged(), steps=1, policy=Policy.EXACT, device="unused", batchsize=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(("entry", "given", "message"), [
    (run_overlapped, ServeOptions(), r"options must be a readfence.graph.LoopOptions, got ServeOptions\(\.\.\.\) \(the "
                                     r"serving loop's options: serve_loop, run_serve and verify_serve take it\)$"),
    (run_serve, LoopOptions(), r"options must be a readfence.graph.ServeOptions, got LoopOptions\(\.\.\.\) \(the "
                               r"decode loop's options: decode_loop, run_overlapped, run_traced, run_serial and "
                               r"verify take it\)$"),
    (decode_loop, LowerOptions(ring_size=2), r"options must be a readfence.graph.LoopOptions, got "
                                             r"LowerOptions\(\.\.\.\) \(lowering options: pass it as lowering=\)$"),
    (run_serial, {"seed": 1}, r"options must be a readfence.graph.LoopOptions, got \{'seed': 1\} \(dict\)$"),
])
def test_a_record_of_the_wrong_kind_is_refused_saying_what_it_is(entry, given, message, dev):
    kw = _kw(entry) | ({"device": dev} if "device" in _kw(entry) else {})
    with pytest.raises(TypeError, match=rf"^{entry.__name__}\(\): {message}"):
        entry(paged(), **kw, cfg=CFG, options=given)


# -- the record reaches the loop, the runners and the reference -----------------------------
def test_one_record_drives_the_loop_and_its_reference(dev):
    churn = LoopOptions(seed=5, finish_prob=0.6)
    ref = run_serial(paged(), steps=5, batch_size=2, cfg=CFG, options=churn)
    assert not ref.matches(run_serial(paged(), steps=5, batch_size=2, cfg=CFG))  # the workload changed
    for run in (run_overlapped, run_traced):
        res = run(paged(), steps=5, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, options=churn)
        res = res if run is run_overlapped else res.result
        assert res.matches(ref) and res.violations == ()
    loop = decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, options=churn)
    runs, _ = loop.run(5)
    assert all(torch.equal(r.logits, x) for r, x in zip(runs, ref.logits, strict=True))


def test_progress_is_called_after_each_step_by_every_runner(dev):
    for run in (run_overlapped, run_traced, run_serial, run_serve, run_serve_serial):
        seen: list[int] = []
        record = LoopOptions if run in DECODE_ENTRIES else ServeOptions
        kw = {} if run in (run_serial, run_serve_serial) else {"policy": Policy.EXACT, "device": dev}
        kw |= {"traffic": TRAFFIC, "capture_sizes": [1, 2]} if record is ServeOptions else {"batch_size": 2}
        run(paged(), steps=3, cfg=CFG, options=record(progress=seen.append), **kw)
        assert seen == [0, 1, 2], run.__name__


def test_the_timeline_and_the_check_mode_reach_the_lowering(dev):
    timeline = Timeline()
    run_overlapped(paged(), steps=2, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                   options=LoopOptions(timeline=timeline))
    assert {s.track for s in timeline.spans} >= {"forward", "schedule", "host"}
    state = make_state(CFG, dev)
    check = CheckState(state["shared"], CFG)
    loop = decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, state=state,
                       options=LoopOptions(check=check))
    assert loop.check is check and loop.lowered.check is check
    served = serve_loop(paged(), policy=Policy.EXACT, device=dev, capture_sizes=[1, 2], cfg=CFG, traffic=TRAFFIC,
                        options=ServeOptions(check=True, timeline=timeline))
    assert served.check is not None and served.lowering.check is served.check and served.timeline is timeline


def test_sanitize_and_the_unsafe_flag_reach_the_run():
    # a fence one step early, lowered anyway: the sanitizer sees the race; unwatched, it reports nothing
    _, make, mode, buffer, _ = BROKEN[0]
    found = {}
    for sanitize in (True, False):
        options = LoopOptions(finish_prob=BROKEN_CHURN, UNSAFE_skip_soundness_check=True, sanitize=sanitize)
        with CpuDevice(timeout=30) as dev:
            found[sanitize] = run_overlapped(make(), mode, steps=6, policy=Policy.PER_BUFFER, device=dev,
                                             batch_size=BROKEN_BATCH, cfg=BROKEN_CFG, options=options).violations
    assert found[True] and {v.buffer for v in found[True]} == {buffer}
    assert found[False] == ()


def test_a_staging_ring_too_shallow_is_refused_through_every_runner(dev):
    shallow = LoopOptions(staging=Staging(1, in_flight=2))
    for run in (run_overlapped, run_traced):
        with pytest.raises(ValueError, match="refills host buffer 0"):
            run(paged(), steps=2, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, options=shallow)


def test_run_traced_records_into_the_timeline_the_record_gives(dev):
    kw = dict(steps=6, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG)
    capped = run_traced(paged(), **kw, options=LoopOptions(timeline=CappedTimeline(max_steps=2)))
    whole = run_traced(paged(), **kw, options=LoopOptions(timeline=Timeline()))
    steps = [sorted({s.args["step"] for s in t.timeline.spans if "step" in s.args}) for t in (capped, whole)]
    assert steps == [[0, 1], list(range(6))]
    assert capped.result.matches(whole.result)


def test_the_loops_refuse_a_lowering_record_that_sets_their_own_options(dev):
    for entry, record in ((run_overlapped, "LoopOptions"), (run_traced, "LoopOptions"), (run_serve, "ServeOptions")):
        with pytest.raises(TypeError, match=rf"^{entry.__name__}\(\) sets the lowering's timeline itself: leave "
                                            rf"timeline out of its LowerOptions and pass "
                                            rf"options={record}\(timeline=\.\.\.\) to {entry.__name__}\(\)$"):
            entry(paged(), steps=1, policy=Policy.EXACT, device=dev, cfg=CFG,
                  lowering=LowerOptions(timeline=Timeline()))


def test_a_mode_is_still_positional(dev):
    res = run_overlapped(paged(), ForwardMode.EXTEND, steps=2, policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG)
    assert res.matches(run_serial(paged(), ForwardMode.EXTEND, steps=2, batch_size=2, cfg=CFG))
