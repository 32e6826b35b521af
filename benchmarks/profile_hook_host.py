"""Host (Python) cost of the lowbit DDP hook: cProfile of rank 0 over a few training steps.

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/profile_hook_host.py --model gpt2_small \
        --hook "qsgd:bits=8,bucket=512" [--steps 10] [--out prof.txt]

Prints the functions with the most own time and the most cumulative time (the hook's share is the
cumulative time of ``ddp.py:hook``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ddp  # noqa: E402

import lowbit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2_small")
    p.add_argument("--hook", default="qsgd:bits=8,bucket=512")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device())
    args = bench_ddp.parse_args(["--models", a.model, "--batch", "64"])
    model, feed = bench_ddp.build(a.model, args)
    x, y = bench_ddp.make_batch(feed, dev, 0)
    ddp = DDP(model.to(dev), device_ids=[dev.index])
    lowbit.ddp.register(ddp, codec=a.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    bf16 = feed["bf16"]
    for _ in range(8):
        bench_ddp.train_step(ddp, opt, x, y, bf16)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if rank == 0:
        prof.enable()
    for _ in range(a.steps):
        bench_ddp.train_step(ddp, opt, x, y, bf16)
    if rank == 0:
        prof.disable()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if rank == 0:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
        text = f"{a.model} {a.hook}: {a.steps} steps in {wall * 1e3:.1f} ms (under cProfile)\n" + s.getvalue()
        print(text[:12000])
        if a.out:
            Path(a.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
