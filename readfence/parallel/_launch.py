"""Tensor-parallel ranks, launched with torch's own machinery and stopped together.

:func:`launch` runs ``job(rank, *args)`` on every rank of a tensor-parallel group:

* as ``torch.multiprocessing`` children of this process (``start_processes``, forked from a
  server that imported readfence once, or spawned). This process hosts the ranks'
  ``TCPStore`` on a port the system picks, as torchrun's agent does
  (``TORCHELASTIC_USE_AGENT_STORE``), so no port is guessed; each child gets this process's
  environment as it is at the launch (a forked child too) and torchrun's (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
* or, when this process is itself one rank started by ``torchrun`` (that environment is set),
  on this rank alone.

Either way a rank initialises the default process group through ``env://`` (gloo on CPU,
NCCL on CUDA) with a timeout on every collective, opens its device with a timeout on every
wait (:meth:`Rank.open_device`), and always destroys the group, whatever happens.

When a rank fails, the others cannot go on: they block in a collective the failed rank never
joins, which times out (or fails at once when the failed rank's connections close). Every rank
reports how it ended; a rank that has not reported within ``grace_s`` of the first failure is
terminated, and no process outlives :func:`launch`. The error names the ranks that failed
first-hand: those that started fewer collectives than the others (the process group's
sequence number says how many each started), else those whose error is not a collective's.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, TypeVarTuple

import attrs

from readfence.core import ModelConfig, TensorParallel
from readfence.effects import ReadfenceError
from readfence.graph import Device, DeviceTimeout, open_device

#: The environment torchrun gives each rank (``launch`` gives its children the same).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Default timeout of every collective (s): generous, since ranks that trace and lower their
#: steps drift apart by seconds on a loaded machine before their first collective meets.
COLLECTIVE_TIMEOUT_S = 60.0

_Ts = TypeVarTuple("_Ts")
_R = TypeVar("_R")


@attrs.frozen
class Rank:
    """What a rank's job is given: which rank it is, the model config of its shard
    (``cfg.tp``), and the timeouts it runs under.

    ``device`` is ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per local rank).
    """

    rank: int
    size: int
    local_rank: int
    device: str
    cfg: ModelConfig
    device_timeout_s: float
    collective_timeout_s: float

    @property
    def backend(self) -> str:
        """The process group's backend: ``gloo`` on CPU, ``nccl`` on CUDA."""
        return "nccl" if self.device == "cuda" else "gloo"

    def device_options(self) -> dict[str, float]:
        """Keywords for ``readfence.graph.open_device(self.device, ...)``: this rank's GPU and
        its wait timeout."""
        options: dict[str, float] = {"timeout": self.device_timeout_s}
        if self.device == "cuda":
            options["index"] = self.local_rank
        return options

    def open_device(self, **kwargs: Any) -> Device:
        """This rank's readfence device (close it, or use it as a context manager)."""
        return open_device(self.device, **{**self.device_options(), **kwargs})


@attrs.frozen
class RankFailure:
    """How one rank failed.

    ``kind``: ``"raised"`` (an error of its own), ``"stalled"`` (a wait for its device timed
    out), ``"collective"`` (a collective failed or timed out), ``"exited"`` (the process ended
    without reporting), ``"unfinished"`` (still running when it was terminated).
    ``collectives`` is how many collectives it had started (``None`` if unknown).
    """

    rank: int
    kind: str
    message: str
    collectives: int | None = None
    traceback: str = ""

    def __str__(self) -> str:
        started = "" if self.collectives is None else f" after {self.collectives} collective(s)"
        return f"rank {self.rank} {_KIND_TEXT[self.kind]}{started}: {self.message}"


_KIND_TEXT = {
    "raised": "raised an error",
    "stalled": "stalled (a wait for its device timed out)",
    "collective": "stopped in a collective",
    "exited": "exited without reporting",
    "unfinished": "did not finish and was terminated",
    "returned": "returned while the others were still in a collective",
}


class TensorParallelError(ReadfenceError, RuntimeError):
    """Ranks failed; every rank was stopped and its process group destroyed.

    ``failures``: every rank's :class:`RankFailure`, by rank; ``culprits``: the ranks that
    failed first-hand (see the module docstring); ``pids``: the ranks' process ids (all ended
    by the time this is raised; empty under torchrun).
    """

    def __init__(self, failures: Sequence[RankFailure], size: int, pids: Sequence[int] = ()) -> None:
        self.pids = tuple(pids)
        self.failures = {f.rank: f for f in sorted(failures, key=lambda f: f.rank)}
        self.culprits = culprits(list(self.failures.values()))
        first = "; ".join(str(self.failures[r]) for r in self.culprits)
        rest = [str(f) for r, f in self.failures.items() if r not in self.culprits]
        ranks = ", ".join(map(str, self.culprits))
        text = f"tensor-parallel run of {size} ranks failed on rank {ranks}: {first}"
        if rest:
            text += "; the other ranks stopped: " + "; ".join(rest)
        super().__init__(text)


def culprits(failures: Sequence[RankFailure]) -> tuple[int, ...]:
    """The ranks that failed first-hand: processes that never reported; else those that
    started fewer collectives than another rank (the others were left waiting in one); else
    those whose error is not a collective's; else all of them.

    >>> culprits([RankFailure(0, "collective", "timed out", 12), RankFailure(1, "stalled", "...", 11)])
    (1,)
    >>> culprits([RankFailure(0, "collective", "closed", 5), RankFailure(1, "raised", "boom", 5)])
    (1,)
    """
    silent = tuple(f.rank for f in failures if f.kind in ("exited", "unfinished"))
    if silent:
        return silent
    counts = [f.collectives for f in failures if f.collectives is not None]
    if len(counts) == len(failures) and len(set(counts)) > 1:
        return tuple(f.rank for f in failures if f.collectives == min(counts))
    own = tuple(f.rank for f in failures if f.kind != "collective")
    return own or tuple(f.rank for f in failures)


@attrs.frozen
class _Setup:
    size: int
    device: str
    cfg: ModelConfig
    device_timeout_s: float
    collective_timeout_s: float


@attrs.frozen
class _Outcome:
    rank: int
    value: Any = None
    failure: RankFailure | None = None
    collectives: int | None = None  # (a rank that returned: how many it started)


def _failures(outcomes: Sequence[_Outcome]) -> list[RankFailure]:
    """The failed ranks' reports, and where some stopped in a collective, each rank that returned
    having started fewer collectives than they did: the collective they waited in is one it never
    joined (a job that returns early on some ranks only), so it failed first-hand."""
    failures = [o.failure for o in outcomes if o.failure is not None]
    waited = [f.collectives for f in failures if f.kind == "collective" and f.collectives is not None]
    if not waited:
        return failures
    early = [RankFailure(o.rank, "returned", f"{type(o.value).__name__} {str(o.value)[:80]!r}", o.collectives)
             for o in outcomes if o.failure is None and o.collectives is not None and o.collectives < max(waited)]
    return failures + early


# -- one rank ------------------------------------------------------------------------------------
def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or getattr(e, "original", None) or e.__context__
    return out


#: What gloo's transport says when a peer's connection goes (a rank killed mid-collective): a
#: plain RuntimeError that names neither gloo nor a DistError.
_TRANSPORT_ERRORS = ("pair closure", "connection closed by peer", "connection reset by peer")


def _is_collective_error(e: BaseException) -> bool:
    import torch.distributed as dist

    text = str(e).lower()
    return isinstance(e, dist.DistError) or "gloo" in text or "nccl" in text or any(
        t in text for t in _TRANSPORT_ERRORS)


def _kind(exc: BaseException) -> str:
    chain = _chain(exc)
    if any(_is_collective_error(e) for e in chain):
        return "collective"
    if any(isinstance(e, DeviceTimeout) for e in chain):
        return "stalled"
    return "raised"


def _collectives_started() -> int | None:
    import torch.distributed as dist

    try:
        return int(dist.group.WORLD._get_sequence_number_for_group())  # type: ignore[union-attr]
    except Exception:  # an uninitialised group, or a backend without sequence numbers
        return None


def _threads_per_rank() -> int:
    # ranks share the machine's cores: torch's default pool per process would oversubscribe them
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, (os.cpu_count() or 1) // max(local, 1))


def _run_rank(job: Callable[..., Any], args: tuple[Any, ...], setup: _Setup) -> _Outcome:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.set_num_threads(_threads_per_rank())
    try:
        if size != setup.size:
            raise ValueError(f"this rank was started in a group of {size} ranks (WORLD_SIZE), but --tp is {setup.size}")
        if setup.device == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if setup.device == "cuda" else "gloo", init_method="env://", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=setup.collective_timeout_s))
        group = dist.group.WORLD.group_name  # type: ignore[union-attr]
        cfg = attrs.evolve(setup.cfg, tp=TensorParallel(size=size, rank=rank, group=group))
        ctx = Rank(rank, size, local_rank, setup.device, cfg, setup.device_timeout_s, setup.collective_timeout_s)
        value = job(ctx, *args)
        return _Outcome(rank, value=value, collectives=_collectives_started())
    except BaseException as exc:  # reported, not raised: the launcher decides who failed first-hand
        failure = RankFailure(rank, _kind(exc), f"{type(exc).__name__}: {exc}", _collectives_started(),
                              traceback.format_exc())
        return _Outcome(rank, failure=failure)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _child(index: int, env: Mapping[str, str], job: Callable[..., Any], args: tuple[Any, ...], setup: _Setup,
             results: Any) -> None:
    # a forkserver child starts with the environment of the first launch's server process: it
    # takes the launcher's as it is now, as a spawned rank would (a variable set, or removed, since)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    results.put(_run_rank(job, args, setup))


# -- the launcher ----------------------------------------------------------------------------------
def under_torchrun() -> bool:
    """Whether this process is one rank started by torchrun (or another env:// launcher)."""
    return all(os.environ.get(k) for k in TORCHRUN_ENV)


def resolve_device(device: str, size: int) -> str:
    """The device kind ``size`` ranks run on: ``cpu``, or ``cuda`` (one GPU per rank); ``auto``
    is CUDA when there are enough GPUs.

    >>> resolve_device("cpu", 2)
    'cpu'
    """
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= size else "cpu"
    if device == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"--tp {size} on cuda needs {size} GPUs (one per rank), found {torch.cuda.device_count()}")
    return device


def _collect(context: Any, results: Any, size: int, grace_s: float, deadline_s: float | None) -> list[_Outcome]:
    outcomes: dict[int, _Outcome] = {}
    start = time.monotonic()
    failed_at: float | None = None
    exited_at: dict[int, float] = {}
    while len(outcomes) < size:
        try:
            got = results.get(timeout=0.1)
            outcomes[got.rank] = got
            if got.failure is not None and failed_at is None:
                failed_at = time.monotonic()
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for i, p in enumerate(context.processes):
            if i not in outcomes and p.exitcode is not None:
                # its report, if any, is in the pipe before it exits: give the pipe a moment
                if now - exited_at.setdefault(i, now) > 2.0:
                    why = f"exit code {p.exitcode}" + (" without a result: the job ended its process itself "
                                                       "(os._exit), or its result could not be sent back (a job "
                                                       "must return something picklable)" if p.exitcode == 0 else "")
                    outcomes[i] = _Outcome(i, failure=RankFailure(i, "exited", why))
                    failed_at = failed_at or now
        overdue = (failed_at is not None and now - failed_at > grace_s) or (
            deadline_s is not None and now - start > deadline_s)
        if overdue:
            why = (f"still running {grace_s:g} s after another rank failed" if failed_at is not None and
                   now - failed_at > grace_s else f"still running after the launch's deadline of {deadline_s:g} s")
            for i in range(size):
                outcomes.setdefault(i, _Outcome(i, failure=RankFailure(i, "unfinished", why)))
    return [outcomes[i] for i in range(size)]


def _reap(context: Any, hung: Iterable[int] = (), ending_s: float = 5.0) -> None:
    """End every child: terminate the ``hung`` ranks, give the others ``ending_s`` together to
    exit (a rank that reported is exiting), then terminate, then kill what is left."""
    for i in hung:
        context.processes[i].terminate()
    deadline = time.monotonic() + ending_s
    for p in context.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in context.processes:
        if p.is_alive():
            p.terminate()
    for p in context.processes:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)


def launch(
    job: Callable[[Rank, *_Ts], _R],
    *args: *_Ts,
    tp: int,
    device: str = "cpu",
    cfg: ModelConfig | None = None,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    device_timeout_s: float | None = None,
    grace_s: float | None = None,
    deadline_s: float | None = None,
    start_method: str = "forkserver",
) -> dict[int, _R]:
    """Run ``job(rank, *args)`` on each of ``tp`` tensor-parallel ranks; their results by rank.

    ``job`` is a module-level function (it is pickled into each rank) that gets a :class:`Rank`
    (``rank.cfg`` is ``cfg`` sharded for that rank: pass it to ``run_serial``,
    ``run_overlapped``, ``verify``, ...; ``rank.open_device()`` is its device) and returns
    something picklable. Under torchrun (see :func:`under_torchrun`) only this process's rank
    runs, and the dict holds its result alone.

    ``device``: ``cpu`` (gloo), ``cuda`` (NCCL, a GPU per rank) or ``auto``. Every collective
    times out after ``collective_timeout_s``, every device wait after ``device_timeout_s``
    (default: the collective timeout plus 30 s). A rank that has not ended ``grace_s`` after
    another failed (default: the device timeout plus 30 s), or when ``deadline_s`` has passed,
    is terminated. Raises :class:`TensorParallelError` naming the failed ranks.

    ``start_method``: ``forkserver`` (ranks fork from a server process that imported readfence
    once, so later launches from the same process start in a fraction of the time; the server
    lives as long as this process) or ``spawn`` (each rank a fresh interpreter).

    >>> from readfence.parallel._launch import Rank
    >>> def heads(rank: Rank) -> int:   # (a job must be importable by its ranks: define it in a module)
    ...     return rank.cfg.local_heads
    """
    from readfence.core.internal import model_config, positive_int, positive_seconds

    positive_int("tp", tp)
    cfg = model_config(cfg)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a readfence.core.ModelConfig, got {cfg!r}")
    for what, total in (("heads", cfg.heads), ("mlp", cfg.mlp)):
        if total % tp:
            raise ValueError(f"tp={tp} cannot shard the model: it has {what}={total}, which {tp} ranks must "
                             f"divide evenly (allowed: {', '.join(map(str, tp_sizes(cfg)))})")
    collective_timeout_s = positive_seconds("collective_timeout_s", collective_timeout_s)
    device_timeout_s = positive_seconds("device_timeout_s", collective_timeout_s + 30.0 if device_timeout_s is None
                                        else device_timeout_s)
    grace_s = device_timeout_s + 30.0 if grace_s is None else positive_seconds("grace_s", grace_s)
    if not callable(job):
        raise TypeError(f"job must be a function of the rank, got {job!r}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    setup = _Setup(tp, resolve_device(device, tp), cfg, device_timeout_s, collective_timeout_s)
    if under_torchrun():
        outcome = _run_rank(job, args, setup)
        if outcome.failure is not None:
            raise TensorParallelError([outcome.failure], tp)
        return {outcome.rank: outcome.value}
    return _start(job, args, setup, grace_s, deadline_s, start_method)


def tp_sizes(cfg: ModelConfig) -> list[int]:
    """The tensor-parallel sizes ``cfg`` can be sharded by: those that divide its heads and
    its MLP columns.

    >>> tp_sizes(ModelConfig())
    [1, 2]
    """
    return [d for d in range(1, cfg.heads + 1) if cfg.heads % d == 0 and cfg.mlp % d == 0]


def _start(job: Callable[..., Any], args: tuple[Any, ...], setup: _Setup, grace_s: float,
           deadline_s: float | None, start_method: str) -> dict[int, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # this process hosts the store the ranks rendezvous on, as torchrun's agent does
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=setup.collective_timeout_s))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(setup.size),
           "LOCAL_WORLD_SIZE": str(setup.size), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if start_method == "forkserver":  # (effective when this process starts its fork server)
        mp.set_forkserver_preload(["readfence.parallel._launch"])
    results = mp.get_context(start_method).Queue()
    context = mp.start_processes(_child, args=(env, job, args, setup, results), nprocs=setup.size, join=False,
                                 start_method=start_method)
    outcomes: list[_Outcome] = []
    try:
        outcomes = _collect(context, results, setup.size, grace_s, deadline_s)
    finally:
        _reap(context, [o.rank for o in outcomes if o.failure is not None and o.failure.kind == "unfinished"])
        results.close()
        del store
    failures = _failures(outcomes)
    if failures:
        raise TensorParallelError(failures, setup.size, context.pids())
    return {o.rank: o.value for o in outcomes}
