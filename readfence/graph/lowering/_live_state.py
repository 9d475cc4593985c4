"""The live state a step is lowered onto: made fresh, or checked (the groups a step runs on, its
shared buffers shaped for the model), and the torch device it lives on."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from readfence.core import ModelConfig, make_shared_state
from readfence.core.internal import STATE_PARTS, check_state, init_params, make_pools, shared_shapes

from ..devices import Device


def device_of(shared: Mapping[str, Tensor]) -> torch.device:
    """The torch device of the live shared buffers."""
    return next(iter(shared.values())).device


def torch_device(device: Device | str) -> str:
    """The torch device kind a readfence ``Device`` (or its name) runs on: ``cuda`` or ``cpu``."""
    name = device if isinstance(device, str) else device.name
    return "cuda" if name.startswith("cuda") else "cpu"


def make_state(cfg: ModelConfig, device: Device | str = "cpu") -> dict[str, dict[str, Tensor]]:
    """Fresh live tensors (shared buffers, pools, params) on ``device``'s torch device."""
    where = torch_device(device)
    return {
        "shared": make_shared_state(cfg, device=where),
        "pools": make_pools(cfg, device=where),
        "params": init_params(cfg, device=where),
    }


def check_live_state(state: object, cfg: ModelConfig) -> None:
    """``state`` holds what a step runs on (``shared``, ``pools``, ``params``), its shared buffers
    shaped for ``cfg``; else an error naming what is wrong (not a failure inside the first replay)."""
    check_state(state, required=STATE_PARTS)
    assert isinstance(state, Mapping)
    for name, (shape, dtype) in shared_shapes(cfg).items():
        t = state["shared"].get(name)
        if not isinstance(t, Tensor):  # every loop writes each one before every step
            got = "nothing" if name not in state["shared"] else f"{type(t).__name__} {t!r}"[:80]
            raise ValueError(f"state['shared'] must hold the shared buffer {name!r} as a tensor, got {got}: a step "
                             f"runs on all of {', '.join(map(repr, shared_shapes(cfg)))} (make_state(cfg) makes them)")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"state['shared'][{name!r}] has shape {tuple(t.shape)} ({t.dtype}) where cfg gives "
                             f"{shape} ({dtype}): pass the ModelConfig the state was made for (cfg={cfg})")


__all__ = ["check_live_state", "device_of", "make_state", "torch_device"]
