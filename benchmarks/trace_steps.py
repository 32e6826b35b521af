"""Per-step summary of a torch.profiler chrome trace of DDP training (as bench_ddp.py --profile writes):
step time, compute-stream busy time, each NCCL kernel (start in the step + duration, ms), the compute
stream's idle gaps over 0.2 ms, and the host time of each comm-hook call on the autograd thread.

    python benchmarks/trace_steps.py trace_resnet50_fp16_rank0.json.gz [...]

Steps are cut at DistributedDataParallel.forward's GPU annotation. Profiling inflates host times (the
hook's calls run 2-3x slower than unprofiled): compare traces with each other, not with bench numbers.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys


def summary(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    nccl = [e for e in gpu if "nccl" in e["name"].lower()]
    comp = [e for e in gpu if "nccl" not in e["name"].lower()]
    fwd = sorted((e["ts"] for e in events
                  if e["name"] == "DistributedDataParallel.forward" and e.get("cat") == "gpu_user_annotation"))
    hooks = [e["dur"] for e in events if e["name"] == "lowbit.ddp.hook" and e.get("cat") == "user_annotation"]
    if not hooks:  # torch's own Python hooks: the allreduce call and the casts around it are not one range
        hooks = [e["dur"] for e in events if e["name"] in ("c10d::allreduce_",) and e.get("cat") == "cpu_op"]
    lines = [f"== {path}"]
    for a, b in zip(fwd, fwd[1:]):
        c = [e for e in comp if a <= e["ts"] < b]
        n = [e for e in nccl if a <= e["ts"] < b and e["dur"] > 20]
        busy = sum(e["dur"] for e in c) / 1e3
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in c)
        gaps, end = [], spans[0][1] if spans else a
        for s, t in spans[1:]:
            if s > end + 200:
                gaps.append(f"@{(end - a) / 1e3:.1f}:{(s - end) / 1e3:.2f}")
            end = max(end, t)
        lines.append(f"step {(b - a) / 1e3:6.2f} ms, compute busy {busy:5.2f} ms; nccl [start+dur ms]: "
                     + " ".join(f"[{(e['ts'] - a) / 1e3:.1f}+{e['dur'] / 1e3:.1f}]" for e in n))
        lines.append("   compute idle > 0.2 ms [@start:ms]: " + " ".join(gaps))
    if hooks:
        lines.append(f"hook host time per call (profiled): median {statistics.median(hooks) / 1e3:.2f} ms, "
                     f"max {max(hooks) / 1e3:.2f} ms, {len(hooks)} calls")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n\n".join(summary(p) for p in sys.argv[1:]))
