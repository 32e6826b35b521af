"""GPU time of one call, without the host's launch overhead and with a cold L2.

``triton.testing.do_bench`` times each call between two events after an L2-flushing memset; when the
host takes longer to issue a call than the GPU takes to run it (about 30 us of Python and launch per
call here, against 25-35 us of GPU work for 64 MiB on an H200), the GPU idles inside the timed region
and the figure measures the host. ``graph_ms`` captures ``reps`` rounds of (flush, call) into one CUDA
graph and subtracts a graph of the flushes alone: what is left is the GPU's own time per call, with
the same cold L2 as do_bench. Host overhead per call is reported separately by the benchmarks.
``print_rows`` prints the tuning scripts' closing table.
"""

from __future__ import annotations

import statistics

import torch

_FLUSH: dict[torch.device, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    if device not in _FLUSH:
        _FLUSH[device] = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=device)  # as do_bench
    return _FLUSH[device]


def _replay_ms(graph: torch.cuda.CUDAGraph, times: int) -> float:
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(times):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _flusher(dev: torch.device, flush: str):
    """What runs before each timed call. "zero": a 256 MiB memset, as do_bench (L2 then holds tens of MB
    of dirty lines of the memset, whose write-back the timed call pays as it evicts them); "clean": the
    memset and then a read of the same buffer (L2 cold and clean); "none": nothing (L2 warm)."""
    buf = _flush_buffer(dev)
    out = torch.empty((), dtype=torch.int32, device=dev)
    if flush == "zero":
        return buf.zero_
    if flush == "clean":
        return lambda: (buf.zero_(), torch.amax(buf, dim=0, out=out))
    if flush == "none":
        return lambda: None
    raise ValueError(f"flush must be 'zero', 'clean' or 'none', not {flush!r}")


def graph_ms(fn, reps: int = 20, times: int = 7, flush: str = "zero") -> float:
    """Median GPU milliseconds of one ``fn()`` with a cold L2 (see the module doc; ``flush``: _flusher)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    flush_fn = _flusher(dev, flush)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as graph capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    work, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(work):
        for _ in range(reps):
            flush_fn()
            fn()
    with torch.cuda.graph(flushes):
        for _ in range(reps):
            flush_fn()
    ms = (_replay_ms(work, times) - _replay_ms(flushes, times)) / reps
    del work, flushes
    torch.cuda.empty_cache()
    return ms


def warm_up(device: torch.device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a moment, so the first size is not timed on an idle card's clocks."""
    import time

    w = torch.empty(16 * 2**20, device=device)
    t_end = time.time() + seconds
    while time.time() < t_end:
        w.mul_(1.0)
    torch.cuda.synchronize()


def copy_ms(dst: torch.Tensor, src: torch.Tensor, timed) -> float:
    """Milliseconds of ``dst.copy_(src)``, the baseline of the bandwidth ratios: the faster (stricter) of
    ``timed(fn)`` and do_bench. Captured in a graph, a large copy_ can become a memcpy node run by a copy
    engine, slower than the SM copy kernel that an eager copy_ runs."""
    from triton.testing import do_bench

    fn = lambda: dst.copy_(src)  # noqa: E731
    return min(timed(fn), float(do_bench(fn, warmup=10, rep=40, return_mode="median")))


def print_rows(title: str, rows: list) -> None:
    """The short table the tuning scripts print last: a line per row of GPU time and % of copy (copy
    rows give the baseline's rate; rows may name a flush, a failure or different bytes)."""
    print(f"\n{title}")
    for r in rows:
        head = f"{r['size_mib']:5d} " + (f"{r['flush']:5s} " if "flush" in r else "")
        if r["what"] == "copy":
            print(f"{head}copy {r['GBps']:.0f} GB/s ({r['ms'] * 1e3:.1f} us)")
        elif "failed" in r:
            print(f"{head}FAILED {r['what']}: {r['failed'][:150]}")
        else:
            print(f"{head}{r['pct_copy']:6.1f}%  {r['ms'] * 1e3:8.1f} us  "
                  f"{'' if r.get('same_bytes', True) else 'DIFFERENT BYTES '}{r['what']}")
