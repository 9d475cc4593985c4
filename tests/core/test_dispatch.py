"""readfence's dispatch modes keep dynamo out of their handlers without importing it."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from readfence.core.tracing._dispatch import DispatchMode


def _doubling(base: type) -> type:
    class Doubling(base):  # type: ignore[misc, valid-type]
        # every op becomes x * y: what a handler returns is what the caller sees
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return base._should_skip_dynamo() if base is DispatchMode else False

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            return torch.ops.aten.mul.Tensor(args[0], args[1])

    return Doubling


@pytest.mark.parametrize("protected", [True, False], ids=["readfence", "unprotected"])
def test_a_handler_run_from_a_compiled_region_is_not_compiled(protected: bool) -> None:
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.full((5,), 3.0)
    with _doubling(DispatchMode if protected else TorchDispatchMode)():
        out = torch.compile(torch.add, backend=backend)(x, x)
    assert torch.equal(out, torch.full((5,), 9.0))  # the handler ran, as it is
    # a mode without the protection has its handler compiled: the check can see it
    assert (len(graphs) == 0) is protected, graphs


def test_an_audit_imports_no_dynamo() -> None:
    # a fresh process, so that nothing the suite imported counts; the smallest model runs every
    # stage and check of an audit all the same
    code = ("import sys, torch\n"
            "torch.set_num_threads(1)\n"
            "from readfence.backends import paged\n"
            "from readfence.core import ForwardMode, ModelConfig, audit\n"
            "cfg = ModelConfig(layers=1, max_reqs=8, max_ctx=16)\n"
            "assert audit(paged(), ForwardMode.DECODE, cfg=cfg).unwrap()\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
