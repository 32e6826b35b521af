"""Soak run (not a test): many DDP steps with error feedback on gloo, memory and residual norm over time.

    PYTHONPATH=src python benchmarks/soak_ef.py [--steps 10000] [--world 2] [--codec onebit:bucket=64]
        [--out benchmarks/results/soak_ef_cpu.json]

Every rank trains a small MLP on synthetic data (labelled as such) through lowbit's DDP hook with error
feedback on, and records every ``--every`` steps: its resident memory (RSS, from /proc), the residual's
L2 norm and the loss. Passes when memory stays flat (the last quarter's RSS within ``--rss-slack-mb`` of
the second quarter's) and the residual norm stays bounded (never above ``--norm-factor`` x its median).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import lowbit  # noqa: E402
from lowbit.launch import spawn  # noqa: E402


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def body(rank: int, world: int, steps: int, every: int, codec: str) -> list[dict]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.1)
    state = lowbit.ddp.register(model, codec=codec, error_feedback=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))  # synthetic: a fixed linear teacher
    rows = []
    for step in range(1, steps + 1):
        x = torch.randn(32, 64, generator=g)
        y = (x @ w).argmax(1)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == 1:
            norm = math.sqrt(sum(float(r.double().pow(2).sum()) for r in state.residuals.values()))
            rows.append({"step": step, "rss_mb": rss_mb(), "residual_norm": norm, "loss": float(loss),
                         "bytes_sent": state.stats.bytes_sent})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--codec", default="onebit:bucket=64")
    p.add_argument("--rss-slack-mb", type=float, default=16.0)
    p.add_argument("--norm-factor", type=float, default=5.0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.steps < a.every * 4:
        raise SystemExit(f"--steps must be at least 4 x --every ({4 * a.every})")
    t0 = time.time()
    res = spawn(body, a.world, a.steps, a.every, a.codec, backend="gloo", timeout_s=600)
    rows = res[0]
    q = len(rows) // 4
    rss_q2 = statistics.median(r["rss_mb"] for r in rows[q : 2 * q])
    rss_q4 = statistics.median(r["rss_mb"] for r in rows[3 * q :])
    norms = [r["residual_norm"] for r in rows[1:]]
    med = statistics.median(norms)
    ok_mem = rss_q4 - rss_q2 <= a.rss_slack_mb
    ok_norm = max(norms) <= a.norm_factor * med
    summary = {"steps": a.steps, "world": a.world, "codec": a.codec, "wall_s": time.time() - t0,
               "rss_mb_q2": rss_q2, "rss_mb_q4": rss_q4, "residual_norm_median": med,
               "residual_norm_max": max(norms), "memory_flat": ok_mem, "norm_bounded": ok_norm,
               "data": "synthetic (random inputs, labels from a fixed random linear teacher)",
               "machine": os.uname().nodename, "torch": torch.__version__}
    print(f"{'step':>7} {'RSS MiB':>9} {'residual norm':>14} {'loss':>8}")
    for r in rows[:: max(1, len(rows) // 12)]:
        print(f"{r['step']:>7} {r['rss_mb']:>9.1f} {r['residual_norm']:>14.4f} {r['loss']:>8.4f}")
    print(f"memory flat: {ok_mem} (RSS {rss_q2:.1f} -> {rss_q4:.1f} MiB); residual norm bounded: {ok_norm} "
          f"(max {max(norms):.4f}, median {med:.4f}); {summary['wall_s']:.0f} s")
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "rank0": rows, "per_rank": res}, indent=1))
    return 0 if ok_mem and ok_norm else 1


if __name__ == "__main__":
    raise SystemExit(main())
