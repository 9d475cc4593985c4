"""One live state that a test runs several loops on, each given the state's fresh values.

An engine's graphs (every batch size, every policy tried) share one live state; lowering a
backend again on the state it was lowered on reuses what readfence knows of its program there
(the binding, the validation, the compiled code, the ledger) instead of redoing it on new
memory. Giving the state back its fresh values before each run keeps each run's outputs those
of a run on a fresh state, so they are still compared with a serial run's.
"""

from __future__ import annotations

from torch import Tensor

from readfence.core import ModelConfig
from readfence.graph import make_state
from readfence.graph.lowering.internal import restore, snapshot


class LiveState:
    """A live state (``make_state(cfg)``) and its fresh values.

    >>> live = LiveState(ModelConfig(layers=1, max_reqs=4, max_ctx=16))
    >>> live.state["shared"]["seq_lens"].fill_(7)[0].item(), live.fresh()["shared"]["seq_lens"][0].item()
    (7, 0)
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.state = make_state(cfg)
        self._values = snapshot(self.state)

    def fresh(self) -> dict[str, dict[str, Tensor]]:
        """The state, every tensor given back its fresh values (in place: the same memory)."""
        restore(self.state, self._values)
        return self.state
