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

import ast
import importlib
import inspect
import re
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


#: ``MODULE:ATTR``, ``ATTR`` dotted, then any ``[KEY]`` subscripts (Python literals): what the loaders take.
_REFERENCE = re.compile(r"(?P<module>[^:\s]+):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?P<keys>(?:\[[^\[\]]+\])*)")


def _file_path_hint(module_name: str) -> str:
    """What to write instead of a file path given as ``MODULE`` (``""`` when it is no path).

    >>> _file_path_hint("engines/mine.py")
    "; MODULE is a dotted module name as `import` takes it, not a file: write 'engines.mine' (run from the folder that holds 'engines')"
    """
    if "/" not in module_name and "\\" not in module_name and not module_name.endswith(".py"):
        return ""
    path = module_name.replace("\\", "/").removesuffix(".py").lstrip("./")
    parts = [p for p in path.split("/") if p and p != "."]
    dotted = ".".join(parts)
    where = f" (run from the folder that holds {parts[0]!r})" if len(parts) > 1 else " (run from its folder)"
    return f"; MODULE is a dotted module name as `import` takes it, not a file: write {dotted!r}{where}"


def load_attribute(text: str, *, option: str, takes: str, example: str,
                   listed: tuple[str, Callable[[object], bool]] | None = None) -> tuple[Any, str]:
    """``(value, name)``: the attribute ``MODULE:ATTR`` names (``ATTR`` dotted, then any
    ``[KEY]`` subscripts with Python literal keys: ``ENGINES['triton']``, ``BACKENDS[0]``), imported
    as ``import`` would, and its name as given. ``ValueError`` says what is wrong, naming
    ``option`` (what it was given to), ``takes`` (its form) and an ``example``; for a name the
    module lacks, the closest it has, and first what ``listed`` picks (``(what they are, test)``:
    the values ``option`` can take), then its other public names.

    >>> value, name = load_attribute("readfence.engine.reference:ENGINES['triton']", option="--engine",
    ...                              takes="MODULE:FACTORY", example="readfence.engine.reference:triton_engine")
    >>> name, value.__name__
    ("readfence.engine.reference:ENGINES['triton']", 'triton_engine')
    >>> load_attribute("engines/mine.py:mine", option="SPEC", takes="MODULE:ATTR",
    ...                example="mypkg.backends:mine")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: SPEC takes MODULE:ATTR (e.g. mypkg.backends:mine), got 'engines/mine.py:mine'; MODULE is a
    dotted module name as `import` takes it, not a file: write 'engines.mine' (run from the folder that holds 'engines')
    """
    form = f"{option} takes {takes} (e.g. {example}), got {text!r}"
    match = _REFERENCE.fullmatch(text.strip())
    if match is None:
        module_name = text.partition(":")[0].strip()
        raise ValueError(form + _file_path_hint(module_name))
    module_name, attribute, keys = match["module"], match["attr"], match["keys"]
    hint = _file_path_hint(module_name)
    if hint:
        raise ValueError(form + hint)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"cannot import module {module_name!r} (from {option} {text!r}): {type(e).__name__}: {e}") from e
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r} (from {option} {text!r})"
                             + _what_it_has(module, attribute, listed))
        value = getattr(value, part)
    name = f"{module_name}:{attribute}"
    for key_text in re.findall(r"\[([^\[\]]+)\]", keys):
        try:
            key = ast.literal_eval(key_text.strip())
        except (ValueError, SyntaxError):
            if key_text.strip().isidentifier():  # ENGINES[triton]: the quotes a shell took away
                key = key_text.strip()
            else:
                raise ValueError(f"{option} {text!r}: [{key_text}] is not a key (a quoted string or an integer, as "
                                 f"in {name}['name'] or {name}[0])") from None
        if callable(value) and not hasattr(value, "__getitem__") and _required(value) == 0:
            value = value()  # FACTORY['key']: that key of what the factory returns
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            available = (", ".join(repr(k) for k in list(value)[:12]) if isinstance(value, Mapping)
                         else f"0..{len(value) - 1}" if isinstance(value, (list, tuple)) and value
                         else f"nothing: it is {type(value).__name__}")
            raise ValueError(f"{name} has no [{key!r}] (from {option} {text!r}); its keys: {available}") from None
        name += f"[{key!r}]"
    return value, name


def _an_engine(value: object) -> bool:
    """An adapted backend, or a class with the contract's ``forward``: what ``--engine`` lists first."""
    return isinstance(value, EngineBackend) or (inspect.isclass(value) and callable(getattr(value, "forward", None)))


def _what_it_has(module: Any, attribute: str, listed: tuple[str, Callable[[object], bool]] | None) -> str:
    """What a module that lacks ``attribute`` has: the closest name, then the values ``listed``
    picks (its backends, its engines) and the module's other public names, each cut at 12."""
    import difflib

    name = module.__name__
    public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    values = {n: getattr(module, n, None) for n in public}
    first = sorted(n for n, v in values.items() if listed is not None and listed[1](v))
    # the module's own functions and classes (not what it imported), and anything listed first
    rest = sorted(n for n, v in values.items() if n not in first and (
        getattr(module, "__all__", None) or str(getattr(v, "__module__", "") or "").startswith(name)))

    def shown(names: list[str]) -> str:
        return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")

    close = difflib.get_close_matches(attribute, first + rest, n=1)
    parts = [f" (did you mean {close[0]!r}?)" if close else ""]
    if listed is not None:
        parts.append(f"; its {listed[0]}: {shown(first) or 'none'}")
    if rest:
        parts.append(f"; {'other names' if listed is not None else 'it has'}: {shown(rest)}")
    elif listed is None:
        parts.append("; it has: nothing public")
    return "".join(parts)


def load_engines(text: str) -> list[tuple[str, EngineBackend]]:
    """``[(name, adapted backend)]`` that ``MODULE:FACTORY`` points at; ``ValueError`` says what is wrong.
    Each name is itself a ``MODULE:FACTORY`` that loads that one backend (``ENGINES['triton']``).

    >>> [name for name, _ in load_engines("readfence.engine.reference:minimax_hybrid_engine")]
    ['readfence.engine.reference:minimax_hybrid_engine']
    >>> [name for name, _ in load_engines("readfence.engine.reference:ENGINES['minimax_hybrid']")]
    ["readfence.engine.reference:ENGINES['minimax_hybrid']"]
    >>> load_engines("readfence.engine.reference")
    Traceback (most recent call last):
    ...
    ValueError: --engine takes MODULE:FACTORY (e.g. readfence.engine.reference:triton_engine), got 'readfence.engine.reference'
    """
    value, name = load_attribute(text, option="--engine", takes="MODULE:FACTORY",
                                 example="readfence.engine.reference:triton_engine",
                                 listed=("engine backends", _an_engine))
    return _resolve(value, name)
