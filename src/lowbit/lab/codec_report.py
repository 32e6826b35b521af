"""``lowbit codecs``: one table row per codec configuration.

Columns: bits per value on the wire (scales included), compression vs fp32, mean relative error and
RMSE on the four distributions of Dettmers' Table 2 (with the paper's figure beside ours where the paper
has one) and on real gradients of a small MLP trained on scikit-learn's digits (offline), and encode /
decode throughput on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from lowbit.codecs.base import Codec, get_codec
from lowbit.extras import require

DEFAULT_SPECS = [
    "fp32",
    "fp16",
    "bf16",
    "qsgd:bits=16,bucket=8192",
    "qsgd:bits=8,bucket=512",
    "qsgd:bits=4,bucket=512",
    "qsgd:bits=2,bucket=128",
    "qsgd:bits=1,bucket=512",
    "onebit:bucket=64",
    "onebit:bucket=0",
    "dettmers:type=dynamic",
    "dettmers:type=dynamic,search=paper",
    "dettmers:type=linear",
    "dettmers:type=linear,search=paper",
    "dettmers:type=static,offset=1",
    "dettmers:type=static,search=paper,offset=1",
    "dettmers:type=mantissa,offset=2",
    "dettmers:type=mantissa,search=paper,offset=2",
    "dettmers:type=dynamic_bnb",
    "topk:ratio=0.01",
]

DISTRIBUTIONS: dict[str, Callable[[int, torch.Generator], torch.Tensor]] = {
    "U(0,1)": lambda n, g: torch.rand(n, generator=g),
    "N(0,1)": lambda n, g: torch.randn(n, generator=g),
    "N(0,10^2)": lambda n, g: 10 * torch.randn(n, generator=g),
    "N(0,0.2^2)": lambda n, g: 0.2 * torch.randn(n, generator=g),
}


def real_gradients(steps: int = 30, seed: int = 0) -> torch.Tensor:
    """Flattened gradients of a 64-256-256-10 MLP trained on scikit-learn's digits (offline)."""
    data = require("sklearn.datasets", "study", "lowbit codecs' real-gradient column (scikit-learn's digits)").load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
    return torch.cat(grads[-5:])  # gradients from late in training


def _errors(codec: Codec, x: torch.Tensor) -> tuple[float, float]:
    y = codec.decode(codec.encode(x, seed=1), x.numel(), shape=codec.flat_shape(x.numel()))
    nz = x != 0
    mre = float(((y - x).abs()[nz] / x.abs()[nz]).double().mean()) * 100.0
    rmse = float((y - x).double().pow(2).mean().sqrt())
    return mre, rmse


def _throughput(codec: Codec, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """GB/s of fp32 input for encode and for decode (median of ``reps`` after one warm-up)."""
    n = x.numel()
    payload = codec.encode(x)
    out = torch.empty(n)
    codec.decode(payload, n, out=out, shape=codec.flat_shape(n))
    enc, dec = [], []
    for r in range(reps):
        t0 = time.perf_counter()
        payload = codec.encode(x, seed=r)
        t1 = time.perf_counter()
        codec.decode(payload, n, out=out, shape=codec.flat_shape(n))
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    enc.sort()
    dec.sort()
    gb = 4 * n / 1e9
    return gb / enc[len(enc) // 2], gb / dec[len(dec) // 2]


def measure(specs: list[str], samples: int, bench_numel: int, reps: int, progress: bool = True) -> list[dict[str, Any]]:
    from tqdm import tqdm

    codecs = [get_codec(s) for s in specs]  # fail on a bad spec before measuring anything
    bar = tqdm(total=len(DISTRIBUTIONS) + 2 + len(codecs), desc="inputs", disable=not progress, unit="step")
    g = torch.Generator().manual_seed(2016)
    data = {}
    for name, make in DISTRIBUTIONS.items():
        data[name] = make(samples, g)
        bar.update(1)
    bar.set_description("real gradients (digits MLP)")
    data["gradients"] = real_gradients()
    bar.update(1)
    bench_x = torch.randn(bench_numel, generator=g)
    bar.update(1)
    rows = []
    for codec in codecs:
        bar.set_description(f"measuring {codec.spec}")
        row: dict[str, Any] = {
            "codec": codec.spec,
            "bits_per_value": round(codec.bits_per_value(bench_numel), 4),
            "compression": round(32.0 / codec.bits_per_value(bench_numel), 2),
        }
        for name, x in data.items():
            mre, rmse = _errors(codec, x)
            row[f"mre%:{name}"] = round(mre, 3)
            row[f"rmse:{name}"] = float(f"{rmse:.4g}")
            paper = codec.published_error(name)
            if paper is not None:
                row[f"paper_mre%:{name}"] = paper
        enc, dec = _throughput(codec, bench_x, reps)
        row["encode_GBps"] = round(enc, 3)
        row["decode_GBps"] = round(dec, 3)
        rows.append(row)
        bar.update(1)
    bar.close()
    return rows


def _pct(v: float) -> str:
    """An error in %: two decimals where readable, scientific notation where huge (a codec that is not
    meant for that distribution, e.g. top-k on uniform data)."""
    return f"{v:.2f}" if abs(v) < 1e4 else f"{v:.2e}"


def format_table(rows: list[dict[str, Any]]) -> str:
    dists = list(DISTRIBUTIONS) + ["gradients"]
    head = ["codec", "bits/val", "x fp32"] + [f"MRE% {d}" for d in dists] + ["RMSE grad", "enc GB/s", "dec GB/s"]
    lines = []
    for r in rows:
        cells = [r["codec"], f"{r['bits_per_value']:.3f}", f"{r['compression']:.1f}"]
        for d in dists:
            c = _pct(r[f"mre%:{d}"])
            if f"paper_mre%:{d}" in r:
                c += f" ({r[f'paper_mre%:{d}']:.2f})"
            cells.append(c)
        cells += [f"{r['rmse:gradients']:.3g}", f"{r['encode_GBps']:.2f}", f"{r['decode_GBps']:.2f}"]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*c) for c in lines]
    out.append("MRE = mean relative error over nonzero inputs; (paper) = Dettmers 2016 Table 2. "
               "Throughput: GB/s of fp32 input on this machine.")
    return "\n".join(out)
