"""Hierarchical all-reduce and DDP hook over NCCL on 4 GPUs as 2 emulated nodes of 2 (NVLink inside a node,
sockets between them: ``NCCL_HOSTID`` per node, ``NCCL_IB_DISABLE=1``). Run on the device: ``pytest -m gpu``."""

from __future__ import annotations

import os

import pytest
import torch

import lowbit
from lowbit.launch import spawn
from tests.gpu.test_nccl import train_mlp

pytestmark = pytest.mark.gpu

needs_4_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                                  reason="needs 4 CUDA GPUs")

CODECS = ["fp32", "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "onebit:bucket=64", "onebit:bucket=0"]
BOUNDS = {"fp32": 1e-6, "qsgd:bits=8,bucket=512": 0.05}


def _body(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    out = {"hostid": os.environ.get("NCCL_HOSTID")}
    for spec in CODECS:
        for n in (1, 4097, 3 << 20):
            g = torch.Generator(device=dev).manual_seed(rank * 11 + n)
            t = torch.randn(n, device=dev, generator=g)
            exact = t.double().clone()
            torch.distributed.all_reduce(exact)
            exact /= world
            lowbit.all_reduce(t, spec, algorithm="hierarchical", op="mean", seed=3)
            err = float((t.double() - exact).norm() / exact.norm())
            out[(spec, n)] = (t.cpu(), err)
    return out


@needs_4_gpus
def test_hierarchical_identical_across_ranks_and_accurate_on_emulated_nodes(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    res = spawn(_body, 4, backend="nccl", node_size=2)
    assert [r.pop("hostid") for r in res] == ["node0", "node0", "node1", "node1"]
    for key, (t, err) in res[0].items():
        for r in res[1:]:
            assert torch.equal(t, r[key][0]), key
        b = BOUNDS.get(key[0])
        if b is not None and key[1] > 1:
            assert err < b, (key, err)


def _ddp_body(rank: int, world: int) -> list:
    torch.cuda.set_device(torch.device("cuda", rank))
    out = []
    for spec, cap, mb, algorithm in [("qsgd:bits=4,bucket=512", 25.0, 64.0, "hierarchical"),
                                     ("onebit:bucket=64", 0.1, 0.3, "hierarchical"),
                                     ("qsgd:bits=4,bucket=512", 0.1, 0.3, "scatter_gather")]:
        grads, state, params = train_mlp(rank, spec, cap, mb, algorithm, steps=8)
        out += grads
        stats = state.stats  # type: ignore[attr-defined]
        out.append((spec, stats.bytes_inter if algorithm == "hierarchical" else stats.bytes_sent, params))
    return out


@needs_4_gpus
def test_ddp_hook_keeps_ranks_identical_on_emulated_nodes(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    res = spawn(_ddp_body, 4, backend="nccl", node_size=2)
    for step in range(len(res[0])):
        a = res[0][step]
        if isinstance(a, tuple):
            assert a[1] > 0, a[0]  # something crossed between the nodes (hierarchical), or was sent
            a = a[2]
        for r in res[1:]:
            b = r[step][2] if isinstance(r[step], tuple) else r[step]
            for x, y in zip(a, b):
                assert torch.equal(x, y), step
