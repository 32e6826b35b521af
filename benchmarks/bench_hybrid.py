"""Dettmers' hybrid parallelism on real GPUs: convolutions data-parallel, fully connected layers
model-parallel (lowbit.parallel.Hybrid), 32-bit vs 8-bit activations, with and without sub-batches,
beside plain data parallelism (DDP, and DDP with a lowbit codec) in the same run. Synthetic inputs
(labelled so): throughput only.

    torchrun --nproc-per-node 2 benchmarks/bench_hybrid.py --link nvlink --out $OUT/hybrid_2xh100_nvlink.json

Configurations (``--configs``, ';'-separated):
  ``dp:HOOK``                     the whole model under DDP with bench_ddp's HOOK (ddp, fp16, lowbit:SPEC, ...)
  ``hybrid[s=S,pair=1,cap=MB,graph=1,conv=HOOK]:SPEC``  Hybrid with S sub-batches, activations in SPEC, the
                                  features' DDP with HOOK (bucket_cap_mb MB); pair=1: column/row pairs;
                                  graph=1: the classifier's step replayed from a CUDA graph
Prints a table last and writes JSON (card, commit, every number); samples/s is the global batch per second.

``--phases`` (default on) also measures, per model and activation codec of the ``s=1`` hybrids, the inputs
of Dettmers' single-node model (ICLR 2016, Appendix 5; :mod:`lowbit.lab.perfmodel.dettmers`) on this machine,
and sets its prediction beside the measured run::

    step = (T_total - T_fc) + P_conv + K T_fc,par + P_fc            samples/s = K B / step

``T_total``: one GPU's whole step (forward, backward, SGD) on its batch ``B``; ``T_fc``: the classifier's
share of it; ``K T_fc,par``: the model-parallel classifier's compute on the gathered ``K B`` rows (each
Linear with ``out/K`` outputs, forward, backward, SGD), no communication; ``P_conv``: the sync of the first
conv layer's gradients (native allreduce); ``P_fc``: every activation transfer of a step, timed alone on
this link with the codec (encode, collective, decode): the batch's features gathered, the labels, each
layer's outputs gathered, the activation gradients summed (layers 2..), the features' gradient
reduce-scattered. With one sub-batch nothing overlaps them, so they add up (Dettmers' unhidden terms).
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

from lowbit.comm.allreduce import all_reduce  # noqa: E402
from lowbit.comm.gather import all_gather, part_sizes, reduce_scatter  # noqa: E402
from lowbit.parallel import Hybrid, ParallelComm, hybrid_parts  # noqa: E402
from lowbit.lab.perfmodel.dettmers import single_node_step_ms  # noqa: E402

DEFAULT_CONFIGS = ("dp:ddp;dp:lowbit:qsgd:bits=8,bucket=512;dp:lowbit:onebit:bucket=64;"
                   "hybrid[s=1]:fp32;hybrid[s=4]:fp32;"
                   "hybrid[s=1,conv=lowbit:qsgd:bits=8,bucket=512]:dettmers:type=dynamic,bucket=0;"
                   "hybrid[s=4,conv=lowbit:qsgd:bits=8,bucket=512]:dettmers:type=dynamic,bucket=0;"
                   "hybrid[s=1,pair=1]:fp32;"
                   "hybrid[s=1,pair=1,graph=1,conv=lowbit:qsgd:bits=8,bucket=512]:dettmers:type=dynamic,bucket=0")
HYBRID = re.compile(r"hybrid(?:\[(?P<opts>(?:[^\[\]]|\[[^\[\]]*\])*)\])?:(?P<spec>.+)")  # conv=lowbit[mb=2]:...


def parse_hybrid(cfg: str) -> tuple[int, str, str, bool, float | None, bool] | None:
    """``hybrid[s=S,pair=1,cap=MB,graph=1,conv=HOOK]:SPEC`` -> (S, HOOK, SPEC, PAIR, CAP, GRAPH); ``conv=``
    comes last (its HOOK may hold commas); ``pair=1``: the classifier's linear layers in column/row pairs
    (lowbit.parallel.parallelize); ``cap=MB``: the features' DDP ``bucket_cap_mb`` (default DDP's 25);
    ``graph=1``: the classifier's step replayed from a CUDA graph (``Hybrid(graph=True)``)."""
    m = HYBRID.fullmatch(cfg)
    if not m:
        return None
    opts = m.group("opts") or ""
    conv = "ddp"
    if "conv=" in opts:
        opts, conv = opts.split("conv=", 1)
    s, pair, cap, graph = 1, False, None, False
    for part in filter(None, opts.split(",")):
        k, _, v = part.partition("=")
        if k == "s":
            s = int(v)
        elif k == "pair" and v in ("0", "1"):
            pair = v == "1"
        elif k == "cap" and v:
            cap = float(v)
        elif k == "graph" and v in ("0", "1"):
            graph = v == "1"
        else:
            raise ValueError(f"hybrid option {part!r}: use s= (sub-batches), pair=0|1, cap=MB, graph=0|1 and "
                             "conv= (last: the features' DDP hook)")
    return s, conv, m.group("spec"), pair, cap, graph


def papers_split(h: tuple | None) -> bool:
    """A parsed hybrid config as Dettmers' model describes it: one sub-batch, unpaired layers, DDP's
    default buckets, no CUDA graph (his model's inputs are measured for these only)."""
    return h is not None and h[0] == 1 and not h[3] and h[4] is None and not h[5]


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
    p.add_argument("--profile", type=Path, default=None,
                   help="directory: profile 5 more steps of each --profile-config on rank 0 (chrome trace + "
                        "key_averages table)")
    p.add_argument("--profile-config", action="append", default=[],
                   help="a config of --configs to profile (repeatable)")
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="skip measuring Dettmers' model inputs and its prediction beside the s=1 hybrids")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    # what bench_ddp's helpers read
    a.seq, a.gpt_batch, a.lowbit_algorithm, a.lowbit_message_mb = 256, 16, None, None
    return a


def run(ctx: B.Ctx, initial: nn.Module, feed: dict[str, Any], x: torch.Tensor, y: torch.Tensor, cfg: str,
        profile_tag: str | None = None) -> dict[str, Any]:
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
        s, conv, spec, pair, cap, graph = hyb
        features, classifier = hybrid_parts(model)
        fdp = DDP(features, device_ids=[ctx.local_rank] if ctx.cuda else None,
                  **({} if cap is None else {"bucket_cap_mb": cap}))
        state = B.register_hook(fdp, conv, a)
        comm = ParallelComm(codec=spec)
        h = Hybrid(fdp, classifier, comm, sub_batches=s, pair=pair, graph=graph)
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
        if profile_tag is not None and ctx.args.profile is not None:
            B.profile(ctx, step, ctx.args.profile, profile_tag, cpu_table=True)
        return {"elapsed_s": elapsed, "loss": B._finite(float(loss.detach())),
                # lowbit's counters: the gradients' hook (not plain DDP's or fp16's) plus the activations
                "bytes_sent_per_step": (b1 - b0 + a1 - a0) / a.steps,
                "activation_bytes_per_step": (a1 - a0) / a.steps if comm is not None else None}
    finally:
        del model
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def _median_time(ctx: B.Ctx, fn: Any, reps: int = 10, collective: bool = False) -> float:
    """Median seconds of ``fn`` (device synchronised; ranks aligned by a barrier first for collectives)."""
    fn()
    ctx.sync()
    times = []
    for _ in range(reps):
        if collective:
            ctx.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def dettmers_phases(ctx: B.Ctx, initial: nn.Module, x: torch.Tensor, y: torch.Tensor, specs: list[str]) -> dict[str, Any]:
    """The inputs of Dettmers' single-node hybrid model measured here (module doc), per activation codec."""
    a, k, dev = ctx.args, ctx.world, ctx.device
    ce = nn.functional.cross_entropy
    model = copy.deepcopy(initial).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)

    def whole() -> None:
        opt.zero_grad(set_to_none=True)
        ce(model(x), y).backward()
        opt.step()

    features, clf = hybrid_parts(model)
    with torch.no_grad():
        feats = features(x)
    opt_c = torch.optim.SGD(clf.parameters(), lr=a.lr)

    def fc() -> None:
        opt_c.zero_grad(set_to_none=True)
        ce(clf(feats), y).backward()
        opt_c.step()

    out: dict[str, Any] = {"t_total_ms": _median_time(ctx, whole) * 1e3, "t_fc_ms": _median_time(ctx, fc) * 1e3}
    # K T_fc,par: each Linear with out/K outputs on the K B gathered rows, forward + backward + SGD
    linears = [m for m in clf if isinstance(m, nn.Linear)]
    par = 0.0
    for i, lin in enumerate(linears):
        part = nn.Linear(lin.in_features, -(-lin.out_features // k)).to(dev)
        o = torch.optim.SGD(part.parameters(), lr=a.lr)
        inp = torch.randn(k * x.shape[0], lin.in_features, device=dev, requires_grad=i > 0)

        def one(part: nn.Module = part, o: torch.optim.Optimizer = o, inp: torch.Tensor = inp) -> None:
            o.zero_grad(set_to_none=True)
            torch.relu(part(inp)).sum().backward()
            o.step()
        par += _median_time(ctx, one)
    out["k_t_fc_par_ms"] = par * 1e3
    conv1 = next(m for m in features.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d)))
    g = torch.randn(conv1.weight.numel(), device=dev)
    out["p_conv_ms"] = _median_time(ctx, lambda: torch.distributed.all_reduce(g), collective=True) * 1e3
    # P_fc: every transfer of an s=1 hybrid step, timed alone with each codec
    b = x.shape[0]
    lab = torch.empty(k * b, dtype=y.dtype, device=dev)
    labels_ms = _median_time(ctx, lambda: torch.distributed.all_gather_into_tensor(lab, y), collective=True) * 1e3
    out["p_fc_ms"], out["transfers_ms"] = {}, {}
    for spec in specs:
        t: dict[str, float] = {"labels": labels_ms}
        t["features"] = _median_time(ctx, lambda: all_gather(feats, spec, dim=0), collective=True) * 1e3
        for i, lin in enumerate(linears):
            sizes = part_sizes(lin.out_features, k)
            mine = torch.randn(k * b, sizes[ctx.rank], device=dev).relu()
            t[f"fc{i + 1}_gather"] = _median_time(ctx, lambda m=mine, sz=sizes: all_gather(m, spec, dim=-1, sizes=sz),
                                                  collective=True) * 1e3
            if i > 0:
                gin = torch.randn(k * b, lin.in_features, device=dev)
                t[f"fc{i + 1}_input_grad"] = _median_time(
                    ctx, lambda gg=gin: all_reduce(gg.clone(), spec, op="sum"), collective=True) * 1e3
        gf = torch.randn(k * b, feats.shape[1], device=dev)
        t["features_grad"] = _median_time(ctx, lambda: reduce_scatter(gf, spec, dim=0, sizes=[b] * k),
                                          collective=True) * 1e3
        out["transfers_ms"][spec] = t
        out["p_fc_ms"][spec] = sum(t.values())
    out["predicted"] = {}
    for spec in specs:
        step = single_node_step_ms(out["t_total_ms"], out["t_fc_ms"], out["k_t_fc_par_ms"], out["p_conv_ms"],
                                   out["p_fc_ms"][spec])
        out["predicted"][spec] = {"step_ms": step, "samples_per_s": k * b / step * 1e3}
    return out


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
                    tag = (f"{name}_{configs.index(cfg)}" if cfg in a.profile_config and rnd == a.rounds - 1
                           else None)
                    row = run(ctx, initial, feed, x, y, cfg, tag)
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
        hybrids = {c: parse_hybrid(c) for c in configs}
        specs = sorted({h[2] for h in hybrids.values() if papers_split(h)})
        if a.phases and specs and ctx.world > 1:
            try:
                ph = res["dettmers"] = dettmers_phases(ctx, initial, x, y, specs)
            except Exception as exc:  # noqa: BLE001 — recorded; the measured table stands
                errors.append({"model": name, "config": "dettmers phases", "error": repr(exc)[:2000]})
                ctx.log(f"  Dettmers phases: FAILED {exc!r}"[:300])
            else:
                ctx.log(f"  Dettmers' model inputs: T_total {ph['t_total_ms']:.2f} ms, T_fc {ph['t_fc_ms']:.2f}, "
                        f"K T_fc,par {ph['k_t_fc_par_ms']:.2f}, P_conv {ph['p_conv_ms']:.3f}, P_fc "
                        + ", ".join(f"{sp}: {v:.2f}" for sp, v in ph["p_fc_ms"].items()))
                for c, h in hybrids.items():
                    if papers_split(h) and c in res["configs"]:
                        pred = ph["predicted"][h[2]]["samples_per_s"]
                        meas = res["configs"][c]["samples_per_s"]
                        res["configs"][c]["dettmers_predicted_samples_per_s"] = pred
                        res["configs"][c]["dettmers_error"] = meas / pred - 1.0  # error of the predicted step
                        ctx.log(f"  {c}: measured {meas:.0f}, Dettmers' model {pred:.0f} samples/s "
                                f"(step error {meas / pred - 1.0:+.1%})")
    info["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if ctx.rank == 0:
        print("\n| model | " + " | ".join(configs) + " |")
        print("|---|" + "---:|" * len(configs))
        for name, res in results.items():
            cells = [("—" if c not in res["configs"] else f"{res['configs'][c]['samples_per_s']:.0f}"
                      + (f" ({res['configs'][c]['ratio_vs_ddp']:.2f}x)" if res["configs"][c]["ratio_vs_ddp"] else ""))
                     for c in configs]
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
