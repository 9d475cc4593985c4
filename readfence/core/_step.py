"""The step: its stages as values, and the one function that runs a step through an interpreter.

Every part of readfence runs the same step: the serial reference, the tracer, the runtime
read observer, the rehearsal before a capture, the fuzzer, the engine adapter. Each is an
*interpreter* of :func:`eval_step`, as every JAX transformation is an interpreter of
``eval_jaxpr``: it is handed one :class:`StageCall` per stage and decides what running it
means (call it, trace it, watch it). The protocol is written here and nowhere else:

1. ``prepare_out_graph(shared=, batch=)`` runs before the replay; what it returns is checked
   (:func:`check_stage_output`) and crosses into the graph as copies (:func:`cross_into_graph`),
   made inside the stage, so a view of a shared buffer it returns is read by that copy;
2. ``prepare_in_graph(shared=, batch=, meta=)`` runs first in the graph, ``meta`` being this
   step's copies;
3. ``body(shared=, batch=, pools=, params=, meta=)`` runs the model, ``meta`` being the copies
   with ``prepare_in_graph``'s outputs merged over them by top-level key (its own, not copied).

Every value that crosses a stage boundary has a *name* (:func:`flatten_group`): ``meta.<key>``
for a copy, ``meta_in.<key>`` for an in-graph output, ``logits`` for the body's output, and
``shared.``, ``batch.``, ``pools.``, ``params.`` for the step's inputs. A traced program runs
on an environment of those names (``Program.run``), so a same-key output of
``prepare_in_graph`` never takes the place of the next step's copy.

>>> import torch
>>> fns = StepFunctions(
...     prepare_out_graph=lambda shared, batch: {"n": shared["seq_lens"] + 0},
...     prepare_in_graph=lambda shared, batch, meta: {"n": meta["n"].clamp(min=2)},
...     body=lambda shared, batch, meta: meta["n"] * 10)
>>> eval_step(EAGER, fns, {"shared": {"seq_lens": torch.tensor([1, 3])}, "batch": {}})
tensor([20, 30])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import attrs
from torch.utils import _pytree as pytree

from ._stage_args import StageArgumentError as StageArgumentError
from ._stage_args import plain, read_only
from ._stage_output import PYTHON_VALUES as PYTHON_VALUES
from ._stage_output import OutputGuard as OutputGuard
from ._stage_output import as_static as as_static
from ._stage_output import check_stage_output as check_stage_output
from ._stage_output import cross_into_graph as cross_into_graph
from ._stage_output import foreign_subclass as foreign_subclass
from ._stage_output import returned_at as returned_at
from ._stage_output import same_value as same_value
from ._stage_output import unfit_tensor as unfit_tensor
from ._stages import BODY as BODY
from ._stages import PREPARE_IN_GRAPH as PREPARE_IN_GRAPH
from ._stages import PREPARE_OUT_GRAPH as PREPARE_OUT_GRAPH
from ._stages import STAGE_ENDS as STAGE_ENDS
from ._stages import STAGES as STAGES
from ._stages import Stage as Stage
from ._stages import StageOutputError as StageOutputError
from ._stages import _check_distinct, _segment
from ._stages import flatten_group as flatten_group
from ._stages import stage_named as stage_named

_T = TypeVar("_T")


# -- one stage's call ------------------------------------------------------------------------
Origin = str | Mapping[Any, str]


@attrs.frozen
class StageCall:
    """One stage of one step, as the protocol hands it to an interpreter.

    ``fn(**kwargs)`` runs it (the user's function, its output checked, and for
    ``prepare_out_graph`` copied into the graph). ``origins`` names the leaves of each
    argument: a group name, or per top-level key the group of the stage that produced it
    (the body's ``meta`` mixes copies, ``meta``, and in-graph outputs, ``meta_in``).
    """

    stage: Stage
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any]
    origins: Mapping[str, Origin] = attrs.Factory(dict)
    backend: str = "?"
    # the step's in-graph stages are replayed from a capture (``StepFunctions.replayed``)
    replayed: bool = True

    def __call__(self) -> Any:
        """Run the stage as written."""
        return self.fn(**self.kwargs)

    def named_leaves(self) -> tuple[list[str], list[Any], pytree.TreeSpec]:
        """The names and leaves of the arguments, in flattening order, and the spec that
        :meth:`rebuild` uses.

        >>> call = StageCall(BODY, lambda **kw: None, {"meta": {"a": 1, "b": 2}},
        ...                  {"meta": {"a": "meta", "b": "meta_in"}})
        >>> call.named_leaves()[0]
        ['meta.a', 'meta_in.b']
        """
        pairs, spec = pytree.tree_flatten_with_path(dict(self.kwargs))
        names = []
        for path, _ in pairs:
            arg = cast(pytree.MappingKey, path[0]).key  # the arguments are a dict, so is a mapped one
            origin = self.origins.get(arg, arg)
            group = origin if isinstance(origin, str) else origin[cast(pytree.MappingKey, path[1]).key]
            names.append(".".join([group, *map(_segment, path[1:])]))
        _check_distinct(f"stage {self.stage.name}'s arguments", names, [p for p, _ in pairs])
        return names, [leaf for _, leaf in pairs], spec

    def rebuild(self, leaves: Sequence[object], spec: pytree.TreeSpec) -> dict[str, Any]:
        """The arguments with their leaves replaced by ``leaves`` (same order and spec)."""
        return dict(pytree.tree_unflatten(list(leaves), spec))

    def output_names(self, out: object) -> list[tuple[str, Any]]:
        """``[(name, leaf)]`` of what the stage returned, under its ``outputs`` group."""
        return flatten_group(self.stage.outputs, out)


class Interpreter(Protocol):
    """What runs a step's stages: handed each :class:`StageCall` in order, it returns what the
    stage returned (on real tensors, as the step would)."""

    def call(self, call: StageCall) -> Any:
        """Run one stage."""
        ...


class Eager:
    """The interpreter that runs each stage as written: the serial reference.

    >>> EAGER.call(StageCall(BODY, lambda x: x + 1, {"x": 1}))
    2
    """

    def call(self, call: StageCall) -> Any:
        return call()


EAGER = Eager()


# -- the step --------------------------------------------------------------------------------
@attrs.frozen
class StepFunctions:
    """A step's three stage functions over keyword groups (what :func:`eval_step` calls).

    ``prepare_out_graph(shared, batch) -> dict``, ``prepare_in_graph(shared, batch, meta) ->
    dict`` and ``body(**inputs, meta) -> logits``, ``inputs`` being the step's groups
    (``shared``, ``batch``, then e.g. ``pools``, ``params``). ``backend`` names them in errors.
    ``replayed`` says whether the step's in-graph stages are replayed from a capture (a mode the
    engine graph-replays: ``core._protocol.replayed``); a step that is not runs every stage as its
    Python, as the engine does. ``readfence.core.step_functions`` makes them for a backend and the
    tiny model.
    """

    prepare_out_graph: Callable[..., object]
    prepare_in_graph: Callable[..., object]
    body: Callable[..., object]
    backend: str = "?"
    replayed: bool = True


def _checked(stage: Stage, fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    def run(**kwargs: Any) -> Any:
        # its arguments read-only (``_stage_args``): a change would reach the next stage serially only
        # (the body's ``meta``, a dict ``eval_step`` makes for it, reaches none: the body is the last)
        handed = {k: v if stage is BODY and k == "meta" else read_only(v, stage.name, k, backend=backend)
                  for k, v in kwargs.items()}
        return check_stage_output(stage, plain(fn(**handed)), backend=backend, fn=fn, kwargs=kwargs)

    return run


def _crossing(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    checked = _checked(PREPARE_OUT_GRAPH, fn, backend)

    def run(**kwargs: Any) -> Any:
        return cross_into_graph(checked(**kwargs))

    return run


def eval_step(interp: Interpreter, fns: StepFunctions, inputs: Mapping[str, object]) -> Any:
    """Run one step of ``fns`` on ``inputs`` (groups: ``shared``, ``batch``, ...) through
    ``interp``; returns what the body returned. The step's protocol, written once (see the
    module docstring): every interpretation of a step is a call of this function.

    >>> import torch
    >>> fns = StepFunctions(lambda shared, batch: {"k": shared["x"][:1]},
    ...                     lambda shared, batch, meta: {}, lambda shared, batch, meta: meta["k"])
    >>> x = torch.ones(2)
    >>> eval_step(EAGER, fns, {"shared": {"x": x}, "batch": {}}).data_ptr() != x.data_ptr()  # a copy
    True
    """
    shared, batch = inputs["shared"], inputs.get("batch", {})
    name, replayed = fns.backend, fns.replayed
    meta = interp.call(StageCall(PREPARE_OUT_GRAPH, _crossing(fns.prepare_out_graph, name),
                                 {"shared": shared, "batch": batch}, backend=name, replayed=replayed))
    own = interp.call(StageCall(PREPARE_IN_GRAPH, _checked(PREPARE_IN_GRAPH, fns.prepare_in_graph, name),
                                {"shared": shared, "batch": batch, "meta": meta},
                                {"meta": PREPARE_OUT_GRAPH.outputs}, backend=name, replayed=replayed))
    merged = {**meta, **own}
    origins = {k: PREPARE_IN_GRAPH.outputs if k in own else PREPARE_OUT_GRAPH.outputs for k in merged}
    return interp.call(StageCall(BODY, _checked(BODY, fns.body, name), {**inputs, "meta": merged},
                                 {"meta": origins}, backend=name, replayed=replayed))
