"""The contract an engine's attention backend object follows, and the checks that hold it to it.

An engine backend (SGLang's style) is a stateful object with:

* ``init_forward_metadata_out_graph(forward_batch, in_capture=False)``: eager, before the
  replay (host reads and dynamic shapes are fine here);
* ``init_forward_metadata_in_graph(forward_batch)``: the first work of the captured graph
  (static shapes, no host reads);
* ``forward(q, k, v, layer, forward_batch, save_kv_cache=True)``, or ``forward_decode`` and
  ``forward_extend`` with that signature (called by mode, as SGLang's base class does);
* ``shared_read_ends(mode)``: ONE value for all its shared reads, a member of the engine's own
  enum named ``PRE_REPLAY``, ``IN_REPLAY``, ``POST_REPLAY`` or ``UNKNOWN`` (matched by name);
* optionally ``resolve_prefill_shared_read_ends(forward_batch, *, num_qo_tokens,
  build_snapshot=True)`` (prefill decides per batch) and ``attn_backend_list`` (a wrapper's
  children).

Nothing else is asked of the class: no base class, no registration.
"""

from __future__ import annotations

import enum
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from readfence.core import BODY, PREPARE_IN_GRAPH, PREPARE_OUT_GRAPH, ForwardMode, Stage
from readfence.core.internal import runs_an_op_for_a_mode
from readfence.effects import ReadEnd, ReadfenceError

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: The names a declaration may have (the engine's enum members are matched by name).
END_NAMES: tuple[str, ...] = ("PRE_REPLAY", "IN_REPLAY", "POST_REPLAY", "UNKNOWN")

#: Which contract method runs each stage of a step.
STAGE_METHODS: dict[Stage, str] = {
    PREPARE_OUT_GRAPH: "init_forward_metadata_out_graph",
    PREPARE_IN_GRAPH: "init_forward_metadata_in_graph",
    BODY: "forward",
}

PREFILL = "resolve_prefill_shared_read_ends"


def stage_of_method(method: str) -> Stage:
    """The stage a method of the engine's object runs in: a contract method's; any other (the
    eager entry point, ``shared_read_ends``, the prefill's resolution) runs on the host before the
    replay.

    >>> stage_of_method("forward_decode").name, stage_of_method("shared_read_ends").name
    ('body', 'prepare_out_graph')
    """
    for stage, name in STAGE_METHODS.items():
        if method == name or (stage == BODY and method.startswith("forward")):
            return stage
    return PREPARE_OUT_GRAPH


class ContractError(ReadfenceError, TypeError):
    """An engine backend object does not follow the contract (a method missing or misshapen)."""


class EngineError(ReadfenceError, RuntimeError):
    """An engine backend's own code (its factory or a contract method) raised; the message
    names the class, the method and the mode, and the original exception is chained.

    ``method`` is the contract method that raised (``""`` for a factory), ``where`` the
    innermost source line of the engine's own code in the traceback (``file:line in function``) and
    ``origin`` whose code raised it (:func:`origin_of`: ``engine``, ``torch``, ``triton`` or
    ``readfence``).
    """

    def __init__(self, message: str, *, method: str = "", where: str = "", origin: str = "engine") -> None:
        super().__init__(message)
        self.method, self.where, self.origin = method, where, origin


def _package_dir(name: str) -> str | None:
    """The folder of the imported package ``name`` (resolved, ending in a separator), or ``None``."""
    where = getattr(sys.modules.get(name), "__file__", None)
    return None if where is None else os.path.dirname(os.path.realpath(where)) + os.sep


def library_file(filename: str, packages: tuple[str, ...] = ("torch", "readfence")) -> bool:
    """Whether ``filename`` (a code object's ``co_filename``) is a module of one of ``packages``:
    a file under the folder that package was imported from. Decided by where the package really
    is, never by the path's spelling: a user's own code in a folder that happens to be named
    ``readfence`` or ``torch`` (the folder ``git clone`` makes, a venv inside it) is not theirs.

    >>> import readfence.engine._contract as here
    >>> library_file(here.__file__), library_file("/home/me/readfence/my_engine.py")
    (True, False)
    """
    if filename.startswith("<"):  # generated code (FX's, a doctest's): no module file
        return False
    path = os.path.realpath(filename)
    return any(folder is not None and path.startswith(folder) for folder in map(_package_dir, packages))


def engine_line(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback outside torch, triton and readfence (by module:
    see :func:`library_file`; a triton kernel's own body, which triton's interpreter runs as Python,
    is the engine's), as ``file:line in function`` (``""`` when every frame is theirs).

    >>> try:
    ...     {}["missing"]
    ... except KeyError as e:
    ...     engine_line(e).endswith("in <module>")
    True
    """
    found = ""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not library_file(code.co_filename, ("torch", "triton", "readfence")):
            found = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return found


#: Where an exception can be raised, besides the engine's own code.
ORIGINS = ("torch", "triton", "readfence")
_OP_CALL = os.path.join("torch", "_ops.py")  # where torch's op objects call their kernels


def origin_of(error: BaseException) -> str:
    """Where ``error`` was raised: ``"torch"`` or ``"triton"`` (an exception type of theirs, or their
    code the innermost frame), ``"readfence"``, else ``"engine"`` (the engine's own code).

    >>> try:
    ...     {}["missing"]
    ... except KeyError as e:
    ...     origin_of(e)
    'engine'
    """
    kind = type(error).__module__.split(".")[0]
    if kind in ORIGINS:
        return kind
    tb, last, watched = error.__traceback__, "", False
    while tb is not None:
        code = tb.tb_frame.f_code
        # a mode of readfence's watching the op, and the op's call below it, are no one's code: an
        # error raised there is the op's, called where the frame above the mode is (a kernel the
        # mode runs below it is code again)
        watched = runs_an_op_for_a_mode(code) or (watched and (library_file(code.co_filename, ("readfence",))
                                                               or code.co_filename.endswith(_OP_CALL)))
        if not watched:
            last = code.co_filename
        tb = tb.tb_next
    for name in ORIGINS:
        if last and library_file(last, (name,)):
            return name
    return "engine"


def traced_failure(error: EngineError) -> bool:
    """Whether ``error`` is the tracer refusing the engine's code (raised by torch while tracing:
    data-dependent control flow, a shape it cannot know, an op it cannot record), not the engine's own."""
    return error.origin == "torch"


class EngineMode(enum.Enum):
    """The forward mode as an engine backend sees it, when the engine has no enum of its own
    (:class:`~readfence.engine.EngineProfile`): readfence's modes, with SGLang 0.5.23's predicates
    (``is_extend()`` is EXTEND and TARGET_VERIFY; DRAFT_EXTEND is SGLang's DRAFT_EXTEND_V2).

    ``shared_read_ends(mode)`` and ``forward_batch.forward_mode`` receive one of these; compare
    with ``mode.is_decode()`` and friends, or by ``mode.name``.

    >>> EngineMode.TARGET_VERIFY.is_extend(), EngineMode.DRAFT_EXTEND.is_extend(), EngineMode.DECODE.is_cuda_graph()
    (True, False, True)
    >>> EngineMode.of(ForwardMode.EXTEND).readfence
    <ForwardMode.EXTEND: 'extend'>
    """

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    EXTEND = "extend"
    IDLE = "idle"

    @staticmethod
    def of(mode: ForwardMode) -> EngineMode:
        return EngineMode[mode.name]

    @property
    def readfence(self) -> ForwardMode:
        return ForwardMode[self.name]

    def is_decode(self) -> bool:
        return self is EngineMode.DECODE

    def is_target_verify(self) -> bool:
        return self is EngineMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self is EngineMode.DRAFT_EXTEND

    is_draft_extend_v2 = is_draft_extend

    def is_idle(self) -> bool:
        return self is EngineMode.IDLE

    def is_extend(self, include_draft_extend_v2: bool = False) -> bool:
        """SGLang's sense: EXTEND and TARGET_VERIFY (DRAFT_EXTEND only when asked)."""
        return self in (EngineMode.EXTEND, EngineMode.TARGET_VERIFY) or (
            include_draft_extend_v2 and self is EngineMode.DRAFT_EXTEND)

    is_prefill = is_extend

    def is_context_parallel_extend(self, include_draft_extend_v2: bool = False) -> bool:
        return self is EngineMode.EXTEND or (include_draft_extend_v2 and self is EngineMode.DRAFT_EXTEND)

    is_extend_or_draft_extend_or_mixed = is_context_parallel_extend

    def is_extend_without_speculative(self) -> bool:
        return self is EngineMode.EXTEND

    def is_decode_or_idle(self) -> bool:
        return self in (EngineMode.DECODE, EngineMode.IDLE)

    def is_cuda_graph(self) -> bool:
        """SGLang's sense: DECODE, TARGET_VERIFY and IDLE."""
        return self in (EngineMode.DECODE, EngineMode.TARGET_VERIFY, EngineMode.IDLE)

    def is_cpu_graph(self) -> bool:
        return self is EngineMode.DECODE

    def is_mixed(self) -> bool:
        return False

    def is_split_prefill(self) -> bool:
        return False

    def is_dllm_extend(self) -> bool:
        return False

    def is_prebuilt(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.name


def read_end_of(value: object, where: str) -> ReadEnd:
    """The readfence end a declaration names: an enum member (or a string) named one of
    :data:`END_NAMES`; anything else is a ``ValueError`` naming ``where`` it came from.

    >>> class SharedReadEnds(enum.Enum):
    ...     PRE_REPLAY, IN_REPLAY, POST_REPLAY, UNKNOWN = 1, 2, 3, 4
    >>> read_end_of(SharedReadEnds.IN_REPLAY, "Mine.shared_read_ends(DECODE)")
    <ReadEnd.IN_REPLAY: 2>
    >>> read_end_of(2, "Mine.shared_read_ends(DECODE)")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: Mine.shared_read_ends(DECODE) returned 2 (int), not one of PRE_REPLAY, IN_REPLAY,
    POST_REPLAY, UNKNOWN (an enum member matched by name; return the member, not its value)
    """
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if isinstance(name, str) and name in END_NAMES:
        return ReadEnd[name]
    hint = "; return the member, not its value" if isinstance(value, int) else ""
    raise ValueError(f"{where} returned {value!r} ({type(value).__name__}), not one of {', '.join(END_NAMES)} "
                     f"(an enum member matched by name{hint})")


def _binds(method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume it accepts
        return True
    return True


# method name -> (the call the adapter makes, as positional and keyword placeholders)
_SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "init_forward_metadata_out_graph": (("forward_batch",), ("in_capture",), "(forward_batch, in_capture=False)"),
    "init_forward_metadata_in_graph": (("forward_batch",), (), "(forward_batch)"),
    "shared_read_ends": (("mode",), (), "(mode)"),
    "forward": (("q", "k", "v", "layer", "forward_batch"), ("save_kv_cache",),
                "(q, k, v, layer, forward_batch, save_kv_cache=True)"),
    "forward_decode": (("q", "k", "v", "layer", "forward_batch"), ("save_kv_cache",),
                       "(q, k, v, layer, forward_batch, save_kv_cache=True)"),
    "forward_extend": (("q", "k", "v", "layer", "forward_batch"), ("save_kv_cache",),
                       "(q, k, v, layer, forward_batch, save_kv_cache=True)"),
    PREFILL: (("forward_batch",), ("num_qo_tokens", "build_snapshot"),
              "(forward_batch, *, num_qo_tokens, build_snapshot=True)"),
}


def _check_method(obj: object, name: str, who: str) -> None:
    method = getattr(obj, name, None)
    positional, keywords, shown = _SIGNATURES[name]
    if not callable(method):
        raise ContractError(f"{who} has no method {name}{shown}: an engine backend defines "
                            f"init_forward_metadata_out_graph, init_forward_metadata_in_graph, "
                            f"forward (or forward_decode and forward_extend) and shared_read_ends")
    if not _binds(method, positional, dict.fromkeys(keywords)):
        raise ContractError(f"{who}.{name} must accept {shown}, its signature is {inspect.signature(method)}")


def check_contract(obj: object, who: str) -> None:
    """``obj`` has every contract method, each accepting the call the adapter makes; else a
    :class:`ContractError` naming ``who`` (the object's place in the wrapper tree) and the method.

    >>> class Half:
    ...     def shared_read_ends(self, mode): ...
    >>> check_contract(Half(), "Half")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    readfence.engine._contract.ContractError: Half has no method init_forward_metadata_out_graph(forward_batch,
    in_capture=False): an engine backend defines init_forward_metadata_out_graph,
    init_forward_metadata_in_graph, forward (or forward_decode and forward_extend) and shared_read_ends
    """
    for name in ("init_forward_metadata_out_graph", "init_forward_metadata_in_graph", "shared_read_ends"):
        _check_method(obj, name, who)
    if callable(getattr(obj, "forward", None)):
        _check_method(obj, "forward", who)
    else:
        for name in ("forward_decode", "forward_extend"):
            _check_method(obj, name, who)
    if hasattr(obj, PREFILL):
        _check_method(obj, PREFILL, who)
    children = getattr(obj, "attn_backend_list", None)
    if children is not None and not isinstance(children, (list, tuple)):
        raise ContractError(f"{who}.attn_backend_list must be a list of backend objects (or None), "
                            f"got {children!r} ({type(children).__name__})")


def forward_method(obj: object, decode: bool) -> tuple[str, Callable[..., Any]]:
    """``(name, method)`` the adapter calls for one layer: ``forward``, or the one SGLang's base
    class would dispatch to (``forward_decode`` in DECODE, ``forward_extend`` otherwise)."""
    if callable(getattr(obj, "forward", None)):
        return "forward", obj.forward  # type: ignore[attr-defined]
    name = "forward_decode" if decode else "forward_extend"
    return name, getattr(obj, name)


def call(obj: object, who: str, method: str, mode: Any, fn: Callable[_P, _R], *args: _P.args,
         **kwargs: _P.kwargs) -> _R:
    """``fn(*args, **kwargs)``, an engine method; an exception of the engine's own code becomes an
    :class:`EngineError` naming ``who.method`` and the mode (readfence's own errors pass)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if type(e).__module__.startswith("readfence.") or isinstance(e, EngineError):
            raise
        origin = origin_of(e)
        inside = "" if origin == "engine" else f" inside {origin}"
        raise EngineError(f"{who}.{method} raised {type(e).__name__}{inside} in {mode.name}: {e}", method=method,
                          where=engine_line(e), origin=origin) from e


__all__ = ["END_NAMES", "STAGE_METHODS", "ContractError", "EngineError", "EngineMode", "check_contract",
           "engine_line", "library_file", "origin_of", "read_end_of", "traced_failure"]
