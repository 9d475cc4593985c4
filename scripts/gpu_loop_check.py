"""The overlapped loop against a serial run on the same device, for every reference backend
and speculative step shape under every policy; one line per case, the last line a total.

    python3 scripts/gpu_loop_check.py --device cuda --steps 20

Exit status 0 when every case is bit-identical to its serial run with no sanitizer finding
(a refused lowering counts as a pass only for a declaration the audit refuses).
"""

from __future__ import annotations

import argparse
import sys
import time

from readfence.backends import REFERENCE_LEAVES
from readfence.core import ForwardMode, ModelConfig
from readfence.graph import Policy, UnsoundLowering, eagle, multi_eagle, ngram, open_device, run_overlapped, run_serial
from readfence.graph.lowering import torch_device


def cases():
    leaves = {name: make for name, make in REFERENCE_LEAVES.items()}
    for name, make in leaves.items():
        for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            yield f"{name}/{mode.name}", make, mode
    a, b = list(leaves.values())[:2]
    yield "eagle", lambda: eagle(a(), b(), draft_steps=2), ForwardMode.DECODE
    yield "multi_eagle", lambda: multi_eagle(a(), b(), b()), ForwardMode.DECODE
    yield "ngram", lambda: ngram(a()), ForwardMode.DECODE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()
    cfg = ModelConfig(layers=2)
    failed = total = 0
    with open_device(args.device) as probe:
        where, name = torch_device(probe), probe.name
    print(f"device {name}", flush=True)
    for label, make, mode in cases():
        ref = run_serial(make(), mode, steps=args.steps, batch_size=args.batch_size, cfg=cfg, device=where)
        for policy in Policy:
            total += 1
            t0 = time.perf_counter()
            try:
                with open_device(args.device) as dev:
                    res = run_overlapped(make(), mode, steps=args.steps, policy=policy, device=dev,
                                         batch_size=args.batch_size, cfg=cfg)
            except UnsoundLowering:
                print(f"{label:32s} {policy.name:10s} refused (unsound declaration)", flush=True)
                continue
            except Exception as exc:
                failed += 1
                print(f"{label:32s} {policy.name:10s} ERROR {type(exc).__name__}: {exc}", flush=True)
                continue
            ok = res.matches(ref) and not res.violations
            failed += not ok
            print(f"{label:32s} {policy.name:10s} {'ok' if ok else 'FAIL'} matches_serial={res.matches(ref)} "
                  f"violations={len(res.violations)} steps/s={res.steps_per_s:.1f} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"loop check: {total - failed}/{total} cases passed on {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
