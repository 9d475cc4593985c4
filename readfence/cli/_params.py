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
import math
import os
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

from ._errors import InputError, param_name

if TYPE_CHECKING:
    from readfence.effects import Capabilities

# What the options are checked against before torch is imported; a test keeps each equal to
# the library's own (``ForwardMode``, ``Policy``, ``DEVICE_KINDS``, ``ModelConfig()``, ``tp_sizes``).
MODE_NAMES = ("decode", "target_verify", "draft_extend", "extend", "idle")
POLICY_NAMES = ("coarse", "joined", "per_buffer", "exact")
DEVICE_KINDS = ("auto", "cpu", "cuda")
LEAF_NAMES = ("deepseek_v4", "dense", "linear", "paged", "sparse", "trtllm_mha")  # the reference leaves
COMBINATOR_NAMES = ("hybrid", "hybrid_linear", "join", "minimax", "per_stream", "select", "tbo")
STEP_SHAPE_NAMES = ("eagle", "multi_eagle", "ngram")
MAX_BATCH = 16  # ModelConfig().max_reqs: the requests the tiny model serves
TINY_HEADS, TINY_MLP = 2, 64  # ModelConfig().heads, .mlp: what a tensor-parallel size must divide
TP_SIZES = tuple(d for d in range(1, TINY_HEADS + 1) if TINY_HEADS % d == 0 and TINY_MLP % d == 0)

#: The demo's backend: a composition whose buffers end at different stages: trtllm_mha snapshots
#: its page-table metadata out of graph (PRE_REPLAY), linear reads its state-slot map in graph
#: (IN_REPLAY).
DEFAULT_SPEC = "hybrid_linear(trtllm_mha, linear)"

#: Longest value an error message repeats in full; past it, its start and its length.
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``value`` as an error message shows it: its ``repr``, cut short when long.

    >>> shown("   "), shown("x" * 1000)
    ("'   '", "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (1000 characters)")
    """
    text = repr(value)
    if isinstance(value, str) and len(text) > SHOWN_CHARS:
        return f"{value[:60]!r}... ({len(value)} characters)"
    return text


def shell_word(text: str) -> str:
    """``text`` as one word of a shell command line, quoted only where a shell would change it
    (what a printed command puts around a value, so that it runs as pasted).

    >>> print(shell_word("paged"), shell_word("tbo(deepseek_v4, paged)"), shell_word("m:ENGINES['triton']"))
    paged 'tbo(deepseek_v4, paged)' "m:ENGINES['triton']"
    """
    import shlex

    if re.fullmatch(r"[\w@%+=:,./-]+", text):
        return text
    if "'" in text and not re.search(r'["$`\\!]', text):
        return f'"{text}"'
    return shlex.quote(text)


def _close(name: str, names: Sequence[str]) -> str:
    """`` (did you mean x?)`` for the closest of ``names`` (a ``-`` read as ``_``), else ``""``.

    >>> _close("per-buffer", POLICY_NAMES), _close("fastest", POLICY_NAMES)
    (' (did you mean per_buffer?)', '')
    """
    import difflib

    close = difflib.get_close_matches(name.replace("-", "_"), list(names), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _fail(param: click.Parameter | None, value: object, why: str) -> InputError:
    return InputError(f"invalid {param_name(param)} {shown(value)}: {why}")


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
    from readfence.effects.internal import _Fail, called_names, tokenize, unknown_name

    try:
        tokens = tokenize(text)
    except _Fail:
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
            return parse_spec(value)
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


class Positive(click.ParamType):
    """A positive integer, at most ``at_most`` (what can still be useful: a step count past it
    would run for hours, not show more); ``bound`` says where the bound comes from.

    >>> Positive(at_most=10).convert("11", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '11': must be at most 10
    >>> BATCH_SIZE.convert("17", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '17': must be at most 16 (the tiny model serves at most 16 requests)
    """

    name = "N"

    def __init__(self, at_most: int | None = None, bound: str = "") -> None:
        self.at_most, self.bound = at_most, bound
        self.expects = "a positive integer" + ("" if at_most is None else f" up to {at_most}")

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip()
        if not (isinstance(value, int) and not isinstance(value, bool)) and not re.fullmatch(r"\+?[0-9]+", text):
            raise _fail(param, value, "must be a positive integer (1, 2, 3, ...)")
        number = int(text)
        if number <= 0:
            raise _fail(param, value, "must be a positive integer (1, 2, 3, ...)")
        if self.at_most is not None and number > self.at_most:
            raise _fail(param, value, f"must be at most {self.at_most}" + (f" ({self.bound})" if self.bound else ""))
        return number


MAX_STEPS = 100_000  # steps per run of a command: minutes on a CPU device, more shows nothing new


#: The type of ``--batch-size``: requests per step, at most what the tiny model serves.
BATCH_SIZE = Positive(at_most=MAX_BATCH, bound=f"the tiny model serves at most {MAX_BATCH} requests")


class Integer(click.ParamType):
    """Any integer (a seed).

    >>> Integer().convert(" -3 ", None, None)
    -3
    """

    name = "INTEGER"
    expects = "an integer"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip()
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise _fail(param, value, "must be an integer (..., -1, 0, 1, ...)")
        return int(text)


class Amount(click.ParamType):
    """A finite number in ``0..at_most`` (an ``int`` when ``integer``): a cost or a duration.

    >>> Amount(100.0).convert("2.5", None, None)
    2.5
    >>> Amount(100.0).convert("nan", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value 'nan': must be a number from 0 to 100
    """

    def __init__(self, at_most: float, *, integer: bool = False, unit: str = "") -> None:
        self.at_most, self.integer, self.unit = at_most, integer, unit
        self.name = "N" if integer else "X"
        self.expects = f"{'an integer' if integer else 'a number'} from 0 to {at_most:g}{unit}"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float | int:
        text = str(value).strip()
        try:
            number: float | int = int(text) if self.integer and re.fullmatch(r"[+-]?[0-9]+", text) else float(text)
        except ValueError:
            number = math.nan
        if self.integer and not isinstance(number, int):
            raise _fail(param, value, f"must be {self.expects}")
        if not (math.isfinite(number) and 0 <= number <= self.at_most):
            raise _fail(param, value, f"must be {self.expects}")
        return number


class Rate(click.ParamType):
    """A positive finite number up to ``at_most`` (requests per step of a serving loop).

    >>> Rate(16.0).convert("0.5", None, None)
    0.5
    >>> Rate(16.0).convert("0", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '0': must be a number above 0 and at most 16 (requests per step)
    """

    name = "R"

    def __init__(self, at_most: float) -> None:
        self.at_most = at_most
        self.expects = f"a number above 0 and at most {at_most:g} (requests per step)"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            number = float(str(value).strip())
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and 0 < number <= self.at_most):
            raise _fail(param, value, f"must be {self.expects}")
        return number


class Sizes(click.ParamType):
    """A comma list of batch sizes, each in ``1..MAX_BATCH``; converts to a sorted tuple.

    >>> Sizes().convert("8, 1,2,4", None, None)
    (1, 2, 4, 8)
    >>> Sizes().convert("1,x", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value '1,x': 'x' is not a batch size: give a comma list of integers from 1 to 16, e.g. 1,2,4,8,16
    """

    name = "SIZES"
    expects = f"a comma list of batch sizes from 1 to {MAX_BATCH}, e.g. 1,2,4,8,16"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        sizes = set()
        for part in str(value).split(","):
            text = part.strip()
            if not re.fullmatch(r"\+?[0-9]+", text) or not 1 <= int(text) <= MAX_BATCH:
                raise _fail(param, value, f"{text!r} is not a batch size: give a comma list of integers from 1 to "
                                          f"{MAX_BATCH}, e.g. 1,2,4,8,16")
            sizes.add(int(text))
        return tuple(sorted(sizes))


class OutputFile(click.ParamType):
    """A file to write, with ``suffix``: refused before anything runs when it cannot be written
    (a wrong suffix, a missing folder, something that is not a regular file, a place the user
    may not write). Nothing is left behind by the check.

    >>> OutputFile(".png").convert("timeline.txt", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value 'timeline.txt': the file name must end in .png
    """

    name = "FILE"

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.expects = f"a file name ending in {suffix}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> pathlib.Path:
        if isinstance(value, pathlib.Path):
            return value
        path = pathlib.Path(value)
        if path.suffix.lower() != self.suffix or not path.stem:
            raise _fail(param, value, f"the file name must end in {self.suffix}")
        folder = path.parent
        if not folder.is_dir():
            # a file where a folder should be is not a missing folder: say which it is
            if folder.exists():
                raise _fail(param, value, f"{str(folder)!r} is not a directory (it is a file)")
            raise _fail(param, value, f"directory {str(folder)!r} does not exist")
        if path.is_dir():
            raise _fail(param, value, f"{str(path)!r} is a directory; give a file name ending in {self.suffix}")
        if path.exists() and not path.is_file():
            raise _fail(param, value, "not a regular file")
        existed = path.exists()
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            raise _fail(param, value, f"cannot write there ({e.strerror})") from None
        if not existed:
            path.unlink()  # only checking: a run that fails leaves nothing behind
        return path


class OneOf(click.ParamType):
    """One of a fixed list of names (case-insensitive), ``what`` they are named in the error.

    >>> OneOf(("overlap", "check"), "benchmark").convert("Overlap", None, None)
    'overlap'
    >>> OneOf(("overlap", "check"), "benchmark").convert("overlay", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value 'overlay': unknown benchmark; allowed: overlap, check
    """

    name = "NAME"

    def __init__(self, choices: tuple[str, ...], what: str) -> None:
        self.choices, self.what = choices, what
        self.expects = f"a {what}: {', '.join(choices)}"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        key = str(value).strip().lower()
        if key not in self.choices:
            raise _fail(param, value, f"unknown {self.what}; allowed: {', '.join(self.choices)}")
        return key


class DeviceName(click.ParamType):
    """``auto``, ``cpu`` or ``cuda``; ``cuda`` must be available and pass the start-up self-check
    (``auto`` falls back to the CPU device with a one-line notice when it does not)."""

    name = "device"
    choices = DEVICE_KINDS
    expects = "auto, cpu or cuda"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        key = str(value).strip().lower()
        if key not in self.choices:
            raise _fail(param, value, f"unknown device; allowed: {', '.join(self.choices)}")
        return key

    def resolve(self, key: str, param: click.Parameter | None, ctx: click.Context | None) -> str:
        """``key``, once CUDA, when asked for, is there and passes its self-check."""
        if key == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise _fail(param, key, "CUDA is not available here (torch.cuda.is_available() "
                                        "is False); allowed: auto, cpu")

            from readfence.graph.devices.internal import self_check_error

            error = self_check_error()
            if error is not None:
                raise _fail(param, key, f"{error}; allowed: auto (falls back to cpu), cpu")
        return key


def device_caps(name: str) -> tuple[str, Capabilities]:
    """``(device name, Capabilities)`` of the device ``name`` would open, closing it again."""
    from readfence.graph import open_device

    dev = open_device(name)
    try:
        return dev.name, dev.caps
    finally:
        dev.close()


JSON_SCHEMA_VERSION = 1  # bumped when a --json key changes meaning or goes away (new keys do not)


def echo_json(doc: object) -> None:
    """Print a ``--json`` document: every object in it (one, or a list of them) carries
    ``schema_version``.

    >>> echo_json([{"policy": "EXACT"}])
    [
      {
        "schema_version": 1,
        "policy": "EXACT"
      }
    ]
    """
    import json

    def versioned(obj: Any) -> Any:
        return {"schema_version": JSON_SCHEMA_VERSION, **obj} if isinstance(obj, dict) else obj

    click.echo(json.dumps([versioned(o) for o in doc] if isinstance(doc, list) else versioned(doc), indent=2))


def refuse_mode_for_shape(spec: Any) -> None:
    """A ``--mode`` given with a step shape is refused: the shape's phases fix their own modes."""
    from readfence.graph import StepShape
    from readfence.graph.verification import phase_modes

    ctx = click.get_current_context()
    if isinstance(spec, StepShape) and ctx.get_parameter_source("mode") is not click.core.ParameterSource.DEFAULT:
        raise InputError(f"--mode does not apply to the step shape {str(spec)!r}: its phases fix their own modes "
                         f"({phase_modes(spec)}); leave --mode out")
