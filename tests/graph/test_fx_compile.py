"""The compiled stage graphs: the same results as the GraphModule, bit for bit, whatever the
graph writes; folding and sharing only where nothing can tell the difference."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from readfence.backends import deepseek_v4, hybrid_linear, linear, paged, tbo, trtllm_mha
from readfence.core import ForwardMode, ModelConfig, trace
from readfence.core._program import flatten_inputs
from readfence.core.internal import example_step
from readfence.core.tracing import note_output_memory
from readfence.graph.lowering._fx_compile import binding_for, compile_graph
from readfence.graph.lowering._fx_records import insert_records

M = ForwardMode


def _clones(args):
    return [a.clone() for a in args]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _same(a, b) -> bool:
    """Bitwise equal values (``torch.equal`` takes ``-0.0`` for ``0.0`` and no NaN for a NaN)."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _fx(fn, *inputs):
    """``make_fx(fn)`` with each op's output memory noted, as the recorder's graphs are (without the
    note the passes take an output a schema calls fresh for any memory it was given)."""
    return note_output_memory(make_fx(fn)(*_clones(inputs)), *inputs)


def _check(fn, *inputs, **compile_kw):
    """Compile ``fn``'s graph; run both on copies of ``inputs``: outputs and inputs after equal."""
    gm = _fx(fn, *inputs)
    compiled = compile_graph(gm, **compile_kw)
    a, b = _clones(inputs), _clones(inputs)
    out_gm, out_c = gm(*a), compiled(*b)
    assert _same(out_c, out_gm), compiled.source
    assert _same(b, a), "the compiled graph left its inputs in a different state"
    return compiled


def test_a_value_used_once_by_the_next_call_is_written_into_it():
    # a chain of single uses is one statement (no name, no line dropping it); a value used twice,
    # or by a call that is not the next one, keeps its name; an in-place op in between keeps the order
    def f(x, y):
        a = (x * 2).neg().exp()          # each used once, by the next call
        b = a + 1                        # used twice
        y.mul_(3)                        # between c's producer and its use: c is named
        c = b * y
        return c + b + x.sum()

    compiled = _check(f, torch.randn(4), torch.randn(4))
    run = compiled.source.split("def run", 1)[1].splitlines()
    statements = [line for line in run if re.match(r"\s+v\d+ = ", line) and not line.endswith("= None")]
    calls = sum(n.op == "call_function" for n in make_fx(f)(torch.ones(4), torch.ones(4)).graph.nodes)
    assert len(statements) == calls - 3, compiled.source  # x * 2, neg, exp written into the add
    assert re.search(r"= (_f\d+)\((_f\d+)\((_f\d+)\((_f\d+)\(v0, 2\)\)\), 1\)", compiled.source), compiled.source
    # each function is one name, however many nodes call it (two adds, two products here)
    defined = re.findall(r"^(_f\d+) = ", compiled.computation, re.M)
    assert len(defined) == len(set(defined)) == len(set(re.findall(r"_f\d+(?=\()", compiled.source))) < calls


def test_folds_and_shares_only_pure_recomputation():
    def f(x):
        w = torch.arange(4.0).exp()      # no input: folded
        return x * w + x * w             # the second product is the first one

    compiled = _check(f, torch.randn(4))
    assert compiled.stats == {"nodes": 5, "folded": 2, "shared": 1, "bound": 2, "pieces": 0, "layer_runs": 0}


def test_a_read_after_an_in_place_write_is_not_the_read_before_it():
    def f(x, i, j, y):
        a = x.index_select(0, i)
        x.index_copy_(0, j, y)
        b = x.index_select(0, i)         # same op, same arguments, other memory contents
        return a + b

    x, i = torch.randn(6, 2), torch.tensor([1, 2])
    compiled = _check(f, x, i, torch.tensor([2, 3]), torch.randn(2, 2))
    assert compiled.stats["shared"] == 0


def test_a_write_through_a_view_counts_as_a_write_of_its_base():
    def f(x):
        a = x.sum(0)
        x[1:3].add_(1.0)                 # writes x through a slice (the trace still says x)
        b = x.sum(0)
        return a - b

    assert _check(f, torch.randn(4, 3)).stats["shared"] == 0


def test_values_written_later_are_never_shared():
    def f(x):
        a = x * 2
        b = x * 2
        a.add_(1.0)                      # sharing would make b see this write
        return a - b

    assert _check(f, torch.randn(3)).stats["shared"] == 0


def test_values_that_leave_the_graph_are_not_shared_nor_folded():
    def f(x):
        return torch.arange(3.0), x + 1, x + 1

    compiled = _check(f, torch.randn(3))
    assert compiled.stats["folded"] == 0 and compiled.stats["shared"] == 0
    first, second = compiled(torch.zeros(3)), compiled(torch.zeros(3))
    first[0].add_(5.0)                   # a caller may write an output: the next call is fresh
    assert second[0] is not first[0] and torch.equal(compiled(torch.zeros(3))[0], torch.arange(3.0))


def test_random_ops_are_neither_folded_nor_shared():
    def f(x):
        return x + torch.rand(3) + torch.rand(3)

    compiled = _check_random(f)
    assert compiled.stats["folded"] == 0 and compiled.stats["shared"] == 0
    assert not torch.equal(compiled(torch.zeros(3)), compiled(torch.zeros(3)))


def _check_random(fn):
    gm = make_fx(fn)(torch.zeros(3))
    compiled = compile_graph(gm)
    torch.manual_seed(3)
    expected = gm(torch.zeros(3))
    torch.manual_seed(3)
    assert torch.equal(compiled(torch.zeros(3)), expected)
    return compiled


def test_floats_compare_by_their_bits():
    def f(x):
        return 1.0 / (x * 0.0) + 1.0 / (x * -0.0)     # inf + -inf: nan; sharing gives inf + inf

    compiled = _check(f, torch.ones(2))
    assert torch.isnan(compiled(torch.ones(2))).all()


def test_an_argument_is_the_same_only_with_its_type_and_an_object_only_as_itself():
    # ``1 == True == 1.0`` and two equal objects may still act apart (a generator, a custom
    # op's handle): the sharing pass and the layer classes compare by this one key
    from fractions import Fraction

    from readfence.graph.lowering._fx_keys import arg_key

    def key(v):
        return arg_key(v, node=lambda n: n)

    assert len({key(1), key(True), key(1.0)}) == 3
    assert key([1, (2.5, "a")]) == key([1, (2.5, "a")]) != key((1, (2.5, "a")))
    half = Fraction(1, 2)
    assert key(half) == key(half) != key(Fraction(1, 2))
    with pytest.raises(TypeError):
        key(bytearray(b"x"))  # (nothing can say it is the same)


def test_an_opaque_python_call_turns_the_passes_off():
    poked = []

    def f(x):
        return x * 2 + x * 2

    gm = make_fx(f)(torch.ones(2))
    first_mul = next(n.name for n in gm.graph.nodes if n.op == "call_function")
    with_action = insert_records(gm, {}, None, {first_mul: [lambda: poked.append(1)]})
    compiled = compile_graph(with_action)
    assert compiled.stats["shared"] == 0 and torch.equal(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert poked == [1]


def test_event_records_do_not_turn_the_passes_off():
    class Dev:
        fired: list[str] = []

        def record_here(self, event):
            self.fired.append(event.name)

    class Ev:
        name = "e"

    gm = _fx(lambda x: x * 2 + x * 2, torch.ones(2))
    first_mul = next(n.name for n in gm.graph.nodes if n.op == "call_function")
    compiled = compile_graph(insert_records(gm, {first_mul: [Ev()]}, Dev()))
    assert compiled.stats["shared"] == 1 and torch.equal(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert Dev.fired == ["e"]


def test_kept_nodes_run_where_they_are():
    gm = _fx(lambda x, i: x.index_select(0, i) + x.index_select(0, i), torch.randn(4), torch.tensor([1]))
    reads = [n.name for n in gm.graph.nodes if "index_select" in str(n.target)]
    assert compile_graph(gm).stats["shared"] == 1
    assert compile_graph(gm, keep=reads).stats["shared"] == 0


# ------------------------------------------------------------------- bindings, only when probed

_X, _Y = torch.empty(2, 3, device="meta"), torch.empty(2, 3, device="meta")
_MUL = torch.ops.aten.mul.Tensor


@pytest.mark.parametrize("candidate, why", [
    (torch.add, "another op"),
    (lambda a, b: torch.mul(b, a), "the arguments swapped"),
    (lambda a, b: torch.mul(a, b.clone()), "two ops"),
    (lambda a, b: torch.mul(a, 2.0), "another argument"),
    (lambda a, b: None, "no op at all"),
    (lambda a, b: 1 / 0, "an error"),
    (lambda a, b: torch.mul(a, b).add(0), "the op and then another"),
])
def test_a_binding_must_dispatch_the_nodes_op_with_its_arguments(candidate, why):
    assert binding_for(_MUL, (_X, _Y), {}, candidates=[candidate]) is None, why
    assert binding_for(_MUL, (_X, _Y), {}, candidates=[torch.mul]) is torch.mul


def test_a_binding_may_spell_out_a_default_but_not_change_a_scalars_type():
    spelled = lambda a, b: torch.add(a, b, alpha=1)  # noqa: E731
    assert binding_for(torch.ops.aten.add.Tensor, (_X, _Y), {}, candidates=[spelled]) is spelled
    assert binding_for(_MUL, (_X, 2), {}, candidates=[lambda a, b: torch.mul(a, 2.0)]) is None
    assert binding_for(_MUL, (_X, 2), {}) is torch._C.TensorBase.mul


def test_the_probe_answers_each_call_with_new_tensors():
    # torch detaches a tensor a mode returns that it held before the call (a second op):
    # answered with one kept stand-in, zeros_like's binding would be refused (its call as a
    # trace records it, with the binding's own pin_memory)
    x = torch.empty(2, 3, device="meta")
    op, kwargs = torch.ops.aten.zeros_like.default, {"pin_memory": False}
    assert binding_for(op, (x,), kwargs, result=torch.empty(2, 3, device="meta")) is torch._C._VariableFunctions.zeros_like


def test_probing_bindings_runs_no_kernel_and_imports_no_dynamo():
    # torch's Python meta kernels (``mean``'s, ``zeros_like``'s) import dynamo when they run
    code = ("import sys, torch\n"
            "from readfence.backends import hybrid_linear, linear, trtllm_mha\n"
            "from readfence.core import ForwardMode\n"
            "from readfence.graph import CpuDevice, Policy, lower\n"
            "with CpuDevice() as dev:\n"
            "    low = lower(hybrid_linear(trtllm_mha(), linear()), ForwardMode.DECODE, batch_size=2, device=dev,\n"
            "                policy=Policy.EXACT)\n"
            "from readfence.graph.lowering._fx_compile import _probed\n"
            "print(_probed.cache_info().misses > 0, 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr


def test_without_bindings_every_call_goes_through_its_handle():
    gm = make_fx(lambda x: x.view(-1) * 2)(torch.ones(2, 2))
    assert compile_graph(gm).stats["bound"] == 2
    plain = compile_graph(gm, bindings=False)
    assert plain.stats["bound"] == 0 and torch.equal(plain(torch.ones(2, 2)), torch.full((4,), 2.0))


# ---------------------------------------------------------------- random programs, adversarially

_OPS = ("add", "mul", "cumsum", "half", "tail", "view", "clone", "add_", "index_copy_", "arange", "cos")


def _program(steps):
    """A straight-line program over two inputs from ``steps``: each step applies an op to one of
    the latest values (few choices, so that equal expressions, views and writes through them
    between two equal expressions are common: make_fx renames a tensor written in place, but
    not the base of a view written in place)."""

    def fn(x, y):
        values = [x, y]
        for op, a, b in steps:
            u, v = values[-1 - a % len(values)], values[-1 - b % len(values)]
            if op == "add":
                values.append(u + v if u.shape == v.shape else u + 1.0)
            elif op == "mul":
                values.append(u * 2.0)
            elif op == "cumsum":
                values.append(u.cumsum(0))
            elif op == "half" and u.numel() >= 2:
                values.append(u[: u.numel() // 2])
            elif op == "tail" and u.numel() >= 2:
                values.append(u[1:])
            elif op == "view":
                values.append(u.view(-1))
            elif op == "clone":
                values.append(u.clone())
            elif op == "add_":
                u.add_(1.0)              # an in-place write, maybe through a view, maybe of an input
            elif op == "index_copy_":
                u.index_copy_(0, torch.tensor([0]), v[:1].clone())
            elif op == "arange":
                values.append(torch.arange(4.0) * 0.5)
            elif op == "cos":
                values.append(u.cos())
        return sum((v[:1] for v in values[2:]), torch.zeros(1)), x, y

    return fn


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=14))
def test_random_programs_compile_to_the_same_results(steps):
    _check(_program(steps), torch.randn(8), torch.randn(8))


def _aliased_inputs(offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    base = torch.arange(16.0).sin()
    return base, base[:8], base[offset:offset + 8]


def _aliasing_program(steps):
    """A straight-line program over two inputs that may share memory: both are read (the same
    expressions each time) before and after every step, and each step writes one of them in
    place (``add_``, through a piece, with an ``out=`` op, or through a fresh handle ``set_``
    onto it) or makes a constant a pass may fold (and writes it through a handle set_ onto it)."""

    def fn(x, y):
        values = []
        for op, which in steps:
            values += [x * 2, y * 2]
            u = (x, y)[which]
            if op == "write":
                u.add_(1.0)
            elif op == "write_piece":
                u[1:].add_(1.0)
            elif op == "out":
                torch.mul(u, 1.5, out=u)
            elif op == "set_":
                h = torch.empty(0)
                h.set_(u)
                h.mul_(0.5)
            elif op == "constant":
                k, h = torch.arange(8.0), torch.empty(0)
                h.set_(k)
                h.add_(u)
                values.append(torch.arange(8.0) * 1.0)
        values += [x * 2, y * 2]
        return sum((v.sum().reshape(1) for v in values), torch.zeros(1))

    return fn


def test_a_program_over_inputs_that_share_memory_compiles_to_its_results():
    # the quick tier's one case of the property below: a read of y, a write through x over the
    # same memory, the same read of y again
    _, x, y = _aliased_inputs(4)
    fn = _aliasing_program([("write", 0)])
    gm = _fx(fn, *_aliased_inputs(4)[1:])
    base_gm, *args_gm = _aliased_inputs(4)
    base_c, *args_c = _aliased_inputs(4)
    assert _same(compile_graph(gm, inputs=(x, y))(*args_c), gm(*args_gm))
    assert not _same(compile_graph(gm)(*_aliased_inputs(4)[1:]), gm(*_aliased_inputs(4)[1:]))  # told nothing


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(("write", "write_piece", "out", "set_", "constant")), st.integers(0, 1)),
                min_size=1, max_size=8),
       st.integers(0, 8))
def test_programs_over_inputs_that_share_memory_compile_to_the_same_results(steps, offset):
    # the two inputs are one storage (overlapping, or apart within it): told so, the passes
    # keep apart whatever a write through either, or through a handle set_ onto one, may change
    fn = _aliasing_program(steps)
    gm = make_fx(fn)(*_aliased_inputs(offset)[1:])
    _, x, y = _aliased_inputs(offset)
    compiled = compile_graph(gm, inputs=(x, y))
    base_gm, *args_gm = _aliased_inputs(offset)
    base_c, *args_c = _aliased_inputs(offset)
    assert _same(compiled(*args_c), gm(*args_gm)), compiled.source
    assert _same(base_c, base_gm), "the compiled graph left the inputs' memory in another state"


# ----------------------------------------------------------------------- the reference backends


@pytest.mark.parametrize("backend,mode", [
    (hybrid_linear(trtllm_mha(), linear()), M.DECODE),
    (tbo(deepseek_v4(), paged()), M.TARGET_VERIFY),
    (paged(), M.DRAFT_EXTEND),
])
def test_stages_of_reference_backends_compile_to_the_same_results(backend, mode):
    cfg = ModelConfig()
    program = trace(backend, mode, cfg=cfg, batch_size=2)
    step = example_step(cfg, mode, 2)
    env = flatten_inputs(shared=step.shared, batch=step.batch, pools=step.pools, params=step.params)
    env_c = {k: v.clone() for k, v in env.items()}
    shared_nodes = 0
    for stage in program.stages:
        graph = stage.graph
        compiled = compile_graph(graph.gm, keep=stage.analysis.reads)
        shared_nodes += compiled.stats["shared"] + compiled.stats["folded"]
        out = graph.gm(*[env[n] for n in graph.inputs])
        out_c = compiled(*[env_c[n] for n in graph.inputs])
        assert _same(list(out_c), list(out)), stage.stage.name
        env.update(zip(graph.outputs, out))
        env_c.update(zip(graph.outputs, out_c))
        assert all(_same(env_c[k], v) for k, v in env.items()), f"{stage.stage} wrote differently"
    assert shared_nodes > 0  # the body's rotary tables are computed once: the passes ran
    assert math.isfinite(float(env["pools.k_cache"].sum()))
