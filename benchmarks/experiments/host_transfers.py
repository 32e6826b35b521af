"""Host time per call of the model-parallel transfers (lowbit.comm.gather / all_reduce), unsynchronised:
what each costs the launching thread, beside the device time of the same call synchronised. With
--cprofile, rank 0 also writes a cProfile of the unsynchronised loops.

    torchrun --nproc-per-node 2 benchmarks/experiments/host_transfers.py [--cprofile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lowbit.comm.allreduce import all_reduce
from lowbit.comm.gather import all_gather, part_sizes, reduce_scatter

D8 = "dettmers:type=dynamic,bucket=0"


def init_nccl() -> tuple[int, int, torch.device]:
    """NCCL process group under torchrun; (rank, world size, this rank's GPU)."""
    dist.init_process_group("nccl")
    rank, k = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return rank, k, torch.device("cuda")


def transfer_cases(rank: int, k: int, dev: torch.device, b: int = 64) -> dict[str, Callable[[object], object]]:
    """The AlexNet hybrid's transfers (batch ``b`` per rank), each a function of the codec (spec or
    object), and a raw NCCL all-gather of the 8-bit features' bytes."""
    feats = torch.randn(b, 9216, device=dev).relu()
    wide = torch.randn(k * b, 4096, device=dev)
    logits = torch.randn(k * b, part_sizes(1000, k)[rank], device=dev)
    gfeat = torch.randn(k * b, 9216, device=dev)
    raw_in = torch.empty(b * 9216, dtype=torch.uint8, device=dev)
    raw_out = torch.empty(k * b * 9216, dtype=torch.uint8, device=dev)
    return {
        "raw NCCL all_gather of 64x9216 bytes": lambda s: dist.all_gather_into_tensor(raw_out, raw_in),
        "features all_gather (64x9216/rank)": lambda s: all_gather(feats, s, dim=0),
        "row all_reduce (128x4096)": lambda s: all_reduce(wide.clone(), s, algorithm="auto", op="sum", key="row"),
        "logits gather dim -1 (128x500)": lambda s: all_gather(logits, s, dim=-1, sizes=part_sizes(1000, k)),
        "features grad reduce_scatter (128x9216)": lambda s: reduce_scatter(gfeat, s, dim=0, sizes=[b] * k),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cprofile", default=None)
    p.add_argument("--reps", type=int, default=100)
    a = p.parse_args()
    rank, k, dev = init_nccl()
    cases = transfer_cases(rank, k, dev)
    prof = cProfile.Profile() if a.cprofile and rank == 0 else None
    rows = []
    for spec in ("fp32", D8):
        for name, fn in cases.items():
            for _ in range(5):
                fn(spec)
            torch.cuda.synchronize()
            dist.barrier()
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            for _ in range(a.reps):
                fn(spec)
            host = (time.perf_counter() - t0) / a.reps
            if prof:
                prof.disable()
            torch.cuda.synchronize()
            total = (time.perf_counter() - t0) / a.reps
            dist.barrier()
            sync = []
            for _ in range(20):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                fn(spec)
                torch.cuda.synchronize()
                sync.append(time.perf_counter() - t1)
            sync.sort()
            rows.append((spec[:8], name, host * 1e3, total * 1e3, sync[len(sync) // 2] * 1e3))
    if rank == 0:
        print(f"{'codec':8s} {'transfer':42s} {'host ms/call':>12s} {'pipelined ms':>12s} {'alone ms':>9s}")
        for r in rows:
            print(f"{r[0]:8s} {r[1]:42s} {r[2]:12.3f} {r[3]:12.3f} {r[4]:9.3f}")
        if prof:
            os.makedirs(a.cprofile, exist_ok=True)
            prof.dump_stats(os.path.join(a.cprofile, "host_transfers.prof"))
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
