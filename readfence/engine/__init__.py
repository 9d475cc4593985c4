"""Engines as they are: an engine's stateful attention backend object, audited, verified and run.

An engine's backend is an object (SGLang's contract): built from the model runner, it keeps the
live pools, leaves per-step metadata on ``self`` and declares one read end for all its shared
reads. The pipeline, in this layer's modules:

* ``adapt(factory)`` (``_adapter``): the object ``factory(runner)`` builds over a readfence state,
  lifted into a readfence backend (``_view``: the runner and forward batch it sees; ``_lift``:
  its per-step metadata between the stages; ``_contract``: what is asked of the class);
* ``audit_engine`` (``_audit``, ``_observe``): per node, mode and buffer, the scalar declaration
  against the truth, traced where the tracer follows the code and observed where it cannot
  (``Result[EngineAudit, EngineUnsound]``, as ``readfence.core.audit``);
* ``runner_model`` (``_runner``): the engine's own runner (one event from the scalar, a mailbox,
  a kill switch, prefill resolved per batch, its publish points) on readfence's loop;
* ``audit_runner`` and ``runner_step`` (``_publish``): where an engine's runners publish against
  where its phases' reads end, checked before anything runs, and run as one step;
* ``verify_engine`` and ``compare`` (``_check``): poison, guard and the read observer under every
  policy and the engine's runner (``Result[EngineVerification, EngineFindings]``, as
  ``readfence.graph.verify``); throughput side by side;
* ``readfence.engine.reference``: a CPU reference engine in SGLang's style.

>>> from readfence.core import ForwardMode
>>> from readfence.engine import adapt, audit_engine
>>> from readfence.engine.reference import TrtllmMhaBackend
>>> engine = adapt(TrtllmMhaBackend)
>>> engine.read_end(ForwardMode.DECODE)
<ReadEnd.PRE_REPLAY: 1>
>>> report = audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1).unwrap()
>>> [(r.buffer, r.truth.name, r.text()) for r in report.rows()][-1]
('state_slots', 'NONE', 'conservative +1')
"""

from ._adapter import EngineBackend, adapt
from ._audit import ENGINE_MODES, EngineAudit, EngineRow, EngineUnsound, NodeAudit, audit_engine
from ._check import (
    RUNNER,
    CompareRow,
    Comparison,
    EngineFindings,
    EngineVerification,
    VerifyRow,
    compare,
    verify_engine,
)
from ._contract import END_NAMES, ContractError, EngineError, EngineMode
from ._observe import observe_engine
from ._profile import EngineProfile
from ._publish import PublishRow, RunnerAudit, RunnerPhase, RunnerUnsound, audit_runner, runner_step
from ._runner import EngineRunner, Mailbox, RunnerModel, RunnerTarget, runner_model
from ._sglang import sglang_profile
from ._view import DEFAULT_LAYOUT, AttentionLayer, ForwardBatch, ModelRunnerView, ReqToTokenPool, StatePool, TokenToKVPool

__all__ = [
    "DEFAULT_LAYOUT",
    "END_NAMES",
    "ENGINE_MODES",
    "RUNNER",
    "AttentionLayer",
    "CompareRow",
    "Comparison",
    "ContractError",
    "EngineAudit",
    "EngineBackend",
    "EngineError",
    "EngineFindings",
    "EngineMode",
    "EngineProfile",
    "EngineRow",
    "EngineRunner",
    "EngineUnsound",
    "EngineVerification",
    "ForwardBatch",
    "Mailbox",
    "ModelRunnerView",
    "NodeAudit",
    "PublishRow",
    "ReqToTokenPool",
    "RunnerAudit",
    "RunnerModel",
    "RunnerPhase",
    "RunnerTarget",
    "RunnerUnsound",
    "StatePool",
    "TokenToKVPool",
    "VerifyRow",
    "adapt",
    "audit_engine",
    "audit_runner",
    "compare",
    "observe_engine",
    "runner_model",
    "runner_step",
    "sglang_profile",
    "verify_engine",
]
