"""End-to-end DDP training throughput: plain DDP vs PyTorch's comm hooks vs lowbit's, per model.

    # 2 GPUs (NCCL, one GPU per rank); defaults: vgg19,resnet50,alexnet,gpt2_small x 7 hook configs
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --link nvlink
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 \\
        PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --link sockets
    # CPU / gloo (defaults to the ~10M-parameter MLP and ddp;lowbit:fp32;lowbit:qsgd:bits=8,bucket=512)
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --device cpu
    # one config profiled on rank 0 (chrome trace + key_averages table)
    ... bench_ddp.py --models resnet50 --profile /tmp/prof --profile-hook "lowbit:qsgd:bits=4,bucket=512"

Hook configs (``--hooks``, separated by ``;`` since codec specs contain commas):

* ``ddp`` — plain DDP, no hook (its fp32 bucketed allreduce);
* ``allreduce`` — ``default_hooks.allreduce_hook``: plain DDP's fp32 allreduce, but called as a Python
  hook (what any Python comm hook costs the host, before it does any work);
* ``fp16`` / ``bf16`` — ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``;
* ``powersgd`` — ``powerSGD_hook`` with rank 4, ``start_powerSGD_iter=2``, error feedback, warm start
  (these three registered by ``lowbit.lab.baselines``, as the study's ``torch:fp16`` / ``torch:bf16`` /
  ``torch:powersgd:rank=4``: torch's hooks as they are, PowerSGD's buckets chained on gloo);
* ``lowbit:SPEC`` — ``lowbit.ddp.register(ddp_model, codec=SPEC)`` (``--lowbit-algorithm`` passed as
  ``algorithm=`` only when given; everything else is the library's default, so onebit gets error feedback);
  ``lowbit[mb=256,algorithm=allgather,thread=0]:SPEC`` sets ``message_mb`` / ``algorithm`` /
  ``hook_thread`` for that config alone, so one run can compare them; ``lowbit:auto`` is ``codec="auto"``
  and ``lowbit[level=bold]:auto`` its bold setting (``auto_level``; ``guard=N``: ``guard_every``).

Protocol, per model: the model is built once per rank (same seed); for each hook config a deep copy goes
to the device, is wrapped in DDP and gets the hook; SGD (lr 0.01, momentum 0.9) runs ``--warmup`` steps
(lowbit and PowerSGD compress only from iteration 2 on), then ``--steps`` timed steps between a device
synchronisation + barrier and a synchronisation. The step time is the slowest rank's; samples/s =
world * batch * steps / elapsed. The hook list runs ``--rounds`` times interleaved (round 1: every hook,
round 2: every hook, ...) and the median per hook is reported, with every raw value. Inputs are one fixed
synthetic batch per model (random images / tokens and labels): this measures the training step, not
data loading. gpt2_small runs under bf16 autocast on CUDA; the CNNs and the MLP in fp32.

A config that raises is recorded as an error row and the run goes on when every rank raised (a
deterministic failure, e.g. a bad spec or a hook bug); if only some ranks did, the collectives may be out
of step, so the script stops (``--stop-on-error`` stops on any error). Bookkeeping (barriers, the slowest
rank's time, the error agreement) goes over a separate gloo group, so it never queues behind NCCL work.

The JSON (``--out``; default ``benchmarks/results/ddp_<world>x<device>_<link>.json``) holds the device,
world size, torch / triton versions, NCCL environment, link label, git commit and, per model and hook:
samples/s (median and raw), step time, ratios vs ddp / fp16 / powersgd, bytes sent per step by this
rank for lowbit configs (``state.stats.bytes_sent``) and the peak device memory. Rank 0 prints two
markdown tables at the end: samples/s and the ratio to plain DDP.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

GPU_MODELS = "vgg19,resnet50,alexnet,gpt2_small"
GPU_HOOKS = ("ddp;fp16;powersgd;lowbit:fp32;lowbit:qsgd:bits=8,bucket=512;"
             "lowbit:qsgd:bits=4,bucket=512;lowbit:onebit:bucket=64")
CPU_MODELS = "mlp10m"
CPU_HOOKS = "ddp;lowbit:fp32;lowbit:qsgd:bits=8,bucket=512"
BASELINES = ("ddp", "fp16", "powersgd")
AUTO_STEADY = 4  # codec="auto": untimed steps after its latest possible decision (AutoTuner.last_decision_step)
POWERSGD_GLOO = ("PowerSGD's hook issues its allreduces from future callbacks, whose order differs across "
                 "ranks on gloo: with several buckets a collective mismatch aborts the run (pytorch/pytorch#58467); "
                 "--powersgd-gloo runs it with its buckets chained (lowbit.lab.baselines), which keeps the order")
NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_HOSTID",
            "NCCL_SOCKET_IFNAME", "NCCL_ALGO", "NCCL_PROTO", "LOWBIT_NODE_SIZE", "LOCAL_WORLD_SIZE")


# ---------------------------------------------------------------------------------------------- models

def mlp10m() -> nn.Module:
    """A ~10M-parameter MLP (10,512,394): 1024-2048-2048-2048-10, ReLU. Input (N, 1024), 10 classes."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 10),
    )


def build(name: str, args: argparse.Namespace) -> tuple[nn.Module, dict[str, Any]]:
    """(model on CPU, how to feed it): input shape, classes, whether tokens, batch per rank, autocast."""
    if name == "mlp10m":
        return mlp10m(), {"in_shape": (1024,), "classes": 10, "tokens": False, "seq_targets": False,
                          "batch": args.batch, "bf16": False}
    from lowbit.lab.models import build_model, model_info

    info = model_info(name)
    shape = info.in_shape
    tokens = info.task == "sequence" and len(shape) == 1
    if tokens:
        shape = (args.seq,)
    model = build_model(name, in_shape=shape)
    is_gpt = name.startswith("gpt")
    return model, {"in_shape": tuple(shape), "classes": info.num_classes, "tokens": tokens,
                   "seq_targets": info.task == "sequence", "batch": args.gpt_batch if is_gpt else args.batch,
                   "bf16": is_gpt}


def make_batch(feed: dict[str, Any], device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n, shape, classes = feed["batch"], feed["in_shape"], feed["classes"]
    if feed["tokens"]:
        x = torch.randint(0, classes, (n, *shape), generator=g)
    else:
        x = torch.randn((n, *shape), generator=g)
    y = torch.randint(0, classes, (n, *shape[:1]) if feed["seq_targets"] else (n,), generator=g)
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------------------------- hooks

LOWBIT_HOOK = re.compile(r"lowbit(?:\[(?P<opts>[^\]]*)\])?:(?P<spec>.+)")
def _flag(text: str) -> bool:
    if text.lower() not in ("0", "1", "true", "false"):
        raise ValueError(text)
    return text.lower() in ("1", "true")


_flag.__name__ = "0/1"
LOWBIT_OPTS = {"mb": ("message_mb", float), "algorithm": ("algorithm", str), "thread": ("hook_thread", _flag),
               "level": ("auto_level", str), "guard": ("guard_every", int)}


def lowbit_hook(hook: str) -> tuple[str, dict[str, Any]] | None:
    """``lowbit:SPEC`` or ``lowbit[mb=256,algorithm=allgather]:SPEC`` -> (SPEC, register keywords); None if
    ``hook`` is not a lowbit config. Raises SystemExit naming a bad option."""
    m = LOWBIT_HOOK.fullmatch(hook)
    if m is None:
        return None
    kw: dict[str, Any] = {}
    for item in filter(None, (m["opts"] or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in LOWBIT_OPTS:
            raise SystemExit(f"bench_ddp: bad option {item!r} in {hook!r} (known: "
                             f"{', '.join(k + '=' for k in LOWBIT_OPTS)})")
        name, kind = LOWBIT_OPTS[key.strip()]
        try:
            kw[name] = kind(value.strip())
        except ValueError:
            raise SystemExit(f"bench_ddp: option {item!r} in {hook!r} is not a {kind.__name__}") from None
    return m["spec"], kw


def parse_hooks(text: str) -> list[str]:
    hooks = [h.strip() for h in text.split(";") if h.strip()]
    for h in hooks:
        if h not in ("ddp", "allreduce", "fp16", "bf16", "powersgd") and lowbit_hook(h) is None:
            raise SystemExit(f"bench_ddp: unknown hook config {h!r} (ddp, allreduce, fp16, bf16, powersgd, "
                             "lowbit:SPEC or lowbit[mb=M,algorithm=A]:SPEC; separate configs with ';')")
    if len(set(hooks)) != len(hooks):
        raise SystemExit(f"bench_ddp: a hook config is listed twice: {hooks}")
    return hooks


#: The bench's names of PyTorch's hooks -> lowbit.lab.baselines' specs (the study runs the same baselines)
TORCH_BASELINES = {"fp16": "torch:fp16", "bf16": "torch:bf16", "powersgd": "torch:powersgd:rank=4,start_iter=2"}


def register_hook(model: DDP, hook: str, args: argparse.Namespace) -> Any:
    """Install ``hook`` on ``model``; returns its state (None for plain DDP)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import lowbit.lab.baselines

    if hook == "ddp":
        return None
    if hook == "allreduce":  # torch's fp32 allreduce as a Python hook: the floor of any Python comm hook
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        return None
    if hook in TORCH_BASELINES:  # torch's own hook, registered as lowbit.lab.baselines registers it
        return lowbit.lab.baselines.register(model, TORCH_BASELINES[hook])
    import lowbit.ddp

    parsed = lowbit_hook(hook)
    assert parsed is not None, hook
    spec, opts = parsed
    kw: dict[str, Any] = {"codec": spec}
    if args.lowbit_algorithm:
        kw["algorithm"] = args.lowbit_algorithm
    if args.lowbit_message_mb is not None:
        kw["message_mb"] = args.lowbit_message_mb
    kw.update(opts)  # a config's own options win over the command-wide ones
    return lowbit.ddp.register(model, **kw)


def bytes_sent(state: Any, field: str = "bytes_sent") -> int | None:
    """What lowbit's hook counted (None for torch's hooks: this bench counts lowbit's bytes only)."""
    if getattr(state, "baseline", None) is not None:
        return None
    value = getattr(getattr(state, "stats", None), field, None)
    return int(value) if isinstance(value, (int, float)) else None


# ------------------------------------------------------------------------------------------- one run

class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", self.local_rank) if self.cuda else torch.device("cpu")
        # Bookkeeping over gloo: never queued behind (or mixed with) the DDP group's NCCL work.
        self.ctl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.barrier(group=self.ctl)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctl)
        return out

    def log(self, *msg: Any) -> None:
        if self.rank == 0:
            print(*msg, flush=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               bf16: bool) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    return loss


def run_config(ctx: Ctx, initial: nn.Module, feed: dict[str, Any], x: torch.Tensor, y: torch.Tensor,
               hook: str, profile_dir: Path | None, tag: str) -> dict[str, Any]:
    """Warm up, time ``--steps`` steps and return this rank's numbers (raises on failure)."""
    args = ctx.args
    bf16 = feed["bf16"] and ctx.cuda
    model = ddp = opt = state = None
    try:
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        model = copy.deepcopy(initial).to(ctx.device)
        ddp = DDP(model, device_ids=[ctx.local_rank] if ctx.cuda else None)
        state = register_hook(ddp, hook, args)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        warmup = args.warmup
        if getattr(state, "auto", None) is not None:  # room to measure, probe and try before the timed steps
            warmup = max(warmup, state.auto.last_decision_step(state.start_iter) + 1 + AUTO_STEADY)
        for _ in range(warmup):
            train_step(ddp, opt, x, y, bf16)
        b0, i0 = bytes_sent(state), bytes_sent(state, "bytes_inter")
        ctx.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step(ddp, opt, x, y, bf16)
        ctx.sync()
        elapsed = time.perf_counter() - t0
        b1, i1 = bytes_sent(state), bytes_sent(state, "bytes_inter")
        row: dict[str, Any] = {
            "elapsed_s": elapsed,
            "loss": _finite(float(loss.detach())),
            "bytes_sent_per_step": (b1 - b0) / args.steps if b0 is not None and b1 is not None else None,
            # of those, to other nodes (the hierarchical algorithm; 0 for the flat ones)
            "bytes_inter_per_step": (i1 - i0) / args.steps if i0 is not None and i1 is not None else None,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None,
        }
        auto = getattr(state, "auto", None)
        if auto is not None:  # codec="auto": what it chose (decided during the warm-up steps)
            d = auto.decision
            if d is None or auto.decided_iter is None or auto.decided_iter >= warmup:
                raise RuntimeError(f"codec='auto' had not decided within the {warmup} warm-up steps "
                                   f"(decided at step {auto.decided_iter}): its timed steps would include "
                                   "measuring and trials; raise --warmup")
            row["auto"] = None if d is None else {
                "fp32_is_best": d.fp32_is_best, "predicted_speedup_vs_fp32": d.speedup,
                "predicted_step_ms": d.step_s * 1e3, "fp32_predicted_step_ms": d.fp32_step_s * 1e3,
                "decided_at_step": auto.decided_iter, "lowbit_hook_installed": bool(ddp._comm_hooks),
                "values_per_codec": {c: sum(r["numel"] for r in d.rows if r["codec"] == c)
                                     for c in sorted({r["codec"] for r in d.rows})},
                "chosen": d.chosen, "measured_step_ms": {k: v * 1e3 for k, v in d.measured_s.items()},
                "finalists_predicted_step_ms": {lab: pred * 1e3 for lab, _, pred in d.finalists},
                # the algorithms of every finalist tried and of the choice (hierarchical on several nodes)
                "finalists_algorithms": {lab: d.algorithms_of(a) for lab, a, _ in d.finalists},
                "algorithms_chosen": d.algorithms_of(d.assignment), "node_size": auto.node_size,
                "level": auto.level, "guard_changes": list(auto.changes),
                "costs": auto.measured["costs"] if auto.measured else None, "table": d.table()}
        if profile_dir is not None:
            profile(ctx, functools.partial(train_step, ddp, opt, x, y, bf16), profile_dir, tag)
        return row
    finally:
        del model, ddp, opt, state
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def profile(ctx: Ctx, step: Any, out: Path, tag: str, steps: int = 5, cpu_table: bool = False) -> None:
    """Every rank runs ``step()`` ``steps`` more times (the collectives need them all); rank 0 records
    them: a chrome trace and a key_averages table by device time (``cpu_table``: and one by host time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ctx.barrier()
    if ctx.rank != 0:
        for _ in range(steps):
            step()
        ctx.sync()
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one cycle, no schedule
        with torch_profile(activities=acts) as prof:
            for _ in range(steps):
                step()
            ctx.sync()
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"trace_{tag}_rank0.json"))
    sort = "cuda_time_total" if ctx.cuda else "cpu_time_total"
    avg = prof.key_averages()
    text = avg.table(sort_by=sort, row_limit=50)
    if cpu_table:
        text += "\n\n" + avg.table(sort_by="cpu_time_total", row_limit=50)
    (out / f"key_averages_{tag}_rank0.txt").write_text(text)
    ctx.log(f"  profile of {tag}: {out}/trace_{tag}_rank0.json, key_averages_{tag}_rank0.txt")


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _fmt(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "x"


# ------------------------------------------------------------------------------------------- summary

def summarise(model_res: dict[str, Any], hooks: list[str], world: int, batch: int, steps: int) -> None:
    per_hook = model_res["hooks"]
    for hook in hooks:
        r = per_hook[hook]
        raw = r["raw_samples_per_s"]
        r["samples_per_s"] = statistics.median(raw) if raw else None
        r["step_ms"] = world * batch / r["samples_per_s"] * 1e3 if r["samples_per_s"] else None
        b = [v for v in r.pop("_bytes") if v is not None]
        r["bytes_sent_per_step"] = statistics.median(b) if b else None
        bi = [v for v in r.pop("_bytes_inter", []) if v is not None]
        r["bytes_inter_per_step"] = statistics.median(bi) if bi else None
    for hook in hooks:
        r = per_hook[hook]
        for base in BASELINES:
            ref = per_hook.get(base, {}).get("samples_per_s")
            r[f"ratio_vs_{base}"] = r["samples_per_s"] / ref if r["samples_per_s"] and ref else None


def _summarised(model_res: dict[str, Any], hooks: list[str], world: int, batch: int, steps: int) -> dict[str, Any]:
    done = copy.deepcopy(model_res)
    summarise(done, hooks, world, batch, steps)
    return done


def write_json(path: Path, info: dict[str, Any], results: dict[str, Any], errors: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": info, "results": results, "errors": errors}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False, default=str) + "\n")
    tmp.replace(path)


def table(results: dict[str, Any], hooks: list[str], key: str, fmt: str) -> str:
    lines = ["| model | " + " | ".join(hooks) + " |", "|---|" + "---:|" * len(hooks)]
    for name, mres in results.items():
        cells = []
        for hook in hooks:
            r = mres["hooks"].get(hook, {})
            v = r.get(key)
            if v is None and r.get("skipped"):
                cells.append("skipped")
            elif v is None and r.get("errors") and not r.get("raw_samples_per_s"):
                cells.append("error")
            else:
                cells.append(_fmt(v, fmt))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spec_of(hook: str) -> str | None:
    """The canonical codec spec of a fixed lowbit config (None: not lowbit, or codec="auto")."""
    parsed = lowbit_hook(hook)
    if parsed is None or parsed[0].strip().lower() == "auto":
        return None
    try:
        from lowbit.codecs.base import get_codec

        return get_codec(parsed[0]).spec
    except ValueError:
        return None


def auto_targets(results: dict[str, Any], hooks: list[str]) -> str:
    """Issue 29's ratios, per model, for each ``codec="auto"`` config: against plain DDP, the best fixed
    8-bit lowbit config (any algorithm), the best fixed lowbit config of a codec its level allows, and
    PowerSGD rank 4 (empty when the run lacks it)."""
    from lowbit.auto.options import default_allow
    from lowbit.codecs.base import get_codec

    autos = [h for h in hooks if (p := lowbit_hook(h)) is not None and p[0].strip().lower() == "auto"]
    if not autos:
        return ""
    eight = {get_codec("qsgd:bits=8,bucket=512").spec}
    lines = ["| model | auto config | / ddp | / best fixed 8-bit | / best fixed it allows | / powersgd |",
             "|---|---|---:|---:|---:|---:|"]
    for name, mres in results.items():
        sps = {h: mres["hooks"].get(h, {}).get("samples_per_s") for h in hooks}

        def best(specs: set[str]) -> float | None:
            vals = [v for h, v in sps.items() if v and _spec_of(h) in specs]
            return max(vals) if vals else None

        for h in autos:
            level = lowbit_hook(h)[1].get("auto_level", "conservative")  # type: ignore[index]
            allowed = {get_codec(s).spec for s in default_allow(level)}
            v = sps.get(h)
            cells = [v / ref if v and ref else None
                     for ref in (sps.get("ddp"), best(eight), best(allowed), sps.get("powersgd"))]
            lines.append(f"| {name} | {h} | " + " | ".join(_fmt(c, ".2f") for c in cells) + " |")
    return "\n".join(lines)


def git_info() -> tuple[str | None, bool | None]:
    """(commit, dirty). ``LOWBIT_GIT_COMMIT`` overrides: a copied working tree (a lent device machine) may
    carry a stale ``.git``, so the launcher passes the commit it sent."""
    if os.environ.get("LOWBIT_GIT_COMMIT"):
        return os.environ["LOWBIT_GIT_COMMIT"], None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), (bool(dirty.stdout.strip()) if dirty.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        return None, None


def meta(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    try:
        import triton  # type: ignore[import-not-found]

        triton_version: str | None = triton.__version__
    except Exception:  # noqa: BLE001 — not installed, or broken: either way no version
        triton_version = None
    try:
        import lowbit

        lowbit_version: str | None = lowbit.__version__
    except Exception:  # noqa: BLE001
        lowbit_version = None
    commit, dirty = git_info()
    if ctx.cuda:
        device_name = torch.cuda.get_device_name(ctx.device)
    else:
        device_name = cpu_name()
    return {
        "device": args.device,
        "device_name": device_name,
        "world_size": ctx.world,
        "backend": dist.get_backend(),
        "link": args.link,
        "hostname": socket.gethostname(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if ctx.cuda else None,
        "triton_version": triton_version,
        "lowbit_version": lowbit_version,
        "python_version": platform.python_version(),
        "nccl_env": {k: os.environ.get(k) for k in NCCL_ENV},
        "git_commit": commit,
        "git_dirty": dirty,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if ctx.cuda else None,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if ctx.cuda else None,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--models", default=None,
                   help=f"comma-separated lowbit.lab.models names or mlp10m (default {GPU_MODELS}; CPU: {CPU_MODELS})")
    p.add_argument("--hooks", default=None,
                   help=f"hook configs separated by ';' (default {GPU_HOOKS!r}; CPU: {CPU_HOOKS!r})")
    p.add_argument("--lowbit-message-mb", type=float, default=None,
                   help="message_mb= for lowbit.ddp.register (default: library's)")
    p.add_argument("--lowbit-algorithm", default=None, help="algorithm= for lowbit.ddp.register (default: library's)")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch of the CNNs and the MLP")
    p.add_argument("--gpt-batch", type=int, default=16, help="per-rank batch of gpt2_small")
    p.add_argument("--seq", type=int, default=256, help="sequence length of token models")
    p.add_argument("--warmup", type=int, default=8,
                   help=f"untimed steps per run (lowbit:auto: at least {AUTO_STEADY} past its latest possible decision: "
                        "it measures, probes and tries first)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--link", default=None, help="label: nvlink | sockets | cpu (free text; default from device/NCCL env)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/ddp_<world>x<device>_<link>.json)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR", help="profile one config on rank 0 into DIR")
    p.add_argument("--profile-model", default=None, help="model to profile (default: the first)")
    p.add_argument("--profile-hook", default=None, help="hook config to profile (default: the last)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank on CPU (default: as launched)")
    p.add_argument("--no-cudnn-benchmark", action="store_true", help="leave cudnn.benchmark off")
    p.add_argument("--powersgd-gloo", action="store_true",
                   help="run powersgd on gloo with several ranks (skipped by default: it aborts there)")
    p.add_argument("--stop-on-error", action="store_true", help="stop at the first failing config")
    p.add_argument("--timeout", type=float, default=900.0, help="process-group timeout in seconds")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    cpu_default = args.device == "cpu" and args.models is None
    args.models = args.models or (CPU_MODELS if cpu_default else GPU_MODELS)
    args.hooks = args.hooks or (CPU_HOOKS if cpu_default else GPU_HOOKS)
    if args.link is None:
        if args.device == "cpu":
            args.link = "cpu"
        else:
            args.link = "sockets" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"
    for k in ("batch", "gpt_batch", "seq", "steps", "rounds"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def init_dist(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:  # plain `python bench_ddp.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    hooks = parse_hooks(args.hooks)
    init_dist(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = Ctx(args)
    if ctx.cuda and not args.no_cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    if args.warmup < 3 and any(h == "powersgd" or lowbit_hook(h) for h in hooks):
        ctx.log(f"note: --warmup {args.warmup} < 3: PowerSGD/lowbit compress from iteration 2 on, "
                "so the timed steps include uncompressed ones")
    info = meta(ctx, args)
    prof_model = args.profile_model or models[0]
    prof_hook = args.profile_hook or hooks[-1]
    ctx.log(f"bench_ddp: {info['device_name']} x{ctx.world} ({info['backend']}, link {args.link}), "
            f"torch {torch.__version__}, models {models}, hooks {hooks}")

    results: dict[str, Any] = {}
    errors: list[dict[str, Any]] = []
    out = args.out or RESULTS / f"ddp_{ctx.world}x{slug(info['device_name'])}_{slug(args.link)}.json"
    stop = False
    for name in models:
        torch.manual_seed(args.seed)
        try:
            initial, feed = build(name, args)
        except Exception as e:  # noqa: BLE001 — unknown name etc.: the same on every rank
            ctx.log(f"{name}: cannot build: {e!r}")
            errors.append({"model": name, "hook": None, "round": None, "error": repr(e)})
            continue
        nparams = sum(p.numel() for p in initial.parameters() if p.requires_grad)
        x, y = make_batch(feed, ctx.device, args.seed + 1 + ctx.rank)
        mres: dict[str, Any] = {
            "params": nparams, "fp32_grad_bytes": 4 * nparams, "batch_per_rank": feed["batch"],
            "global_batch": feed["batch"] * ctx.world, "input_shape": list(feed["in_shape"]),
            "tokens": feed["tokens"], "bf16_autocast": feed["bf16"] and ctx.cuda,
            "hooks": {h: {"raw_samples_per_s": [], "raw_step_ms": [], "_bytes": [], "loss": [],
                          "peak_mem_bytes": None, "errors": [], "skipped": None} for h in hooks},
        }
        results[name] = mres
        ctx.log(f"\n## {name}: {nparams:,} parameters, batch {feed['batch']}/rank, input {feed['in_shape']}")
        for rnd in range(args.rounds):
            for hook in hooks:
                r_out = mres["hooks"][hook]
                if hook == "powersgd" and ctx.world > 1 and dist.get_backend() == "gloo" and not args.powersgd_gloo:
                    if rnd == 0:
                        r_out["skipped"] = POWERSGD_GLOO
                        ctx.log(f"  {hook:42s} skipped: {POWERSGD_GLOO}")
                    continue
                tag = f"{slug(name)}_{slug(hook)}"
                want_prof = args.profile is not None and rnd == 0 and name == prof_model and hook == prof_hook
                try:
                    row: dict[str, Any] = run_config(ctx, initial, feed, x, y, hook,
                                                     args.profile if want_prof else None, tag)
                    row["error"] = None
                except Exception as e:  # noqa: BLE001 — recorded, then agreed on below
                    tb = traceback.format_exc()
                    print(f"[rank {ctx.rank}] {name} / {hook} round {rnd + 1} failed:\n{tb}", file=sys.stderr,
                          flush=True)
                    row = {"error": f"{type(e).__name__}: {e}"}
                rows = ctx.gather(row)  # every rank's outcome (also the error agreement)
                failed = [r for r in rows if r["error"] is not None]
                if failed:
                    err = {"model": name, "hook": hook, "round": rnd + 1,
                           "error": failed[0]["error"], "ranks_failed": len(failed)}
                    errors.append(err)
                    r_out["errors"].append(err["error"])
                    ctx.log(f"  round {rnd + 1} {hook:34s} ERROR on {len(failed)}/{ctx.world} ranks: {err['error']}")
                    if len(failed) != ctx.world:
                        ctx.log("  only some ranks failed: collectives may be out of step, stopping")
                        stop = True
                    if args.stop_on_error:
                        stop = True
                else:
                    elapsed = max(r["elapsed_s"] for r in rows)  # the slowest rank's
                    sps = ctx.world * feed["batch"] * args.steps / elapsed
                    r_out["raw_samples_per_s"].append(sps)
                    r_out["raw_step_ms"].append(elapsed / args.steps * 1e3)
                    r_out["_bytes"].append(rows[0]["bytes_sent_per_step"])
                    r_out.setdefault("_bytes_inter", []).append(rows[0]["bytes_inter_per_step"])
                    r_out["loss"].append(rows[0]["loss"])
                    if rows[0].get("auto") is not None:
                        r_out.setdefault("auto", []).append(rows[0]["auto"])
                    peaks = [r["peak_mem_bytes"] for r in rows if r["peak_mem_bytes"] is not None]
                    if peaks:
                        r_out["peak_mem_bytes"] = max(peaks + [r_out["peak_mem_bytes"] or 0])
                    b = rows[0]["bytes_sent_per_step"]
                    ctx.log(f"  round {rnd + 1} {hook:34s} {sps:10.1f} samples/s  {elapsed / args.steps * 1e3:9.2f} "
                            f"ms/step  loss {_fmt(rows[0]['loss'], '.4f')}"
                            + (f"  {b / 2**20:.2f} MiB sent/step (rank 0)" if b is not None else ""))
                if ctx.rank == 0:  # partial results survive a crash later on (info has no "finished" yet)
                    write_json(out, info, {**results, name: _summarised(mres, hooks, ctx.world, feed["batch"],
                                                                         args.steps)}, errors)
                if stop:
                    break
            if stop:
                break
        summarise(mres, hooks, ctx.world, feed["batch"], args.steps)
        del initial, x, y
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
        if stop:
            break

    info["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if ctx.rank == 0:
        write_json(out, info, results, errors)
        print(f"\n### samples/s (median of {args.rounds}; {ctx.world} x {info['device_name']}, {args.link})\n")
        print(table(results, hooks, "samples_per_s", ".1f"))
        print("\n### throughput ratio vs plain DDP\n")
        print(table(results, hooks, "ratio_vs_ddp", ".2f"))
        targets = auto_targets(results, hooks)
        if targets:
            print("\n### codec='auto' against the fixed configurations of this run (issue 29's targets)\n")
            print(targets)
        if errors:
            print(f"\n{len(errors)} error(s); see 'errors' in the JSON")
        print(f"\nwrote {out}", flush=True)
    # Everything DDP made must die while the group exists; then every rank leaves together.
    gc.collect()
    dist.barrier(group=ctx.ctl)
    dist.destroy_process_group()
    return 1 if stop else 0


if __name__ == "__main__":
    sys.exit(main())
