"""numba QSGD encode and decode, 4M float32 values, one thread, best of 20, at buckets of 512, 128 and 64
(per-bucket costs show at small buckets); prints one line. Run it in two checkouts to compare kernel
versions:

    PYTHONPATH=src python benchmarks/experiments/numba_qsgd_bucket_speed.py LABEL
"""
import sys, time, torch, os
torch.set_num_threads(1)
os.environ["LOWBIT_KERNELS"]="numba"
import lowbit
x = torch.randn(4<<20, generator=torch.Generator().manual_seed(0))
out=[]
for spec in ("qsgd:bits=8,bucket=512","qsgd:bits=2,bucket=128","qsgd:bits=4,bucket=64"):
    c = lowbit.get_codec(spec)
    c.encode(x, seed=1); c.encode(x, seed=1)
    best=min((lambda t: (c.encode(x, seed=1), time.perf_counter()-t)[1])(time.perf_counter()) for _ in range(20))
    p=c.encode(x, seed=1); o=torch.empty_like(x); c.decode(p, x.numel(), out=o)
    bd=min((lambda t: (c.decode(p, x.numel(), out=o), time.perf_counter()-t)[1])(time.perf_counter()) for _ in range(20))
    out.append(f"{spec} enc {best*1e3:.2f} ms dec {bd*1e3:.2f} ms")
print(sys.argv[1], "; ".join(out))
