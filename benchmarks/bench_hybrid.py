"""Dettmers' hybrid parallelism on real GPUs: convolutions data-parallel, fully connected layers
model-parallel (lowbit.parallel.Hybrid), 32-bit vs 8-bit activations, with and without sub-batches,
beside plain data parallelism (DDP, and DDP with a lowbit codec) in the same run. Synthetic inputs
(labelled so): throughput only.

    torchrun --nproc-per-node 2 benchmarks/bench_hybrid.py --link nvlink --out $OUT/hybrid_2xh100_nvlink.json

Configurations (``--configs``, ';'-separated):
  ``dp:HOOK``                     the whole model under DDP with bench_ddp's HOOK (ddp, fp16, lowbit:SPEC, ...)
  ``hybrid[s=S,conv=HOOK]:SPEC``  Hybrid with S sub-batches, activations in SPEC, the features' DDP with HOOK
Prints a table last and writes JSON (card, commit, every number); samples/s is the global batch per second.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ddp as B  # noqa: E402  (the DDP bench's model feeds, hooks, context and metadata)

from lowbit.parallel import Hybrid, ParallelComm  # noqa: E402

DEFAULT_CONFIGS = ("dp:ddp;dp:lowbit:qsgd:bits=8,bucket=512;dp:lowbit:onebit:bucket=64;"
                   "hybrid[s=1]:fp32;hybrid[s=4]:fp32;"
                   "hybrid[s=1,conv=lowbit:qsgd:bits=8,bucket=512]:dettmers:type=dynamic,bucket=0;"
                   "hybrid[s=4,conv=lowbit:qsgd:bits=8,bucket=512]:dettmers:type=dynamic,bucket=0")
HYBRID = re.compile(r"hybrid(?:\[(?P<opts>[^\]]*)\])?:(?P<spec>.+)")


def parse_hybrid(cfg: str) -> tuple[int, str, str] | None:
    """``hybrid[s=S,conv=HOOK]:SPEC`` -> (S, HOOK, SPEC); ``conv=`` comes last (its HOOK may hold commas)."""
    m = HYBRID.fullmatch(cfg)
    if not m:
        return None
    opts = m.group("opts") or ""
    conv = "ddp"
    if "conv=" in opts:
        opts, conv = opts.split("conv=", 1)
    s = 1
    for part in filter(None, opts.split(",")):
        k, _, v = part.partition("=")
        if k != "s":
            raise ValueError(f"hybrid option {k!r}: use s= (sub-batches) and conv= (last: the features' DDP hook)")
        s = int(v)
    return s, conv, m.group("spec")


def split_configs(text: str) -> list[str]:
    """';'-separated configs; a ',' inside [...] belongs to its options (conv=lowbit:qsgd:bits=8,bucket=512)."""
    return [c.strip() for c in text.split(";") if c.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="alexnet,vgg19")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--batch", type=int, default=64, help="per-rank batch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--link", default=None)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    # what bench_ddp's helpers read
    a.seq, a.gpt_batch, a.lowbit_algorithm, a.lowbit_message_mb = 256, 16, None, None
    return a


def run(ctx: B.Ctx, initial: nn.Module, feed: dict[str, Any], x: torch.Tensor, y: torch.Tensor, cfg: str) -> dict[str, Any]:
    a = ctx.args
    model = copy.deepcopy(initial).to(ctx.device)
    hyb = parse_hybrid(cfg)
    state = comm = None
    ce = nn.functional.cross_entropy
    if hyb is None:
        hook = cfg.split(":", 1)[1]
        net = DDP(model, device_ids=[ctx.local_rank] if ctx.cuda else None)
        state = B.register_hook(net, hook, a)
        opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9)

        def step() -> torch.Tensor:
            return B.train_step(net, opt, x, y, False)
    else:
        s, conv, spec = hyb
        features = nn.Sequential(model.features, model.pool, nn.Flatten())
        fdp = DDP(features, device_ids=[ctx.local_rank] if ctx.cuda else None)
        state = B.register_hook(fdp, conv, a)
        comm = ParallelComm(codec=spec)
        h = Hybrid(fdp, model.classifier, comm, sub_batches=s)
        opt_f = torch.optim.SGD(fdp.parameters(), lr=a.lr, momentum=0.9)
        opt_c = torch.optim.SGD(h.classifier.parameters(), lr=a.lr, momentum=0.9)

        def step() -> torch.Tensor:
            return h.train_step(x, y, ce, opt_f, opt_c)
    try:
        for _ in range(a.warmup):
            step()
        b0, a0 = (B.bytes_sent(state) or 0), (comm.stats.bytes_sent if comm else 0)
        ctx.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step()
        ctx.sync()
        elapsed = time.perf_counter() - t0
        b1, a1 = (B.bytes_sent(state) or 0), (comm.stats.bytes_sent if comm else 0)
        return {"elapsed_s": elapsed, "loss": B._finite(float(loss.detach())),
                # lowbit's counters: the gradients' hook (not plain DDP's or fp16's) plus the activations
                "bytes_sent_per_step": (b1 - b0 + a1 - a0) / a.steps,
                "activation_bytes_per_step": (a1 - a0) / a.steps if comm is not None else None}
    finally:
        del model
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    B.init_dist(a)
    ctx = B.Ctx(a)
    torch.backends.cudnn.benchmark = True
    configs = split_configs(a.configs)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    info = B.meta(ctx, a)
    info["what"] = "hybrid parallelism (lowbit.parallel.Hybrid) beside data parallelism; SYNTHETIC inputs"
    results: dict[str, Any] = {}
    errors: list[dict[str, Any]] = []
    for name in models:
        initial, feed = B.build(name, a)
        feed["batch"] = a.batch
        x, y = B.make_batch(feed, ctx.device, seed=ctx.rank)
        res = results[name] = {"params": sum(p.numel() for p in initial.parameters()), "batch_per_rank": a.batch,
                               "configs": {}}
        ctx.log(f"\n## {name}: {res['params']:,} parameters, batch {a.batch}/rank")
        for cfg in configs:
            rows = []
            for rnd in range(a.rounds):
                try:
                    row = run(ctx, initial, feed, x, y, cfg)
                except Exception as exc:  # noqa: BLE001 — recorded, the other configs go on
                    errors.append({"model": name, "config": cfg, "error": repr(exc)[:2000]})
                    ctx.log(f"  {cfg}: FAILED {exc!r}"[:300])
                    break
                rows.append(row)
                sps = a.steps * a.batch * ctx.world / row["elapsed_s"]
                ctx.log(f"  round {rnd + 1} {cfg:70s} {sps:10.1f} samples/s  loss {row['loss']}  "
                        f"{(row['bytes_sent_per_step'] or 0) / 2**20:8.2f} MiB sent/step")
            if rows:
                sps = sorted(a.steps * a.batch * ctx.world / r["elapsed_s"] for r in rows)
                res["configs"][cfg] = {"samples_per_s": sps[len(sps) // 2], "raw_samples_per_s": sps,
                                       "loss": [r["loss"] for r in rows],
                                       "bytes_sent_per_step": rows[-1]["bytes_sent_per_step"],
                                       "activation_bytes_per_step": rows[-1]["activation_bytes_per_step"]}
        base = res["configs"].get("dp:ddp", {}).get("samples_per_s")
        for c in res["configs"].values():
            c["ratio_vs_ddp"] = c["samples_per_s"] / base if base else None
    info["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if ctx.rank == 0:
        print("\n| model | " + " | ".join(configs) + " |")
        print("|---|" + "---:|" * len(configs))
        for name, res in results.items():
            cells = [f"{res['configs'][c]['samples_per_s']:.0f} ({res['configs'][c]['ratio_vs_ddp']:.2f}x)"
                     if c in res["configs"] and res["configs"][c]["ratio_vs_ddp"] else "—" for c in configs]
            print(f"| {name} | " + " | ".join(cells) + " |")
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({"meta": info, "results": results, "errors": errors}, indent=1,
                                        default=str) + "\n")
            print(f"wrote {a.out}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
