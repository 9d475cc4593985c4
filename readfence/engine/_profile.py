"""An engine's contract as a value: its mode enum, its layers, its runtime context, what it replays.

readfence hands an engine backend the engine's own values, so that the engine's code means what
it means in the engine: ``forward_batch.forward_mode == ForwardMode.EXTEND`` compares with the
engine's enum, ``fm.is_extend_without_speculative()`` is the engine's predicate. An
:class:`EngineProfile` says what those values are:

* ``modes``: the engine's mode enum (members matched to readfence's modes by name; DRAFT_EXTEND
  also as ``DRAFT_EXTEND_V2``). Without one, the enum named ``ForwardMode`` in the module of
  the object's class or of one of its bases is used, and else :class:`EngineMode`;
* ``layer(runner, layer_id)``: the ``layer`` argument of ``forward`` (default:
  :class:`~readfence.engine.AttentionLayer`, RadixAttention's fields);
* ``context(runner)``: the engine's runtime context (server args, model config published the way
  the engine publishes them), a function returning a context manager entered around every call
  into the object, construction included;
* ``buffers``: where each shared buffer is, ``None`` for one the engine does not have;
* ``replays(obj)``: whether the engine graph-replays this backend at all (a backend it never
  replays runs every mode eagerly: its declaration for a replayed mode is never used);
* ``eager``: the modes the engine runs eagerly, through ``init_forward_metadata``;
* ``spec_info(forward_batch)``: the speculative input of a TARGET_VERIFY batch (SGLang's
  ``EagleVerifyInput``), made when the object first asks for ``forward_batch.spec_info``;
* ``runner(runner)``: completes readfence's runner view with the engine's own model-runner values
  (SGLang's ``ModelConfig`` of the model, its speculative algorithm), before the factory runs, in
  the runtime context;
* ``batch_fields()``: the engine's own forward-batch fields readfence's step does not set, each
  with a function making its default (SGLang's ``kv_loc_cols`` is ``None``...);
* ``capture(runner)``: the engine's capture mode, a context manager entered around the calls whose
  code runs inside a replayed graph (``init_forward_metadata_in_graph``, ``forward``, and the
  capture-time ``init_forward_metadata_out_graph``): in the engine that code runs once, while the
  graph is captured (SGLang's ``model_capture_mode``), and what it decides there is what replays;
* ``bind_batch(forward_batch, runner)``: completes each forward batch as the engine does when it
  makes one (SGLang binds the batch's KV write plan, ``kv_loc_plan``, from the runner's index
  translator).

>>> EngineProfile().eager
frozenset({<ForwardMode.EXTEND: 'extend'>})
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import attrs

from readfence.backends import MODES
from readfence.core import ForwardMode

from ._contract import EngineMode

#: The engine member names each readfence mode may have, in the order they are tried.
MODE_NAMES: dict[ForwardMode, tuple[str, ...]] = {
    ForwardMode.DECODE: ("DECODE",),
    ForwardMode.TARGET_VERIFY: ("TARGET_VERIFY",),
    ForwardMode.DRAFT_EXTEND: ("DRAFT_EXTEND", "DRAFT_EXTEND_V2"),
    ForwardMode.EXTEND: ("EXTEND",),
    ForwardMode.IDLE: ("IDLE",),
}


@attrs.frozen
class Modes:
    """readfence's modes as the members of one engine enum.

    >>> Modes.of_enum(EngineMode).engine(ForwardMode.DRAFT_EXTEND)
    <EngineMode.DRAFT_EXTEND: 'draft_extend'>
    """

    cls: type[enum.Enum]
    members: tuple[Any, ...]  # per readfence mode, in MODES order

    @staticmethod
    def of_enum(cls: type[enum.Enum]) -> Modes:
        """The members of ``cls`` for each readfence mode; a ``ValueError`` names a mode it lacks."""
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            raise TypeError(f"modes must be the engine's mode enum (an enum.Enum class), got {cls!r} "
                            f"({type(cls).__name__})")
        members = []
        for mode in MODES:
            found = next((cls[name] for name in MODE_NAMES[mode] if name in cls.__members__), None)
            if found is None:
                raise ValueError(f"the engine's mode enum {cls.__qualname__} has no member for readfence's "
                                 f"{mode.name} (looked for {' or '.join(MODE_NAMES[mode])}); its members are "
                                 f"{', '.join(cls.__members__)}")
            members.append(found)
        return Modes(cls, tuple(members))

    def engine(self, mode: ForwardMode) -> Any:
        """The engine's member for readfence's ``mode``."""
        return self.members[MODES.index(mode)]

    def is_decode(self, member: Any) -> bool:
        """Whether ``member`` is the engine's DECODE (SGLang's base class dispatches on it)."""
        return member is self.engine(ForwardMode.DECODE)


def find_modes(obj: object) -> type[enum.Enum] | None:
    """The enum named ``ForwardMode`` (with DECODE and EXTEND members) in the module of ``obj``'s
    class or of one of its bases, or ``None``.

    >>> class Mine:
    ...     pass
    >>> find_modes(Mine()) is None
    True
    """
    for cls in type(obj).__mro__:
        module = sys.modules.get(cls.__module__)
        value = getattr(module, "ForwardMode", None) if module is not None else None
        if (isinstance(value, type) and issubclass(value, enum.Enum) and value is not ForwardMode
                and {"DECODE", "EXTEND"} <= set(value.__members__)):
            return value
    return None


def _buffers(value: Mapping[str, str | None]) -> dict[str, str | None]:
    if not isinstance(value, Mapping):
        raise TypeError(f"EngineProfile.buffers must be a mapping {{shared buffer: dotted path or None}}, got "
                        f"{value!r} ({type(value).__name__})")
    return dict(value)


def _nothing(runner: Any) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@attrs.frozen
class EngineProfile:
    """What an engine's contract looks like (see the module docstring); every field has a default
    that asks nothing of the class.

    >>> profile = EngineProfile(buffers={"seq_lens": None})
    >>> profile.buffers
    {'seq_lens': None}
    """

    modes: type[enum.Enum] | None = None
    layer: Callable[[Any, int], Any] | None = None
    context: Callable[[Any], AbstractContextManager[Any]] = _nothing
    buffers: Mapping[str, str | None] = attrs.field(factory=dict, converter=_buffers)
    replays: Callable[[Any], bool] | None = None
    eager: frozenset[ForwardMode] = frozenset({ForwardMode.EXTEND})
    spec_info: Callable[[Any], Any] | None = None
    runner: Callable[[Any], None] | None = None
    batch_fields: Callable[[], Mapping[str, Callable[[], Any]]] | None = None
    bind_batch: Callable[[Any, Any], None] | None = None
    capture: Callable[[Any], AbstractContextManager[Any]] = _nothing

    def __attrs_post_init__(self) -> None:
        for name in ("layer", "replays", "spec_info", "runner", "batch_fields", "bind_batch"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"EngineProfile.{name} must be callable or None, got {value!r} "
                                f"({type(value).__name__})")
        for name in ("context", "capture"):
            if not callable(getattr(self, name)):
                raise TypeError(f"EngineProfile.{name} must be callable (runner) -> context manager, got "
                                f"{getattr(self, name)!r} ({type(getattr(self, name)).__name__})")
        if not all(isinstance(m, ForwardMode) for m in self.eager):
            raise TypeError(f"EngineProfile.eager must be readfence ForwardMode values, got {set(self.eager)!r}")

    def modes_for(self, obj: object) -> Modes:
        """The engine's modes for the object tree rooted at ``obj``."""
        cls = self.modes if self.modes is not None else find_modes(obj)
        return Modes.of_enum(EngineMode if cls is None else cls)

    def spec_for(self, mode: ForwardMode) -> Callable[[Any], Any] | None:
        """What makes a forward batch's ``spec_info`` in ``mode`` (only TARGET_VERIFY has one)."""
        return self.spec_info if mode is ForwardMode.TARGET_VERIFY else None

    def replayed(self, obj: object) -> bool:
        """Whether the engine graph-replays ``obj`` (every backend, unless ``replays`` says not)."""
        return True if self.replays is None else bool(self.replays(obj))


__all__ = ["MODE_NAMES", "EngineProfile", "Modes", "find_modes"]
