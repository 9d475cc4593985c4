"""The decode loop's reference: :func:`run_serial`, eager ``run_step`` on the host, every write
before every read, no overlap. It takes the loop's own :class:`LoopOptions`, so that a loop and
its reference run one workload."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import Tensor

from readfence.core import SHARED_BUFFERS, ForwardMode, ModelConfig
from readfence.core.internal import model_config, positive_int

from ..devices import Device
from ..devices.internal import check_device
from ..lowering import make_state, torch_device
from ..lowering.internal import check_live_state, device_of, names_keywords
from ..steps.internal import Target, check_run, eager_step, scheduling_mode
from ._loop import synthetic_work
from ._options import LoopOptions, options_of
from ._result import LoopResult
from ._scheduler import Scheduler


@names_keywords(options=LoopOptions)
def run_serial(
    backend: Target,
    mode: ForwardMode = ForwardMode.DECODE,
    *,
    steps: int,
    batch_size: int = 4,
    cfg: ModelConfig | None = None,
    state: Mapping[str, dict[str, Tensor]] | None = None,
    device: Device | str | None = None,
    options: LoopOptions | None = None,
) -> LoopResult:
    """The reference: eager ``run_step``, one step after another; writes always precede reads.

    ``device`` (a readfence ``Device`` or a torch device kind) is where the reference runs:
    the device of the run it is compared with, since float results differ between devices and
    logits on two devices do not compare. ``state`` (``shared``, ``pools``, ``params``) is the
    state to run on, fresh by default; pass one for a backend that holds references to it
    (the reference then runs where the state lives).

    ``options`` (a :class:`LoopOptions`: the loop's own record) gives the workload: the
    scheduler's ``seed`` and ``finish_prob``, and ``write_cost`` / ``write_wait_s``, the
    synthetic page-table work of ``decode_loop`` added to each step (a matmul, or a wait that uses
    no compute and overlaps nothing), so that the reference is also the baseline *without
    overlap* of a loop given the same work: its ``steps_per_s`` is 1 / the median time between
    two steps' ends, as for the loop. ``options.progress(i)`` is called after step ``i``; the
    record's other fields are the overlapped loop's.

    >>> from readfence.backends import paged
    >>> run_serial(paged(), steps=3, batch_size=2).steps
    3
    """
    check_run(backend, mode)
    positive_int("steps", steps)
    opts = options_of(options, LoopOptions, "run_serial")
    if device is not None and not isinstance(device, str):
        check_device(device)
    elif isinstance(device, str) and device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be a readfence device object or a torch device kind ('cpu', 'cuda'), "
                         f"got {device!r}")
    cfg = model_config(cfg)
    if state is not None:
        check_live_state(state, cfg)
    if device is None:
        where = "cpu" if state is None else device_of(state["shared"]).type
    else:
        where = torch_device(device)
    state = make_state(cfg, where) if state is None else state
    if device_of(state["shared"]).type != where:
        raise ValueError(f"run_serial on {where!r} was given a state on {device_of(state['shared'])}")
    sched = Scheduler(cfg, scheduling_mode(backend, mode), batch_size, seed=opts.seed, finish_prob=opts.finish_prob)
    work = synthetic_work(where, write_cost=opts.write_cost, write_wait_s=opts.write_wait_s)
    t0 = time.perf_counter()
    logits, ends = [], []
    for i in range(steps):
        nxt = sched.next_step()
        if work is not None:
            work()
        for b in SHARED_BUFFERS:
            state["shared"][b].copy_(nxt.shared[b])
        batch = nxt.batch if where == "cpu" else {k: v.to(where) for k, v in nxt.batch.items()}
        logits.append(eager_step(backend, mode, cfg, state, batch))
        ends.append(time.perf_counter())
        if opts.progress is not None:
            opts.progress(i)
    if where == "cuda":  # eager CUDA work is asynchronous: the steps ended when the device is done
        torch.cuda.synchronize()
    intervals = tuple(b - a for a, b in zip(ends, ends[1:])) if where == "cpu" else ()
    return LoopResult(None, logits, time.perf_counter() - t0, intervals=intervals)
