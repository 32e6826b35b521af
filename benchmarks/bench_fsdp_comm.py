"""Host (CPU) and device time of one lowbit.fsdp reduce-scatter / all-gather call beside NCCL's own, and a
cProfile of the host side (torchrun, 2+ ranks). FSDP2 issues these calls from the training thread, so
their host time adds to a step wherever the step is bound by the host (small batches, fast links).

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp_comm.py --numel 6300000 --out results/x.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import torch.distributed as dist

from lowbit.codecs import get_codec
from lowbit.fsdp import FSDPState, LowbitAllGather, LowbitReduceScatter, _make_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=6_300_000, help="values per rank (one block's shard)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--codecs", default="bf16;qsgd:bits=8,bucket=512;qsgd:bits=4,bucket=512", help="';'-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, k = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    s = args.numel
    sizes = [s - 4096, 1024, 3072]  # a matrix and two small exact tensors
    exact = [False, True, True]
    group = dist.group.WORLD
    rows = []

    def timeit(fn, label):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / args.calls
        rows.append({"call": label, "numel": s, "host_ms": host * 1e3, "total_ms": total * 1e3})
        if rank == 0:
            print(f"{label:<40} host {host * 1e3:7.3f} ms   host+device {total * 1e3:7.3f} ms", flush=True)

    g32 = torch.randn(k * s, device=dev)
    out32 = torch.empty(s, device=dev)
    p16 = torch.randn(s, device=dev).to(torch.bfloat16)
    ag16 = torch.empty(k * s, device=dev, dtype=torch.bfloat16)
    timeit(lambda: dist.reduce_scatter_tensor(out32, g32, op=dist.ReduceOp.AVG), "nccl reduce_scatter fp32")
    out16 = torch.empty(s, device=dev, dtype=torch.bfloat16)
    timeit(lambda: dist.reduce_scatter_tensor(out16, g32.to(torch.bfloat16), op=dist.ReduceOp.AVG),
           "nccl reduce_scatter bf16 (+cast)")
    timeit(lambda: dist.all_gather_into_tensor(ag16, p16), "nccl all_gather bf16")
    groups = _make_groups(group, None)
    for spec in args.codecs.split(";"):
        codec = get_codec(spec)
        st = FSDPState(codec, codec, False, None, None, None, rank, k, dev)
        rs = LowbitReduceScatter(st, "blk", 0, sizes, exact, codec, groups)
        ag = LowbitAllGather(st, "blk", 0, sizes, exact, codec, None)
        timeit(lambda: rs(out32, g32, group, dist.ReduceOp.AVG), f"lowbit reduce_scatter {codec.label}")
        timeit(lambda: ag(ag16, ag16.view(k, s)[rank], group), f"lowbit all_gather {codec.label}")
        if rank == 0 and spec.startswith("qsgd:bits=8"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                rs(out32, g32, group, dist.ReduceOp.AVG)
                ag(ag16, ag16.view(k, s)[rank], group)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            print(buf.getvalue()[:6000])
        elif spec.startswith("qsgd:bits=8"):
            for _ in range(20):
                rs(out32, g32, group, dist.ReduceOp.AVG)
                ag(ag16, ag16.view(k, s)[rank], group)
    torch.cuda.synchronize()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(dev), "ranks": k, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
