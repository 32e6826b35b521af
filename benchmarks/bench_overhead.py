"""What lowbit itself adds to a training step, with the wire taken away (one process, any device).

    python benchmarks/bench_overhead.py --mode fsdp --model gpt_350m --device cuda --out fsdp.json
    python benchmarks/bench_overhead.py --mode ddp --model resnet50 --device cuda --out ddp.json
    python benchmarks/bench_overhead.py --mode fsdp --model tiny --out /tmp/o.json      # CPU smoke test

Why: on a fast link (NVLink, InfiniBand) a step's time is compute plus whatever the communication code
costs the host and the GPU beyond the transfer itself. This benchmark removes the transfer: the process
is rank 0 of a world of ``--world`` ranks whose collectives return at once and move nothing, so a step
is compute plus lowbit's (or FSDP's / DDP's) own work, and ``native ms / this ms`` in the same run says
what turning lowbit on costs where the link is free.

* FSDP2 (``--mode fsdp``): torch's fake process group (``FakeStore``, backend ``"fake"``). The model is
  sharded as on ``--world`` ranks (each rank computes its local batch with the whole model).
* DDP (``--mode ddp``): :class:`FreeWire`, a Python ``ProcessGroup`` of this file whose works complete at
  once with completed futures (DDP's reducer reads the future's value; torch's fake group gives none).
  Its ``allgather`` of tensor lists copies (DDP checks parameter shapes with one at construction);
  nothing else moves. ``LOWBIT_CHECK_CALLS=0``: fingerprints gathered over it never agree.

Neither group is visible to lowbit as anything but a process group of ``--world`` ranks: no code path
detects them, so what this benchmark gains a real run gains too.

Configurations (named as bench_fsdp.py / bench_ddp.py name them). FSDP: ``fsdp_bf16`` (native, bf16
reduce: the baseline), ``fsdp`` (native, fp32 reduce), ``bf16`` (lowbit bf16 wire, fp32 sums),
``bf16_r16`` (the same from FSDP's bf16 buffers), ``q8`` (8-bit QSGD gradients), ``q8_p8`` (+ 8-bit
parameters), ``q4_p8``, ``q4ef_p8`` (with error feedback). DDP: ``ddp`` (the baseline), ``fp16``
(PyTorch's hook), ``lowbit:SPEC`` for fp32, 8-bit, 4-bit QSGD and 1bitSGD*, ``lowbit:auto`` (timed after
it has decided).

Method: every configuration is built anew in every one of ``--rounds`` rounds (configurations in a
rotated order each round, so drift is shared), ``--warmup`` untimed steps, then ``--steps`` steps timed
between two synchronisations. ``ratio`` is the median over rounds of baseline ms / this ms in the same
round. In the last round, after the timed steps, each configuration is measured once more for its
breakdown (these steps are not in ``ms_per_step``):

* ``host_ms``: CPU time to issue one step from an idle GPU (sync, step, stop the clock before syncing);
* ``gpu_ms``, ``launches``: summed kernel time and kernel launches a step under torch.profiler (CUDA);
* ``call_host_ms``: host time per call of the communication objects (lowbit's hooks, FSDP's own
  ``DefaultReduceScatter`` / ``DefaultAllGather``, or the DDP comm hook), by direction;
  ``wire_bytes_per_step``: what this rank would send a step (lowbit's own count; FSDP's collectives from
  their tensors; DDP's all-reduce and torch's fp16 hook as a ring, 2(K-1)/K of the gradient);
* ``peak_mb``: peak allocated device memory during the timed steps (``mem_ratio`` against the
  baseline's; static buffers, CUDA graphs and their pools included), ``residual_mb`` the error-feedback
  residuals, ``mem_ratio_ex_residual`` the ratio without them.

Output: ``{"meta": {...}, "rows": [{"mode", "model", "batch", "config", "ms_per_step", "ratio", "host_ms",
"gpu_ms", "launches", ...}]}`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

FSDP_CONFIGS = ("fsdp_bf16", "fsdp", "bf16", "bf16_r16", "q8", "q8_p8", "q4_p8", "q4ef_p8")
DDP_CONFIGS = ("ddp", "fp16", "lowbit:fp32", "lowbit:qsgd:bits=8,bucket=512", "lowbit:qsgd:bits=4,bucket=512",
               "lowbit:onebit:bucket=64", "lowbit:auto")
BASELINE = {"fsdp": "fsdp_bf16", "ddp": "ddp"}


# ----------------------------------------------------------------------------------------- free wire
def _done(result: Any) -> Any:
    from torch._C._distributed_c10d import _create_work_from_future

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class FreeWire(dist.ProcessGroup):
    """A process group whose collectives complete at once and move nothing (see the module docstring)."""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "freewire"

    def allreduce(self, tensors, opts):  # noqa: ANN001
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts):  # noqa: ANN001
        return _done(tensors)

    def broadcast(self, tensors, opts):  # noqa: ANN001
        return _done(tensors)

    def barrier(self, opts):  # noqa: ANN001
        return _done([])

    def allgather(self, outs, ins, opts):  # noqa: ANN001 - DDP's parameter-shape check at construction
        for out, x in zip(outs, ins):
            for o in out:
                o.copy_(x)
        return _done(outs)

    def _allgather_base(self, out, x, opts):  # noqa: ANN001
        return _done([out])

    def all_gather_single(self, out, x, opts=None):  # noqa: ANN001
        return _done([out])

    def alltoall_base(self, out, x, out_splits, in_splits, opts):  # noqa: ANN001
        return _done([out])

    def reduce_scatter(self, outs, ins, opts):  # noqa: ANN001
        return _done(outs)

    def _reduce_scatter_base(self, out, x, opts):  # noqa: ANN001
        return _done([out])

    def reduce_scatter_single(self, out, x, opts=None):  # noqa: ANN001
        return _done([out])


class Mirror(FreeWire):
    """``--wire mirror``: a free wire that hands back real, finite bytes, as if every rank held this one's
    data: all-to-all returns what it was given (rank j sent me what I sent j), all-gather gives every
    rank my shard, reduce-scatter my own chunk. Costs the local copies a collective makes anyway."""

    def getBackendName(self) -> str:  # noqa: N802
        return "mirror"

    def setGroupName(self, name: str) -> None:  # noqa: N802 - DeviceMesh reads the group's name
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return getattr(self, "_name", "mirror")

    def _allgather_base(self, out, x, opts=None):  # noqa: ANN001
        for row in out.view(-1, x.numel()):
            if row.data_ptr() != x.data_ptr():  # FSDP gathers in place: its input is its own slot
                row.copy_(x.view(-1))
        return _done([out])

    all_gather_single = _allgather_base  # (the name newer torch calls)

    def alltoall_base(self, out, x, out_splits, in_splits, opts):  # noqa: ANN001
        out.copy_(x)
        return _done([out])

    def _reduce_scatter_base(self, out, x, opts=None):  # noqa: ANN001
        out.copy_(x.view(-1, out.numel())[0])
        return _done([out])

    reduce_scatter_single = _reduce_scatter_base


def init_group(mode: str, world: int, wire: str = "fake") -> None:
    if wire == "mirror":
        os.environ["LOWBIT_CHECK_CALLS"] = "0"
        dist.Backend.register_backend("mirror", lambda store, rank, size, timeout: Mirror(rank, size),
                                      devices=["cpu", "cuda"])
        dist.init_process_group("mirror", store=dist.HashStore(), rank=0, world_size=world)
        return
    if mode == "fsdp":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        os.environ["LOWBIT_CHECK_CALLS"] = "0"
        dist.Backend.register_backend("freewire", lambda store, rank, size, timeout: FreeWire(rank, size),
                                      devices=["cpu", "cuda"])
        dist.init_process_group("freewire", store=dist.HashStore(), rank=0, world_size=world)


# ----------------------------------------------------------------------------------------- configs
class Run:
    """One configuration, built: ``step()`` runs one training step; ``state`` is lowbit's (or None)."""

    def __init__(self, step: Callable[[], None], state: Any, model: nn.Module,
                 native_ddp_bytes: int | None = None) -> None:
        self.step, self.state, self.model = step, state, model
        self.native_ddp_bytes = native_ddp_bytes  # DDP's own all-reduce (or torch's hook): bytes a step

    def residual_mb(self) -> float:
        """Error feedback's residual memory: FSDP's (``state.feedback.residuals``) or DDP's
        (``state.residuals``, name -> tensor)."""
        fb = getattr(self.state, "feedback", None)
        res = getattr(fb, "residuals", None) or getattr(self.state, "residuals", None) or {}
        return sum(t.numel() * t.element_size() for t in res.values() if isinstance(t, torch.Tensor)) / 2**20


def build_fsdp(args: argparse.Namespace, config: str, device: torch.device) -> Run:
    import bench_fsdp
    from torch.nn import functional as F

    ns = argparse.Namespace(model=args.model, seq=args.seq, lr=1e-4, node_size=None)
    vocab = 50257 if args.model != "tiny" else 256
    with torch.device(device):
        model, opt, state = bench_fsdp.build(ns, config, vocab, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return Run(step, state, model)


def build_ddp(args: argparse.Namespace, config: str, device: torch.device) -> Run:
    import bench_ddp

    if args.model == "tiny":
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        feed = {"in_shape": (256,), "classes": 10, "tokens": False, "seq_targets": False, "batch": args.batch,
                "bf16": False}
    else:
        ns = argparse.Namespace(seq=args.seq, batch=args.batch, gpt_batch=args.batch)
        torch.manual_seed(0)
        model, feed = bench_ddp.build(args.model, ns)
    model = model.to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    register = ddp.register_comm_hook
    ddp.register_comm_hook = lambda state, hook: register(state, _timed_hook(hook))  # type: ignore[method-assign]
    state = bench_ddp.register_hook(ddp, config, argparse.Namespace(lowbit_algorithm=None, lowbit_message_mb=None))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    x, y = bench_ddp.make_batch(feed, device, 0)
    bf16 = feed["bf16"] and device.type == "cuda"

    def step() -> None:
        bench_ddp.train_step(ddp, opt, x, y, bf16)

    grad = sum(p.numel() for p in model.parameters() if p.requires_grad)
    k = dist.get_world_size()
    # a ring all-reduce sends 2(K-1)/K of the message; codec="auto" keeps DDP's own fp32 one where it
    # installs no hook
    width = {"ddp": 4, "fp16": 2, "lowbit:auto": 4}.get(config)
    return Run(step, state, ddp, 2 * (k - 1) * grad * width // k if width else None)


def warmup_steps(run: Run, args: argparse.Namespace) -> int:
    """``--warmup``, and with codec="auto" enough to be past its decision (DDP: its latest possible step)."""
    st = run.state
    auto = getattr(st, "auto", None)
    if auto is None:
        return args.warmup
    if hasattr(auto, "last_decision_step"):  # DDP's tuner
        import bench_ddp

        return max(args.warmup, auto.last_decision_step(st.start_iter) + 1 + bench_ddp.AUTO_STEADY)
    return args.warmup


def warm(run: Run, args: argparse.Namespace) -> None:
    for _ in range(warmup_steps(run, args)):
        run.step()
    auto = getattr(run.state, "auto", None)
    i = 0
    while auto is not None and getattr(auto, "decision", "") is None and i < 200:  # FSDP's auto: until decided
        run.step()
        i += 1


# ----------------------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed(run: Run, steps: int, device: torch.device) -> float:
    """ms per step over ``steps`` steps between two synchronisations."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        run.step()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def host_ms(run: Run, device: torch.device, reps: int = 5) -> float:
    """Median CPU time to issue one step from an idle GPU."""
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        run.step()
        out.append((time.perf_counter() - t0) * 1e3)
        sync(device)
    return statistics.median(out)


def _comm_classes() -> dict[str, type]:
    """The communication objects whose calls are timed, by direction."""
    out: dict[str, type] = {}
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

        out["fsdp_reduce_scatter"], out["fsdp_all_gather"] = fc.DefaultReduceScatter, fc.DefaultAllGather
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        pass
    try:
        import lowbit.fsdp as lf

        out["lowbit_reduce_scatter"], out["lowbit_all_gather"] = lf.LowbitReduceScatter, lf.LowbitAllGather
    except ImportError:  # pragma: no cover
        pass
    return out


def _native_bytes(name: str, a: tuple, kw: dict) -> int:
    """Bytes this rank sends in one of FSDP's own collectives (ring: K-1 chunks of its shard)."""
    x = kw.get("input_tensor", a[1] if len(a) > 1 else None)
    group = kw.get("group", a[2] if len(a) > 2 else None)
    if x is None or group is None:
        return 0
    k = group.size()
    per = x.numel() * x.element_size()
    return (k - 1) * per // k if name == "fsdp_reduce_scatter" else (k - 1) * per


def _lowbit_bytes(run: Run) -> int:
    stats = getattr(run.state, "stats", None)
    return int(getattr(stats, "bytes_sent", 0) or 0)


def call_host_ms(run: Run, device: torch.device, steps: int = 3) -> tuple[dict[str, dict[str, float]], int | None]:
    """Host time per call of each communication class over ``steps`` steps: {name: {calls, ms_per_call}},
    and the bytes this rank put on the wire a step (FSDP's own collectives counted from their tensors,
    lowbit's from its statistics, DDP's own all-reduce as a ring's 2(K-1)/K of the gradient)."""
    times: dict[str, list[float]] = {}
    native = [0]
    saved = []
    for name, cls in _comm_classes().items():
        orig = cls.__call__

        def wrapper(self, *a, __orig=orig, __name=name, **kw):  # noqa: ANN001
            if __name.startswith("fsdp_"):
                native[0] += _native_bytes(__name, a, kw)
            t0 = time.perf_counter()
            try:
                return __orig(self, *a, **kw)
            finally:
                times.setdefault(__name, []).append((time.perf_counter() - t0) * 1e3)

        saved.append((cls, orig))
        cls.__call__ = wrapper  # type: ignore[method-assign]
    HOOK_TIMES.clear()
    HOOK_TIMES["on"] = times
    before = _lowbit_bytes(run)
    try:
        for _ in range(steps):
            run.step()
        sync(device)
    finally:
        HOOK_TIMES.clear()
        for cls, orig in saved:
            cls.__call__ = orig  # type: ignore[method-assign]
    counted = _lowbit_bytes(run) - before
    wire = (counted + native[0]) / steps
    if run.native_ddp_bytes is not None and counted == 0:  # DDP's own all-reduce (auto: where it kept it)
        wire = run.native_ddp_bytes
    calls = {k: {"calls": len(v) / steps, "ms_per_call": statistics.median(v)} for k, v in sorted(times.items())}
    return calls, int(wire)


#: while call_host_ms runs: {"on": its dict of times}; empty otherwise
HOOK_TIMES: dict[str, dict[str, list[float]]] = {}


def _timed_hook(fn: Callable) -> Callable:
    """A DDP comm hook that times ``fn``'s host time per bucket while :func:`call_host_ms` runs (one extra
    Python call a bucket otherwise, for torch's hooks and lowbit's alike)."""
    def hook(state, bucket):  # noqa: ANN001
        times = HOOK_TIMES.get("on")
        if times is None:
            return fn(state, bucket)
        t0 = time.perf_counter()
        try:
            return fn(state, bucket)
        finally:
            times.setdefault("ddp_comm_hook", []).append((time.perf_counter() - t0) * 1e3)
    hook.__name__ = getattr(fn, "__name__", "hook")
    return hook


def profiled(run: Run, device: torch.device, steps: int = 3,
             trace: str = "") -> tuple[float | None, float | None, list]:
    """(GPU kernel ms a step, kernel launches a step, the 12 kernels of most time: [name, ms a step,
    launches a step]) under torch.profiler; (None, None, []) on CPU. ``trace``: also write the
    profiler's Chrome trace there (gzipped JSON; every thread, every stream)."""
    if device.type != "cuda":
        return None, None, []
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.step()
        sync(device)
    if trace:
        import gzip
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            prof.export_chrome_trace(tmp.name)
            with open(tmp.name, "rb") as src, gzip.open(trace, "wb") as dst:
                dst.write(src.read())
    kernel_us, launches = 0.0, 0
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            # kernels, copies and sets (not the record_function ranges the profiler also puts on the GPU)
            us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
            kernel_us += us
            k = per.setdefault(e.name[:90], [0.0, 0])
            k[0] += us
            k[1] += 1
        elif "LaunchKernel" in e.name:
            launches += 1
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:12]
    return kernel_us / 1e3 / steps, launches / steps, [[n, us / 1e3 / steps, c / steps] for n, (us, c) in top]


def finite(run: Run) -> bool:
    """Whether every parameter is still finite (a free wire's outputs are whatever memory held: with the
    fake group a step can turn values non-finite, which sends codecs down their slow, non-finite path)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                   for p in run.model.parameters())


def syncs(run: Run, device: torch.device, steps: int = 2) -> list[dict[str, Any]]:
    """The calls that make the host wait for the GPU during ``steps`` steps (CUDA): torch's sync debug mode
    warns at each; every warning's thread and the innermost frames of its Python stack, counted, most
    frequent first. A wait on the hook thread or in the autograd thread stalls the host's run-ahead."""
    if device.type != "cuda":
        return []
    import threading
    import traceback
    import warnings

    seen: dict[tuple[str, str], int] = {}

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "warnings.py" not in f.filename][-8:]
        key = (threading.current_thread().name, " <- ".join(reversed(stack)))
        seen[key] = seen.get(key, 0) + 1

    sync(device)
    with warnings.catch_warnings():  # (restores showwarning and the filters on the way out)
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                run.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return [{"thread": t, "stack": st, "per_step": n / steps}
            for (t, st), n in sorted(seen.items(), key=lambda kv: -kv[1])][:20]


def cprofile(run: Run, device: torch.device, path: str, steps: int = 3) -> None:
    """Write cProfile's top functions (by internal time, then cumulative) over ``steps`` steps to ``path``."""
    import cProfile
    import io
    import pstats

    sync(device)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        run.step()
    sync(device)
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(45)
    Path(path).write_text(f"{steps} steps\n" + buf.getvalue())


# ----------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fsdp", "ddp"), required=True)
    ap.add_argument("--model", default="tiny", help="tiny (smoke test), or a lowbit.lab.models name (gpt_350m; "
                    "gpt2_small, resnet50, alexnet for DDP)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--wire", choices=("fake", "mirror"), default="fake", help="fake: torch's fake group (FSDP) "
                    "or FreeWire (DDP), nothing moves; mirror: every collective hands back this rank's own "
                    "bytes (finite values throughout, at the cost of local copies)")
    ap.add_argument("--world", type=int, default=2, help="ranks the free-wire group pretends to have (>= 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences or samples per rank (default: 16 for "
                    "FSDP and GPT, 64 for DDP's CNNs, 4 for tiny)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 1024 FSDP, 256 DDP, 32 tiny)")
    ap.add_argument("--configs", default=None, help="comma-separated (FSDP) or ';'-separated (DDP); default: all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cprofile", default="", help="configs (same separator as --configs) whose host time is "
                    "also profiled with cProfile over 3 steps in the last round: OUT.cprofile.CONFIG.txt")
    ap.add_argument("--trace", default="", help="configs (same separator as --configs) whose profiled steps are "
                    "also written as a Chrome trace: OUT.trace.CONFIG.json.gz")
    ap.add_argument("--syncs", default="", help="configs (same separator as --configs) whose steps run once more "
                    "under torch.cuda.set_sync_debug_mode('warn') in the last round: every call that makes the host "
                    "wait for the GPU, with its thread and Python stack, counted (the row's 'syncs')")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds) for the "
                    "whole run: how long a thread that wants the GIL waits for its holder (Python's default 0.005)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error("--world must be at least 2 (with one rank lowbit compresses nothing)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    tiny = args.model == "tiny"
    args.batch = args.batch or (4 if tiny else 16 if (args.mode == "fsdp" or args.model.startswith("gpt")) else 64)
    args.seq = args.seq or (32 if tiny else 1024 if args.mode == "fsdp" else 256)
    names = FSDP_CONFIGS if args.mode == "fsdp" else DDP_CONFIGS
    if args.configs:
        names = tuple(c.strip() for c in args.configs.split("," if args.mode == "fsdp" else ";") if c.strip())
    base = BASELINE[args.mode]
    if base not in names:
        names = (base, *names)
    args.names = names
    args.trace_names = set(c.strip() for c in args.trace.split("," if args.mode == "fsdp" else ";") if c.strip())
    args.sync_names = set(c.strip() for c in args.syncs.split("," if args.mode == "fsdp" else ";") if c.strip())
    args.cprofile_names = set(c.strip() for c in args.cprofile.split("," if args.mode == "fsdp" else ";") if c.strip())
    for r in ("rounds", "steps"):
        if getattr(args, r) < 1:
            ap.error(f"--{r} must be at least 1")
    return args


def meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    commit = os.environ.get("LOWBIT_GIT_COMMIT") or commit  # (the device's copy of the history may be stale)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"card": card, "commit": commit, "dirty": dirty, "torch": torch.__version__, "mode": args.mode,
            "model": args.model, "world": args.world, "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "baseline": BASELINE[args.mode],
            "threads": torch.get_num_threads(), "switch_interval_s": sys.getswitchinterval(),
            "wire": "mirror (collectives hand back this rank's bytes)" if args.wire == "mirror"
            else "free (fake process group)" if args.mode == "fsdp" else "free (FreeWire: works complete at once)"}


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return format("-", fmt.split(".")[0] + "s") if v is None else format(v, fmt)

    lines = [f"{'config':34} {'ms/step':>8} {'ratio':>6} {'host ms':>8} {'gpu ms':>7} {'launch':>7} "
             f"{'call ms':>8} {'mem':>6}"]
    for r in rows:
        calls = [c["ms_per_call"] for k, c in r["call_host_ms"].items() if k.startswith(("lowbit", "ddp_comm"))]
        if not calls:
            calls = [c["ms_per_call"] for c in r["call_host_ms"].values()]
        lines.append(f"{r['config'][:34]:34} {r['ms_per_step']:8.2f} {r['ratio']:6.3f} {f(r['host_ms'], '8.2f')} "
                     f"{f(r['gpu_ms'], '7.2f')} {f(r['launches'], '7.0f')} {f(max(calls) if calls else None, '8.3f')} "
                     f"{f(r['mem_ratio'], '6.3f')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    init_group(args.mode, args.world, args.wire)
    build = build_fsdp if args.mode == "fsdp" else build_ddp
    names, base = args.names, BASELINE[args.mode]
    ms: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, list[float]] = {n: [] for n in names}
    extra: dict[str, dict[str, Any]] = {}
    try:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                free(device)
                run = build(args, name, device)
                warm(run, args)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                ms[name].append(timed(run, args.steps, device))
                peak[name].append(torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0)
                if r == args.rounds - 1:
                    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)  # (a file name any copy tool keeps)
                    gpu, launches, top = profiled(run, device, trace=f"{args.out}.trace.{tag}.json.gz"
                                                  if name in args.trace_names else "")
                    calls, wire = call_host_ms(run, device)
                    extra[name] = {"host_ms": host_ms(run, device), "gpu_ms": gpu, "launches": launches,
                                   "top_kernels": top, "finite": finite(run), "call_host_ms": calls,
                                   "wire_bytes_per_step": wire,
                                   "residual_mb": run.residual_mb(),
                                   "auto": _auto(run.state)}
                    if name in args.sync_names:
                        extra[name]["syncs"] = syncs(run, device)
                    if name in args.cprofile_names:
                        cprofile(run, device, f"{args.out}.cprofile.{tag}.txt")
                print(f"round {r + 1}/{args.rounds} {name}: {ms[name][-1]:.2f} ms/step", file=sys.stderr, flush=True)
                del run
    finally:
        dist.destroy_process_group()
    rows = []
    for name in names:
        ratios = [b / m for b, m in zip(ms[base], ms[name])]
        pk = statistics.median(peak[name])
        bpk = statistics.median(peak[base])
        rows.append({"mode": args.mode, "model": args.model, "batch": args.batch, "config": name,
                     "ms_per_step": statistics.median(ms[name]), "ratio": statistics.median(ratios),
                     "ratios": ratios, "ms_rounds": ms[name], "peak_mb": pk if device.type == "cuda" else None,
                     "mem_ratio": pk / bpk if device.type == "cuda" and bpk else None, **extra[name]})
        r = rows[-1]
        r["mem_ratio_ex_residual"] = ((pk - r["residual_mb"]) / bpk) if device.type == "cuda" and bpk else None
    out = {"meta": meta(args, device), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(rows))
    return 0


def _auto(state: Any) -> Any:
    auto = getattr(state, "auto", None)
    if auto is None:
        return None
    for attr in ("chosen", "decision"):
        if hasattr(auto, attr):
            try:
                return json.loads(json.dumps(getattr(auto, attr), default=str))
            except (TypeError, ValueError):
                return str(getattr(auto, attr))
    return None


if __name__ == "__main__":
    sys.exit(main())
