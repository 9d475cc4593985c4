"""A pure piece of the model, recorded once per input signature and spliced after that.

Every backend's step runs the same model around its ``attend``: norms, projections, rotary,
the MLP; in every layer, at every batch size the audit asks, for every backend it audits. The
recorder (``_record``) writes each of those ops down as it runs, tens of microseconds an op, and
they are most of a step's ops. :class:`Segment` marks such a piece: a function of its tensor
arguments alone (no closure over tensors, no global state, no escape), whose ops and their
order depend only on each argument's shape, strides, dtype, device and grad flags, and on the
segment's ``key`` (the Python values it closes over). Like a ``jax.jit`` function, its record is
kept per signature (a :class:`Template`: the nodes, their arguments as references to the
segment's inputs or to earlier nodes, their metadata) and a later call under a recorder runs
the function eagerly, unrecorded, and writes the template's nodes over the call's input nodes:
the graph is the one the record would have made, node for node and name for name. The calls
that eager run makes must be the template's, in order: each op with the same arguments (a
tensor as the same input or the same earlier result, a Python value of the same type and bits)
and the same results returned (:class:`Listing`), compared as each is made. From the first
that is not (a function the piece calls was replaced since, a value its code reads changed, a
tensor from outside the piece), the calls before it are written from the template and that one
and the rest recorded; the next call records a template again. A run is never made twice: what
it did (a cache it filled, an error it raised) is in the graph.

A template is only made and only used where it cannot hide a read: every input a plain
``torch.Tensor`` whose storage holds no shared buffer's memory (an output the backend returns that
is a view of one, a tensor subclass, a fake tensor: the piece is recorded op by op), and a record
that made nothing but operator nodes over its inputs and their results, none touching a buffer.
Only the recorder splices. The read observer runs a segment unobserved where, by its own look at
their storages, none of its inputs holds a shared buffer's memory, and only while its calls are
those of its own observed run of that signature (``ReadObserver.run_segment``: it keeps its own
references, not the recorder's templates); the poison and the serial comparison run the function
as it is.

>>> import torch
>>> double = Segment("double", lambda x: x * 2)
>>> double(torch.ones(2))     # no recorder: the function itself
tensor([2., 2.])
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import fx
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ._cache import CACHES
from ._codegen import define
from ._fx import add_node
from ._record import NOTHING, GraphRecorder, node_name


@attrs.frozen
class _In:
    """A template's reference to the segment's input ``index``."""

    index: int


@attrs.frozen
class _Ref:
    """A template's reference to its node ``index``."""

    index: int


@attrs.frozen
class Template:
    """A segment's record: per node ``(target, args, kwargs, name, meta)``, args and kwargs
    holding :class:`_In` and :class:`_Ref`; ``outputs`` the references the segment returns."""

    nodes: tuple[tuple[Any, tuple[Any, ...], dict[str, Any], str, dict[str, Any]], ...]
    outputs: tuple[_In | _Ref, ...]
    #: the calls the record made, as a :class:`Listing` of an eager run writes them: each node's
    #: target and arguments (a tensor as the input or the node it is, a Python value by its type
    #: and, for a float, its bits); a list's pieces as ``getitem`` nodes
    calls: tuple[tuple[Any, tuple[Any, ...], dict[str, Any]], ...] = attrs.field()

    #: :meth:`write` as one generated function (made at the first write)
    _writer: Callable[..., list[fx.Node]] | None = attrs.field(init=False, default=None, eq=False, repr=False)

    @calls.default
    def _calls(self) -> tuple[tuple[Any, tuple[Any, ...], dict[str, Any]], ...]:
        return tuple((t, _value(args), {k: _value(v) for k, v in kwargs.items()}) for t, args, kwargs, *_ in self.nodes)

    @property
    def returned(self) -> tuple[int, ...]:
        """The indices of the nodes the segment returns (an input returned as it is is none)."""
        return tuple(ref.index for ref in self.outputs if isinstance(ref, _Ref))

    def inputs_of(self, nodes: Sequence[fx.Node]) -> dict[int, fx.Node] | None:
        """The node each input of the segment is, in ``nodes`` spliced from this template (by
        index of the segment's inputs; only those its nodes read), or ``None`` where ``nodes``
        are not this template's calls (another target, another argument, another value of a
        Python argument, one input given as two nodes)."""
        if len(nodes) != len(self.nodes):
            return None
        inputs: dict[int, fx.Node] = {}

        def same(want: Any, got: Any) -> bool:
            if isinstance(want, _In):
                return isinstance(got, fx.Node) and inputs.setdefault(want.index, got) is got
            if isinstance(want, _Ref):
                return got is nodes[want.index]
            if isinstance(want, (list, tuple)):
                return (isinstance(got, (list, tuple)) and len(got) == len(want)
                        and all(same(w, g) for w, g in zip(want, got)))
            return type(got) is type(want) and _value(got) == _value(want)

        for node, (target, args, kwargs, _, _) in zip(nodes, self.nodes):
            if (node.op != "call_function" or node.target is not target or kwargs.keys() != node.kwargs.keys()
                    or not same(args, node.args) or not all(same(v, node.kwargs[k]) for k, v in kwargs.items())):
                return None
        return inputs

    def write(self, graph: fx.Graph, inputs: Mapping[int, fx.Node] | Sequence[fx.Node]) -> list[fx.Node]:
        """The template's nodes written at the end of ``graph`` over ``inputs`` (the node of each
        input, by index), their metadata its own; returns them in order."""
        writer = self._writer
        if writer is None:  # (made at the first write: a template written once never pays for it)
            writer = _writer_of(self)
            object.__setattr__(self, "_writer", writer)
        return writer(graph, inputs)

    def write_each(self, graph: fx.Graph, inputs: Mapping[int, fx.Node] | Sequence[fx.Node],
                   count: int | None = None) -> list[fx.Node]:
        """:meth:`write`, node by node, as the generated writer does it (its reference); with
        ``count``, its first ``count`` nodes only."""
        made: list[fx.Node] = []

        def node_of(ref: _In | _Ref) -> fx.Node:
            return _node_of(ref, inputs, made)

        for target, args, kwargs, name, meta in self.nodes[:count]:
            node = add_node(graph, "call_function", target, _mapped(args, node_of),
                            {k: _mapped(v, node_of) for k, v in kwargs.items()}, name)
            node.meta.update(meta)
            made.append(node)
        return made

    def graph(self, inputs: Mapping[int, Any]) -> tuple[fx.GraphModule, tuple[int, ...]]:
        """The template as a graph of its own: a placeholder per input it reads (index order, each
        with ``inputs[index]`` as its traced value), its nodes, and a tuple of the nodes it returns
        (an input returned as it is is left out); with the indices of the nodes returned."""
        graph = fx.Graph()
        held = {i: graph.placeholder(f"input_{i}") for i in sorted(inputs)}
        for i, node in held.items():
            node.meta["val"] = inputs[i]
        made = self.write(graph, held)
        graph.output(tuple(made[i] for i in self.returned))
        from torch.fx._lazy_graph_module import _LazyGraphModule  # (its Python made only if it is called)

        return _LazyGraphModule(torch.nn.Module(), graph), self.returned


def _writer_of(template: Template) -> Callable[..., list[fx.Node]]:
    """:meth:`Template.write` as a function of its own: each node's arguments written out as
    Python displays (each input as ``inputs[i]``, each earlier node by its variable, a list as a new
    list), a Python value as it is in the template, so that a splice builds no argument by walking
    the template's (the splices of a deep model write most of its graph)."""
    scope: dict[str, Any] = {"add_node": add_node}
    held: dict[int, str] = {}

    def constant(value: Any) -> str:
        name = held.get(id(value))
        if name is None:
            name = held[id(value)] = f"c{len(held)}"
            scope[name] = value
        return name

    def display(value: Any) -> str:
        if isinstance(value, _In):
            return f"inputs[{value.index}]"
        if isinstance(value, _Ref):
            return f"n{value.index}"
        if isinstance(value, list):
            return "[" + "".join(f"{display(v)}, " for v in value) + "]"
        if isinstance(value, tuple):
            return "(" + "".join(f"{display(v)}, " for v in value) + ")"
        return constant(value)  # (immutable: ints, floats, dtypes, None... as the record holds them)

    lines = ["def write(graph, inputs):"]
    for i, (target, args, kwargs, name, meta) in enumerate(template.nodes):
        pairs = "".join(f"{k!r}: {display(v)}, " for k, v in kwargs.items())
        lines.append(f"    n{i} = add_node(graph, 'call_function', {constant(target)}, {display(tuple(args))}, "
                     f"{{{pairs}}}, {name!r})")
        lines.append(f"    n{i}.meta.update({constant(meta)})")
    lines.append("    return [" + "".join(f"n{i}, " for i in range(len(template.nodes))) + "]")
    return define("write", "\n".join(lines) + "\n", scope, f"<segment template writer {next(_WRITERS)}>")


_WRITERS = itertools.count()


def _node_of(ref: _In | _Ref, inputs: Mapping[int, fx.Node] | Sequence[fx.Node], made: Sequence[fx.Node]) -> fx.Node:
    """The node a template's reference names: the segment's input, or a node the template wrote (``made``)."""
    return inputs[ref.index] if isinstance(ref, _In) else made[ref.index]


def _value(v: Any, ref_of: Callable[[Any], Any] | None = None) -> Any:
    """An argument as a call is compared: references, containers and values whose equality is
    their type's (an int, a string, a dtype) as they are; a float by its bits (``-0.0`` is not
    ``0.0``, nor ``1.0`` the int ``1``), any other value with its type (``True`` is not ``1``);
    with ``ref_of``, a tensor as the reference it names (an eager run's argument)."""
    kind = type(v)
    if kind in _SELF_EQUAL:
        return v
    if ref_of is not None and isinstance(v, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
        return ref_of(v)  # (a storage is no input nor result: memory from outside the segment)
    if kind is list or kind is tuple:
        return kind([_value(x, ref_of) for x in v])
    if kind is float:
        return (float, v.hex())
    return (kind, v)


#: Values equal only to values of their own type (``_In`` and ``_Ref``: attrs compares the class too).
_SELF_EQUAL = frozenset({int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, _In, _Ref})


class Listing:
    """The calls a segment's eager run made, unrecorded, in the form of :attr:`Template.calls`:
    each op's target and its arguments, a tensor named by what it is (an input of the segment, or
    the value of an earlier call, by identity, checked through a weak reference: a tensor that
    died and whose identity a later one took is named by nothing), a list or tuple result's
    pieces as ``getitem`` calls. Two runs with equal listings made the same calls on the same
    values: the template's graph is the run's. (Results are held weakly, as the recorder holds
    them: a strong reference to a factory function's result makes torch detach it on return, a
    call the record does not have.)"""

    def __init__(self, inputs: Sequence[torch.Tensor], expected: Sequence[Any] | None = None) -> None:
        self.refs: dict[int, tuple[weakref.ref[torch.Tensor], _In | _Ref]] = {}
        for index, t in enumerate(inputs):
            self.refs.setdefault(id(t), (weakref.ref(t), _In(index)))
        self.inputs = tuple(inputs)  # (alive while the listing is)
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        #: whether a call was given a tensor from outside the segment (none of its inputs, no
        #: earlier call's value: a closure's, a global's; a storage): such a listing equals no
        #: other run's (a caller may also mark it so: a tensor re-pointed without an op)
        self.outside = False
        #: the calls the run is held to, as they are made (``None``: none): ``diverged`` once a
        #: call is not the one ``expected`` has at its place, or one more than it has
        self.expected = expected
        self.diverged = False
        self.matched = 0  # how many calls, from the first, are ``expected``'s

    def _known(self, t: torch.Tensor) -> _In | _Ref | None:
        hit = self.refs.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def _ref(self, t: Any) -> Any:
        known = self._known(t)
        if known is None:  # a tensor from outside the segment: no template holds it
            self.outside = True
            return _UNKNOWN
        return known

    def enter(self, target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
        """List a call before it runs; returns its place (:meth:`leave` names its result by it)."""
        ref, refs = self._ref, self.refs
        listed = []
        for a in args:  # (a plain tensor or a value equal only to its own type's: most arguments, at once)
            kind = type(a)
            if kind is torch.Tensor:
                hit = refs.get(id(a))
                listed.append(hit[1] if hit is not None and hit[0]() is a else ref(a))
            elif kind in _SELF_EQUAL:
                listed.append(a)
            else:
                listed.append(_value(a, ref))
        self._append((target, tuple(listed), {k: _value(v, ref) for k, v in kwargs.items()} if kwargs else {}))
        return len(self.calls) - 1

    def leave(self, index: int, out: Any) -> None:
        """The call listed at ``index`` returned ``out``."""
        self._result(out, _Ref(index))

    def add(self, target: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """An op the run dispatched, with what it returned."""
        self.leave(self.enter(target, args, kwargs), out)

    def _append(self, call: tuple[Any, tuple[Any, ...], dict[str, Any]]) -> None:
        calls, expected = self.calls, self.expected
        calls.append(call)
        if expected is not None and not self.diverged:
            at = len(calls) - 1
            self.diverged = at >= len(expected) or expected[at] != call
            self.matched = at if self.diverged else at + 1

    def _result(self, out: Any, ref: _Ref) -> None:
        if type(out) is torch.Tensor or isinstance(out, torch.Tensor):
            self.refs[id(out)] = (weakref.ref(out), ref)
        elif isinstance(out, (list, tuple)):  # as the record writes a list: a getitem node a piece
            for index, element in enumerate(out):
                self._append((operator.getitem, (ref, index), {}))
                self._result(element, _Ref(len(self.calls) - 1))

    def returned(self, out: Any) -> tuple[_In | _Ref, ...] | None:
        """What the segment returned, as references (``None``: not tensors the listing knows)."""
        tensors = _outputs(out)
        if tensors is None:
            return None
        refs = tuple(self._known(t) for t in tensors)
        return None if any(r is None for r in refs) else refs  # type: ignore[return-value]


#: An argument that is a tensor the listing does not know: equal to nothing a template holds.
_UNKNOWN = object()


@attrs.frozen
class SegmentSignature:
    """What the ops a segment dispatches, and their order, may depend on (:func:`segment_signature`):
    its name, code and key (the Python values it closes over), torch's grad and inference modes and
    default dtype, and each input's shape, strides, dtype, device and grad flag."""

    name: str
    code: Hashable
    key: Hashable
    grad: bool
    inference: bool
    dtype: torch.dtype
    inputs: tuple[tuple[Any, ...], ...]


#: Templates by signature: a model's few pieces, a handful of shapes each. Kept by
#: ``clear_trace_cache``: a template is rechecked at every use (the calls a run makes, arguments and
#: results included, must be its own), so it cannot outlive what it was recorded from.
_TEMPLATES = CACHES.table("segment_templates", SegmentSignature, "a model segment's record, spliced for a call "
                          "that makes the same calls (rechecked at use)", limit=4096, kept=True)


def clear_templates() -> None:
    """Forget every segment's record (the next call under a recorder records it again)."""
    _TEMPLATES.clear()


@attrs.frozen
class Segment:
    """``fn`` as a piece of the model whose record is reused (see the module docstring);
    ``key``: what else its ops depend on (closed-over Python values). Call it with tensors; it
    returns what ``fn`` returns (a tensor or a tuple of tensors). A key (or a code) that cannot be
    hashed keys no record: the piece runs as the code it is, recorded and observed op by op.

    >>> import torch
    >>> Segment("norm", lambda x: x / x.norm(), key=()).name
    'norm'
    >>> Segment("listed", lambda x: x, key=[1]).keyed
    False
    """

    name: str
    fn: Callable[..., Any]
    key: Hashable = ()
    keyed: bool = attrs.field(init=False, eq=False, repr=False)

    @keyed.default
    def _keyed(self) -> bool:
        try:
            hash((self.key, getattr(self.fn, "__code__", self.fn)))
        except TypeError:
            return False
        return True

    def __call__(self, *tensors: torch.Tensor) -> Any:
        stack = _get_current_dispatch_mode_stack()
        mode: Any = stack[-1] if stack and self.keyed else None
        if isinstance(mode, GraphRecorder):
            return _record_segment(mode, self, tensors)
        if hasattr(mode, "run_segment"):  # the read observer: unobserved where it can touch no buffer
            return mode.run_segment(self, tensors)
        return self.fn(*tensors)


def segment_signature(segment: Segment, tensors: Sequence[torch.Tensor]) -> SegmentSignature:
    """What the ops ``segment`` dispatches on ``tensors``, and their order, may depend on: its
    code, what it closes over (the key), torch's modes and default dtype, and each input's
    layout (a record or an observation is reused only for the same signature, and only after
    the ops that ran were checked against it)."""
    with torch._C.DisableTorchFunction():  # readfence's own look at the tensors: no mode's handler sees it
        layouts = tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors)
    return SegmentSignature(segment.name, getattr(segment.fn, "__code__", segment.fn), segment.key,
                            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(), layouts)


def _input_nodes(recorder: GraphRecorder, tensors: Sequence[torch.Tensor]) -> list[fx.Node] | None:
    """The node of each input, or None where one is not a plain tensor the record follows whose
    memory touches no shared buffer."""
    if recorder.fake or recorder.pauses or recorder.unrecorded is not None:  # (a piece inside a listed one: plain)
        return None
    nodes = []
    for t in tensors:
        if type(t) is not torch.Tensor:
            return None
        hit = recorder.tracked.get(id(t))
        if hit is None or hit[0]() is not t or hit[2] or recorder.touched(t) or recorder.in_storage_of_buffer(t):
            return None
        nodes.append(hit[1])
    return nodes


def _record_segment(recorder: GraphRecorder, segment: Segment, tensors: Sequence[torch.Tensor]) -> Any:
    inputs = _input_nodes(recorder, tensors)
    if inputs is None:
        return segment.fn(*tensors)
    signature = segment_signature(segment, tensors)
    template = _TEMPLATES.get(signature)
    if template is None:
        tail, constants = recorder.graph._root.prev, len(recorder.constants)
        out = segment.fn(*tensors)
        made = _template(recorder, tail, inputs, out) if len(recorder.constants) == constants else None
        if made is not None:
            _TEMPLATES.put(signature, made)
        return out
    listing = recorder.unrecorded = _Splicing(recorder, template, inputs, tensors)
    try:
        # (torch-function modes stay on: a host read or an escape reaches no dispatcher, and the
        # tracer's mode turns it into a call the record does not have)
        out = segment.fn(*tensors)
    except BaseException:
        listing.resume()  # what ran before the error is the graph's (the caller may go on)
        raise
    finally:
        recorder.unrecorded = None
    if listing.resumed or len(listing.calls) != len(template.calls) or listing.returned(out) != template.outputs:
        # it made other calls than its record holds (a function it calls was replaced since, a
        # value its code reads changed), or fewer, or returned another value: recorded from its
        # first call that is not the template's, and its next call records a template again
        listing.resume()
        _TEMPLATES.forget(signature)
        return out
    _splice(recorder, template, inputs, out)
    return out


class _Splicing(Listing):
    """A spliced piece's listing (held to its template's calls), and how its run goes on recorded
    from the first call that is not the template's (:meth:`resume`): one run, never made again."""

    def __init__(self, recorder: GraphRecorder, template: Template, inputs: Sequence[fx.Node],
                 tensors: Sequence[torch.Tensor]) -> None:
        super().__init__(tensors, template.calls)
        self.recorder, self.template, self.input_nodes = recorder, template, inputs
        self.resumed = False

    def resume(self) -> None:
        """Write the template's nodes of the calls made so far that are its own, follow their values,
        and record every later call (the listing is the recorder's no more)."""
        if self.resumed:
            return
        self.resumed = True
        recorder = self.recorder
        if recorder.unrecorded is self:
            recorder.unrecorded = None
        made = self.template.write_each(recorder.graph, self.input_nodes, self.matched)
        for held, ref in list(self.refs.values()):
            t = held()
            if isinstance(ref, _Ref) and ref.index < len(made) and t is not None:
                recorder.track(t, made[ref.index], NOTHING)  # (the template's calls touch no buffer)


def _mapped(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` (a node's argument) with each node or reference in it replaced by ``fn`` of it;
    lists stay lists (an ``immutable_list`` a plain one, as the record makes it)."""
    if isinstance(value, (fx.Node, _In, _Ref)):
        return fn(value)
    if isinstance(value, list):
        return [_mapped(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_mapped(v, fn) for v in value)
    return value


def _outputs(out: Any) -> tuple[torch.Tensor, ...] | None:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
        return out
    return None


def _template(recorder: GraphRecorder, tail: fx.Node, inputs: Sequence[fx.Node], out: Any) -> Template | None:
    """The record the segment just made after ``tail``, or None where it cannot be reused."""
    refs: dict[fx.Node, _In | _Ref] = {}
    for index, node in enumerate(inputs):
        refs.setdefault(node, _In(index))
    probe = recorder.probe
    changed = {node for node, _ in probe.changed}
    nodes = []
    node = tail.next
    while node is not recorder.graph._root:
        if (node.op != "call_function" or node.target is recorder.escape_op or node.name in probe.touched
                or node in changed or node.name in probe.copies):
            return None
        try:
            args = _mapped(node.args, refs.__getitem__)
            kwargs = {k: _mapped(v, refs.__getitem__) for k, v in node.kwargs.items()}
        except KeyError:  # a node of the graph before the segment that is none of its inputs
            return None
        target: Any = node.target
        name = "getitem" if target is operator.getitem else node_name(target.overloadpacket.__name__)
        nodes.append((node.target, args, kwargs, name, dict(node.meta)))
        refs[node] = _Ref(len(nodes) - 1)
        node = node.next
    tensors = _outputs(out)
    if tensors is None:
        return None
    outputs = []
    for t in tensors:
        hit = recorder.tracked.get(id(t))
        if hit is None or hit[0]() is not t or hit[1] not in refs:
            return None
        outputs.append(refs[hit[1]])
    return Template(tuple(nodes), tuple(outputs))


#: Where a node was spliced from (``node.meta[SPLICED_KEY]``, a :class:`Spliced`): the nodes of
#: one call of a segment, recorded once and spliced after that, are one piece a compile may call
#: as one function (``graph.lowering._fx_pieces``).
SPLICED_KEY = "readfence_spliced"


@attrs.frozen(eq=False)
class Spliced:
    """A spliced node's template, the splice it belongs to (``call``: one number a splice) and
    which of the template's nodes it is (``index``)."""

    template: Template
    call: int
    index: int


_SPLICES = itertools.count()


def _splice(recorder: GraphRecorder, template: Template, inputs: Sequence[fx.Node], out: Any) -> None:
    made = template.write(recorder.graph, inputs)
    call = next(_SPLICES)
    for index, node in enumerate(made):
        node.meta[SPLICED_KEY] = Spliced(template, call, index)
    tensors = _outputs(out)
    assert tensors is not None and len(tensors) == len(template.outputs)
    for t, ref in zip(tensors, template.outputs, strict=True):
        recorder.track(t, _node_of(ref, inputs, made), NOTHING)

