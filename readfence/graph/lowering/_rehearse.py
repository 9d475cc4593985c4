"""Lowering pass: rehearse the traced step once, eagerly, before anything is captured.

The rehearsal runs the bound program on a throwaway example (:func:`readfence.core.run_program`
under the runtime read observer) on the lowered stream, as a run of the program's ledger
(``core.internal.Ledger``). It gives:

* the shapes of the out-of-graph stage's outputs, for the graph's static metadata buffers;
* what each node really read (the example's buffers, or the live ones a stage keeps a
  reference to), recorded in the ledger: the verdict, the fences and the sanitizer read it there;
* a first run of every kernel before any capture, as ``torch.cuda.graph`` asks (lazy library
  and allocator set-up must not happen inside a capture);
* a second step's outputs for the stages that run their Python: the example differs from the
  traced one (another seed), so a Python value or a metadata shape computed from the step's
  data is refused here, naming stage and key (``StageOutputError``), not found at run time.

The live state is not touched.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

from readfence.core import PREPARE_OUT_GRAPH, ForwardMode, Program, StageOutputError, StageThreadError
from readfence.core.internal import Ledger, RunKind, as_static, as_words, example_step, flatten_inputs

from ..devices import DeviceError, Stream

#: The seed of the rehearsal's example: not the trace's (0), so that values computed from the
#: step's data differ between the two.
REHEARSAL_SEED = 1


@attrs.frozen
class Rehearsal:
    """What the rehearsal found beside its reads (which are the ledger's): zeroed static buffers
    shaped like the out-of-graph stage's outputs (``meta``, by name), on the live state's device."""

    meta: dict[str, Tensor]


def rehearse(program: Program, *, ledger: Ledger, mode: ForwardMode, stream: Stream, label: str) -> Rehearsal:
    """Run ``program`` once on an example step of the ledger's batch size on ``stream``, recording
    what it reads in ``ledger`` (a run of kind ``rehearsal``; see the module docstring), on the
    live state's device: a stage that keeps references to the live buffers reads those.

    A stage's own error (a thread it starts, an output it cannot return) is raised as it is,
    not as the device's.

    >>> from readfence.backends import paged
    >>> from readfence.core import ModelConfig, PREPARE_IN_GRAPH, trace
    >>> from readfence.core.internal import ledger_of
    >>> from readfence.graph import CpuDevice
    >>> cfg = ModelConfig()
    >>> program = trace(paged(), ForwardMode.DECODE, cfg=cfg)
    >>> ledger = ledger_of(program, cfg, 2)
    >>> with CpuDevice() as dev:
    ...     r = rehearse(program, ledger=ledger, mode=ForwardMode.DECODE, stream=dev.stream("forward"), label="demo")
    >>> sorted(r.meta), sorted(ledger.node_reads()[PREPARE_IN_GRAPH])
    ([], ['index_select', 'index_select_1'])
    """
    live = ledger.state["shared"] if ledger.state is not None else {}
    device = next(iter(live.values())).device if live else torch.device("cpu")
    example = example_step(ledger.cfg, mode, ledger.batch_size, seed=REHEARSAL_SEED, device=device)
    env = flatten_inputs(**example.groups())

    def run() -> None:
        ledger.observe_program(RunKind.REHEARSAL, "rehearsal", env, example.shared)

    stream.launch(run, label=f"{label}/rehearse")
    try:
        stream.synchronize()
    except DeviceError as e:  # the backend's own error, not the device's: name it as such
        if isinstance(e.__cause__, (StageThreadError, StageOutputError)):
            raise e.__cause__ from None
        raise
    if program.replayed:  # a step that is not replayed bakes no shape: its stages run their Python
        _check_shapes(program, env)
    # (a meta tensor, a shape without data, keeps a buffer without data: there is nothing to copy);
    # each laid out as the traced step's output, which the graph was traced reading (and validated on)
    traced = program.stage(PREPARE_OUT_GRAPH).graph.traced_outputs()
    meta = {k: as_static(torch.zeros_like(as_words(env[k]), device="meta" if env[k].is_meta else device
                                          ).view(env[k].dtype), traced[k])
            for k in traced}
    return Rehearsal(meta)


def _check_shapes(program: Program, env: Mapping[str, Tensor]) -> None:
    # the graphs after a stage were traced on its outputs' shapes: an op whose output shape
    # depends on the data (a boolean mask, ``nonzero``) gives another on another step
    for s in program.stages:
        graph = s.graph
        output = next(n for n in reversed(graph.gm.graph.nodes) if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        for name, node in zip(graph.outputs, values):
            traced = getattr(node, "meta", {}).get("val")
            if isinstance(traced, Tensor) and tuple(traced.shape) != tuple(env[name].shape):
                raise StageOutputError(
                    f"backend {program.backend!r} stage {s.stage} returned {name!r} of shape {tuple(traced.shape)} "
                    f"on the traced step and {tuple(env[name].shape)} on another (at {graph.source(node.name)}): a graph "
                    f"reads metadata of one shape per batch size; pad it to a fixed shape, as engines' graph runners do",
                    stage=s.stage.name)
