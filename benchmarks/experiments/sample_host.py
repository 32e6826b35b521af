"""A sampling profile of the host side of lowbit's model-parallel transfers (cProfile inflates every
Python call several times and misleads here): a thread samples the main thread's stack every ~50 us;
printed per case: the share of samples in which each function is on the stack (inclusive) and on top.

    torchrun --nproc-per-node 2 benchmarks/experiments/sample_host.py
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from host_transfers import init_nccl, transfer_cases  # (this directory: the same transfers)

from lowbit.codecs.base import get_codec

D8 = "dettmers:type=dynamic,bucket=0"


class Sampler:
    def __init__(self, tid: int) -> None:
        self.tid, self.on = tid, False
        self.incl: collections.Counter = collections.Counter()
        self.top: collections.Counter = collections.Counter()
        self.n = 0
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self) -> None:
        while True:
            time.sleep(0.00005)
            if not self.on:
                continue
            f = sys._current_frames().get(self.tid)
            if f is None:
                continue
            self.n += 1
            seen = set()
            first = True
            while f is not None:
                c = f.f_code
                key = f"{os.path.basename(c.co_filename)}:{c.co_firstlineno}({c.co_name})"
                if first:
                    self.top[key + f" L{f.f_lineno}"] += 1
                    first = False
                if key not in seen:
                    self.incl[key] += 1
                    seen.add(key)
                f = f.f_back


def main() -> None:
    sys.setswitchinterval(1e-5)
    rank, k, dev = init_nccl()
    codec = get_codec(D8)
    every = transfer_cases(rank, k, dev)
    cases = {name: (lambda fn=every[full]: fn(codec)) for name, full in (
        ("all_gather", "features all_gather (64x9216/rank)"), ("all_reduce", "row all_reduce (128x4096)"),
        ("reduce_scatter", "features grad reduce_scatter (128x9216)"))}
    s = Sampler(threading.get_ident())
    for name, fn in cases.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        s.incl.clear(), s.top.clear()
        s.n = 0
        s.on = True
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        h = (time.perf_counter() - t0) / 300
        s.on = False
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            print(f"\n== {name}: {h * 1e6:.0f} us host per call, {s.n} samples")
            for key, c in s.incl.most_common(28):
                print(f"  incl {100 * c / s.n:5.1f}%  {key}")
            for key, c in s.top.most_common(14):
                print(f"  top  {100 * c / s.n:5.1f}%  {key}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
