"""Bad input through the Python API fails up front with an error that names the argument.

Every check here runs before any tracing or lowering, so each test is fast; where the old
behaviour was to lower first and fail (or not) later, a closed device shows that nothing was
lowered: touching it would raise ``DeviceClosed`` instead of the argument error.
"""

from __future__ import annotations

import math

import pytest

from readfence.backends import leaf, paged, redeclare
from readfence.core import ForwardMode, audit, trace
from readfence.core.internal import example_step
from readfence.effects import ReadEffect, ReadEnd
from readfence.graph import (
    CpuDevice,
    LowerOptions,
    Policy,
    decode_loop,
    lower,
    lower_step,
    open_device,
    run_overlapped,
    run_serial,
    verify,
)
from tests.conftest import DEFAULT as CFG

M = ForwardMode


@pytest.fixture(scope="module")
def closed():
    """A device nothing may touch: using it raises ``DeviceClosed``."""
    dev = CpuDevice(timeout=5.0)
    dev.close()
    return dev


def _attend(mode, layer, q, k, v, pools, shared, batch, meta):
    return q


# -- backend: a spec string (or an uncalled constructor) is not a backend --------------------

def _entry_points(dev):
    return {
        "audit": lambda b: audit(b, M.DECODE),
        "trace": lambda b: trace(b, M.DECODE),
        "lower": lambda b: lower(b, M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT),
        "run_serial": lambda b: run_serial(b, steps=2),
        "run_overlapped": lambda b: run_overlapped(b, steps=2, policy=Policy.EXACT, device=dev),
        "decode_loop": lambda b: decode_loop(b, policy=Policy.EXACT, device=dev),
        "verify": lambda b: verify(b, device=dev),
        "lower_step": lambda b: lower_step(b, M.DECODE, device=dev, policy=Policy.EXACT, batch_size=2, cfg=CFG,
                                           state={}),
    }


@pytest.mark.parametrize("entry", ["audit", "trace", "lower", "run_serial", "run_overlapped", "decode_loop",
                                   "verify", "lower_step"])
def test_a_spec_string_is_refused_naming_the_argument_and_the_parser(entry, closed) -> None:
    name = "target" if entry in ("verify", "lower_step") else "backend"
    with pytest.raises(TypeError, match=rf"^{name} must be a backend .*got 'paged' \(str\); .*"
                                        r"readfence\.backends\.parse\('paged'\)\.unwrap\(\)"):
        _entry_points(closed)[entry]("paged")


def _chain(depth: int):
    from readfence.backends import join

    tree = paged()
    for _ in range(depth - 1):
        tree = join(tree, paged())
    return tree


@pytest.mark.parametrize("entry", ["audit", "trace", "lower", "run_serial", "run_overlapped", "decode_loop",
                                   "verify", "lower_step"])
def test_a_tree_deeper_than_the_checks_walk_is_refused_naming_the_limit(entry, closed) -> None:
    # a backend value is built for any depth; the audit's walks recurse once a level, and a tree
    # some three hundred levels deep died in them with a raw RecursionError
    from readfence.core.internal import MAX_TREE_DEPTH

    with pytest.raises(ValueError, match=rf"'join' is a tree more than {MAX_TREE_DEPTH} levels deep"):
        _entry_points(closed)[entry](_chain(MAX_TREE_DEPTH + 1))


def test_a_tree_as_deep_as_the_limit_is_lowered_and_runs_as_serial() -> None:
    from readfence.core import ModelConfig
    from readfence.core.internal import MAX_TREE_DEPTH, tree_depth
    from readfence.graph import make_state

    tree, cfg = _chain(MAX_TREE_DEPTH), ModelConfig(layers=1)
    assert tree_depth(tree) == MAX_TREE_DEPTH
    with CpuDevice(timeout=60.0) as dev:
        serial = run_serial(tree, steps=2, cfg=cfg, state=make_state(cfg))
        run = run_overlapped(tree, steps=2, policy=Policy.EXACT, device=dev, cfg=cfg, state=make_state(cfg))
    assert run.matches(serial)


def test_a_step_shape_spec_string_points_to_the_step_parser(closed) -> None:
    with pytest.raises(TypeError, match=r"readfence\.graph\.parse_step\('eagle\(paged, paged\)'\)"):
        run_serial("eagle(paged, paged)", steps=2)


def test_an_uncalled_backend_constructor_is_refused_with_the_call_to_make() -> None:
    with pytest.raises(TypeError, match=r"backend must be a backend .*\(function\); did you forget to call it "
                                        r"\(paged\(\)\)\?"):
        audit(paged, M.DECODE)


# -- device: a device kind string is not a device ------------------------------------------

@pytest.mark.parametrize("entry", ["lower", "run_overlapped", "decode_loop", "verify"])
def test_a_device_name_is_refused_naming_device_and_how_to_open_one(entry) -> None:
    with pytest.raises(TypeError, match=r"^device must be a readfence device object such as CpuDevice\(\) or "
                                        r"open_device\('cpu'\) .*got 'cpu' \(str\)"):
        _entry_points("cpu")[entry](paged())


def test_run_serial_takes_a_device_object_or_a_torch_device_kind_only() -> None:
    with pytest.raises(TypeError, match=r"^device must be a readfence device object"):
        run_serial(paged(), steps=1, device=3)
    with pytest.raises(ValueError, match=r"^device must be .* torch device kind \('cpu', 'cuda'\), got 'gpu'"):
        run_serial(paged(), steps=1, device="gpu")


# -- steps: one check, a positive int, everywhere ------------------------------------------

STEPS = [-1, 0, 2.5, True, "3"]


@pytest.mark.parametrize("steps", STEPS, ids=repr)
def test_run_serial_refuses_bad_step_counts(steps) -> None:
    with pytest.raises(ValueError, match=r"^steps must be a positive int, got "):
        run_serial(paged(), steps=steps)


@pytest.mark.parametrize("steps", STEPS, ids=repr)
def test_run_overlapped_refuses_bad_step_counts_before_lowering(steps, closed) -> None:
    with pytest.raises(ValueError, match=r"^steps must be a positive int, got "):
        run_overlapped(paged(), steps=steps, policy=Policy.EXACT, device=closed)


@pytest.mark.parametrize("steps", STEPS, ids=repr)
def test_verify_refuses_bad_step_counts_before_lowering(steps, closed) -> None:
    with pytest.raises(ValueError, match=r"^steps must be a positive int, got "):
        verify(paged(), steps=steps, device=closed)


# -- batch sizes: ints in 1..cfg.max_reqs, never truncated ---------------------------------

BATCH = [2.5, True, 0, -1, CFG.max_reqs + 1]


@pytest.mark.parametrize("size", BATCH, ids=repr)
def test_trace_refuses_a_bad_batch_size_instead_of_truncating_it(size) -> None:
    with pytest.raises(ValueError, match=rf"^batch_size must be an int in 1\.\.{CFG.max_reqs}, got .*cfg\.max_reqs"):
        trace(paged(), M.DECODE, batch_size=size)


@pytest.mark.parametrize("size", BATCH, ids=repr)
def test_example_step_refuses_a_bad_batch_size(size) -> None:
    with pytest.raises(ValueError, match=rf"^batch_size must be an int in 1\.\.{CFG.max_reqs}"):
        example_step(CFG, M.DECODE, size)


@pytest.mark.parametrize("size", BATCH, ids=repr)
def test_audit_names_the_bad_entry_of_batch_sizes(size) -> None:
    with pytest.raises(ValueError, match=rf"^batch_sizes\[1\] must be an int in 1\.\.{CFG.max_reqs}, got"):
        audit(paged(), M.DECODE, batch_sizes=[1, size])


def test_audit_batch_sizes_must_be_a_non_empty_list() -> None:
    with pytest.raises(TypeError, match=r"^batch_sizes must be a non-empty list .*got 2 \(int\); for one size "
                                        r"write \[n\]"):
        audit(paged(), M.DECODE, batch_sizes=2)
    with pytest.raises(ValueError, match=r"^batch_sizes must be a non-empty list of ints; omit it"):
        audit(paged(), M.DECODE, batch_sizes=[])


def test_audit_refuses_a_negative_observe_step_count() -> None:
    with pytest.raises(ValueError, match=r"^observe_steps .* must be a positive int, got -1"):
        audit(paged(), M.DECODE, observe_steps=-1)


# -- device timeouts -----------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [-1, 0, 0.0, math.nan, math.inf, "5", True], ids=repr)
def test_a_device_refuses_a_timeout_that_is_not_a_finite_positive_number(timeout) -> None:
    with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds > 0, got"):
        CpuDevice(timeout=timeout)
    with pytest.raises(ValueError, match=r"^timeout must be"):
        open_device("cpu", timeout=timeout)


# -- declarations of user leaves -----------------------------------------------------------

def test_an_empty_declare_mapping_is_refused_saying_to_omit_it() -> None:
    with pytest.raises(ValueError, match=r"^declare of mine is an empty mapping; omit declare for the default"):
        leaf("mine", _attend, declare={})


def test_a_none_declaration_is_refused_naming_its_mode() -> None:
    with pytest.raises(TypeError, match=r"^declare of mine maps DECODE to None; give it a ReadEffect, or leave "
                                        r"DECODE out"):
        leaf("mine", _attend, declare={M.DECODE: None})


def test_a_declared_effect_of_none_is_kept_not_replaced_by_the_default() -> None:
    mine = leaf("mine", _attend, declare={M.DECODE: ReadEffect.none()})
    assert mine.read_effect(M.DECODE) == ReadEffect.none()


MISSPELT = "declaration of mine for DECODE names unknown buffer 'req_to_tokn'; shared buffers are req_to_token, " \
           "seq_lens, swa_map, state_slots; did you mean 'req_to_token'?"


@pytest.mark.parametrize("how", ["mapping", "function"])
def test_a_misspelt_buffer_in_a_declaration_is_refused_with_a_suggestion(how) -> None:
    effect = ReadEffect.of({"req_to_tokn": ReadEnd.IN_REPLAY})
    declare = {M.DECODE: effect} if how == "mapping" else (lambda m: effect)
    with pytest.raises(ValueError) as info:
        leaf("mine", _attend, declare=declare)
    assert str(info.value) == MISSPELT


@pytest.mark.parametrize(("end", "default"), [(ReadEnd.NONE, ReadEnd.NONE), (ReadEnd.UNKNOWN, ReadEnd.UNKNOWN)])
def test_a_misspelt_buffer_declared_at_the_default_end_is_still_named(end, default) -> None:
    # an entry equal to the default is no part of the effect's value, but it is still a name
    effect = ReadEffect.of({"req_to_tokn": end, "seq_lens": ReadEnd.IN_REPLAY}, default=default)
    assert effect == ReadEffect.of({"seq_lens": ReadEnd.IN_REPLAY}, default=default)
    with pytest.raises(ValueError) as info:
        leaf("mine", _attend, declare={M.DECODE: effect})
    assert str(info.value) == MISSPELT


def test_redeclare_refuses_a_misspelt_buffer() -> None:
    with pytest.raises(ValueError, match=r"^declaration of paged for DECODE names unknown buffer 'swa'; .*"
                                        r"did you mean 'swa_map'\?"):
        redeclare(paged(), lambda m: ReadEffect.of({"swa": ReadEnd.IN_REPLAY}))


def test_reads_must_name_shared_buffers() -> None:
    with pytest.raises(ValueError, match=r"^reads of mine names unknown buffer 'seq_len'; .*did you mean "
                                        r"'seq_lens'\?"):
        leaf("mine", _attend, reads=["req_to_token", "seq_len"])
    with pytest.raises(TypeError, match=r"^reads of mine must be a list of buffer names, got 'seq_lens' \(str\)"):
        leaf("mine", _attend, reads="seq_lens")


def test_lower_names_a_misspelt_published_buffer_as_declarations_do(closed) -> None:
    with pytest.raises(ValueError, match=r"^publish names unknown buffer 'seq_len'; shared buffers are req_to_token, "
                                         r".*did you mean 'seq_lens'\?$"):
        lower(paged(), M.DECODE, batch_size=2, device=closed, policy=Policy.EXACT,
              lowering=LowerOptions(publish=["seq_len"]))


# -- IDLE runs no forward: nothing to lower, run or verify ---------------------------------

IDLE_ERROR = r"^mode IDLE runs no forward \(its steps carry no tokens\): there is nothing to {}; allowed: DECODE"


def test_lower_refuses_idle(closed) -> None:
    with pytest.raises(ValueError, match=IDLE_ERROR.format("lower")):
        lower(paged(), M.IDLE, batch_size=2, device=closed, policy=Policy.EXACT)


def test_the_loops_refuse_idle_with_the_same_check(closed) -> None:
    with pytest.raises(ValueError, match=IDLE_ERROR.format("run")):
        run_serial(paged(), M.IDLE, steps=2)
    with pytest.raises(ValueError, match=IDLE_ERROR.format("run")):
        run_overlapped(paged(), M.IDLE, steps=2, policy=Policy.EXACT, device=closed)
    with pytest.raises(ValueError, match=IDLE_ERROR.format("lower")):
        decode_loop(paged(), M.IDLE, policy=Policy.EXACT, device=closed)
    with pytest.raises(ValueError, match=IDLE_ERROR.format("verify")):
        verify(paged(), M.IDLE, device=closed)


# -- arguments of the wrong type are named, not found 24 frames deep ------------------------

@pytest.mark.parametrize("pattern", [111, 1.5, b"01", [True, False]])
def test_hybrid_linear_names_a_pattern_of_the_wrong_type(pattern) -> None:
    from readfence.backends import hybrid_linear, linear, trtllm_mha

    with pytest.raises(TypeError, match=r"^hybrid_linear: pattern must be a string of child indices like \"0111\" "
                                        r"or a sequence of ints .*, got "):
        hybrid_linear(trtllm_mha(), linear(), pattern=pattern)


@pytest.mark.parametrize(("state", "error", "says"), [
    ("x", TypeError, r"^state must be None or a mapping \{'shared': \.\.\., 'pools': \.\.\., 'params': \.\.\.\} .*"
                     r"got 'x' \(str\)"),
    ({}, ValueError, r"^state has no 'shared'"),
    ({"shared": {}, "pool": {}}, ValueError, r"^state has unknown key\(s\) 'pool'"),
    ({"shared": 3}, TypeError, r"^state\['shared'\] must be a mapping of name -> tensor, got 3 \(int\)"),
])
def test_audit_names_a_state_that_is_not_the_live_tensors(state, error, says) -> None:
    with pytest.raises(error, match=says):
        audit(paged(), M.DECODE, state=state)


@pytest.mark.parametrize(("stage", "fn", "takes"), [
    ("attend", lambda: None, r"\(\): too many positional arguments"),
    ("attend", lambda mode, layer, q: q, r"\(mode, layer, q\): too many positional arguments"),
    ("prepare_out_graph", lambda mode, shared, batch, meta: {}, r"missing a required argument: 'meta'"),
    ("prepare_in_graph", lambda mode, shared, batch: {}, r"too many positional arguments"),
])
def test_leaf_checks_each_stage_can_be_called_as_the_step_calls_it(stage, fn, takes) -> None:
    kw = {} if stage == "attend" else {stage: fn}
    attend = fn if stage == "attend" else _attend
    with pytest.raises(TypeError, match=rf"^{stage} of leaf 'mine' is called as {stage}\(mode, .*\), but it takes .*{takes}"):
        leaf("mine", attend, **kw)


def test_leaf_accepts_stages_that_take_more_or_star_arguments() -> None:
    def attend(*args, **kwargs):
        return args[2]

    def prep(mode, shared, batch, extra=None):
        return {}

    assert leaf("mine", attend, prepare_out_graph=prep).name == "mine"
    assert leaf("mine", print).name == "mine"  # a builtin's signature is not read: let through
    with pytest.raises(TypeError, match=r"^name of a leaf must be a non-empty str"):
        leaf(3, attend)


# -- unwrap() of a failure says why ----------------------------------------------------------

def test_unwrap_of_a_failed_parse_audit_and_verify_carries_the_reason(closed) -> None:
    from returns.primitives.exceptions import UnwrapFailedError

    from readfence.backends import parse

    with pytest.raises(UnwrapFailedError, match=r"position 4: expected a backend name, found end of spec"):
        parse("tbo(").unwrap()
    early = redeclare(paged(), lambda m: ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY,
                                                        "seq_lens": ReadEnd.IN_REPLAY}))
    with pytest.raises(UnwrapFailedError, match=r"unsound declaration: paged in mode DECODE declares buffer "
                                                r"'req_to_token' ends at PRE_REPLAY"):
        audit(early, M.DECODE, batch_sizes=[2]).unwrap()
    with CpuDevice() as dev:
        result = verify(early, steps=2, batch_size=2, device=dev, policy=Policy.PER_BUFFER)
    with pytest.raises(UnwrapFailedError, match=r"unsound declaration of 'req_to_token'.*under PER_BUFFER") as info:
        result.unwrap()
    assert info.value.halted_container is result  # the failure is still there, as returns keeps it


def test_a_failure_still_equals_returns_own() -> None:
    from returns.result import Failure

    from readfence.backends import parse

    failed = parse("tbo(")
    assert failed == Failure(failed.failure()) and Failure(failed.failure()) == failed
    assert hash(failed) == hash(Failure(failed.failure()))
    assert repr(failed).startswith("<Failure: position 4")


# -- values that would have hung or failed deep inside -------------------------------------------
def test_sizes_that_would_build_forever_are_refused_naming_their_bound(closed) -> None:
    from readfence.graph import Traffic

    with pytest.raises(ValueError, match=r"LowerOptions.ring_size must be an int in 1..64, got 1000000000"):
        LowerOptions(ring_size=10**9)
    with pytest.raises(ValueError, match=r"steps_in_flight must be an int in 1..64"):
        lower(paged(), M.DECODE, batch_size=2, device=closed, policy=Policy.EXACT, steps_in_flight=10**9)
    with pytest.raises(ValueError, match=r"Traffic.rate must be a positive number of requests per step, at most 1024"):
        Traffic(rate=1e9)
    for seed in (1.5, True):
        with pytest.raises(TypeError, match=r"Traffic.seed must be an int"):
            Traffic(seed=seed)


@pytest.mark.parametrize("max_reqs", [3, 5, 6])
def test_a_model_whose_slots_the_example_layout_cannot_step_through_is_refused_when_made(max_reqs) -> None:
    from readfence.core import ModelConfig

    with pytest.raises(ValueError, match=rf"ModelConfig\(max_reqs={max_reqs}, max_ctx=64\): its num_\w+ \(\d+\) is a multiple"):
        ModelConfig(max_reqs=max_reqs)


@pytest.mark.parametrize("size", [1, 2])
def test_a_batch_of_every_request_the_model_holds_runs(size) -> None:
    from readfence.core import ModelConfig

    cfg = ModelConfig(layers=1, max_reqs=size)
    with CpuDevice(timeout=30.0) as dev:
        run = run_overlapped(paged(), steps=2, policy=Policy.EXACT, device=dev, cfg=cfg, batch_size=size)
    assert run.matches(run_serial(paged(), steps=2, cfg=cfg, batch_size=size))


def test_a_rare_arrival_is_waited_for_in_one_jump_not_tick_by_tick() -> None:
    from readfence.graph import Traffic
    from readfence.graph.runtime import serve_scheduler

    scheduler = serve_scheduler(paged(), Traffic(rate=1e-9, prompt=(4, 4), output=(2, 2)), (1,), CFG)
    kind, reqs, *_, idle = scheduler.plan()
    assert kind == "prefill" and len(reqs) == 1 and idle > 10**8  # (ticks counted, none looped through)


def test_a_model_and_a_state_that_are_not_the_run_s_are_refused_naming_them() -> None:
    from readfence.core import ModelConfig
    from readfence.graph import make_state

    with CpuDevice(timeout=30.0) as dev:
        with pytest.raises(TypeError, match=r"cfg must be a readfence.core.ModelConfig .*got \{'layers': 2\} \(dict\)"):
            run_overlapped(paged(), steps=2, policy=Policy.EXACT, device=dev, cfg={"layers": 2})
        with pytest.raises(ValueError, match=r"^state has no 'pools', 'params': it must be a mapping"):
            lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, state={"shared": {}})
        with pytest.raises(ValueError, match=r"state\['shared'\]\['req_to_token'\] has shape \(4, 64\) .* where cfg gives "
                                             r"\(16, 64\)"):
            run_overlapped(paged(), steps=2, policy=Policy.EXACT, device=dev, state=make_state(ModelConfig(max_reqs=4)))
    # a shared buffer missing (or no tensor) is named by every run, the serial one too, before any step
    for name, value in (("swa_map", None), ("seq_lens", [0, 1])):
        state = make_state(ModelConfig())
        if value is None:
            del state["shared"][name]
        else:
            state["shared"][name] = value
        named = rf"^state\['shared'\] must hold the shared buffer '{name}' as a tensor, got {'nothing' if value is None else 'list'}"
        with CpuDevice(timeout=30.0) as dev:
            with pytest.raises(ValueError, match=named):
                run_serial(paged(), M.DECODE, steps=2, state=state)
            with pytest.raises(ValueError, match=named):
                lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, state=state)
            with pytest.raises(ValueError, match=named):
                run_overlapped(paged(), steps=2, policy=Policy.EXACT, device=dev, state=state)
