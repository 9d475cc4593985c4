"""Observing an adapted backend on the state it is bound to, over real scheduler steps.

An engine object reads the state it was built over through references it keeps, so it is
observed there (not on a fresh example): a seeded :class:`~readfence.graph.Scheduler` writes
each step's shared buffers into the bound state, and the step runs eagerly under the runtime
read observer (``readfence.core.observe``'s), at each batch size. The state is put back
afterwards. Like any observation it covers only the paths those steps took.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from readfence.core import SHARED_BUFFERS, ForwardMode, Observation, step_functions
from readfence.core.internal import check_forward_mode, observe_step, positive_int
from readfence.graph import Scheduler
from readfence.graph.lowering.internal import preserved

from ._adapter import EngineBackend, check_engine


def observe_engine(engine: EngineBackend, mode: ForwardMode, *, batch_sizes: Sequence[int] = (2,), steps: int = 2,
                   seed: int = 0) -> Observation:
    """What ``engine``'s step touches of the shared buffers, observed op by op on its own state.

    ``steps`` scheduler steps (request churn, seeded by ``seed``) at each of ``batch_sizes``.

    >>> from readfence.engine.reference import minimax_sparse_engine
    >>> obs = observe_engine(minimax_sparse_engine(), ForwardMode.DECODE, steps=1)
    >>> obs.observed()["req_to_token"], obs.last_reader("req_to_token")
    (<ReadEnd.POST_REPLAY: 3>, ('body', 'aten.index_select.default'))
    """
    engine = check_engine(engine)
    mode = check_forward_mode(mode, "observe")
    positive_int("steps", steps)
    cfg, state = engine.cfg, engine.state
    sizes = tuple(dict.fromkeys(positive_int("batch_size", n, at_most=cfg.max_reqs, limit="cfg.max_reqs")
                                for n in batch_sizes))
    if not sizes:
        raise ValueError("batch_sizes must name at least one batch size")

    fns = step_functions(engine, mode, cfg)
    accesses: list[Any] = []
    step = 0
    with preserved(state):
        for size in sizes:
            scheduler = Scheduler(cfg, mode, size, seed=seed)
            for _ in range(steps):
                nxt = scheduler.next_step()
                for b in SHARED_BUFFERS:
                    state["shared"][b].copy_(nxt.shared[b])
                inputs = {"shared": state["shared"], "batch": nxt.batch, "pools": state["pools"],
                          "params": state["params"]}
                accesses += observe_step(fns, inputs, step=step)
                step += 1
    return Observation(engine.name, mode, SHARED_BUFFERS, tuple(accesses), steps, sizes)
