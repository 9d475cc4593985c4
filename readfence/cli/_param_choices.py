"""The option types that pick one of a fixed list: a name among choices, and a device kind (checked
against this machine when resolved).

>>> OneOf(("ascii", "markdown"), "format").convert("Markdown", None, None)
'markdown'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ._param_base import DEVICE_KINDS, _fail

if TYPE_CHECKING:
    from readfence.effects import Capabilities


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
