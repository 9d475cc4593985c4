"""LowerOptions: one typed record of the lowering options, which lower takes and every function
that lowers for you hands on; and no public function takes more than ten parameters."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

from readfence.backends import paged, per_stream, trtllm_mha
from readfence.core import ForwardMode
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
    eagle,
    lower,
    lower_capture_list,
    make_state,
    run_overlapped,
    run_serve,
    run_traced,
    serve_loop,
    verify,
    verify_serve,
)
from tests.conftest import DEFAULT as CFG

M = ForwardMode


# -- the record ----------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("ring_size", 0, ValueError, "LowerOptions.ring_size must be an int in 1..64, got 0 (int)"),
    ("ring_size", True, ValueError, "LowerOptions.ring_size must be an int in 1..64, got True (bool)"),
    ("ring_size", 2.0, ValueError, "LowerOptions.ring_size must be an int in 1..64, got 2.0 (float)"),
    ("measure", 1, TypeError, "LowerOptions.measure must be a bool, got 1 (int)"),
    ("UNSAFE_skip_soundness_check", "yes", TypeError, "LowerOptions.UNSAFE_skip_soundness_check must be a bool"),
    ("timeline", [], TypeError, "LowerOptions.timeline must be a Timeline or None, got [] (list)"),
    ("check", {}, TypeError, "LowerOptions.check must be a CheckState or None, got {} (dict)"),
    ("new_event", "event", TypeError, "LowerOptions.new_event must be a function of an event's name"),
    ("publish", "seq_lens", TypeError, "LowerOptions.publish must be a list of buffer names or None, got 'seq_lens'"),
    ("publish", ["seq_len"], ValueError, "publish names unknown buffer 'seq_len'"),
])
def test_a_bad_value_is_refused_naming_the_field(field, value, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        LowerOptions(**{field: value})


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match="LowerOptions.__init__.*'ring'"):
        LowerOptions(ring=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        LowerOptions(2)  # type: ignore[misc]


def test_the_record_is_a_frozen_value():
    a = LowerOptions(ring_size=2, measure=True)
    assert a == LowerOptions(measure=True, ring_size=2) != LowerOptions(ring_size=2)
    assert hash(a) == hash(LowerOptions(measure=True, ring_size=2))
    with pytest.raises(AttributeError):
        a.ring_size = 3  # type: ignore[misc]


# -- the options reach the lowered graphs ---------------------------------------------------
def test_lower_takes_the_record(dev):
    made: list[str] = []

    def new_event(name: str):
        made.append(name)
        return dev.event(name)

    low = lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG,
                lowering=LowerOptions(ring_size=3, new_event=new_event, publish=["req_to_token"], optimize=False))
    assert low.ring_size == 3 and not low.optimized
    assert sorted(low.plan.placements) == ["req_to_token"]
    assert made and all(name.startswith(low.label + "/") for name in made)
    plain = lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, cfg=CFG)
    assert plain.ring_size == 1 and plain.optimized and len(plain.plan.placements) > 1


def test_lower_refuses_an_option_given_as_a_keyword_naming_the_record(dev):
    for name, value in (("ring_size", 2), ("measure", True), ("optimize", False), ("publish", ["seq_lens"]),
                        ("UNSAFE_skip_soundness_check", True)):
        with pytest.raises(TypeError, match=rf"^lower\(\) got an unexpected keyword argument '{name}'; it is a "
                                            rf"lowering option: pass lowering=LowerOptions\({name}=\.\.\.\)$"):
            lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, **{name: value})
    with pytest.raises(TypeError, match=r"^lower\(\) got an unexpected keyword argument 'stream_'; did you mean "
                                        r"'stream'\?"):
        lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, stream_=None)
    with pytest.raises(TypeError, match=r"^lower\(\): lowering must be a readfence.graph.LowerOptions, got "
                                        r"\{'ring_size': 2\} \(dict\)$"):
        lower(paged(), M.DECODE, batch_size=2, device=dev, policy=Policy.EXACT, lowering={"ring_size": 2})


def test_decode_loop_lowers_with_the_ring_size(dev):
    for ring in (1, 3):
        loop = decode_loop(paged(), policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG,
                           lowering=LowerOptions(ring_size=ring))
        assert loop.lowered.ring_size == ring
        runs, _ = loop.run(4)
        assert len(runs) == 4


def test_every_graph_of_a_composite_step_gets_the_options(dev):
    # a step shape's graphs, a per_stream group's members, every size of a capture list
    made: list[str] = []

    def new_event(name: str):
        made.append(name)
        return dev.event(name)

    options = LowerOptions(ring_size=4, new_event=new_event)
    shape = decode_loop(eagle(paged(), trtllm_mha()), policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                        lowering=options).lowered
    assert [g.ring_size for g in shape.graphs.values()] == [4] * len(shape.graphs)
    group = decode_loop(per_stream(paged(), trtllm_mha()), policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                        lowering=options).lowered
    assert [g.ring_size for g in group.lowered] == [4, 4]
    graphs = lower_capture_list(paged(), M.DECODE, [1, 2], device=dev, policy=Policy.EXACT, cfg=CFG, lowering=options)
    assert [graphs[s].ring_size for s in graphs] == [4, 4]
    labels = {g.label for g in (*shape.graphs.values(), *group.lowered, graphs[1], graphs[2])}
    assert all(any(name.startswith(label + "/") for name in made) for label in labels)  # every graph's events


def test_serve_loop_lowers_every_size_with_the_options(dev):
    loop = serve_loop(paged(), policy=Policy.PER_BUFFER, device=dev, capture_sizes=[1, 2], cfg=CFG,
                      traffic=Traffic(rate=1.0, prompt=(2, 4), output=(1, 3)), lowering=LowerOptions(ring_size=2))
    assert [loop.decode[s].ring_size for s in (1, 2)] == [2, 2]


def _events(options_ring: int) -> list[str]:
    made: list[str] = []
    with CpuDevice() as dev:
        def new_event(name: str):
            made.append(name)
            return dev.event(name)

        report = verify(paged(), steps=3, batch_size=2, device=dev, cfg=CFG, policy=Policy.PER_BUFFER,
                        lowering=LowerOptions(ring_size=options_ring, new_event=new_event))
        assert report.unwrap().checks[0].policy is Policy.PER_BUFFER
    return made


def test_verify_lowers_with_the_options():
    # verify lowers through its loop with the record: its event factory makes every event, as
    # many per graph as the ring has slots
    one, three = _events(1), _events(3)
    assert one and len(three) == 3 * len(one)


def test_run_overlapped_and_run_traced_hand_the_options_on(dev):
    made: list[str] = []

    def new_event(name: str):
        made.append(name)
        return dev.event(name)

    options = LowerOptions(ring_size=2, new_event=new_event)
    run_overlapped(paged(), steps=2, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG, lowering=options)
    once = len(made)
    run_traced(paged(), steps=2, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG, lowering=options)
    assert once and len(made) == 2 * once
    res = run_serve(paged(), steps=3, policy=Policy.PER_BUFFER, device=dev, capture_sizes=[2], cfg=CFG,
                    traffic=Traffic(rate=1.0, prompt=(2, 4), output=(1, 3)), lowering=options)
    assert res.violations == () and len(made) > 2 * once


# -- one way to say each option ------------------------------------------------------------
def test_a_loop_refuses_a_record_setting_what_it_sets_itself(dev):
    state = make_state(CFG, dev)
    for name, value in (("timeline", Timeline()), ("check", CheckState(state["shared"], CFG)),
                        ("UNSAFE_skip_soundness_check", True)):
        options = LowerOptions(**{name: value})
        with pytest.raises(TypeError, match=rf"^decode_loop\(\) sets the lowering's {name} itself: leave {name} out "
                                            rf"of its LowerOptions and pass options=LoopOptions\({name}=\.\.\.\) to "
                                            rf"decode_loop\(\)$"):
            decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG, state=state,
                        lowering=options)
        with pytest.raises(TypeError, match=rf"^serve_loop\(\) sets the lowering's {name} itself: leave {name} out "
                                            rf"of its LowerOptions and pass options=ServeOptions\({name}=\.\.\.\) to "
                                            rf"serve_loop\(\)$"):
            serve_loop(paged(), policy=Policy.EXACT, device=dev, capture_sizes=[1], cfg=CFG, state=state,
                       lowering=options)
        for run in (verify, run_overlapped, run_traced, run_serve):
            with pytest.raises(TypeError, match=rf"^{run.__name__}\(\) sets the lowering's {name} itself"):
                run(paged(), steps=1, policy=Policy.EXACT, device=dev, cfg=CFG, lowering=options)
    for name, value in (("measure", True), ("publish", ["req_to_token"])):  # no option of the loop's says these
        with pytest.raises(TypeError, match=rf"^decode_loop\(\) sets the lowering's {name} itself: leave {name} out "
                                            rf"of its LowerOptions$"):
            decode_loop(paged(), policy=Policy.EXACT, device=dev, batch_size=2, cfg=CFG,
                        lowering=LowerOptions(**{name: value}))
        for run in (verify, run_overlapped, run_traced, run_serve):
            with pytest.raises(TypeError, match=rf"^{run.__name__}\(\) sets the lowering's {name} itself"):
                run(paged(), steps=1, policy=Policy.EXACT, device=dev, cfg=CFG, lowering=LowerOptions(**{name: value}))


@pytest.mark.parametrize("entry", [decode_loop, run_overlapped, run_traced, verify, run_serve, verify_serve])
def test_a_lowering_option_given_as_a_keyword_says_where_it_goes(entry, dev):
    name = entry.__name__
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'ring_size'; it is a "
                                        rf"lowering option: pass lowering=LowerOptions\(ring_size=\.\.\.\)$"):
        entry(paged(), policy=Policy.EXACT, device=dev, ring_size=2)
    with pytest.raises(TypeError, match=rf"^{name}\(\): lowering must be a readfence.graph.LowerOptions, got "
                                        r"\{'ring_size': 2\} \(dict\)$"):
        kw = {"steps": 1} if entry is not decode_loop else {}
        entry(paged(), policy=Policy.EXACT, device=dev, cfg=CFG, lowering={"ring_size": 2}, **kw)


@pytest.mark.parametrize(("outer", "inner"), [
    (run_overlapped, decode_loop),
    (run_traced, decode_loop),
    (run_serve, serve_loop),
])
def test_the_runners_take_their_loops_keywords_with_the_same_defaults(outer, inner):
    # the loop's keywords and steps, nothing else: what a run adds (sanitize, progress) is in the
    # loop's record, which the runner hands on whole
    theirs = inspect.signature(inner).parameters
    mine = {n: p for n, p in inspect.signature(outer).parameters.items() if n != "steps"}
    assert list(mine) == list(theirs)
    assert {n: (p.default, p.annotation) for n, p in mine.items()} == \
        {n: (p.default, p.annotation) for n, p in theirs.items()}



# -- no public function takes more than ten parameters ---------------------------------------
MAX_PARAMETERS = 10


def _public_functions():
    # every package of readfence and what its __all__ names: its functions, and its classes'
    # public methods (a record's fields are its constructor's, not a function's parameters)
    import readfence

    packages = [readfence, *(importlib.import_module(m.name)
                             for m in pkgutil.walk_packages(readfence.__path__, "readfence.")
                             if m.ispkg and not any(part.startswith("_") for part in m.name.split(".")))]
    seen: dict[object, str] = {}
    for package in packages:
        for name in getattr(package, "__all__", ()):
            value = getattr(package, name)
            if inspect.isfunction(value):
                seen.setdefault(value, f"{package.__name__}.{name}")
            elif inspect.isclass(value) and value.__module__.startswith("readfence"):
                for attr, member in vars(value).items():
                    fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                    if not attr.startswith("_") and inspect.isfunction(fn):
                        seen.setdefault(fn, f"{package.__name__}.{name}.{attr}")
    return seen


def _parameters(fn) -> int:
    params = list(inspect.signature(fn).parameters.values())
    return len([p for p in params if p.name not in ("self", "cls")])


def test_no_public_function_takes_more_than_ten_parameters():
    functions = _public_functions()
    assert len(functions) > 100  # the walk reaches the whole public API
    over = {where: n for fn, where in functions.items() if (n := _parameters(fn)) > MAX_PARAMETERS}
    assert over == {}, f"more than {MAX_PARAMETERS} parameters: take the options as a record (see LowerOptions)"


def test_the_parameter_rule_sees_a_function_over_the_limit():
    def eleven(a, b, c, d, e, f, g, h, i, j, k): ...

    assert _parameters(eleven) == 11 > MAX_PARAMETERS
    from readfence.graph.lowering.internal import names_keywords
    assert _parameters(names_keywords(eleven)) == 11  # a wrapped function is counted by its own signature
    assert _parameters(lower) == 10


# -- verify takes the loops' records -----------------------------------------------------------
@pytest.mark.parametrize(("checker", "runner"), [(verify, run_overlapped), (verify_serve, run_serve)])
def test_verify_takes_the_keywords_of_the_runner_of_its_loop(checker, runner):
    # the same keywords (after what runs): the loop's record as options=, the lowering's as lowering=
    assert set(list(inspect.signature(checker).parameters)[1:]) == set(list(inspect.signature(runner).parameters)[1:])
    assert inspect.signature(checker).parameters["options"].annotation == \
        inspect.signature(runner).parameters["options"].annotation


@pytest.mark.parametrize(("checker", "name", "record"), [
    (verify, "seed", "LoopOptions"), (verify, "finish_prob", "LoopOptions"), (verify, "checks", "LoopOptions"),
    (verify, "UNSAFE_skip_soundness_check", "LoopOptions"), (verify_serve, "checks", "ServeOptions"),
    (verify_serve, "max_prefill", "ServeOptions"),
])
def test_a_loop_option_given_to_verify_as_a_keyword_says_where_it_goes(checker, name, record, dev):
    kind = "a serving loop option" if record == "ServeOptions" else "a loop option"
    with pytest.raises(TypeError, match=rf"^{checker.__name__}\(\) got an unexpected keyword argument '{name}'; it is "
                                        rf"{kind}: pass options={record}\({name}=\.\.\.\)$"):
        checker(paged(), policy=Policy.EXACT, device=dev, **{name: 1})


def test_verify_runs_its_loops_workload_and_refuses_a_check_mode_of_the_records(dev):
    # the record's workload reaches both the loop and its reference: a seed that changes the
    # schedule verifies clean as the default does (the reference runs the same record)
    for options in (None, LoopOptions(seed=5, finish_prob=0.9, write_wait_s=0.0001)):
        report = verify(paged(), steps=4, batch_size=2, device=dev, cfg=CFG, policy=Policy.EXACT, options=options)
        assert report.unwrap().checks[0].policy is Policy.EXACT
    state = make_state(CFG, dev)
    for checker, record in ((verify, LoopOptions), (verify_serve, ServeOptions)):
        for check in (True, CheckState(state["shared"], CFG)):
            with pytest.raises(TypeError, match=rf"^{checker.__name__}\(\) runs the loop in its own check mode: leave "
                                                rf"check out of its {record.__name__}"):
                checker(paged(), policy=Policy.EXACT, device=dev, cfg=CFG, options=record(check=check))
    with pytest.raises(TypeError, match=r"^verify\(\): options must be a readfence.graph.LoopOptions, got "
                                        r"ServeOptions\(\.\.\.\) \(the serving loop's options: serve_loop, run_serve and "
                                        r"verify_serve take it\)$"):
        verify(paged(), policy=Policy.EXACT, device=dev, options=ServeOptions())
