"""Which flat algorithm is faster on two ranks here: scatter_gather or allgather, call by call.

    PYTHONPATH=src python benchmarks/bench_auto_two_ranks.py --json results/auto_two_ranks_gloo_cpu2.json
    PYTHONPATH=src python benchmarks/bench_auto_two_ranks.py --backend nccl --sizes 1M,16M,64M

``lowbit bench allreduce`` times one case after another, so load that comes and goes on a shared machine
(and whatever the first of two identical cases pays) lands on one algorithm and not the other: on the
2-core VM two rows running the same native fp32 allreduce differed by up to 1.8x. Here the two
algorithms alternate call by call (A B, then B A), each call timed alone after a barrier, so both see
the same load; a row reports each one's median (max over ranks per call), the median of the per-pair
ratios scatter_gather / allgather (< 1: scatter_gather faster), how many pairs scatter_gather won, and
what ``algorithm="auto"`` runs for that size and device (lowbit.comm.registry.auto_algorithm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

import lowbit
from lowbit.comm.registry import resolve_algorithm
from lowbit.env import host
from lowbit.kernels.dispatch import backend_for
from lowbit.launch import spawn

ALGOS = ("scatter_gather", "allgather")


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def _body(rank: int, world: int, sizes: list[int], codecs: list[str], reps: int, warmup: int) -> dict:
    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank + n)).to(dev)
        for spec in codecs:
            times: dict[str, list[float]] = {a: [] for a in ALGOS}
            for i in range(warmup + reps):
                for algo in (ALGOS if i % 2 == 0 else ALGOS[::-1]):
                    t = x.clone()
                    dist.barrier()
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    lowbit.all_reduce(t, spec, algorithm=algo, op="mean", seed=i)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    if i >= warmup:
                        times[algo].append(time.perf_counter() - t0)
            out[(n, spec)] = times
    kernels = backend_for(torch.empty(1 << 20, device=dev), "qsgd_encode").__name__
    return {"times": out, "device": dev.type, "kernels": kernels, "host": host(dev, "lowbit.launch.spawn")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--sizes", default="512K,1M,2M,4M,8M,16M")
    ap.add_argument("--codecs", default="qsgd:bits=8,bucket=512;qsgd:bits=4,bucket=512;qsgd:bits=2,bucket=128;"
                                        "onebit:bucket=64")
    ap.add_argument("--reps", type=int, default=10, help="pairs of calls per case (default 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    codecs = [s for s in args.codecs.split(";") if s]
    load_before = os.getloadavg()
    res = spawn(_body, 2, sizes, codecs, args.reps, args.warmup, backend=args.backend)
    load_after = os.getloadavg()
    rows = []
    for (n, spec), _ in res[0]["times"].items():
        per = {a: [max(r["times"][(n, spec)][a][i] for r in res) for i in range(args.reps)] for a in ALGOS}
        ratios = [s / g for s, g in zip(per["scatter_gather"], per["allgather"])]
        codec = lowbit.get_codec(spec)
        rows.append({"numel": n, "codec": spec, "scatter_gather_s": statistics.median(per["scatter_gather"]),
                     "allgather_s": statistics.median(per["allgather"]),
                     "ratio_sg_over_ag": statistics.median(ratios),
                     "sg_wins": sum(r < 1 for r in ratios), "pairs": len(ratios),
                     "auto": resolve_algorithm("auto", codec, 2, n, res[0]["device"]),
                     "per_pair_s": per})
        r = rows[-1]
        print(f"{n >> 10:>7}K {spec:24s} sg {1e3 * r['scatter_gather_s']:8.2f} ms  ag {1e3 * r['allgather_s']:8.2f} ms"
              f"  sg/ag {r['ratio_sg_over_ag']:.2f}  sg won {r['sg_wins']}/{r['pairs']}  auto: {r['auto']}")
    if args.json:
        meta = {"benchmark": "benchmarks/bench_auto_two_ranks.py", "label": args.label,
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "backend": args.backend,
                "world_size": 2, "reps": args.reps, "warmup": args.warmup, "op": "mean",
                "loadavg_1_5_15_before": list(load_before), "loadavg_1_5_15_after": list(load_after),
                "kernel_backend": res[0]["kernels"],
                "timing": "per call: barrier, then the call alone (CUDA: synchronised); the two algorithms alternate "
                          "call by call (A B, B A, ...); a call's time is the max over ranks; medians over pairs",
                "host": res[0]["host"]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
