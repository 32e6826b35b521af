"""Compressed collectives and the DDP hook over NCCL on 2 GPUs (run on the device: ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.launch import spawn

pytestmark = pytest.mark.gpu

needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                  reason="needs 2 CUDA GPUs")

CODECS = ["fp32", "fp16", "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=128",
          "onebit:bucket=64", "dettmers:type=dynamic"]


def _body(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    out = {}
    for spec in CODECS:
        for algo in ("scatter_gather", "allgather", "allreduce"):
            if algo == "allreduce" and spec not in ("fp32", "fp16"):
                continue
            for n in (1, 4097, 1 << 22):
                g = torch.Generator(device=dev).manual_seed(rank * 7 + n)
                t = torch.randn(n, device=dev, generator=g)
                exact = t.double().clone()
                torch.distributed.all_reduce(exact)
                exact /= world
                lowbit.all_reduce(t, spec, algorithm=algo, op="mean", seed=1)
                err = float((t.double() - exact).norm() / exact.norm())
                out[(spec, algo, n)] = (t.cpu(), err)
    return out


@needs_2_gpus
def test_nccl_collectives_identical_across_ranks_and_accurate() -> None:
    r0, r1 = spawn(_body, 2, backend="nccl")
    bounds = {"fp32": 1e-6, "fp16": 2e-3, "qsgd:bits=8,bucket=512": 0.05, "dettmers:type=dynamic": 0.05}
    for key, (t, err) in r0.items():
        assert torch.equal(t, r1[key][0]), key
        b = bounds.get(key[0])
        if b is not None and key[2] > 1:
            assert err < b, (key, err)


def _ddp_body(rank: int, world: int) -> tuple[float, list]:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(dev)
    model = DDP(net, device_ids=[rank])
    state = lowbit.ddp.register(model, codec="qsgd:bits=4,bucket=512")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device=dev).manual_seed(rank)
    for _ in range(10):
        x = torch.randn(64, 256, device=dev, generator=g)
        y = torch.randint(0, 10, (64,), device=dev, generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return state.stats.bytes_sent, [p.detach().cpu() for p in model.parameters()]


@needs_2_gpus
def test_ddp_hook_on_nccl_keeps_ranks_identical() -> None:
    (b0, p0), (b1, p1) = spawn(_ddp_body, 2, backend="nccl")
    assert b0 > 0
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
