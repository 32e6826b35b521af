"""CPU codec throughput, torch reference vs numba kernels, measured side by side in one run (issue 2).

    PYTHONPATH=src python benchmarks/bench_codecs.py                  # writes results/codecs_cpu_<host>.json
    PYTHONPATH=src python benchmarks/bench_codecs.py --sizes 1M --reps 3 --name scratch

Each codec runs through its public API (``codec.encode`` / ``codec.decode(out=...)`` /
``codec.decode_sum``), once with ``LOWBIT_KERNELS=reference`` and once with ``LOWBIT_KERNELS=numba``, so
the numbers include everything a caller pays (flattening, allocation of the payload, dispatch). The
repetitions of the two backends alternate, so a burst of load from other processes hits both; we report
the median and the minimum after one warm-up call (the warm-up also keeps numba's compilation, or its
load from the on-disk cache, out of the numbers). torch's and numba's thread counts stay at their
defaults (``--threads N`` sets torch's, which the numba kernels follow, for a second file).

Throughput is GB/s of fp32 input (``4 * n / time``) for encode and of fp32 output for decode, and
nanoseconds per value. ``decode_sum4`` sums four payloads (the shape of an allgather-based allreduce
with 4 ranks); its GB/s counts the four decoded tensors. Codecs without numba kernels (fp16, Dettmers)
take the same path under both settings; their ratio shows the run's noise.

The issue's targets on 2 cores: encode about 2 GB/s and decode about 9 GB/s for 8-bit buckets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import lowbit

RESULTS = Path(__file__).resolve().parent / "results"

# (label, codec spec, has numba kernels)
CASES = [
    ("qsgd8 b512", "qsgd:bits=8,bucket=512", True),
    ("qsgd4 b512", "qsgd:bits=4,bucket=512", True),
    ("qsgd2 b128", "qsgd:bits=2,bucket=128", True),
    ("qsgd1 b512", "qsgd:bits=1,bucket=512", True),
    ("onebit b64", "onebit:bucket=64", True),
    ("dettmers dyn", "dettmers:type=dynamic", False),
    ("fp16", "fp16", False),
]
BACKENDS = ("reference", "numba")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def default_name() -> str:
    """The hostname, or 'ci-cpu' on CI and on hosts with a generic name."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    if os.environ.get("CI") or host.lower() in ("", "localhost", "vm", "ubuntu", "runner"):
        return "ci-cpu"
    return host


def machine_info() -> dict:
    info: dict = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "numpy": np.__version__,
    }
    try:
        import numba

        info["numba"] = numba.__version__
        # not numba.get_num_threads(): it starts numba's pool, which resets torch's (OpenMP) thread count
        info["numba_max_threads"] = numba.config.NUMBA_NUM_THREADS
    except ImportError:
        info["numba"] = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Model name", "L2 cache", "L3 cache", "Thread(s) per core"):
                info["lscpu_" + key.strip().lower().replace(" ", "_").replace("(s)", "s")] = val.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _stats(times: list[float], n: int, nbytes_fp32: int) -> dict:
    med, best = statistics.median(times), min(times)
    return {
        "median_s": med,
        "min_s": best,
        "gbps": nbytes_fp32 / med / 1e9,
        "gbps_best": nbytes_fp32 / best / 1e9,
        "ns_per_value": med / n * 1e9,
        "reps": len(times),
    }


def bench_case(spec: str, n: int, reps: int, warmup: int) -> dict:
    """Alternating reference/numba repetitions of encode, decode and (qsgd) decode_sum of 4 payloads."""
    codec = lowbit.get_codec(spec)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    out = torch.empty(n)
    fused = codec.name == "qsgd"
    payloads = [codec.encode(torch.randn(n, generator=g), seed=k) for k in range(4)] if fused else []
    times: dict[str, dict[str, list[float]]] = {
        op: {b: [] for b in BACKENDS} for op in ("encode", "decode", "decode_sum4")
    }
    payload = {}
    prev = os.environ.get("LOWBIT_KERNELS")
    try:
        for b in BACKENDS:  # warm-up (numba: compile or load from the cache)
            os.environ["LOWBIT_KERNELS"] = b
            for _ in range(warmup):
                payload[b] = codec.encode(x, seed=7)
                codec.decode(payload[b], n, out=out, shape=codec.flat_shape(n))
                if fused:
                    codec.decode_sum(payloads, n, out=out)
        for _ in range(reps):
            for b in BACKENDS:
                os.environ["LOWBIT_KERNELS"] = b
                t0 = time.perf_counter()
                payload[b] = codec.encode(x, seed=7)
                t1 = time.perf_counter()
                codec.decode(payload[b], n, out=out, shape=codec.flat_shape(n))
                t2 = time.perf_counter()
                times["encode"][b].append(t1 - t0)
                times["decode"][b].append(t2 - t1)
                if fused:
                    t3 = time.perf_counter()
                    codec.decode_sum(payloads, n, out=out)
                    times["decode_sum4"][b].append(time.perf_counter() - t3)
    finally:
        if prev is None:
            os.environ.pop("LOWBIT_KERNELS", None)
        else:
            os.environ["LOWBIT_KERNELS"] = prev
    same = torch.equal(payload["reference"], payload["numba"])
    row: dict = {"codec": spec, "numel": n, "payload_bytes": codec.nbytes(n, codec.flat_shape(n)), "payloads_identical": same}
    for op, per in times.items():
        if not per["numba"]:
            continue
        vol = 4 * n * (4 if op == "decode_sum4" else 1)
        r = {b: _stats(per[b], n, vol) for b in BACKENDS}
        r["speedup"] = r["reference"]["median_s"] / r["numba"]["median_s"]
        row[op] = r
    return row


def print_table(rows: list[dict]) -> None:
    """GB/s as ``reference -> numba median [numba best]`` and the speedup of the medians."""
    width = 33
    head = " | ".join(h.rjust(width) for h in ("encode GB/s ref -> numba [best]", "decode GB/s ref -> numba [best]",
                                               "decode_sum4 GB/s"))
    print(f"{'codec':<24}{'n':>5} | {head} | ns/value enc, dec (numba)")
    for r in rows:
        cells = []
        for op in ("encode", "decode", "decode_sum4"):
            cell = "-"
            if op in r:
                ref_, nb = r[op]["reference"], r[op]["numba"]
                cell = f"{ref_['gbps']:5.2f} -> {nb['gbps']:5.2f} [{nb['gbps_best']:5.2f}] {r[op]['speedup']:5.1f}x"
            cells.append(cell.rjust(width))
        ns = f"{r['encode']['numba']['ns_per_value']:.2f}, {r['decode']['numba']['ns_per_value']:.2f}"
        print(f"{r['codec']:<24}{r['numel'] >> 20:>4}M | " + " | ".join(cells) + f" | {ns}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,4M,16M", help="comma-separated element counts (K/M suffixes)")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions per backend (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--codecs", default="", help="comma-separated labels or specs to run (default: all)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads(N) first (the numba kernels follow torch); 0: leave the default")
    ap.add_argument("--name", default="", help="suffix of the result file (default: host, plus -<N>thread)")
    ap.add_argument("--out", default="", help="result path (default: benchmarks/results/codecs_cpu_<name>.json)")
    args = ap.parse_args(argv)

    try:
        import lowbit.kernels.numba  # noqa: F401
    except ImportError as exc:
        print(f"numba kernels unavailable ({exc}); nothing to compare", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.name or default_name() + (f"-{args.threads}thread" if args.threads else "")
    wanted = {c.strip() for c in args.codecs.split(",") if c.strip()}
    cases = [c for c in CASES if not wanted or c[0] in wanted or c[1] in wanted]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    info = machine_info()
    info["loadavg_start"] = os.getloadavg()
    rows = []
    t_start = time.time()
    for _label, spec, has_kernels in cases:
        for n in sizes:
            load = os.getloadavg()[0]
            row = bench_case(spec, n, args.reps, args.warmup)
            row["numba_kernels"] = has_kernels
            row["loadavg_1min_before"] = load
            rows.append(row)
            print(f"  {spec} n={n}: encode {row['encode']['speedup']:.1f}x, decode {row['decode']['speedup']:.1f}x",
                  file=sys.stderr, flush=True)
    info["loadavg_end"] = os.getloadavg()
    import numba

    info["numba_threading_layer"] = numba.threading_layer()
    info["numba_threads"] = numba.get_num_threads()
    info["torch_threads_end"] = torch.get_num_threads()
    result = {
        "benchmark": "codec throughput on CPU, torch reference vs numba kernels (issue 2)",
        "units": "GB/s of fp32 values (input for encode, output for decode; 4 outputs for decode_sum4)",
        "method": f"median and min of {args.reps} alternating repetitions after {args.warmup} warm-up call(s); "
                  "codec API with LOWBIT_KERNELS=reference|numba; "
                  + (f"torch.set_num_threads({args.threads})" if args.threads else "default torch threads")
                  + " (numba follows torch)",
        "machine": info,
        "elapsed_s": time.time() - t_start,
        "rows": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"codecs_cpu_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    print(f"machine: {info.get('lscpu_model_name', info['machine'])}, {info['cpu_count']} CPUs, "
          f"load average {info['loadavg_start'][0]:.1f} -> {info['loadavg_end'][0]:.1f} (other processes share it)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
