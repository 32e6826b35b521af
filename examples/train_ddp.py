"""Train a small network on scikit-learn's digits with DDP, gradients exchanged in low precision.

Runs on CPU with gloo or on GPUs with NCCL, under torchrun or on its own:

    torchrun --nproc-per-node 2 examples/train_ddp.py --codec qsgd:bits=4
    python examples/train_ddp.py --world-size 2 --codec onebit:bucket=64     # spawns its own processes
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --nproc-per-node 8 examples/train_ddp.py ...

The lowbit part is the single line marked below; everything else is an ordinary DDP script. Rank 0
prints the accuracy, the time per step, and what lowbit measured: the bytes each rank sent in how many
compressed collectives (``--timing`` adds the seconds in encode / communicate / decode, which are measured
only when asked: on CUDA that synchronises the device around each phase). Every process ends by tearing its
process group down cleanly (:func:`lowbit.launch.shutdown`).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.lab.data import load_dataset
from lowbit.launch import process_group_from_env, spawn


def train(rank: int, world: int, args: argparse.Namespace) -> float:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ds = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)

    state = lowbit.ddp.register(model, codec=args.codec, algorithm=args.algorithm)  # <- the one-line change
    state.stats.timing = args.timing  # off by default: the encode/comm/decode seconds stay unmeasured

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = ds.x_train.to(device), ds.y_train.to(device)
    steps = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch)).to(device)
        for i in range(0, len(x) - world * args.batch + 1, world * args.batch):  # same step count on every rank
            if args.steps and steps == args.steps:
                break
            idx = perm[i + rank * args.batch : i + (rank + 1) * args.batch]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        acc = (model(ds.x_test.to(device)).argmax(1) == ds.y_test.to(device)).float().mean().item()
    if rank == 0:
        s = state.stats
        line = (f"{args.codec}: test accuracy {acc:.4f} after {steps} steps ({args.epochs} epochs max) in "
                f"{train_s:.1f}s, {train_s / max(steps, 1) * 1e3:.1f} ms/step on {world} ranks; "
                f"sent {(s.bytes_sent - s.warmup_bytes) / 1e6:.3f} MB/rank in {s.calls - s.warmup_calls} compressed "
                f"collectives (and {s.warmup_bytes / 1e6:.3f} MB in {s.warmup_calls} fp32 ones before compression starts)")
        if args.timing:
            line += f" (encode {s.t_encode:.3f}s, comm {s.t_comm:.3f}s, decode {s.t_decode:.3f}s)"
        print(line, flush=True)
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", default="qsgd:bits=8,bucket=512")
    p.add_argument("--algorithm", default="scatter_gather")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: run every epoch)")
    p.add_argument("--timing", action="store_true",
                   help="also measure seconds in encode / communicate / decode (on CUDA: synchronises the device)")
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn when not under torchrun")
    args = p.parse_args()
    if "RANK" in os.environ:  # under torchrun
        with process_group_from_env() as (rank, world):  # ends with a clean teardown of the process group
            train(rank, world, args)
    else:
        spawn(train, args.world_size, args)


if __name__ == "__main__":
    main()
