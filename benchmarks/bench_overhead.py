"""Overhead: host cost per step of ``Lowered.run`` plus the fence wait, against a hand loop.

Both loops enqueue exactly the same device work for one decode step on the same device and
stream, each on its own one of two identical lowerings (a fence's events belong to the graph
that records them), as one ``stream.batch()``: wait for the scheduler's event, copy the batch in, launch the
out-of-graph stage GraphModule, record the PRE_REPLAY events, replay the captured graph
(in-graph records included), record the POST_REPLAY events, copy the logits out (kept for the stream that writes them), record the
done event, and make the schedule stream wait on the fence (one wait on its latest event). The hand loop does it with
direct device calls; the other calls ``Lowered.run`` and ``fence.wait`` (shape checks, ring
slot, ``Fence`` and ``Bound`` objects).

Only host time is measured: the forward stream is held by a gate while the steps are
enqueued (so the two loops never compete with device work for the GIL), then released and
drained; the garbage collector is paused while timing (as ``timeit`` does). The two loops
alternate step by step, so the machine's drift hits both alike; a run's ratio compares their
median step times; the printed ratio is the median over runs.

It also measures what CpuDevice's machinery costs against running the same functions inline
on the host (``machinery``): microseconds per launch (a stream of launches drained by the
worker thread, and one launch waited for by the host: the handoff to an idle stream and
back), per record, per wait (on a fired event, and the handoff from a record on one stream
to a stream blocked waiting on it), and per graph replay (a captured graph shaped like a
lowered step's: two launches and an in-graph record). Each figure is the median over runs.

    python benchmarks/bench_overhead.py [--quick] [--json] [--device cpu|cuda|auto]

``main(quick=False)`` returns ``{"lowered_vs_hand": ratio, ...}`` (``readfence bench`` prints it).
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import statistics
import sys
import threading
import time
from typing import Any

import torch

from readfence.backends import hybrid_linear, linear, trtllm_mha
from readfence.core import PREPARE_OUT_GRAPH, SHARED_BUFFERS, ForwardMode
from readfence.effects import ReadEnd
from readfence.graph import DEVICE_KINDS, CpuDevice, LowerOptions, Policy, Scheduler, lower, open_device
from readfence.graph.lowering._issue import load_batch

MODE = ForwardMode.DECODE


def _hand_loop(low: Any, sched: Any, written: Any) -> Any:
    """One step of ``low`` issued by hand: the same launches, records and waits as ``run``,
    written as a careful user would: labels made once, the step's tensors taken when it is
    issued (a launch that read the caller's dict later, on the stream thread, would copy in
    whatever the scheduler put there for the next step), the logits kept for the stream that
    writes them (a no-op on CpuDevice, needed on CUDA), no shape check."""
    s = low.stream
    slot = low._slots[0]
    pre = [e for p, e in slot.events.items() if p.after is None and p.end is ReadEnd.PRE_REPLAY]
    post = [e for p, e in slot.events.items() if p.after is None and p.end is ReadEnd.POST_REPLAY]
    unknown = [e for p, e in slot.events.items() if p.after is None and p.end is ReadEnd.UNKNOWN]
    # as ``Fence.wait``: a step's events fire in order on one stream, so the latest covers all
    last = [e for p, e in slot.events.items() if p.waits][-1:]
    out_runner, out_ops = slot.stages[PREPARE_OUT_GRAPH]
    env, meta, static_batch, static_logits = low._env, low._meta, low._batch, low._logits
    graph = slot.graph
    take, static = operator.itemgetter(*static_batch), tuple(static_batch.values())
    l_load, l_out, l_outputs = (f"{low.label}/{name}" for name in ("load_batch", "prepare_out_graph", "outputs"))

    def prepare_out_graph() -> None:
        for k, v in out_runner.run(env).items():
            meta[k].copy_(v)

    def step(batch: dict, i: int) -> None:
        given = take(batch)  # this step's tensors, taken now: the caller refills its dict for the next
        with s.batch():
            s.wait(written)
            s.launch(load_batch, static, given, label=l_load, step=i)
            s.launch(prepare_out_graph, label=l_out, ops=out_ops, step=i)
            for e in pre:
                s.record(e)
            graph.replay(s, step=i)
            for e in post:
                s.record(e)
            logits = torch.empty_like(static_logits)
            s.launch(logits.copy_, static_logits, label=l_outputs, step=i)
            s.keep(logits)  # on CUDA the allocator would hand the logits' block out again while s writes it
            for e in unknown:
                s.record(e)
            s.record(slot.done)
        for e in last:
            sched.wait(e)

    return step


def _hold(dev: Any, stream: Any) -> Any:
    """Keep ``stream`` from running until the returned function is called.

    On CpuDevice the stream's worker thread would compete with the host for the GIL while
    steps are enqueued; a CUDA stream needs no GIL, so there is nothing to hold.
    """
    if not isinstance(dev, CpuDevice):
        return lambda: None
    gate = threading.Event()
    stream.launch(gate.wait, 30.0, label="gate")
    return gate.set


def _interleaved(dev: Any, low: Any, steps: dict[str, Any], batch: dict, n: int) -> dict[str, float]:
    """Median host nanoseconds per step of each loop, the loops alternating step by step.

    Steps are enqueued while the forward stream is held (see :func:`_hold`), then it is
    released and drained, untimed; on CUDA in chunks of 8 steps, so that the launch queue
    never fills.
    Alternating single steps pairs every sample of one loop with a neighbour of the other:
    the machine's drift (on a shared VM, per-step cost moves by 2x from one second to the
    next) hits both loops alike, and the median ignores preemptions. The garbage collector is
    paused while timing, as ``timeit`` does.
    """
    clock = time.perf_counter_ns
    fns = list(steps.items())
    times: dict[str, list[int]] = {name: [] for name in steps}
    chunk = n if isinstance(dev, CpuDevice) else 8  # CpuDevice queues are unbounded; chunks cool caches
    for start in range(0, n, chunk):
        release = _hold(dev, low.stream)
        gc.collect()
        gc.freeze()  # the survivors (torch's own objects) are left out of later collections
        gc.disable()
        try:
            for i in range(start, min(n, start + chunk)):
                for name, fn in (fns if i % 2 == 0 else fns[::-1]):
                    t0 = clock()
                    fn(batch, i)
                    times[name].append(clock() - t0)
        finally:
            gc.enable()
            release()
        dev.synchronize(120)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(*, quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Per policy: host us/step of both loops and their ratio (median over runs).

    A run interleaves ``steps`` steps of each loop (see :func:`_interleaved`) and takes the
    ratio of their median step times; the reported ratio is the median over ``runs`` runs.
    """
    steps, runs, warmup = (20, 2, 5) if quick else (300, 9, 20)  # quick: a smoke run of seconds
    backend = hybrid_linear(trtllm_mha(), linear())
    results = {}
    for policy in (Policy.PER_BUFFER, Policy.EXACT):
        with open_device(device, timeout=120) as dev:
            low = lower(backend, MODE, batch_size=4, device=dev, policy=policy, lowering=LowerOptions(ring_size=1))
            twin = lower(backend, MODE, batch_size=4, device=dev, policy=policy,
                         state={"shared": low.shared, "pools": low.pools, "params": low.params},
                         lowering=LowerOptions(ring_size=1))
            nxt = Scheduler(low.cfg, MODE, 4).next_step()
            for b in SHARED_BUFFERS:
                low.shared[b].copy_(nxt.shared[b])
            batch = {k: v for k, v in nxt.batch.items()}
            sched = dev.stream("schedule")
            written = dev.event("scheduler/written")
            sched.record(written)

            def lowered_step(batch: dict, i: int, low: Any = low, sched: Any = sched, written: Any = written) -> None:
                run = low.run(batch, step=i, after=[written])
                run.fence.wait(sched)

            loops = {"lowered": lowered_step, "hand": _hand_loop(twin, sched, written)}
            _interleaved(dev, low, loops, batch, warmup)  # warm up both
            ratios, lowered, hand = [], [], []
            for _ in range(runs):
                t = _interleaved(dev, low, loops, batch, steps)
                lowered.append(t["lowered"] / 1e9)
                hand.append(t["hand"] / 1e9)
                ratios.append(lowered[-1] / hand[-1])
            results[policy.name] = {
                "lowered_us_per_step": statistics.median(lowered) * 1e6,
                "hand_us_per_step": statistics.median(hand) * 1e6,
                "lowered_vs_hand": statistics.median(ratios),
                "ratios": ratios,
                "fence_points": len(low.plan.points()),
            }
            device_name = dev.name
    return {"backend": str(backend), "device": device_name, "steps": steps, "runs": runs, "policies": results}


def _noop() -> None:
    pass


def _per_call_us(fn: Any, n: int, runs: int) -> float:
    """Median over ``runs`` of ``fn(n)``'s seconds / ``n``, in microseconds (gc paused)."""
    samples = []
    for _ in range(runs):
        gc.collect()
        gc.freeze()  # the survivors (torch's own objects) are left out of later collections
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn(n)
            samples.append((time.perf_counter() - t0) / n * 1e6)
        finally:
            gc.enable()
    return statistics.median(samples)


def measure_machinery(*, quick: bool = False) -> dict[str, float]:
    """Microseconds per CpuDevice primitive, and per inline call of the same function.

    * ``inline_call_us``: calling the launched function (a no-op) on the host;
    * ``launch_us``: ``n`` launches of it, then a host wait for the stream, per launch (the
      worker drains the queue while the host fills it, as in the decode loop);
    * ``launch_handoff_us``: one launch, then the host waits for it: the wake-up of an idle
      stream and of the host, per launch;
    * ``record_us`` / ``wait_us``: ``n`` records of an event (``n`` waits on a fired one),
      then a host wait for the stream, per op;
    * ``wait_handoff_us``: from a record firing on one stream to the op after a wait on it
      running on another stream that was blocked in that wait (the events' timestamps);
    * ``replay_us`` / ``replay_inline_us``: a graph of two launches and an in-graph record,
      replayed ``n`` times then waited for, per replay; and its two launches called inline.
    """
    n, runs = (300, 3) if quick else (2000, 7)
    out: dict[str, float] = {}
    with CpuDevice(timeout=120) as dev:
        s, other = dev.stream("forward"), dev.stream("schedule")
        ev = dev.event("ev")

        def inline(k: int) -> None:
            for _ in range(k):
                _noop()

        def launches(k: int) -> None:
            for _ in range(k):
                s.launch(_noop, label="noop")
            s.synchronize()

        def handoffs(k: int) -> None:
            for _ in range(k):
                s.launch(_noop, label="noop")
                s.synchronize()

        def records(k: int) -> None:
            for _ in range(k):
                s.record(ev)
            s.synchronize()

        s.record(ev)
        s.synchronize()

        def waits(k: int) -> None:
            for _ in range(k):
                s.wait(ev)
            s.synchronize()

        with dev.capture(s, label="step") as graph:
            s.launch(_noop, label="prepare_in_graph")
            s.record(dev.event("in replay"))
            s.launch(_noop, label="body")

        def replays(k: int) -> None:
            for _ in range(k):
                graph.replay(s)
            s.synchronize()

        def replay_inline(k: int) -> None:
            for _ in range(k):
                _noop()
                _noop()

        for key, fn in (("inline_call_us", inline), ("launch_us", launches), ("launch_handoff_us", handoffs),
                        ("record_us", records), ("wait_us", waits), ("replay_us", replays),
                        ("replay_inline_us", replay_inline)):
            fn(n // 10)  # warm up
            out[key] = _per_call_us(fn, n // 10 if key == "launch_handoff_us" else n, runs)
        out["wait_handoff_us"] = _wait_handoff_us(dev, s, other, n // 10, runs)
    return out


def _wait_handoff_us(dev: Any, s: Any, other: Any, k: int, runs: int) -> float:
    """Median microseconds from a record firing on ``s`` to the next op of ``other``, which
    was blocked waiting on it (``s`` is held by a short stall first, so ``other`` is waiting)."""
    samples = []
    for _ in range(runs * k):
        ev = dev.event("handoff")
        seen: list[float] = []
        s.launch(dev.stall, 0.002, label="hold")
        s.record(ev)
        other.wait(ev)
        other.launch(lambda seen=seen: seen.append(time.perf_counter()), label="after wait")
        other.synchronize()
        samples.append((seen[0] - ev.timestamp) * 1e6)
    return statistics.median(samples)


def main(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Median ratio (Lowered.run + fence) / (hand loop) of host time per step, per policy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = measure(quick=quick, device=device)
        r["machinery"] = measure_machinery(quick=quick)
    finally:
        torch.set_num_threads(threads)
    main.details = r  # type: ignore[attr-defined]
    out: dict[str, Any] = {f"cpu_{k}": v for k, v in r["machinery"].items()}
    for policy, v in r["policies"].items():
        p = policy.lower()
        out[f"{p}_lowered_vs_hand"] = v["lowered_vs_hand"]
        out[f"{p}_lowered_us_per_step"] = v["lowered_us_per_step"]
        out[f"{p}_hand_us_per_step"] = v["hand_us_per_step"]
    return out


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--device", choices=DEVICE_KINDS, default="cpu",
                        help="device to run on (default cpu; auto = CUDA when available)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (torch.cuda.is_available() is False)")
    main(quick=args.quick, device=args.device)
    r = main.details  # type: ignore[attr-defined]
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['backend']} on {r['device']}: host time per step; {r['runs']} runs of {r['steps']} steps of each loop, "
          f"alternating step by step (median step per run, median over runs)")
    for policy, v in r["policies"].items():
        print(f"  {policy:10} Lowered.run + fence {v['lowered_us_per_step']:7.1f} us   hand loop "
              f"{v['hand_us_per_step']:7.1f} us   ratio {v['lowered_vs_hand']:.3f}x "
              f"({v['fence_points']} fence points; target <= 1.10x)")
    m = r["machinery"]
    print(f"CpuDevice machinery, us per op (median of runs; inline call of the same no-op: {m['inline_call_us']:.2f} us)")
    print(f"  launch {m['launch_us']:.1f} (queued behind others), {m['launch_handoff_us']:.1f} (to an idle stream "
          f"and back to the host)")
    print(f"  record {m['record_us']:.1f}   wait on a fired event {m['wait_us']:.1f}   record -> waiting stream runs "
          f"{m['wait_handoff_us']:.1f}")
    print(f"  replay of a 2-launch, 1-record graph {m['replay_us']:.1f} (its 2 launches inline: "
          f"{m['replay_inline_us']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
