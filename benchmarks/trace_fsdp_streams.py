"""Busy time per CUDA stream in a torch.profiler trace (bench_fsdp.py --profile): which kernels ran where.

    python benchmarks/trace_fsdp_streams.py results/prof_trace_q8_p8.json.gz [...]
"""

from __future__ import annotations

import collections
import gzip
import json
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            trace = json.load(f)
        ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        streams = collections.defaultdict(list)
        for e in ev:
            streams[e["tid"]].append(e)
        t0 = min(e["ts"] for e in ev)
        t1 = max(e["ts"] + e["dur"] for e in ev)
        print(f"{path}: span {(t1 - t0) / 1e3:.1f} ms")
        for tid, es in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
            names = collections.Counter()
            for e in es:
                names[e["name"][:40]] += e["dur"] / 1e3
            top = ", ".join(f"{n} {d:.1f}" for n, d in names.most_common(5))
            print(f"  stream {tid}: busy {sum(e['dur'] for e in es) / 1e3:.1f} ms, {len(es)} kernels: {top}")


if __name__ == "__main__":
    main(sys.argv[1:])
