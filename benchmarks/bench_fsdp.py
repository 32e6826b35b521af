"""FSDP2 training throughput and convergence with lowbit's gradient and parameter codecs (torchrun).

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --model gpt_350m --link nvlink --out results.json
    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --train 1500 --model gpt_350m --configs fsdp,q8_p8 ...

A decoder-only transformer (``lowbit.lab.models``: gpt_350m, gpt_760m, gpt_1_3b) with ``fully_shard`` on
every block and on the root, bf16 parameters (``MixedPrecisionPolicy(param_dtype=bfloat16)``), AdamW.

Throughput (default): synthetic token ids (labelled so; speed only), sequence ``--seq``; for every
configuration in ``--configs`` (the table below), in ``--rounds`` interleaved rounds: build the model,
``--warmup`` steps, then ``--steps`` timed steps; tokens/s of the whole job and peak GPU memory
(``max_memory_allocated``) per rank, and the bytes lowbit put on the wire. Ratios are against the better
of the two FSDP2 baselines measured in the same run (``fsdp``, ``fsdp_bf16``).

Paired (``--paired A,B``): both models built side by side (twice the memory), then ``--steps`` pairs of
steps, A then B or B then A (the order alternates), each step timed alone between two synchronisations;
the row gives B's per-step speed over A's, pair by pair (median and quartiles), so drift between rounds
(5-10 % on the same cards) cancels. Synchronising every step removes what overlaps between steps from both
alike.

Convergence (``--train N``): the byte-level ``pysource`` corpus (real text, the standard library's
source; vocabulary 256), N steps of AdamW with warmup and cosine decay, validation loss on a fixed
held-out subset every ``--eval-every`` steps (its time left out of the step times and reported).

Links on one host: NVLink (default), sockets (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1``),
and, on 4 GPUs, two emulated nodes of two (``benchmarks/emulated_node.sh``; ``--node-size 2``). The
``--link`` label is only written into the results. With ``--node-size``, the ``hsdp_*`` configurations
shard inside each node and replicate across nodes: FSDP2's own HSDP (2-D mesh, bf16 reduce) against
lowbit's replicate all-reduce in 8 or 4 bits (FSDP's reduce-scatter inside the node).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

import lowbit.fsdp
from lowbit.lab.models import build_model

Q8 = "qsgd:bits=8,bucket=512"
Q4 = "qsgd:bits=4,bucket=512"
P8 = "qsgd:bits=8,bucket=512,rounding=nearest"

#: name -> (FSDP reduce dtype, gradient codec or None for FSDP's own, parameter codec, error feedback, hierarchical);
#: "auto" / "auto:bold" are lowbit.fsdp's codec="auto" at its two levels (warmed up until it has decided)
CONFIGS: dict[str, tuple[torch.dtype, str | None, str | None, bool, bool]] = {
    "fsdp": (torch.float32, None, None, False, False),          # FSDP2's defaults with bf16 parameters
    "fsdp_bf16": (torch.bfloat16, None, None, False, False),    # the strong 16-bit baseline
    "bf16": (torch.float32, "bf16", None, False, False),        # lowbit, bf16 on the wire, fp32 sums
    "bf16_r16": (torch.bfloat16, "bf16", None, False, False),   # the same from FSDP's bf16 reduce buffers
    "q8": (torch.float32, Q8, None, False, False),
    "q8_p8": (torch.float32, Q8, P8, False, False),
    "q4_p8": (torch.float32, Q4, P8, False, False),
    "q4ef_p8": (torch.float32, Q4, P8, True, False),
    "q4": (torch.float32, Q4, None, False, False),
    "q4ef": (torch.float32, Q4, None, True, False),
    "h_q8": (torch.float32, Q8, None, False, True),
    "h_q8_p8": (torch.float32, Q8, P8, False, True),
    "h_q4_p8": (torch.float32, Q4, P8, False, True),
    "auto": (torch.float32, "auto", None, False, False),         # per module: FSDP's own, bf16 or 8-bit QSGD
    "auto_bold": (torch.float32, "auto:bold", None, False, False),  # ... or 4-bit QSGD, 1bitSGD* (error feedback)
    "auto_p8": (torch.float32, "auto", P8, False, False),
    "h_auto": (torch.float32, "auto", None, False, True),        # codecs between nodes only (--node-size)
    # HSDP (--node-size L: shard inside each node of L ranks, replicate across nodes)
    "hsdp_bf16": (torch.bfloat16, None, None, False, True),     # FSDP2's own HSDP on a 2-D mesh
    "hsdp_q8": (torch.bfloat16, Q8, None, False, True),         # the replicas' all-reduce in lowbit's codec
    "hsdp_q4": (torch.bfloat16, Q4, None, False, True),
}
BASELINES = ("fsdp", "fsdp_bf16", "hsdp_bf16")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_350m", help="gpt_350m, gpt_760m, gpt_1_3b, or 'tiny' (CPU smoke runs)")
    ap.add_argument("--configs", default="fsdp,fsdp_bf16,bf16,q8,q8_p8,q4_p8",
                    help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--node-size", type=int, default=None, help="ranks per node for the h_* configurations")
    ap.add_argument("--link", default="nvlink", help="a label written into the results (nvlink, sockets, 2nodes)")
    ap.add_argument("--paired", default="", help="A,B: time B against A step by step, both models built at once")
    ap.add_argument("--train", type=int, default=0, help="convergence mode: this many steps on pysource")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--profile", default="", help="configurations to profile after timing (torch.profiler, rank 0): "
                    "a table and a gzipped trace beside --out")
    ap.add_argument("--commit", default=os.environ.get("LOWBIT_COMMIT", ""))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for c in args.configs.split(",") + [c for c in args.paired.split(",") if c]:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
        if c.startswith("hsdp") and not args.node_size:
            ap.error(f"{c} shards inside nodes and replicates across them: pass --node-size")
    if args.paired and len(args.paired.split(",")) != 2:
        ap.error(f"--paired takes two configurations, A,B; got {args.paired!r}")
    return args


def build(args: argparse.Namespace, config: str, vocab: int, device: torch.device):
    reduce_dtype, codec, pcodec, ef, hier = CONFIGS[config]
    torch.manual_seed(0)
    kw = dict(context=args.seq, n_layers=2, n_heads=2, d_model=64) if args.model == "tiny" else {}
    with device:
        model = build_model("gpt2_small" if args.model == "tiny" else args.model, num_classes=vocab,
                            in_shape=(args.seq,), **kw)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                              reduce_dtype=reduce_dtype)
    mesh, replicate = None, None
    if config.startswith("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh2 = init_device_mesh(device.type, (world // args.node_size, args.node_size),
                                 mesh_dim_names=("replicate", "shard"))
        # FSDP2's own HSDP takes the 2-D mesh; lowbit shards on the inner one and all-reduces across the outer
        mesh, replicate = (mesh2, None) if codec is None else (mesh2["shard"], mesh2["replicate"].get_group())
    # as torchtitan shards a decoder: the token embedding, every block and the head on their own, the
    # rest (positions, final norm) in the root, so the two vocabulary-sized matrices overlap with compute
    fully_shard(model.tok_emb, mesh=mesh, mp_policy=mp, reshard_after_forward=False)  # its backward needs no weight
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model.head, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    state = None
    if codec is not None and replicate is not None:
        state = lowbit.fsdp.register(model, codec=codec, replicate_group=replicate)
    elif codec is not None:
        name, _, level = codec.partition(":")
        auto = dict(codec="auto", auto_level=level or None) if name == "auto" else dict(codec=codec, error_feedback=ef)
        state = lowbit.fsdp.register(model, **auto, param_codec=pcodec,
                                     # flat configurations say "one node": else register would take
                                     # $LOWBIT_NODE_SIZE / LOCAL_WORLD_SIZE and run hierarchically too
                                     node_size=args.node_size if hier else dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=True)
    return model, opt, state


def free(device: torch.device) -> None:
    """Start a configuration from an empty GPU: FSDP's modules hold reference cycles, so the previous
    model is only freed by the collector (else its memory counts in this one's peak)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def wire(state) -> tuple[int, int, int]:
    """Bytes lowbit has put on the wire so far: gradients, parameters, between nodes (zeros for FSDP2's own)."""
    if state is None:
        return 0, 0, 0
    return state.grad_stats.bytes_sent, state.param_stats.bytes_sent, state.stats.bytes_inter


def warm_up(model, opt, state, batches, steps: int) -> None:
    """``steps`` steps, and with codec="auto" as many more as it takes to decide (its measuring steps are
    not the steady state the timed steps measure)."""
    i = 0
    while i < steps or (state is not None and state.auto is not None and state.auto.decision is None):
        b = batches[i % 2]
        step(model, opt, b[:, :-1], b[:, 1:])
        i += 1


def auto_row(state) -> dict:
    """codec="auto"'s decision for a result row (empty for any other configuration)."""
    if state is None or state.auto is None:
        return {}
    a = state.auto
    return {"auto": {"chosen": a.chosen, "decision": a.decision, "measured_s": a.measured_s,
                     "decided_step": a.decided_iter, "changes": a.changes}}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def step(model, opt, x, y) -> torch.Tensor:
    logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def throughput(args, rank, world, device, write) -> None:
    vocab = 50257
    names = args.configs.split(",")
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    for rnd in range(args.rounds):
        for name in names:
            free(device)
            model, opt, state = build(args, name, vocab, device)
            batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device)
                       for _ in range(2)]
            warm_up(model, opt, state, batches, args.warmup)
            sync(device)
            before = wire(state)
            t0 = time.perf_counter()
            for i in range(args.steps):
                b = batches[i % 2]
                loss = step(model, opt, b[:, :-1], b[:, 1:])
            sync(device)
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            peaks = [None] * world
            dist.all_gather_object(peaks, peak)
            after = wire(state)
            reduce_dtype, codec, pcodec, ef, hier = CONFIGS[name]
            row = {"mode": "throughput", "config": name, "round": rnd,
                   "spec": {"reduce_dtype": str(reduce_dtype), "codec": codec, "param_codec": pcodec,
                            "error_feedback": ef, "hierarchical": hier},
                   "tokens_per_s": world * args.batch * args.seq * args.steps / dt, "step_s": dt / args.steps,
                   "peak_mem_gb": max(peaks) / 2**30, "loss": float(loss),
                   "grad_bytes_per_step": (after[0] - before[0]) / args.steps,
                   "param_bytes_per_step": (after[1] - before[1]) / args.steps,
                   "inter_bytes_per_step": (after[2] - before[2]) / args.steps, **auto_row(state)}
            write(row)
            if name in args.profile.split(",") and rnd == 0:
                profile(args, name, rank, device, model, opt, batches)
            del model, opt, state, batches


def paired(args, rank, world, device, write) -> None:
    """B against A, step by step (module docstring)."""
    vocab = 50257
    names = args.paired.split(",")
    free(device)
    built = {n: build(args, n, vocab, device) for n in names}
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(2)]
    for name in names:
        warm_up(*built[name], batches, args.warmup)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.steps):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            model, opt, _ = built[name]
            b = batches[i % 2]
            sync(device)
            t0 = time.perf_counter()
            step(model, opt, b[:, :-1], b[:, 1:])
            sync(device)
            times[name].append(time.perf_counter() - t0)
    a, b = names
    ratios = sorted(ta / tb for ta, tb in zip(times[a], times[b]))  # B's speed over A's, per pair
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    write({"mode": "paired", "config": b, "baseline": a, "pairs": len(ratios), "ratio_median": q[1],
           "ratio_q1": q[0], "ratio_q3": q[2], "ratio_mean": statistics.fmean(ratios),
           "step_s_median": {n: statistics.median(t) for n, t in times.items()}, "step_s": times,
           "tokens_per_s_median": {n: world * args.batch * args.seq / statistics.median(t) for n, t in times.items()},
           **auto_row(built[b][2])})


def profile(args, name, rank, device, model, opt, batches) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch_profile(activities=acts) as prof:
        for i in range(3):
            b = batches[i % 2]
            step(model, opt, b[:, :-1], b[:, 1:])
        sync(device)
    if rank == 0:
        base = Path(args.out).with_suffix("")
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        text = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=60)
        text += "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
        Path(f"{base}_profile_{name}.txt").write_text(text)
        tmp = f"/tmp/trace_{name}.json"
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as f, gzip.open(f"{base}_trace_{name}.json.gz", "wb") as g:
            g.write(f.read())


def evaluate(model, xs, ys) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in zip(xs, ys):
            logits = model(x)
            total += float(F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1)))
    model.train()
    return total / len(xs)


def train(args, rank, world, device, write) -> None:
    from lowbit.lab.data import load_dataset

    data = load_dataset("pysource", seq_len=args.seq)
    n_val = args.eval_batches * args.batch
    xs = data.x_test[:n_val].to(device).split(args.batch)
    ys = data.y_test[:n_val].to(device).split(args.batch)
    warm = max(1, args.train // 15)

    def lr_at(i: int) -> float:
        if i < warm:
            return args.lr * (i + 1) / warm
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, args.train - warm))))

    for name in args.configs.split(","):
        free(device)
        model, opt, state = build(args, name, 256, device)
        g = torch.Generator().manual_seed(99)  # the same order of windows for every configuration
        order = torch.randperm(len(data.x_train), generator=g)
        per_step = world * args.batch
        curve, losses, t_train, t_eval = [], [], 0.0, 0.0
        sync(device)
        for i in range(args.train):
            for group in opt.param_groups:
                group["lr"] = lr_at(i)
            idx = order[(i * per_step + rank * args.batch + torch.arange(args.batch)) % len(order)]
            t0 = time.perf_counter()
            loss = step(model, opt, data.x_train[idx].to(device, non_blocking=True), data.y_train[idx].to(device))
            losses.append(loss)
            if (i + 1) % args.eval_every == 0 or i + 1 == args.train:
                sync(device)
                t_train += time.perf_counter() - t0
                t1 = time.perf_counter()
                val = evaluate(model, xs, ys)
                t_eval += time.perf_counter() - t1
                curve.append({"step": i + 1, "train_loss": float(torch.stack(losses[-20:]).mean()),
                              "val_loss": val, "wall_s": t_train})
                if rank == 0:
                    print(f"  {name} step {i + 1}: train {curve[-1]['train_loss']:.4f} val {val:.4f} "
                          f"({t_train:.1f} s)", flush=True)
            else:
                t_train += time.perf_counter() - t0
        write({"mode": "train", "config": name, "steps": args.train, "final_val_loss": curve[-1]["val_loss"],
               "curve": curve, "train_s": t_train, "eval_s": t_eval, "corpus": dict(data.meta),
               "tokens_per_step": per_step * args.seq,
               "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0})
        del model, opt, state


def table(rows: list[dict]) -> str:
    """Per configuration: its best and median tokens/s over rounds, best over the best FSDP2 baseline,
    and the median over rounds of its ratio to each baseline measured in the same round (the figure
    least moved by drift between rounds; runs of one round vary by up to 10 % on the same card)."""
    tp = [r for r in rows if r["mode"] == "throughput"]
    lines = []
    if tp:
        by: dict[str, list[float]] = {}
        rounds: dict[tuple[int, str], float] = {}
        for r in tp:
            by.setdefault(r["config"], []).append(r["tokens_per_s"])
            rounds[(r["round"], r["config"])] = r["tokens_per_s"]
        best = {c: max(v) for c, v in by.items()}
        base = max((best[b] for b in BASELINES if b in best), default=None)
        mem = {r["config"]: r["peak_mem_gb"] for r in tp}
        base_mem = min((mem[b] for b in BASELINES if b in mem), default=None)
        bases = [b for b in BASELINES if b in by]
        head = "".join(f" {'x ' + b + ' med':>16}" for b in bases)
        lines.append(f"{'config':<10} {'best tok/s':>10} {'median':>10} {'x best FSDP2':>12}{head} {'peak GB':>8} {'x mem':>6}")
        for c, v in best.items():
            ratio = f"{v / base:.3f}" if base else "-"
            per = ""
            for b in bases:
                rs = [t / rounds[(rnd, b)] for (rnd, cc), t in rounds.items() if cc == c and (rnd, b) in rounds]
                per += f" {statistics.median(rs):>16.3f}" if rs else f" {'-':>16}"
            mratio = f"{mem[c] / base_mem:.2f}" if base_mem else "-"
            lines.append(f"{c:<10} {v:>10.0f} {statistics.median(by[c]):>10.0f} {ratio:>12}{per} {mem[c]:>8.2f} {mratio:>6}")
    for r in rows:
        if r["mode"] == "train":
            lines.append(f"train {r['config']:<10} final val loss {r['final_val_loss']:.4f} ({r['train_s']:.0f} s)")
    return "\n".join(lines)


def main() -> None:
    args = parse()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        card = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        card = "cpu"
    meta = {"card": card, "gpus": world, "link": args.link, "model": args.model, "seq": args.seq,
            "batch_per_rank": args.batch, "steps": args.steps, "warmup": args.warmup, "torch": torch.__version__,
            "commit": args.commit, "node_size": args.node_size, "synthetic_tokens": not args.train}
    rows: list[dict] = []
    out = Path(args.out)

    def write(row: dict) -> None:
        rows.append(row)
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            if row["mode"] == "paired":
                print(f"  {row['config']} / {row['baseline']}: {row['ratio_median']:.3f}x per step (median of "
                      f"{row['pairs']} pairs; quartiles {row['ratio_q1']:.3f}-{row['ratio_q3']:.3f})", flush=True)
            if row["mode"] == "throughput":
                print(f"  {row['config']:<10} round {row['round']}: {row['tokens_per_s']:.0f} tokens/s, "
                      f"{row['peak_mem_gb']:.2f} GB", flush=True)

    try:
        (train if args.train else paired if args.paired else throughput)(args, rank, world, device, write)
    finally:
        if rank == 0:
            print(table(rows), flush=True)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
