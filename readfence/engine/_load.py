"""``MODULE:FACTORY``: the adapted backends a name points at (what ``--engine`` takes).

``FACTORY`` (a dotted attribute of ``MODULE``) may be

* an adapted backend (:func:`~readfence.engine.adapt`'s result);
* a callable with no required argument returning one (``def engine(cfg=None): return adapt(...)``);
* an engine backend factory ``factory(runner) -> backend object`` (a backend class taking the
  model runner, or a function of it): adapted with the default layout and the profile of the
  engine its module belongs to (:data:`PROFILES`: SGLang's for ``sglang.*``), else the default;
* a list or mapping of any of these (every one is loaded).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ._adapter import EngineBackend, adapt
from ._contract import ContractError, EngineError
from ._profile import EngineProfile
from ._sglang import sglang_profile

#: The profile of each engine, by the top-level package its backend classes live in.
PROFILES: dict[str, Callable[[], EngineProfile]] = {"sglang": sglang_profile}


def profile_for(factory: object) -> EngineProfile:
    """The profile of the engine ``factory``'s module belongs to (the default one for any other).

    >>> profile_for(print) == EngineProfile()
    True
    """
    package = (getattr(factory, "__module__", None) or "").split(".")[0]
    make = PROFILES.get(package)
    return EngineProfile() if make is None else make()


def _required(fn: Any) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sum(1 for p in sig.parameters.values()
               if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _resolve(value: Any, where: str) -> list[tuple[str, EngineBackend]]:
    if isinstance(value, EngineBackend):
        return [(where, value)]
    if isinstance(value, Mapping):
        return [item for key, v in value.items() for item in _resolve(v, f"{where}[{key!r}]")]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _resolve(v, f"{where}[{i}]")]
    if not callable(value):
        raise ValueError(f"{where} is {value!r} ({type(value).__name__}): name an adapted backend, a factory "
                         f"returning one, or a backend class taking the model runner")
    required = _required(value)
    if required == 0:
        try:
            made = value()
        except (EngineError, TypeError, ValueError) as e:
            raise ValueError(f"{where}() failed: {e}") from e
        except Exception as e:
            raise ValueError(f"{where}() raised {type(e).__name__}: {e}") from e
        if not isinstance(made, (EngineBackend, Mapping, list, tuple)):
            raise ValueError(f"{where}() returned {made!r} ({type(made).__name__}), not an adapted backend "
                             f"(readfence.engine.adapt(...))")
        return _resolve(made, where)
    if required == 1:
        try:
            return [(where, adapt(value, profile=profile_for(value)))]
        except (EngineError, ContractError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
    raise ValueError(f"{where} takes {required} required arguments: a factory takes none (and returns an adapted "
                     f"backend) or the model runner alone")


def load_engines(text: str) -> list[tuple[str, EngineBackend]]:
    """``[(name, adapted backend)]`` that ``MODULE:FACTORY`` points at; ``ValueError`` says what is wrong.

    >>> [name for name, _ in load_engines("readfence.engine.reference:minimax_hybrid")]
    ['readfence.engine.reference:minimax_hybrid']
    >>> load_engines("readfence.engine.reference")
    Traceback (most recent call last):
    ...
    ValueError: --engine takes MODULE:FACTORY (e.g. readfence.engine.reference:triton), got 'readfence.engine.reference'
    """
    module_name, sep, attribute = text.partition(":")
    if not sep or not module_name.strip() or not attribute.strip():
        raise ValueError(f"--engine takes MODULE:FACTORY (e.g. readfence.engine.reference:triton), got {text!r}")
    module_name, attribute = module_name.strip(), attribute.strip()
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"cannot import module {module_name!r} (from --engine {text!r}): {type(e).__name__}: {e}") from e
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            names = sorted(getattr(module, "__all__", None) or
                           [n for n in dir(module) if not n.startswith("_")
                            and getattr(getattr(module, n), "__module__", "").startswith(module_name)])
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r} (from --engine {text!r}); "
                             f"it has: {shown or 'nothing public'}")
        value = getattr(value, part)
    return _resolve(value, f"{module_name}:{attribute}")
