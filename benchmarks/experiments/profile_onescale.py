"""Run the encoders once each inside a CUDA profiler range, for Nsight Compute (ncu).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 benchmarks/experiments/profile_onescale.py [--mib 64]

Warm-up (compilation) runs outside the range, so ncu sees only the timed calls: Dettmers dynamic with
one scale (fill, max pass, quantiser), Dettmers per bucket of 4096, and qsgd 8-bit per bucket of 512;
with ``--qsgd``: qsgd 8/2-bit encodes, and as references a device copy and torch's amax of the input.
"""

import argparse

import torch

from lowbit.kernels import triton as tk

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, default=64)
ap.add_argument("--qsgd", action="store_true")
args = ap.parse_args()
n = args.mib * 2**20 // 4
x = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
calls = [lambda: tk.dettmers_encode(x, "dynamic", "nearest", 0, 0),
         lambda: tk.dettmers_encode(x, "dynamic", "nearest", 4096, 0),
         lambda: tk.qsgd_encode(x, 8, 512, "max", True, 1)]
if args.qsgd:
    dst = torch.empty_like(x)
    calls = [lambda: tk.qsgd_encode(x, 8, 512, "max", True, 1), lambda: tk.qsgd_encode(x, 2, 128, "max", True, 1),
             lambda: dst.copy_(x), lambda: torch.amax(x)]
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
