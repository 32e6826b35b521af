"""``lowbit bench allreduce``: time compressed allreduce against torch's own fp32 allreduce.

For every size x codec x algorithm the benchmark reports the time of one ``lowbit.all_reduce`` call,
the bytes each rank puts on the wire, the algorithm bandwidth, the split encode / communicate / decode,
and the speedup over ``torch.distributed.all_reduce`` itself, measured in the same run at the same size
(its own row, first in each size). lowbit's own fp32 path (``lowbit.all_reduce(t, "fp32",
algorithm="allreduce")``: the float32 cast, the rank agreement and the copy back) is a row of its own,
so what lowbit adds to the native call shows instead of hiding in the baseline.

Measurement plan (every rank runs the same loop, so collectives are issued in the same order):

    for size:                                 x0 = randn(size) on this rank's device (per-rank seed)
        cases = [torch.distributed.all_reduce itself (the baseline), lowbit fp32 allreduce, the grid...]
        warm-up: each case warmup times      not timed (allocator, numba JIT, gloo connections)
        for rep in reps:                      round-robin, so a burst of other load hits every case
            for case in cases:
                t.copy_(x0); barrier          every rank starts the call together
                start; call(t); sync          CUDA synchronisation before reading the clock on GPU
        median over reps                      per rank and case
        all_gather_object                     rank 0 reports the max over ranks of the medians:
                                              the slowest rank bounds a collective

The encode / communicate / decode split comes from :class:`~lowbit.comm.allreduce.CommStats` (median
per call, of the slowest rank). On CPU its timers cost nothing, so the timed calls carry them; on CUDA
they synchronise the device between phases, so the split is measured in a separate pass of ``reps``
calls and the headline time comes from calls without them. Time outside the three phases (the cast to
float32 and the copy back into the caller's tensor) is in the headline time only.

Processes: ``lowbit.launch.spawn`` starts ``--world-size`` local processes (one GPU each on NCCL);
under ``torchrun`` (RANK and WORLD_SIZE set) the benchmark joins that launch instead and only rank 0
prints and writes. Every argument is validated before any process starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
from pathlib import Path
from typing import Any

import torch

from lowbit.codecs.base import parse_codec_list
from lowbit.comm.allreduce import SIMULATED, algorithm_choices
from lowbit.env import NCCL_ENV, git_commit, loadavg, under_torchrun
from lowbit.launch import process_group_from_env, spawn
from lowbit.lab.bench import SIZE_SUFFIX, BenchConfig, size_label, worker

__all__ = ["BenchConfig", "parse_sizes", "parse_codecs", "parse_algorithms", "register", "run", "format_table",
           "load_bench", "transport_key"]

DEFAULT_SIZES = "1M,4M,16M"
DEFAULT_CODECS = [
    "fp32",
    "fp16",
    "qsgd:bits=8,bucket=512",
    "qsgd:bits=4,bucket=512",
    "qsgd:bits=2,bucket=128",
    "onebit:bucket=64",
    "dettmers:type=dynamic",
]


# --------------------------------------------------------------------------------------- arguments
def parse_sizes(text: str) -> list[int]:
    """``"1M,4M,16M"`` -> element counts. Suffixes K/M/G are binary (1M = 2**20 elements)."""
    sizes = []
    for item in (s.strip() for s in text.split(",")):
        m = re.fullmatch(r"(\d+)\s*([KMGkmg]?)", item)
        if not m:
            raise ValueError(f"bad size {item!r} in --sizes {text!r}: expected an element count with an optional "
                             "suffix K, M or G (binary: 1M = 1048576 elements), e.g. 1M,4M,16M")
        n = int(m.group(1)) * SIZE_SUFFIX[m.group(2).upper()]
        if n < 1:
            raise ValueError(f"bad size {item!r} in --sizes: must be at least 1 element")
        sizes.append(n)
    return list(dict.fromkeys(sizes))


def parse_codecs(values: list[str] | None) -> list[str]:
    """``--codecs`` values (default: the standard set) as validated, deduplicated specs: the one codec
    list syntax of every command (:func:`lowbit.codecs.base.parse_codec_list`)."""
    return parse_codec_list(values or DEFAULT_CODECS, what="--codecs")


def parse_algorithms(text: str) -> list[str]:
    algos = [a.strip() for a in text.replace(";", ",").split(",") if a.strip()]
    known = algorithm_choices()
    for a in algos:
        if a not in known:
            raise ValueError(f"unknown algorithm {a!r} in --algorithms; choose from {', '.join(known)}")
    if not algos:
        raise ValueError("--algorithms is empty")
    return list(dict.fromkeys(algos))


def _with_node_size(algos: list[str]) -> list[str]:
    """``hierarchical`` needs the ranks per node before any process starts: a clear error, not a
    traceback from every worker."""
    if "hierarchical" in algos and not os.environ.get("LOWBIT_NODE_SIZE") and not os.environ.get("LOCAL_WORLD_SIZE"):
        raise ValueError("--algorithms hierarchical needs the number of ranks per node: set $LOWBIT_NODE_SIZE "
                         "(e.g. LOWBIT_NODE_SIZE=2 for 4 ranks as 2 nodes) or launch with torchrun")
    return algos


def _human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["size", "codec", "algorithm", "ms/call", "vs torch AR", "algbw GB/s", "sent/rank",
            "encode ms", "comm ms", "decode ms", "rel err"]
    body = []
    for r in rows:
        body.append([
            r["size"], r["codec"] + (" +ef" if r["error_feedback"] else ""),
            "torch allreduce" if r.get("torch") else
            "lowbit " + r["algorithm"] if r["algorithm"] == "allreduce" else
            r["algorithm"] + (" (sim.)" if r["algorithm"] == SIMULATED else ""),
            f"{1e3 * r['time_s']:.2f}", f"{r['ratio_vs_torch_allreduce']:.2f}x", f"{r['algbw_GBps']:.2f}",
            _human_bytes(r["bytes_sent_per_rank"]), f"{1e3 * r['t_encode_s']:.2f}",
            f"{1e3 * r['t_comm_s']:.2f}", f"{1e3 * r['t_decode_s']:.2f}", f"{r['rel_error']:.1e}",
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    left = {0, 1, 2}

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(head), "  ".join("-" * w for w in widths)]
    for i, b in enumerate(body):
        if i and rows[i]["numel"] != rows[i - 1]["numel"]:
            out.append("")
        out.append(line(b))
    if any(r["algorithm"] == SIMULATED for r in rows):
        out.append("(sim.) Grubic et al.'s simulated low-precision NCCL: an fp32 allreduce of the codec's wire size; "
                   "the tensor is not reduced (speed only; its rel err means nothing)")
    return "\n".join(out)


def _metadata(cfg: BenchConfig, world_size: int, label: str, worker_meta: dict[str, Any],
              skipped: list[dict[str, str]], launcher: str, load_before: list[float] | None) -> dict[str, Any]:
    return {
        "benchmark": "lowbit bench allreduce",
        "label": label,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "backend": cfg.backend,
        "world_size": world_size,
        "launcher": launcher,
        "device_name": worker_meta["device_name"],
        "cpu_count": os.cpu_count(),
        # Other work on the machine skews CPU timings: a load average above the rank count says so.
        "loadavg_1_5_15_before": load_before,
        "loadavg_1_5_15_after": loadavg(),
        "torch_threads_per_rank": worker_meta["torch_threads_per_rank"],
        "numba_threads_per_rank": worker_meta["numba_threads_per_rank"],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "numba_num_threads_env": os.environ.get("NUMBA_NUM_THREADS"),
        "kernel_backend": worker_meta["kernel_backend"],
        "torch_version": torch.__version__,
        "lowbit_git_commit": git_commit(),
        "python_version": platform.python_version(),
        "nccl_env": {k: os.environ[k] for k in NCCL_ENV if k in os.environ},
        "tensors": "synthetic: torch.randn float32, a different seed per rank",
        "op": "mean",
        "reps": cfg.reps,
        "warmup": cfg.warmup,
        "error_feedback": cfg.ef,
        "timing": "time_s = max over ranks of the per-rank median over reps (barrier before each rep, CUDA "
                  "sync after); encode/comm/decode = CommStats medians per call of that slowest rank; "
                  "the row with torch: true (algorithm torch.distributed.all_reduce) is torch's own allreduce, "
                  "same protocol, and the baseline; ratio_vs_torch_allreduce = its time / this time, same run "
                  "and size; ratio_vs_fp32_allreduce = lowbit's fp32 allreduce time (codec fp32, algorithm "
                  "allreduce) / this time; *_min: the same from each rank's fastest rep; "
                  "raw_dist_all_reduce_s / ratio_vs_raw_dist_all_reduce: old names of the torch row's time "
                  "and ratio_vs_torch_allreduce; "
                  "rel_error = ||result - fp32 allreduce mean|| / ||mean|| after the last rep (max over ranks)",
        "sizes": [size_label(n) for n in cfg.sizes],
        "codecs": list(cfg.codecs),
        "algorithms": list(cfg.algorithms),
        "skipped": skipped,
    }


# ------------------------------------------------------------------------------------------ command
def run(args: argparse.Namespace) -> int:
    """Validate everything, launch (or join torchrun), print the table and write the JSON."""
    cfg = BenchConfig(
        backend=args.backend,
        sizes=tuple(parse_sizes(args.sizes)),
        codecs=tuple(parse_codecs(args.codecs)),
        algorithms=tuple(_with_node_size(parse_algorithms(args.algorithms))),
        reps=args.reps,
        warmup=args.warmup,
        ef=args.ef,
        progress=not args.quiet,
    )
    _, skipped = cfg.combos()
    json_path = Path(args.json) if args.json else None
    if json_path is not None and json_path.exists() and json_path.is_dir():
        raise ValueError(f"--json {args.json!r} is a directory")
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA GPUs, and none is visible; use --backend gloo on CPU")

    load_before = loadavg()
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world_size:
            raise ValueError(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={world_size}")
        # ends with a clean teardown of the process group (lowbit.launch.shutdown)
        timeout = datetime.timedelta(seconds=args.timeout)
        with process_group_from_env(cfg.backend, timeout=timeout) as (rank, world_size):
            result = worker(rank, world_size, cfg)
        if rank != 0:
            return 0
        launcher = "torchrun"
    else:
        world_size = 2 if args.world_size is None else args.world_size
        if world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {world_size}")
        if cfg.backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"--backend nccl needs one GPU per rank: {world_size} ranks, "
                             f"{torch.cuda.device_count()} GPUs visible")
        result = spawn(worker, world_size, cfg, backend=cfg.backend, timeout_s=args.timeout)[0]
        launcher = "lowbit.launch.spawn"

    assert result is not None
    rows = result["rows"]
    meta = _metadata(cfg, world_size, args.label or "", result["meta"], skipped, launcher, load_before)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"lowbit bench allreduce: {cfg.backend}, {world_size} ranks, {meta['device_name']}, "
          f"kernels {meta['kernel_backend']}, torch {meta['torch_version']}, median of {cfg.reps} reps"
          f"{', error feedback' if cfg.ef else ''}{', ' + meta['label'] if meta['label'] else ''}")
    if load_before and load_before[0] >= max(1.0, (os.cpu_count() or 1) / 4):
        print(f"warning: load average {load_before[0]:.1f} on {os.cpu_count()} CPUs before the run: other "
              "processes competed for the CPU, so these timings may be pessimistic")
    if meta["nccl_env"]:
        print("NCCL env: " + " ".join(f"{k}={v}" for k, v in meta["nccl_env"].items()))
    for s in skipped:
        print(f"skipped {s['codec']} / {s['algorithm']}: {s['reason']}")
    if json_path is not None:
        print(f"wrote {json_path}")
    print(format_table(rows))
    return 0


def load_bench(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read back what ``--json PATH`` wrote (the speed model calibrates on it); ValueError naming the problem."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"bench file {str(p)!r} does not exist")
    if p.is_dir():
        raise ValueError(f"bench file {str(p)!r} is a directory; give the JSON written by "
                         "`lowbit bench allreduce --json PATH`")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"bench file {str(p)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not isinstance(data.get("meta"), dict):
        raise ValueError(f"bench file {str(p)!r} is not `lowbit bench allreduce --json` output "
                         "(expected an object with 'meta' and 'rows')")
    need = ("numel", "codec", "algorithm", "time_s", "t_encode_s", "t_comm_s", "t_decode_s")
    for i, row in enumerate(data["rows"]):
        missing = [k for k in need if k not in row]
        if missing:
            raise ValueError(f"bench file {str(p)!r}: row {i} lacks {', '.join(missing)}")
    if not data["rows"]:
        raise ValueError(f"bench file {str(p)!r} has no rows")
    meta = data["meta"]
    meta.setdefault("path", str(p))
    meta.setdefault("transport", transport_key(str(meta.get("backend", "?")), meta.get("nccl_env")))
    return data


def transport_key(backend: str, nccl_env: dict[str, str] | None = None) -> str:
    """``gloo``, ``nccl``, or ``nccl/socket`` when NCCL was forced off P2P, shared memory and InfiniBand."""
    env = nccl_env or {}
    if backend == "nccl" and env:
        off = {k for k, v in env.items() if str(v) == "1"}
        if {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"} <= off:
            return "nccl/socket"
        if off:
            return "nccl/" + ",".join(sorted(k.removeprefix("NCCL_").removesuffix("_DISABLE").lower() + "-off"
                                             for k in off))
    return backend



def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` (with ``bench allreduce``) to the ``lowbit`` command."""
    bench = sub.add_parser("bench", help="benchmarks of the compressed collectives")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")

    def usage(args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=usage)
    p = bsub.add_parser(
        "allreduce",
        help="time compressed allreduce vs torch's own fp32 allreduce",
        description="Times lowbit.all_reduce per size x codec x algorithm on synthetic randn tensors and "
        "compares it with torch.distributed.all_reduce measured in the same run (its own row, the "
        "baseline of the ratios; lowbit's fp32 path is a separate row) (docs/bench.md). Launches "
        "its own processes, or joins a torchrun launch when RANK/WORLD_SIZE are set.",
    )
    p.add_argument("--world-size", type=int, default=None, help="processes to start (default 2; torchrun's under torchrun)")
    p.add_argument("--backend", default="gloo", help="gloo (CPU tensors) or nccl (GPU rank per process); default gloo")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"elements per tensor, comma-separated, suffix K/M/G = 2^10/2^20/2^30 (default {DEFAULT_SIZES})")
    p.add_argument("--codecs", action="extend", nargs="+", metavar="SPEC",
                   help="codec specs, separated by spaces, ';' or ',' (a 'key=value' item continues the spec "
                   "before it), as for every lowbit command. Default: " + " ".join(DEFAULT_CODECS))
    known = algorithm_choices()
    p.add_argument("--algorithms", default=",".join(a for a in known if a not in (SIMULATED, "hierarchical")),
                   help=f"comma-separated subset of {','.join(known)} (default all but simulated: Grubic "
                   "et al.'s simulated low-precision NCCL, an fp32 allreduce of the codec's wire size that "
                   "leaves the tensor unreduced; label it so; and hierarchical, which needs ranks per node: "
                   "$LOWBIT_NODE_SIZE or torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per case; the median is reported (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per case first (default 2)")
    p.add_argument("--ef", action="store_true", help="with error feedback (not for the native allreduce)")
    p.add_argument("--json", metavar="PATH", help="also write rows and metadata as JSON")
    p.add_argument("--label", default="", help="free text stored in the JSON metadata")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout per rank, seconds (default 600)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
