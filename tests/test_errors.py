"""Every error readfence raises on purpose derives from one base, ``ReadfenceError``, and keeps
the built-in class its callers catch."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import readfence
from readfence.effects import ReadfenceError

#: Exceptions used for control flow inside the tracer and caught there: never reach a user.
INTERNAL = {"readfence.core.tracing._record.Unrecordable", "readfence.core.tracing._trace_modes.TraceAborted",
            "readfence.effects._spec_tokens.SpecFault"}


def error_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a readfence module, by dotted name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(readfence.__path__, "readfence."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{info.name}.{obj.__qualname__}"] = obj
    return found


def strays(classes: dict[str, type[BaseException]]) -> list[str]:
    """The public error classes among ``classes`` that are not readfence errors."""
    return sorted(name for name, cls in classes.items()
                  if not issubclass(cls, ReadfenceError) and name not in INTERNAL
                  and not name.rpartition(".")[2].startswith("_"))


def test_every_error_readfence_raises_on_purpose_is_a_readfence_error() -> None:
    classes = error_classes()
    assert len(classes) > 20  # the walk found the package's errors (devices, lowering, core, engine, cli...)
    assert strays(classes) == []


def test_the_walk_would_catch_an_error_outside_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    import readfence.core._step as step

    class StrayError(ValueError):
        pass

    StrayError.__module__, StrayError.__qualname__ = step.__name__, "StrayError"
    monkeypatch.setattr(step, "StrayError", StrayError, raising=False)
    assert strays(error_classes()) == ["readfence.core._step.StrayError"]


def test_a_refusal_is_caught_as_a_readfence_error_and_as_its_builtin_class() -> None:
    from readfence.backends import redeclare, trtllm_mha
    from readfence.core import ForwardMode
    from readfence.effects import ReadEffect, ReadEnd
    from readfence.graph import CpuDevice, Policy, UnsoundLowering, lower

    early = redeclare(trtllm_mha(), lambda mode: ReadEffect.of({}, default=ReadEnd.NONE))
    with CpuDevice() as device:
        for kind in (ReadfenceError, ValueError, UnsoundLowering):
            with pytest.raises(kind, match="trtllm_mha"):
                lower(early, ForwardMode.DECODE, batch_size=2, device=device, policy=Policy.JOINED)
