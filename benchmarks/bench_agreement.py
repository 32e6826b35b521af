"""What lowbit.all_reduce's per-call agreement check costs (issue 32 item 2), 2 ranks.

Every call all-gathers a 64-bit fingerprint of (key, codec, algorithm, op, numel, feedback) before its
data (lowbit.comm.collectives.check_call). This times ``all_reduce`` per call with the check on and off
(``collectives.CHECK_CALLS``, the switch behind ``LOWBIT_CHECK_CALLS=0``), interleaved rep by rep so that
drift hits both alike, for 8-bit QSGD (scatter_gather) and fp32 (native allreduce), and the check alone.

    torchrun --nproc-per-node 2 benchmarks/bench_agreement.py --backend nccl --out results/agreement_nccl_h100x2.json
    PYTHONPATH=src python benchmarks/bench_agreement.py        # CPU gloo, 2 spawned ranks (default sizes smaller)

Writes JSON (rows: size, codec, per-call seconds with and without the check, the difference) and prints
a table on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lowbit
from lowbit.comm import collectives as C

RESULTS = Path(__file__).resolve().parent / "results"
CASES = [("qsgd:bits=8,bucket=512", "scatter_gather"), ("fp32", "allreduce")]


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KM" else s) * mult


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_calls(x: torch.Tensor, spec: str, algorithm: str, calls: int, check: bool) -> float:
    """Seconds per call of ``calls`` back-to-back all_reduces (the last one's result waited for)."""
    C.CHECK_CALLS = check
    dist.barrier()
    _sync(x.device)
    t0 = time.perf_counter()
    for i in range(calls):
        lowbit.all_reduce(x, spec, algorithm=algorithm, op="mean", seed=i)
    _sync(x.device)
    dt = (time.perf_counter() - t0) / calls
    C.CHECK_CALLS = True
    return dt


def _time_check(dev: torch.device, calls: int) -> float:
    """Seconds per call of the check alone (one fingerprint all-gather and its comparison)."""
    fields = ("'tensor'", "qsgd:bits=8,bucket=512", "scatter_gather", "mean", 1 << 20, False)
    dist.barrier()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(calls):
        C.check_call(None, "all_reduce", fields, str, dev)
    _sync(dev)
    return (time.perf_counter() - t0) / calls


def run(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}") if args.backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rows = []
    for n in [_size(s) for s in args.sizes.split(",")]:
        x = torch.randn(n, device=dev)
        for spec, algorithm in CASES:
            calls = max(3, min(args.calls, int(args.calls * (1 << 20) / n) or 3))
            _time_calls(x, spec, algorithm, 2, True)  # warm-up (kernels compiled, buffers pooled)
            on, off = [], []
            for _ in range(args.reps):
                on.append(_time_calls(x, spec, algorithm, calls, True))
                off.append(_time_calls(x, spec, algorithm, calls, False))
            t_on, t_off = statistics.median(on), statistics.median(off)
            rows.append({"numel": n, "codec": spec, "algorithm": algorithm, "calls_per_rep": calls,
                         "reps": args.reps, "s_per_call_check": t_on, "s_per_call_no_check": t_off,
                         "check_cost_s": t_on - t_off, "check_cost_rel": (t_on - t_off) / t_off})
    _time_check(dev, 20)
    alone = statistics.median(_time_check(dev, 200) for _ in range(5))
    if rank != 0:
        return None
    meta = {"backend": args.backend, "world_size": world, "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda" else platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "check_alone_s": alone}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"agreement check, {world} ranks, {args.backend} ({meta['device']}); the check alone: "
          f"{alone * 1e6:.0f} us per call")
    print(f"{'numel':>10} {'codec':<24} {'with check':>12} {'without':>12} {'cost':>10} {'rel':>7}")
    for r in rows:
        print(f"{r['numel']:>10} {r['codec']:<24} {r['s_per_call_check'] * 1e3:>10.3f}ms "
              f"{r['s_per_call_no_check'] * 1e3:>10.3f}ms {r['check_cost_s'] * 1e6:>8.0f}us "
              f"{100 * r['check_cost_rel']:>6.1f}%")
    print(f"wrote {out}")
    return rows


def _spawned(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    return run(rank, world, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--sizes", default=None, help="comma-separated numels, e.g. 64K,1M,16M,64M "
                    "(default: 64K,1M,4M,16M,64M on nccl; 64K,1M,4M,16M on gloo)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per rep at 1M values (fewer above, more below)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.sizes is None:
        args.sizes = "64K,1M,4M,16M,64M" if args.backend == "nccl" else "64K,1M,4M,16M"
    if args.out is None:
        args.out = str(RESULTS / f"agreement_{args.backend}_{'gpu' if args.backend == 'nccl' else 'cpu'}2.json")
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(args.backend)
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        from lowbit.launch import spawn

        spawn(_spawned, 2, args, backend=args.backend, timeout_s=600)


if __name__ == "__main__":
    main()
