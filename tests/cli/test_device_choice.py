"""``--device``: ``auto`` takes CUDA only if it passes the start-up self-check, else falls back
to the CPU device with a one-line notice; ``cuda`` fails with the check's error. A CUDA machine
is simulated: ``torch.cuda.is_available`` says yes, the check is replaced by its verdict and the
CUDA device by a CPU device named ``cuda:0``."""

from __future__ import annotations

import pytest
import torch

from readfence.graph import CpuDevice, open_device
from readfence.graph.devices import _cuda

SPEC = "paged"


@pytest.fixture
def cuda_machine(monkeypatch):
    """``verdict(error_or_None)`` sets what the self-check finds; returns the calls it got."""
    calls = []

    def verdict(error):
        def check(index=0, **kwargs):
            calls.append(index)
            if error is not None:
                raise _cuda.SelfCheckFailed(error)

        monkeypatch.setattr(_cuda, "self_check", check)
        _cuda.self_check_error.cache_clear()
        return calls

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_cuda, "CudaDevice", lambda index=0, **kw: CpuDevice(name=f"cuda:{index}", **kw))
    yield verdict
    _cuda.self_check_error.cache_clear()


def test_auto_falls_back_to_cpu_with_one_line_notice_when_the_check_fails(cli, cuda_machine):
    calls = cuda_machine("side stream read [2.0, 3.0],\nexpected [1.0, 3.0]")
    result = cli("plan", SPEC, "--device", "auto")
    assert result.exit_code == 0, result.output
    notices = [line for line in result.stderr.splitlines() if "self-check" in line]
    assert len(notices) == 1 and "using the CPU device" in notices[0] and "[2.0, 3.0], expected" in notices[0]
    assert "device: cpu" in result.stdout
    assert calls == [0]  # once per process, however many devices are opened


def test_cuda_fails_with_the_checks_error(cli, cuda_machine):
    cuda_machine("side stream read [2.0, 3.0]")
    result = cli("plan", SPEC, "--device", "cuda")
    assert result.exit_code != 0
    assert "side stream read [2.0, 3.0]" in result.output
    with pytest.raises(_cuda.SelfCheckFailed, match=r"\[2\.0, 3\.0\]"):
        open_device("cuda")


def test_a_passing_check_keeps_cuda(cli, cuda_machine):
    cuda_machine(None)
    result = cli("plan", SPEC, "--device", "auto")
    assert result.exit_code == 0, result.output
    assert "device: cuda:0" in result.stdout and "self-check" not in result.stderr
    with open_device("cuda") as dev:
        assert dev.name == "cuda:0"
