"""Timing of compressed allreduces against the native fp32 allreduce: the measuring half of ``lowbit
bench allreduce`` (:mod:`lowbit.lab.cli.bench` parses the arguments, launches, prints and writes; the
measurement plan is in its doc). Every rank runs :func:`worker` with the same :class:`BenchConfig`."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

import torch

from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import CommStats, all_reduce, bytes_sent_per_rank
from lowbit.comm.collectives import all_gather_object
from lowbit.env import device_name
from lowbit.feedback import ErrorFeedback
from lowbit.kernels.dispatch import backend_for

__all__ = ["BenchConfig", "worker", "BASELINE", "LOWBIT_FP32", "TORCH_ALGORITHM", "size_label"]

#: lowbit's own fp32 path (``lowbit.all_reduce(t, "fp32", algorithm="allreduce")``): a row of its own.
LOWBIT_FP32 = ("fp32", "allreduce")
#: Old name of :data:`LOWBIT_FP32` (it was the ratios' baseline before torch's own allreduce became it).
BASELINE = LOWBIT_FP32
#: The ``algorithm`` of the row of ``torch.distributed.all_reduce`` itself, the baseline of the ratios.
TORCH_ALGORITHM = "torch.distributed.all_reduce"
SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_label(n: int) -> str:
    for suffix in ("G", "M", "K"):
        if n % SIZE_SUFFIX[suffix] == 0:
            return f"{n // SIZE_SUFFIX[suffix]}{suffix}"
    return str(n)




@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run, validated; what every rank receives."""

    backend: str
    sizes: tuple[int, ...]
    codecs: tuple[str, ...]
    algorithms: tuple[str, ...]
    reps: int = 10
    warmup: int = 2
    ef: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"--backend must be gloo or nccl, got {self.backend!r}")
        if self.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {self.reps}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")

    def combos(self) -> tuple[list[tuple[str, str]], list[dict[str, str]]]:
        """(codec, algorithm) pairs of lowbit to time per size, its fp32 allreduce first; and the skipped.
        (torch's own allreduce, the baseline of the ratios, is timed besides them.)"""
        pairs, skipped = [LOWBIT_FP32], []
        for spec in self.codecs:
            codec = get_codec(spec)
            for algo in self.algorithms:
                if algo == "allreduce" and not codec.sums_on_wire:
                    skipped.append({"codec": spec, "algorithm": algo,
                                    "reason": "allreduce sums on the wire: fp32/fp16/bf16 only"})
                elif (codec.spec, algo) != (get_codec(LOWBIT_FP32[0]).spec, LOWBIT_FP32[1]):
                    pairs.append((spec, algo))
        return pairs, skipped


# ------------------------------------------------------------------------------------------ worker
def _device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # set to the rank's GPU by the launcher
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    import torch.distributed as dist

    _sync(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def _numba_threads() -> int | None:
    """numba's thread count in this process, if the numba kernels were loaded."""
    numba = sys.modules.get("numba")
    return int(numba.get_num_threads()) if numba is not None else None


RAW = ("torch.distributed", "all_reduce")  # torch.distributed.all_reduce itself (sum, in place)


def _timed_call(t: torch.Tensor, x0: torch.Tensor, case: tuple[str, str], feedback: ErrorFeedback | None,
                seed: int, stats: CommStats | None, device: torch.device) -> float:
    """Reset ``t`` to this rank's input, line the ranks up, and time one call (seconds)."""
    import torch.distributed as dist

    t.copy_(x0)
    _barrier(device)
    t0 = time.perf_counter()
    if case == RAW:
        if dist.get_world_size() > 1:
            dist.all_reduce(t)
    else:
        all_reduce(t, case[0], algorithm=case[1], op="mean", feedback=feedback, seed=seed, stats=stats)
    _sync(device)
    return time.perf_counter() - t0


def _measure_size(n: int, rank: int, cfg: BenchConfig, pairs: list[tuple[str, str]], device: torch.device,
                  bar: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """This rank's medians for every case at size n.

    The reps go round-robin over the cases (rep 0 of every case, then rep 1, ...), so a burst of other
    load on the machine slows every case alike instead of whichever case it happened to fall on: the
    ratios to the baseline stay fair on a busy machine.
    """
    g = torch.Generator().manual_seed(1_000 * rank + 17)
    x0 = torch.randn(n, generator=g, device="cpu").to(device)  # (n,) float32, synthetic
    t = torch.empty_like(x0)
    cases = [RAW, *pairs]
    feedback = {c: ErrorFeedback(c[0]) if cfg.ef and c[1] != "allreduce" and c != RAW else None for c in cases}
    split_pass = device.type == "cuda"  # CommStats' timers synchronise the device: keep them off the clock
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    stats: dict[tuple[str, str], list[CommStats]] = {c: [] for c in cases}
    rel_err: dict[tuple[str, str], float] = {}
    raw_sum = None  # torch's allreduce sums: its result over k is the mean the others compute
    for i in range(cfg.warmup):
        for c in cases:
            _timed_call(t, x0, c, feedback[c], 10_000 + i, None, device)
            if bar is not None:
                bar.update(1)
    for i in range(cfg.reps):
        exact = None  # this rep's mean from the fp32 allreduce (the baseline comes right after RAW)
        for c in cases:
            s = CommStats(timing=True) if not split_pass and c != RAW else None
            times[c].append(_timed_call(t, x0, c, feedback[c], i, s, device))
            if s is not None:
                stats[c].append(s)
            if c == RAW and i == cfg.reps - 1:
                raw_sum = t.clone()
            if c == LOWBIT_FP32:
                exact = t.clone()
                if raw_sum is not None:
                    rel_err[RAW] = float((raw_sum / dist_world() - exact).norm() / exact.norm().clamp_min(1e-30))
            elif c != RAW and i == cfg.reps - 1:
                # A sanity check, not a quality study: a broken kernel must not pass as a fast one.
                rel_err[c] = float((t - exact).norm() / exact.norm().clamp_min(1e-30))
            if bar is not None:
                bar.update(1)
    if split_pass:
        for i in range(cfg.reps):
            for c in pairs:
                s = CommStats(timing=True)
                _timed_call(t, x0, c, feedback[c], cfg.reps + i, s, device)
                stats[c].append(s)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for c in pairs:
        out[c] = {
            "time_s": statistics.median(times[c]),
            "time_min_s": min(times[c]),
            "t_encode_s": statistics.median(s.t_encode for s in stats[c]),
            "t_comm_s": statistics.median(s.t_comm for s in stats[c]),
            "t_decode_s": statistics.median(s.t_decode for s in stats[c]),
            "bytes_sent": max(s.bytes_sent for s in stats[c]),
            "rel_error": rel_err.get(c, 0.0),
        }
    # torch's allreduce has no CommStats: all of its time is communication, its bytes a ring's.
    k = dist_world()
    out[RAW] = {"time_s": statistics.median(times[RAW]), "time_min_s": min(times[RAW]), "t_encode_s": 0.0,
                "t_comm_s": statistics.median(times[RAW]), "t_decode_s": 0.0,
                "bytes_sent": bytes_sent_per_rank(get_codec("fp32"), n, k, "allreduce"),
                "rel_error": rel_err.get(RAW, 0.0)}
    return out


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def worker(rank: int, world_size: int, cfg: BenchConfig) -> dict[str, Any] | None:
    """Run the grid on this rank; rank 0 returns ``{"rows": [...], "meta": {...}}``, the others None."""
    device = _device(cfg.backend)
    pairs, _ = cfg.combos()
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        calls = len(cfg.sizes) * (len(pairs) + 1) * (cfg.warmup + cfg.reps)
        bar = tqdm(total=calls, desc="bench allreduce", unit="call", file=sys.stderr, leave=False)
    rows = []
    for n in cfg.sizes:
        if bar is not None:
            bar.set_postfix_str(f"size {size_label(n)}")
        mine = _measure_size(n, rank, cfg, pairs, device, bar)
        per_rank = all_gather_object(mine, None)  # every rank's medians; rank 0 reports the slowest
        if rank == 0:
            rows += [_row(n, spec, algo, cfg, [r[(spec, algo)] for r in per_rank]) for spec, algo in [RAW, *pairs]]
    if bar is not None:
        bar.close()
    # Which kernels ran, asked after the run (each process loads a backend once, on first use).
    kernels = all_gather_object(backend_for(torch.empty(1 << 20, device=device), "qsgd_encode").__name__, None)
    if rank != 0:
        return None
    _add_ratios(rows)
    kernel = kernels[0] if len(set(kernels)) == 1 else ", ".join(f"rank {r}: {k}" for r, k in enumerate(kernels))
    return {"rows": rows, "meta": {"device_name": device_name(device), "kernel_backend": kernel,
                                   "torch_threads_per_rank": torch.get_num_threads(),
                                   "numba_threads_per_rank": _numba_threads()}}


def _row(n: int, spec: str, algo: str, cfg: BenchConfig, per_rank: list[Any]) -> dict[str, Any]:
    slowest = max(per_rank, key=lambda r: r["time_s"])
    time_s = slowest["time_s"]
    torch_row = (spec, algo) == RAW
    return {
        "size": size_label(n),
        "numel": n,
        "codec": "fp32" if torch_row else spec,
        "codec_spec": "fp32" if torch_row else get_codec(spec).spec,
        "algorithm": TORCH_ALGORITHM if torch_row else algo,
        "torch": torch_row,  # torch.distributed.all_reduce itself, not lowbit
        "baseline": torch_row,  # the baseline of the ratios
        "error_feedback": cfg.ef and algo != "allreduce" and not torch_row,
        "time_s": time_s,
        "time_min_s": max(r["time_min_s"] for r in per_rank),
        "algbw_GBps": 4 * n / time_s / 1e9,
        "bytes_sent_per_rank": max(r["bytes_sent"] for r in per_rank),
        "fp32_bytes": 4 * n,
        "t_encode_s": slowest["t_encode_s"],
        "t_comm_s": slowest["t_comm_s"],
        "t_decode_s": slowest["t_decode_s"],
        "rel_error": max(r["rel_error"] for r in per_rank),
        "per_rank": per_rank,
    }


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratios against torch's own allreduce (the headline) and, for files that older readers parse,
    against lowbit's fp32 allreduce, both measured in the same run at the same size."""
    torch_t = {r["numel"]: r["time_s"] for r in rows if r["torch"]}
    torch_min = {r["numel"]: r["time_min_s"] for r in rows if r["torch"]}
    fp32 = {r["numel"]: r for r in rows if not r["torch"] and (r["codec"], r["algorithm"]) == LOWBIT_FP32}
    for r in rows:
        n = r["numel"]
        r["ratio_vs_torch_allreduce"] = torch_t[n] / r["time_s"]
        # The same from each rank's fastest rep: less sensitive to other load on a shared machine.
        r["ratio_vs_torch_allreduce_min"] = torch_min[n] / r["time_min_s"]
        r["ratio_vs_fp32_allreduce"] = fp32[n]["time_s"] / r["time_s"]
        r["ratio_vs_fp32_allreduce_min"] = fp32[n]["time_min_s"] / r["time_min_s"]
        r["raw_dist_all_reduce_s"] = torch_t[n]  # old name of the torch row's time_s
        r["ratio_vs_raw_dist_all_reduce"] = r["ratio_vs_torch_allreduce"]


# ------------------------------------------------------------------------------------------ output
