"""Dettmers' model-parallel MLP trained with 8-bit activations: does each of the four 8-bit data types
reach fp32's test accuracy (within 1 point)?

The paper's MNIST network is 784-1024-1024-10; the offline data here is scikit-learn's digits (8x8
images, 1,437 train / 360 test), so the input layer is 64 wide: 64-1024-1024-10, ReLU, every linear
layer split over the ranks (lowbit.parallel.parallelize), activations gathered and activation gradients
summed in the codec under test (one scale per tensor), plain SGD with momentum, the full batch of every
step on every rank (model parallelism: the ranks split the layers, not the data). Gloo, CPU.

    PYTHONPATH=src python benchmarks/mp_accuracy.py --world 2 --seeds 0 1 2 --out benchmarks/results/mp_accuracy_digits_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch import nn

from lowbit.lab.data import load_dataset
from lowbit.launch import spawn
from lowbit.parallel import ParallelComm, parallelize

CODECS = ["fp32", "dettmers:type=dynamic,bucket=0", "dettmers:type=linear,bucket=0", "dettmers:type=static,bucket=0",
          "dettmers:type=mantissa,bucket=0"]


def mlp(seed: int, width: int = 1024, inputs: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def train(rank: int, world: int, codecs: list[str], seeds: list[int], epochs: int, batch: int,
          lr: float, width: int) -> list[dict]:
    torch.set_num_threads(1)
    data = load_dataset("digits")
    rows = []
    for seed in seeds:
        for spec in codecs:
            t0 = time.perf_counter()
            comm = ParallelComm(codec=spec)
            model = parallelize(mlp(seed, width, data.x_train[0].numel()), comm)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            g = torch.Generator().manual_seed(seed)  # the same order on every rank
            n = len(data.y_train)
            for _ in range(epochs):
                perm = torch.randperm(n, generator=g)
                for i in range(0, n - batch + 1, batch):
                    idx = perm[i : i + batch]
                    loss = nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    comm.step += 1
            model.eval()
            with torch.no_grad():
                acc = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
            rows.append({"codec": spec, "seed": seed, "test_acc": acc, "final_loss": float(loss.detach()),
                         "steps": comm.step, "bytes_sent_per_step": comm.stats.bytes_sent / max(1, comm.step),
                         "seconds": time.perf_counter() - t0})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--codecs", nargs="+", default=CODECS)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = spawn(train, a.world, a.codecs, a.seeds, a.epochs, a.batch, a.lr, a.width, backend="gloo",
                 timeout_s=3600)[0]
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["codec"], []).append(r["test_acc"])
    base = sum(by["fp32"]) / len(by["fp32"]) if "fp32" in by else float("nan")
    summary = {c: {"mean_test_acc": sum(v) / len(v), "runs": len(v), "points_below_fp32": 100 * (base - sum(v) / len(v))}
               for c, v in by.items()}
    doc = {"what": "model-parallel 64-1024-1024-10 MLP on digits, activations in each codec (lowbit.parallel)",
           "machine": platform.node(), "cpu": platform.processor() or platform.machine(), "world": a.world,
           "torch": torch.__version__, "args": vars(a) | {"out": str(a.out)}, "seconds": time.perf_counter() - t0,
           "runs": rows, "summary": summary}
    print(f"{'codec':36s} {'mean test acc':>13s} {'vs fp32 (points)':>17s}")
    for c, s in summary.items():
        print(f"{c:36s} {100 * s['mean_test_acc']:12.2f}% {-s['points_below_fp32']:+16.2f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
