"""Summarise a torch.profiler Chrome trace (as bench_overhead.py --trace writes it) kernel by kernel.

    python benchmarks/trace_kernels.py TRACE.json.gz [--steps N] [--top 25]

Prints, per GPU activity name (kernels, copies, sets), launches and milliseconds a step, and for copies
the bytes a step and their sizes; the same split by whether the activity ran inside a CUDA graph replay
(its launch was ``cudaGraphLaunch``) or was launched on its own. What it shows is where a step's GPU
time goes, to find what a change should remove before making it.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def summarise(events: list[dict], steps: int) -> list[dict]:
    launch_of = {}
    for e in events:  # runtime calls: correlation id -> the API that launched it
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launch_of[c] = e.get("name", "")
    rows: dict[tuple[str, bool], dict] = {}
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args", {})
        graphed = "Graph" in launch_of.get(args.get("correlation"), "")
        r = rows.setdefault((e.get("name", "?")[:80], graphed), {"us": 0.0, "n": 0, "bytes": 0,
                                                                  "sizes": collections.Counter()})
        r["us"] += float(e.get("dur", 0.0))
        r["n"] += 1
        b = int(args.get("bytes", 0) or 0)
        r["bytes"] += b
        if b:
            r["sizes"][b] += 1
    out = []
    for (name, graphed), r in rows.items():
        out.append({"name": name, "graphed": graphed, "ms_step": r["us"] / 1e3 / steps, "n_step": r["n"] / steps,
                    "MB_step": r["bytes"] / 1e6 / steps,
                    "sizes": [[s, c / steps] for s, c in r["sizes"].most_common(6)]})
    return sorted(out, key=lambda r: -r["ms_step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps in the trace (bench_overhead: 3)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    rows = summarise(load(args.trace), args.steps)
    total = sum(r["ms_step"] for r in rows)
    print(f"{args.trace}: {total:.2f} ms of GPU activity a step")
    for r in rows[: args.top]:
        extra = f" {r['MB_step']:.1f} MB sizes {r['sizes'][:3]}" if r["MB_step"] else ""
        print(f"{r['ms_step']:8.3f} ms {r['n_step']:6.1f}x {'G' if r['graphed'] else ' '} {r['name']}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
