"""Command-line inputs: parameter types that turn bad input into one clean error line.

Every bad value raises :class:`InputError`: click prints ``Error: <message>`` on one line and
exits with status 2, without a usage banner or a traceback. The message names the option,
the value, what was wrong and what is allowed. Each type's ``expects`` says what it takes
(the message for an option given no value).

This module imports no torch, and neither does any type's ``convert``: every option is checked
(and ``--help`` printed) at once. What needs the library (parsing a spec, importing an engine's
module, asking CUDA) is the type's ``resolve``, run after every option has passed (see
:class:`~readfence.cli._errors.OneLineCommand`).

>>> Positive().convert("12", None, None), Positive().convert("007", None, None)
(12, 7)
>>> try:
...     Positive().convert("0", None, None)
... except InputError as e:
...     print(e.message, "| exit status", e.exit_code)
invalid value '0': must be a positive integer (1, 2, 3, ...) | exit status 2
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import click

from ._errors import InputError, param_name
from ._param_base import COMBINATOR_NAMES as COMBINATOR_NAMES
from ._param_base import DEFAULT_SPEC as DEFAULT_SPEC
from ._param_base import DEVICE_KINDS as DEVICE_KINDS
from ._param_base import LEAF_NAMES as LEAF_NAMES
from ._param_base import MAX_BATCH as MAX_BATCH
from ._param_base import MODE_NAMES as MODE_NAMES
from ._param_base import POLICY_NAMES as POLICY_NAMES
from ._param_base import STEP_SHAPE_NAMES as STEP_SHAPE_NAMES
from ._param_base import TINY_HEADS as TINY_HEADS
from ._param_base import TINY_MLP as TINY_MLP
from ._param_base import TP_SIZES as TP_SIZES
from ._param_base import _close, _fail
from ._param_base import shell_word as shell_word
from ._param_base import shown as shown
from ._param_choices import DeviceName as DeviceName
from ._param_choices import OneOf as OneOf
from ._param_choices import device_caps as device_caps
from ._param_numbers import BATCH_SIZE as BATCH_SIZE
from ._param_numbers import MAX_STEPS as MAX_STEPS
from ._param_numbers import Amount as Amount
from ._param_numbers import Integer as Integer
from ._param_numbers import Positive as Positive
from ._param_numbers import Rate as Rate
from ._param_numbers import Sizes as Sizes
from ._param_output import JSON_SCHEMA_VERSION as JSON_SCHEMA_VERSION
from ._param_output import OutputFile as OutputFile
from ._param_output import echo_json as echo_json


@contextlib.contextmanager
def importable_here() -> Iterator[None]:
    """The current folder first on ``sys.path`` while a user's module is imported, as
    ``python -m`` puts it there (a console script's own folder is there instead)."""
    here = os.getcwd()
    if here in sys.path or "" in sys.path:
        yield
        return
    sys.path.insert(0, here)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(here)


def is_reference(text: str) -> bool:
    """Whether ``text`` names a Python value (``MODULE:ATTR``) rather than spelling a spec: a
    colon before any parenthesis (the grammar has none outside its quoted values).

    >>> is_reference("mypkg.backends:mine"), is_reference('hybrid_linear(paged, linear, pattern=":")')
    (True, False)
    """
    head = text.partition("(")[0]
    return ":" in head and not head.rstrip().endswith(":")


def load_spec(text: str, *, option: str = "SPEC") -> Any:
    """The backend or step shape ``MODULE:ATTR`` names: a backend value (``leaf(...)``, a
    composition), a step shape, or a function with no required argument returning one (called
    here). The module is imported from the current folder too, as ``python -m`` would.
    ``ValueError`` says what is wrong.

    >>> str(load_spec("readfence.backends:paged"))
    'paged'
    >>> load_spec("readfence.backends:MODES")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: readfence.backends:MODES is a tuple, not a backend: name a backend value (leaf(...), a
    composition), a step shape, or a function with no required argument returning one
    """
    import inspect

    from readfence.backends import Backend
    from readfence.engine import EngineBackend
    from readfence.engine.internal import load_attribute
    from readfence.graph import StepShape

    with importable_here():
        value, name = load_attribute(text, option=option, takes="MODULE:ATTR", example="mypkg.backends:mine",
                                     listed=("backends", lambda v: isinstance(v, (Backend, StepShape))))
    if not isinstance(value, (Backend, StepShape)) and callable(value) and not isinstance(value, type):
        try:
            required = [p for p in inspect.signature(value).parameters.values()
                        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            required = []
        if required:
            raise ValueError(f"{name} takes {len(required)} required argument(s) "
                             f"({', '.join(p.name for p in required)}): name a backend, or a function with no required "
                             f"argument returning one")
        try:
            value = value()
        except Exception as e:
            raise ValueError(f"{name}() raised {type(e).__name__}: {e}") from e
        name += "()"
    if isinstance(value, EngineBackend):
        raise ValueError(f"{name} is an adapted engine backend (bound to the state it was built over): audit or "
                         f"verify it with --engine {shell_word(text)}")
    if not isinstance(value, (Backend, StepShape)):
        kind = type(value).__name__
        raise ValueError(f"{name} is {'an' if kind[:1] in 'aeiouAEIOU' else 'a'} {kind}, not a backend: name a backend "
                         f"value (leaf(...), a composition), a step shape, or a function with no required argument "
                         f"returning one")
    return value


def check_spec_names(text: str) -> None:
    """Refuse a spec that calls a name no reference leaf, combinator or step shape has, as the
    parser words it (``position N: unknown backend ...``), without importing torch; anything else
    is left to the parser.

    >>> check_spec_names("tbo(paged, linear)")
    >>> check_spec_names("tbo(pagd)")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: position 4: unknown backend 'pagd' (did you mean 'paged'?); known leaves: deepseek_v4, ...
    """
    from readfence.effects.internal import SpecFault, called_names, tokenize, unknown_name

    try:
        tokens = tokenize(text)
    except SpecFault:
        return  # the parser says what is wrong, and where
    known = {*LEAF_NAMES, *COMBINATOR_NAMES, *STEP_SHAPE_NAMES}
    for token, depth in called_names(tokens):
        if token.text not in known:
            raise ValueError(f"position {token.pos}: " + unknown_name(
                token.text, depth=depth, leaves=LEAF_NAMES, combinators=COMBINATOR_NAMES, outer=STEP_SHAPE_NAMES,
                what="step shape"))


def parse_spec(text: str) -> Any:
    """The backend (or speculative step shape) a spec names; ``ValueError`` says what is wrong
    and where: ``position N: ...``, on one line, for every command that takes a spec.

    Step shapes (``eagle(TARGET, DRAFT)``, ``multi_eagle(TARGET, D1, D2...)``,
    ``ngram(TARGET)``) run several phases per step; anything else is a backend spec. Both are
    the one spec grammar (``readfence.graph.parse_target``). ``MODULE:ATTR`` names a backend
    of your own instead (:func:`load_spec`).

    >>> str(parse_spec("tbo( deepseek_v4 , paged )"))
    'tbo(deepseek_v4, paged)'
    >>> [p.name for p in parse_spec("ngram(deepseek_v4)").phases]
    ['target_verify']
    >>> parse_spec("tbo(")
    Traceback (most recent call last):
    ...
    ValueError: position 4: expected a backend name, found end of spec
    """
    from returns.pipeline import is_successful

    from readfence.graph import parse_target

    if is_reference(text):
        return load_spec(text)
    result = parse_target(text)
    if not is_successful(result):
        error = result.failure()
        raise ValueError(f"position {error.position}: {error.message}")
    return result.unwrap()


#: Where :class:`Spec` keeps the text a ``MODULE:ATTR`` spec was given as (a rank parses it again).
_GIVEN = "readfence.spec_reference"


def spec_text(spec: Any) -> str:
    """Text that :func:`parse_spec` turns back into ``spec`` in another process (a tensor-parallel
    rank): the ``MODULE:ATTR`` it was given as, else its spec.

    >>> from readfence.backends import paged
    >>> spec_text(paged())
    'paged'
    """
    ctx = click.get_current_context(silent=True)
    given = None if ctx is None else ctx.meta.get(_GIVEN)
    return given if given is not None else str(spec)


def check_shares(spec: Any, batch_size: int) -> None:
    """``InputError`` unless every forward stream of ``spec`` gets a request at ``batch_size`` (a
    ``per_stream`` group of ``m`` members needs ``m`` or more).

    >>> from readfence.backends import paged, per_stream
    >>> check_shares(per_stream(paged(), paged()), 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: per_stream(paged, paged) runs 2 forward streams, ... at least 2, got 1
    """
    from readfence.graph.steps.internal import check_shares as check
    from readfence.graph.steps.internal import members

    try:
        check(members(spec), batch_size, who=str(spec), name="--batch-size")
    except ValueError as e:
        raise InputError(str(e)) from None


class Spec(click.ParamType):
    """A backend spec such as ``hybrid_linear(trtllm_mha, linear)``, a step shape, or
    ``MODULE:ATTR`` naming a backend of your own (:func:`load_spec`)."""

    name = "spec"
    expects = ("a backend spec such as 'tbo(deepseek_v4, paged)', a step shape such as "
               "'eagle(paged, trtllm_mha)', or MODULE:ATTR naming a backend of your own")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        # parsed by ``resolve`` (the grammar lives with the backends); a name no backend has is
        # refused here, before torch is imported
        if isinstance(value, str) and not is_reference(value):
            try:
                check_spec_names(value)
            except ValueError as e:
                raise _fail(param, value, str(e)) from None
        return value

    def resolve(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The backend or step shape ``value`` names (``parse_spec``)."""
        if not isinstance(value, str):
            return value
        try:
            if is_reference(value):
                spec = load_spec(value, option=param_name(param) if param is not None else "SPEC")
                if ctx is not None:
                    ctx.meta[_GIVEN] = value
                return spec
            from readfence.core import BackendLike
            from readfence.core.internal import check_tree_depth

            spec = parse_spec(value)
            return check_tree_depth(spec, "the spec") if isinstance(spec, BackendLike) else spec
        except ValueError as e:
            raise _fail(param, value, str(e)) from None


class Mode(click.ParamType):
    """A forward mode name (case-insensitive), checked against :data:`MODE_NAMES`; ``resolve``
    gives the ``ForwardMode``. ``refused`` maps modes a command cannot take to the reason: they
    are left out of what the errors list as allowed.

    >>> Mode(refused={"idle": "its steps carry no tokens"}).convert("IDLE", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value 'IDLE': its steps carry no tokens; allowed: decode, target_verify, draft_extend, extend
    """

    name = "mode"

    def __init__(self, refused: dict[str, str] | None = None) -> None:
        self.refused = dict(refused or {})
        self.allowed = tuple(m for m in MODE_NAMES if m not in self.refused)
        self.expects = "a forward mode: " + ", ".join(self.allowed)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        key = value.strip().lower()
        allowed = ", ".join(self.allowed)
        if key in self.refused:
            raise _fail(param, value, f"{self.refused[key]}; allowed: {allowed}")
        if key not in MODE_NAMES:
            raise _fail(param, value, f"unknown forward mode{_close(key, self.allowed)}; allowed: {allowed}")
        return key

    def resolve(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The ``ForwardMode`` (a tuple of them for a repeated option)."""
        from readfence.core import ForwardMode

        if isinstance(value, tuple):
            return tuple(ForwardMode.parse(v) if isinstance(v, str) else v for v in value)
        return ForwardMode.parse(value) if isinstance(value, str) else value


class Policies(click.ParamType):
    """Fence policies as a comma list (``per_buffer,exact``) or ``all``; converts to a tuple of
    policy names in a fixed order, which ``resolve`` turns into ``Policy`` values. The option is
    repeatable: :func:`merge_policies` joins the uses.

    >>> Policies().convert("exact, coarse", None, None)
    ('coarse', 'exact')
    """

    name = "policy"
    expects = "coarse, joined, per_buffer, exact or all (a comma list, or the option repeated)"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[Any, ...]:
        if isinstance(value, tuple):
            return value
        chosen: set[str] = set()
        for part in value.split(","):
            name = part.strip().lower()
            if name == "all":
                chosen.update(POLICY_NAMES)
            elif name in POLICY_NAMES:
                chosen.add(name)
            else:
                allowed = ", ".join(POLICY_NAMES + ("all",))
                raise _fail(param, value, f"unknown policy {part.strip()!r}{_close(name, POLICY_NAMES)}; allowed: "
                                          f"{allowed} (a comma list, or the option repeated)")
        return tuple(p for p in POLICY_NAMES if p in chosen)

    def resolve(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[Any, ...]:
        """The ``Policy`` values, in the fixed order."""
        from readfence.graph import Policy

        return tuple(Policy.parse(p) if isinstance(p, str) else p for p in value)


def merge_policies(ctx: click.Context | None, param: click.Parameter | None, value: Any) -> tuple[Any, ...]:
    """The policies of every use of a repeated ``--policy``, in a fixed order (a click callback).

    >>> merge_policies(None, None, (("exact",), ("coarse", "exact")))
    ('coarse', 'exact')
    """
    chosen = {p for group in value for p in group}
    return tuple(p for p in POLICY_NAMES if p in chosen)




def refuse_mode_for_shape(spec: Any) -> None:
    """A ``--mode`` given with a step shape is refused: the shape's phases fix their own modes."""
    from readfence.graph import StepShape
    from readfence.graph.verification import phase_modes

    ctx = click.get_current_context()
    if isinstance(spec, StepShape) and ctx.get_parameter_source("mode") is not click.core.ParameterSource.DEFAULT:
        raise InputError(f"--mode does not apply to the step shape {str(spec)!r}: its phases fix their own modes "
                         f"({phase_modes(spec)}); leave --mode out")
