"""Opening a device by kind (``cpu``, ``cuda``, ``auto``), and checking that one was given.

The one module that knows both implementations: the protocol (``_protocol``) imports neither.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from readfence.effects import Capabilities

from . import _cuda
from ._cpu import CpuDevice
from ._protocol import Device

DEVICE_KINDS = ("auto", "cpu", "cuda")
"""What ``open_device`` (and ``--device``) accepts."""


def check_device(device: Any, name: str = "device") -> Device:
    """``device`` if it is a readfence device (streams, events, ``caps``); else a ``TypeError``
    naming ``name`` that says how to make one.

    >>> check_device("cpu")
    Traceback (most recent call last):
    ...
    TypeError: device must be a readfence device object such as CpuDevice() or open_device('cpu') (from readfence.graph), got 'cpu' (str)
    """
    if isinstance(getattr(device, "caps", None), Capabilities) and callable(getattr(device, "stream", None)):
        return device
    kind = f"{device.strip().lower()!r}" if isinstance(device, str) and device.strip().lower() in DEVICE_KINDS else "'cpu'"
    raise TypeError(f"{name} must be a readfence device object such as CpuDevice() or open_device({kind}) "
                    f"(from readfence.graph), got {device!r} ({type(device).__name__})")


def default_device(**kwargs: Any) -> Device:
    """``CudaDevice`` when ``torch.cuda.is_available()``, else ``CpuDevice`` (kwargs passed on).

    >>> import torch
    >>> dev = default_device()
    >>> dev.name.split(":")[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    True
    >>> dev.close()
    """
    return open_device("auto", **kwargs)


def open_device(kind: str = "auto", *, notice: Callable[[str], None] | None = None, **kwargs: Any) -> Device:
    """A fresh device of ``kind``: ``cpu``, ``cuda``, or ``auto`` (CUDA when available and it
    passes the start-up self-check, ``readfence.graph.devices._cuda.self_check``, run once per process).

    ``cuda`` raises the self-check's error; ``auto`` falls back to the CPU device and says so in
    one line to ``notice`` (default: standard error). Close the device, or use it as a context
    manager; kwargs go to the device's constructor.

    >>> with open_device("cpu", timeout=5) as dev:
    ...     dev.name, dev.timeout
    ('cpu', 5.0)
    >>> open_device("tpu")
    Traceback (most recent call last):
    ...
    ValueError: unknown device kind 'tpu'; allowed: auto, cpu, cuda
    """
    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device kind {kind!r}; allowed: {', '.join(DEVICE_KINDS)}")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        error = _cuda.self_check_error(kwargs.get("index", 0))
        if error is None:
            return _cuda.CudaDevice(**kwargs)
        if kind == "cuda":
            raise error
        message = " ".join(str(error).split())
        (notice or _stderr)(f"readfence: CUDA failed its start-up self-check, using the CPU device ({message})")
        kwargs.pop("index", None)
    return CpuDevice(**kwargs)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
