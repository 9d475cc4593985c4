"""The graph layer, in pipeline order: each subpackage imports only those before it.

* ``devices``: the ``Device`` protocol, ``CpuDevice`` and ``CudaDevice``, opening one by kind,
  op items, errors, fault injection, timelines;
* ``lowering``: fence policies and plans, the FX pass that inserts event records, fences and
  event rings, the poison-on-release check state, ``lower``;
* ``steps``: steps of several graphs: speculative step shapes, per-stream groups, ``lower_step``;
* ``runtime``: the scheduler, the race sanitizer, the overlapped decode loop and its serial
  reference;
* ``verification``: ``verify`` (poison, guard and read observer against the serial run); the
  differential fuzzer that uses it is ``readfence.graph.fuzz``.

Each subpackage's ``__init__`` lists its public names; all of them are re-exported here.

>>> import readfence.graph as graph
>>> graph.CpuDevice is graph.devices.CpuDevice, graph.lower is graph.lowering.lower
(True, True)
"""

# in pipeline order, not alphabetical: each subpackage imports only those above it
# isort: off
from . import devices, lowering, steps, runtime, verification
from .devices import *
from .lowering import *
from .steps import *
from .runtime import *
from .verification import *
# isort: on

__all__ = [*devices.__all__, *lowering.__all__, *steps.__all__, *runtime.__all__, *verification.__all__]
