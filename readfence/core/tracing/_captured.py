"""Tensors a stage reads without receiving them (closures, attributes, globals), matched by
memory against the state the program runs on, and the error that refuses the ones no state holds.

make_fx keeps such a tensor as a constant of the stage's graph (a ``get_attr`` node). What it is
decides whether the graph may be replayed: a shared buffer (a read of it), a pool or parameter,
a constant the backend keeps (the step reads the same memory again on its next call), or
trace-time state baked into the graph (see ``readfence.core._program``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import fx

from readfence.effects import ReadfenceError

from .._modes import ForwardMode
from .._program import SOURCE_KEY, Captured, Constant, Foreign, Match, MatchedOn, Owned, Shared, StageGraph, Unmatched
from .._step import Stage, StageCall, StageOutputError, StepFunctions, eval_step, foreign_subclass
from ._dispatch import DispatchMode
from ._memory import BufferMap, met_shared, span_of, tensors_in
from ._schema import bind as bind_arguments
from ._schema import op_aliasing

_LITERAL_USERS = frozenset({torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default})


def captured_tensors(backend: str, stage: Stage, gm: fx.GraphModule, buffers: BufferMap, owned: BufferMap) -> list[Captured]:
    """The tensors ``gm`` holds as constants and uses, each matched against the example's shared
    buffers and the tensors the step owns; a tensor subclass is refused (``StageOutputError``)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or not node.users:
            continue
        if foreign_subclass(value):
            source = next((str(u.meta[SOURCE_KEY]) for u in node.users if SOURCE_KEY in u.meta), "?")
            raise StageOutputError(
                f"backend {backend!r} stage {stage} uses a {type(value).__name__} (a tensor subclass) at {source}: "
                f"make_fx does not trace through it, so the trace would hold a constant made while tracing; "
                f"unwrap it to a plain tensor inside the stage, or keep the subclass out of the step")
        # a literal (``torch.tensor(...)`` in the stage) is copied by its users on every run:
        # from fresh memory, or from memory the stage keeps (see ``_fresh_literals_dropped``)
        literal = all(u.op == "call_function" and u.target in _LITERAL_USERS for u in node.users)
        users = tuple(u.name for u in node.users)
        source = next((str(u.meta[SOURCE_KEY]) for u in node.users if SOURCE_KEY in u.meta), "?")
        out.append(Captured(stage, node.name, str(node.target), users, source, _match(value, buffers, owned),
                            literal=literal))
    return out


def fresh_literals_dropped(stages: list[StageGraph], persistence_known: bool) -> list[StageGraph]:
    """The stages without the literals that are constants of the code (``torch.tensor([1, 2])``).

    A literal over no memory of the state that the step, run once more, does not read again
    was made while tracing: a constant, fine on every run. One the step reads again (the
    literal of a numpy mirror of a buffer) copies that memory on every run, and stays
    captured, matched like any other. Without the rerun (fake tensors) every literal over no
    memory of the example is taken for a constant.
    """
    out = []
    for s in stages:
        kept = tuple(c for c in s.analysis.captured
                     if not (c.literal and isinstance(c.matches, Unmatched) and not (persistence_known and c.persistent)))
        out.append(s if kept == s.analysis.captured else attrs.evolve(s, analysis=attrs.evolve(s.analysis, captured=kept)))
    return out


def _match(value: torch.Tensor, buffers: BufferMap, owned: BufferMap) -> Match:
    hit = buffers.touched(value)
    if hit:
        return Shared(tuple(sorted(hit)))
    if owned.touched(value):
        return Owned()
    return Unmatched()



class _Consumed(DispatchMode):
    """Records the memory every op's tensor arguments span (to tell kept constants from
    values a stage computed once), and, by the stage that wrote them, the memory of the
    arguments it writes (a buffer the step fills itself: the backend's own). It is also the
    interpreter the step is run with, so that each write is the stage's that made it."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[Any] = []
        self.written: list[tuple[str, Any]] = []
        self.stage = ""

    def call(self, call: StageCall) -> Any:
        self.stage = call.stage.name
        return call()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for t in tensors_in((args, kwargs)):
            span = span_of(t)
            if span is not None:
                self.spans.append(span)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        aliasing = op_aliasing(func)
        if aliasing is not None and aliasing.writes:
            values = bind_arguments(func, args, kwargs)
            self.written += [(self.stage, sp) for i in aliasing.writes for t in tensors_in(values[i])
                             if (sp := span_of(t)) is not None]
        return func(*args, **kwargs)


def bind_captured(c: Captured, value: torch.Tensor, shared: BufferMap, owned: BufferMap) -> Captured:
    matches = _match(value, shared, owned)
    if isinstance(matches, Unmatched) and c.persistent and isinstance(c.matches, Unmatched | Constant):
        matches = _kept(value)
    return attrs.evolve(c, matches=matches, state=MatchedOn.LIVE)


def _kept(value: torch.Tensor) -> Foreign | Constant:
    """What a tensor the step reads again on every call, and no part of the state it runs on, is:
    a shared buffer of another state when its memory is one (:func:`met_shared`), else the
    backend's own (its constants, its persistent metadata buffers: whatever their shape)."""
    other = met_shared(value)
    return Foreign(other) if other is not None else Constant()



def mark_persistent(stages: list[StageGraph], fns: StepFunctions, groups: Mapping[str, Any]) -> list[StageGraph]:
    """The stages with their unmatched captured tensors marked ``persistent`` and ``filled_by``:
    the step run once more, eagerly, a captured tensor whose memory it reads again is a constant
    the backend keeps; one it does not read again was computed for that one call; the stages
    that write its memory fill it."""
    consumed = _Consumed()
    with consumed:
        eval_step(consumed, fns, groups)
    marked = []
    for s in stages:
        captured = []
        for c in s.analysis.captured:
            span = span_of(getattr(s.graph.gm, c.target))
            again = span is not None and any(span.overlaps(other) for other in consumed.spans)
            filled = frozenset(stage for stage, other in consumed.written if span is not None and span.overlaps(other))
            if not isinstance(c.matches, Unmatched):
                captured.append(attrs.evolve(c, filled_by=filled))
                continue
            # read again on the next call: the backend's own, unless its memory is a known state's
            kept = _kept(getattr(s.graph.gm, c.target)) if again else Unmatched()
            captured.append(attrs.evolve(c, persistent=again, filled_by=filled,
                                         matches=kept if isinstance(kept, Constant) else c.matches))
        marked.append(attrs.evolve(s, analysis=attrs.evolve(s.analysis, captured=tuple(captured))))
    return marked


class CapturedStateError(ReadfenceError, ValueError):
    """A stage reads a tensor it did not receive that is not live state of the step.

    Such a tensor is a constant of the traced graph: trace-time state (a copy or a DLPack view
    made while tracing, a tensor kept from another state) that would be replayed stale.
    """

    def __init__(self, backend: str, mode: ForwardMode, captured: Iterable[Captured]) -> None:
        self.backend, self.mode, self.captured = backend, mode, tuple(captured)
        reasons = "; ".join(grouped_reasons(self.captured))
        super().__init__(f"cannot lower {backend} for {mode.name}: {reasons}; {self.fix}")

    @property
    def fix(self) -> str:
        """What to do: give the state a backend keeps references to (an engine object cannot
        change how it keeps them), else hand live state to the stage or compute the tensor there."""
        if self.captured and all(isinstance(c.matches, Foreign) for c in self.captured):
            return ("pass the state the backend keeps references to: state=... to lower, run_overlapped, verify "
                    "and audit (an adapted engine backend keeps its own: state=engine.state, cfg=engine.cfg)")
        return ("pass live state to the stage through its arguments (shared, pools), or compute the tensor inside "
                "the stage")


def _made_in(source: str) -> str:
    """Whose code a source line (``file:line in function``) is in: triton's interpreter, torch, or the file."""
    path = source.split(":")[0]
    for name, who in (("triton", "triton's interpreter"), ("torch", "torch")):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if where is not None and os.path.abspath(path).startswith(os.path.dirname(os.path.abspath(where)) + os.sep):
            return who
    return os.path.basename(path) or "?"


def grouped_reasons(captured: Iterable[Captured]) -> list[str]:
    """One clause per cause: the captured tensors refused for the same reason in the same stage and
    made in the same code, counted, with one of them as the example.

    >>> from readfence.core import BODY
    >>> c = Captured(BODY, "_tensor_constant0", "_tensor_constant0", ("add",), "/x/model.py:3 in f", Unmatched())
    >>> grouped_reasons([c, attrs.evolve(c, target="_tensor_constant1", node="_tensor_constant1")])[0][:58]
    'stage body: 2 captured tensors made in model.py (_tensor_c'
    """
    groups: dict[tuple[Stage, type[Match], MatchedOn, str], list[Captured]] = {}
    for c in captured:
        groups.setdefault((c.stage, type(c.matches), c.state, _made_in(c.source)), []).append(c)
    out = []
    for (stage, _, _, made), cs in groups.items():
        names = list(dict.fromkeys(c.target for c in cs))
        if len(names) == 1:
            out.append(f"stage {stage}: {cs[0].why()}")
            continue
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"stage {stage}: {len(names)} captured tensors made in {made} ({shown}), e.g. {cs[0].why()}")
    return out
