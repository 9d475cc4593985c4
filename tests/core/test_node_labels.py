"""A stage graph run node by node under the read observer sees what the observed interpreter sees.

``NodeLabels`` runs a node below the modes where the op is torch's own and, by the observer's own
look at memory, none of its tensors touches a buffer (``ReadObserver.run_node_op``). The check
that does not share that rule: ``LabelledInterpreter``, which runs every node through the mode.
Attacks, each in a graph whose other nodes take the fast path: a node reading a view of a buffer,
a node fed a captured buffer (``get_attr``), a custom op reading a buffer it was not given (a
plan/run kernel) registered in a user namespace and in ``aten`` (where it was defined decides,
not its name), a tensor subclass argument, and another mode on the stack. Values known to hold
no buffer in their storages (an input the observer looked at, a quiet op's result on such values)
are not looked at again: a strided view into a storage that holds a buffer, and a custom op's
result, are the attacks on that.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from readfence.core import ReadObserver
from readfence.core._node_labels import LabelledInterpreter, NodeLabels

_COUNT = itertools.count()
_KEPT: dict[str, torch.Tensor] = {}  # what a "plan" kept: read by the kernels below, not handed to them


class Counts(TorchDispatchMode):
    """Another mode: the ops it sees, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _kernel(namespace: str):
    name = f"rf_node_labels_run_{next(_COUNT)}"

    @torch.library.custom_op(f"{namespace}::{name}", mutates_args=())
    def run(q: torch.Tensor) -> torch.Tensor:
        return q + _KEPT["pages"].float().sum()

    @run.register_fake
    def _(q):
        return torch.empty_like(q)

    return getattr(getattr(torch.ops, namespace), name).default


def _runs(gm: torch.fx.GraphModule, shared: dict[str, torch.Tensor], *args) -> list[tuple]:
    """The output and the accesses of each way to run ``gm`` node by node, on fresh copies."""
    seen = []
    for runner in (NodeLabels, LabelledInterpreter):
        observer = ReadObserver(shared)
        with observer:
            out = runner(gm, observer, "body").run(*args)
        seen.append((out, sorted((a.buffer, a.stage, a.kind) for a in observer.accesses)))
    return seen


def _graphs(shared: dict[str, torch.Tensor]) -> dict[str, tuple[torch.fx.GraphModule, tuple]]:
    user, in_aten = _kernel("rf_node_labels"), _kernel("aten")
    pages = shared["req_to_token"]
    x = torch.randn(4, 8)

    def view_read(x, pages):
        h = (x * 2).relu() @ torch.ones(8, 8)        # quiet nodes
        return h + pages[1:3].float().sum()          # a view of the buffer, read by the sum

    def captured(x):
        return (x + 1) * pages.float().mean()        # the buffer enters as a constant of the graph

    def kept_user(x):
        return user((x * 3).tanh()) - 1              # the kernel reads what a plan kept

    def kept_aten(x):
        return in_aten(x.exp()) / 2                  # the same kernel, defined in ``aten``

    return {
        "view": (make_fx(view_read)(x, pages), (x, pages)),
        "captured": (make_fx(captured)(x), (x,)),
        "kept in a user namespace": (make_fx(kept_user)(x), (x,)),
        "kept, defined in aten": (make_fx(kept_aten)(x), (x,)),
    }


@pytest.mark.parametrize("case", ["view", "captured", "kept in a user namespace", "kept, defined in aten"])
def test_the_node_loop_sees_what_the_observed_interpreter_sees(case) -> None:
    shared = {"req_to_token": torch.arange(12).reshape(4, 3)}
    _KEPT["pages"] = shared["req_to_token"]
    gm, args = _graphs(shared)[case]
    (out, fast), (want, slow) = _runs(gm, shared, *args)
    assert torch.equal(out, want)
    assert fast == slow and fast, (fast, slow)  # the read is seen, by the node the interpreter names
    assert all(stage.startswith("body:") for _, stage, _ in fast)


def test_a_broken_fast_path_that_trusted_every_op_would_miss_the_kernel_s_read(monkeypatch) -> None:
    # the rule the fast path rests on, made wrong on purpose: every op taken for torch's own. The
    # interpreter, which runs every node through the mode, still sees the kernel's read; the loop does not
    import readfence.core._read_observer as observed

    shared = {"req_to_token": torch.arange(12).reshape(4, 3)}
    _KEPT["pages"] = shared["req_to_token"]
    gm, args = _graphs(shared)["kept in a user namespace"]
    monkeypatch.setattr(observed, "_quiet_op", lambda func: True)
    (_, fast), (_, slow) = _runs(gm, shared, *args)
    assert slow and not fast


def test_quiet_nodes_run_below_the_modes_only_where_the_observer_is_alone() -> None:
    # another mode on the stack sees every op, as it would without the observer
    shared = {"seq_lens": torch.arange(4)}
    gm = make_fx(lambda x: (x * 2).exp().sum())(torch.ones(3))
    alone = ReadObserver(shared)
    with alone:
        assert alone.below_modes()
    x = torch.ones(3)
    for outer_first in (True, False):
        counts, observer = Counts(), ReadObserver(shared)
        modes = (counts, observer) if outer_first else (observer, counts)
        with modes[0], modes[1]:
            assert not observer.below_modes()
            NodeLabels(gm, observer, "body").run(x)
        assert counts.ops == ["aten.mul.Tensor", "aten.exp.default", "aten.sum.default"], counts.ops


def test_the_stacks_are_looked_at_again_at_every_node() -> None:
    # a mode entered after the loop looked (a kernel that left one on the stack) sees the later nodes
    x, seq_lens = torch.ones(3), torch.arange(4)  # (the buffer held: the observer watches its addresses)
    observer, counts = ReadObserver({"seq_lens": seq_lens}), Counts()
    with observer:
        alone = observer.below_modes()
        with counts:
            observer.run_node_op(torch.ops.aten.mul.Tensor, (x, 2), {}, alone)
        observer.run_node_op(torch.ops.aten.mul.Tensor, (x, 3), {}, alone)
    assert alone and counts.ops == ["aten.mul.Tensor"]


def test_a_tensor_subclass_argument_runs_through_the_modes() -> None:
    # a wrapper subclass needs the Python key to run: its node is never sent below the modes
    from torch.testing._internal.two_tensor import TwoTensor

    shared = {"seq_lens": torch.arange(4, dtype=torch.float32)}
    gm = make_fx(lambda a: a * 2)(torch.ones(4))
    pair = TwoTensor(shared["seq_lens"], torch.ones(4))
    observer = ReadObserver(shared)
    with observer:
        out = NodeLabels(gm, observer, "body").run(pair)
    assert isinstance(out, TwoTensor) and torch.equal(out.a, shared["seq_lens"] * 2)
    assert [(a.buffer, a.stage) for a in observer.accesses] == [("seq_lens", "body:mul")]


def _arena_reads() -> tuple[dict[str, torch.Tensor], torch.fx.GraphModule, torch.Tensor]:
    # the buffer is the front of one storage; the stage is handed a view of its back, reads it
    # (quiet nodes over that view), and reaches the front with a strided view of the same storage
    arena = torch.arange(16.0)
    shared = {"seq_lens": arena[:4]}
    x = arena[8:]
    gm = make_fx(lambda x: (x * 2).sum() + torch.as_strided(x.exp(), (4,), (1,), 0).sum()
                 + torch.as_strided(x, (4,), (1,), 0).mul(3).sum())(x)
    return shared, gm, x


def test_a_view_of_a_storage_that_holds_a_buffer_is_looked_at_at_every_node() -> None:
    # the loop's clean values are decided by storage, not by the elements a tensor spans: an input
    # whose storage holds a buffer is no clean value, so the op that strides into the buffer and
    # the ops over its result are looked at, as the interpreter (every node through the mode) sees
    shared, gm, x = _arena_reads()
    (out, fast), (want, slow) = _runs(gm, shared, x)
    assert torch.equal(out, want)
    assert fast == slow and [(b, stage) for b, stage, _ in fast] == [("seq_lens", "body:mul_1")], fast


def test_clean_values_decided_by_the_elements_spanned_would_miss_the_strided_read(monkeypatch) -> None:
    # the rule made wrong on purpose (a tensor clean where its own elements touch no buffer): the
    # loop then runs the strided view and its readers below the modes and records nothing, while
    # the interpreter still sees the read
    from readfence.core.tracing import BufferMap

    shared, gm, x = _arena_reads()
    monkeypatch.setattr(BufferMap, "in_storage_of", lambda self, t: bool(self.touched(t)))
    (_, fast), (_, slow) = _runs(gm, shared, x)
    assert slow and not fast


def test_clean_values_follow_quiet_ops_only() -> None:
    # a value a custom op (not torch's own) made from clean values is no clean value: the op may
    # hand back memory it was not given, and the ops over its result are looked at
    shared = {"req_to_token": torch.arange(12).reshape(4, 3)}
    _KEPT["pages"] = shared["req_to_token"]
    name = f"rf_node_labels_hands_{next(_COUNT)}"

    @torch.library.custom_op(f"rf_node_labels::{name}", mutates_args=())
    def hands(q: torch.Tensor) -> torch.Tensor:
        return _KEPT["pages"].float().flatten()[: q.numel()].clone() + 0 * q

    @hands.register_fake
    def _(q):
        return torch.empty_like(q)

    op = getattr(torch.ops.rf_node_labels, name).default
    x = torch.randn(6)
    gm = make_fx(lambda x: (op(x * 2) + 1).sum())(x)
    (out, fast), (want, slow) = _runs(gm, shared, x)
    assert torch.equal(out, want) and fast == slow and fast, (fast, slow)


_ARENA = torch.arange(8.0)  # the buffer is its front; its back touches no element of the buffer
_HELD: dict[str, torch.Tensor] = {}


@torch.library.custom_op("rf_node_labels::bind_back", mutates_args=())
def _bind_back(x: torch.Tensor) -> torch.Tensor:
    x.set_(_ARENA[4:])  # the tensor it is handed, now over the arena's back
    return torch.zeros(1)


@_bind_back.register_fake
def _(x):
    return torch.empty(1)


@torch.library.custom_op("rf_node_labels::bind_kept", mutates_args=())
def _bind_kept(q: torch.Tensor) -> torch.Tensor:
    _HELD["ws"].set_(_ARENA[4:])  # a tensor it keeps, not one it is handed
    return q + 1


@_bind_kept.register_fake
def _(q):
    return torch.empty_like(q)


def _repointed(case: str) -> tuple[torch.fx.GraphModule, Any]:
    if case == "its argument":
        def handed(x):
            z = torch.ops.rf_node_labels.bind_back.default(x)
            return torch.as_strided(x, (4,), (1,), 0).sum() + z

        return make_fx(handed)(torch.zeros(0)), lambda: (torch.zeros(0),)
    if case == "a tensor it keeps":
        def kept(q, ws):
            return torch.ops.rf_node_labels.bind_kept.default(q).sum() + torch.as_strided(ws, (4,), (1,), 0).sum()

        def inputs():
            _HELD["ws"] = torch.zeros(4)
            return torch.ones(2), _HELD["ws"]

        _HELD["ws"] = torch.zeros(4)
        return make_fx(kept)(torch.ones(2), torch.zeros(4)), inputs
    # torch's own set_, handed the buffer: the clean tensor it re-points is clean no more (a graph
    # whose later use names the tensor's own node, not set_'s, as a pass that drops in-place
    # results could write it)
    graph = torch.fx.Graph()
    x, front = graph.placeholder("x"), graph.placeholder("front")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 1))
    graph.call_function(torch.ops.aten.set_.source_Tensor, (y, front))
    graph.output(graph.call_function(torch.ops.aten.sum.default, (y,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph), lambda: (torch.zeros(4), _ARENA[:4])


@pytest.mark.parametrize("case", ["its argument", "a tensor it keeps", "torch's set_"])
def test_a_clean_tensor_an_op_re_points_at_a_buffer_is_looked_at_after(case: str) -> None:
    # a value found clean before an op re-points it (a custom op's kernel sets it over memory whose
    # storage holds the buffer, one it was handed or one it keeps; torch's own ``set_`` given the
    # buffer): the reads after it are seen, as the interpreter sees them
    shared = {"seq_lens": _ARENA[:4]}
    gm, inputs = _repointed(case)
    seen = []
    for runner in (NodeLabels, LabelledInterpreter):
        observer = ReadObserver(shared)
        with observer:
            out = runner(gm, observer, "body").run(*inputs())
        seen.append((out.item(), sorted((a.buffer, a.kind) for a in observer.accesses)))
    assert seen[0] == seen[1] and ("seq_lens", "read") in seen[0][1], seen


def test_an_object_that_is_no_tensor_is_no_clean_value() -> None:
    # a placeholder holding something the observer cannot look into (an object that hands a buffer
    # out through getitem) is not clean, nor what is taken from it
    shared = {"seq_lens": torch.arange(4.0)}

    class Holder:
        def __getitem__(self, i):
            return shared["seq_lens"]

    graph = torch.fx.Graph()
    holder = graph.placeholder("holder")
    item = graph.call_function(operator.getitem, (holder, 0))
    graph.output(graph.call_function(torch.ops.aten.sum.default, (item,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    observer = ReadObserver(shared)
    with observer:
        out = NodeLabels(gm, observer, "body").run(Holder())
    assert out.item() == 6.0 and [(a.buffer, a.stage) for a in observer.accesses] == [("seq_lens", "body:sum_default")]
