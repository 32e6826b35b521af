"""Encode time of the numba kernels whose scales are float sums (onebit means, QSGD L2), 4M float32
values, one thread, best of 30 calls; prints JSON naming the machine. Run it in two checkouts to
compare kernel versions (session 11: torch's summation order vs reference.tree_sum):

    PYTHONPATH=src python benchmarks/experiments/numba_sum_speed.py > out.json
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time

import torch

from lowbit.kernels import numba as nk


def best_ms(fn, reps: int = 30) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(4_000_000)
    cases = {
        "onebit bucket=64": lambda: nk.onebit_encode_buckets(x, 64),
        "onebit bucket=512": lambda: nk.onebit_encode_buckets(x, 512),
        "onebit one bucket of 1M": lambda: nk.onebit_encode_buckets(x[:1_000_000], 1_000_000),
        "qsgd 8-bit l2 bucket=512": lambda: nk.qsgd_encode(x, 8, 512, "l2", False, 0),
        "qsgd 4-bit l2 bucket=8192 stochastic": lambda: nk.qsgd_encode(x, 4, 8192, "l2", True, 0),
        "qsgd 8-bit max bucket=512 (no sum)": lambda: nk.qsgd_encode(x, 8, 512, "max", False, 0),
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(json.dumps({"machine": cpu, "cpu_count": os.cpu_count(),
                      "torch": torch.__version__, "commit": commit, "threads": 1, "values": x.numel(),
                      "best_ms": {k: round(best_ms(f), 3) for k, f in cases.items()}}, indent=1))


if __name__ == "__main__":
    main()
