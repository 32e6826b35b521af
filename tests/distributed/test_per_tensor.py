"""Per-tensor codecs through lowbit.all_reduce and the DDP hook (issue 16 items 1 and 2): every
parameter tensor is its own message, encoded with its shape, so per-column 1bitSGD gives each column
(a contiguous run of shape[-1] values) its own (avg+, avg-) and Dettmers' one scale is per tensor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.comm.allreduce import bytes_sent_per_rank
from lowbit.launch import spawn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))


def _body(rank: int, world: int) -> dict:
    out: dict = {}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    for spec in ("onebit:bucket=0", "dettmers:type=dynamic"):
        net = _net()
        local = copy.deepcopy(net)  # this rank's own gradient, before any reduction
        nn.functional.cross_entropy(local(x), y).backward()
        model = DDP(net)
        state = lowbit.ddp.register(model, codec=spec, start_iter=0, error_feedback=False)
        nn.functional.cross_entropy(model(x), y).backward()
        codec = lowbit.get_codec(spec)
        expected, want_bytes = {}, 0
        for (name, p), lp in zip(net.named_parameters(), local.parameters()):
            plan = state.plan[name]
            if plan.spec != codec.spec:
                continue
            mine = codec.decode(codec.encode(lp.grad), lp.numel(), shape=tuple(lp.shape))
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            expected[name] = (sum(everyone[1:], everyone[0]) / world).view(lp.shape)
        # the formula, message by message: each tensor's per-column / per-tensor payload in its own message,
        # plus the fp32 tensors riding raw in them (16-byte slots included)
        for g in {id(g): g for g in state._group_of.values()}.values():
            want_bytes += bytes_sent_per_rank(codec, g.n, world, "allgather", exact=g.exact, shape=g.shape)
        out[spec] = ({n: p.grad.clone() for n, p in net.named_parameters()}, expected, state.stats.calls,
                     state.stats.bytes_sent, want_bytes, len(expected))
    return out


@pytest.mark.parametrize("kernels", ["reference", pytest.param("numba", marks=pytest.mark.slow)])
def test_per_tensor_codecs_through_the_hook(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference kernels in the default run (the ranks fork from a server without numba: its import and
    cache load cost ~2 s a rank); numba, the CPU default, is the slow parametrization, with the same checks."""
    monkeypatch.setenv("LOWBIT_KERNELS", kernels)
    res = spawn(_body, 2, backend="gloo")
    for spec in ("onebit:bucket=0", "dettmers:type=dynamic"):
        grads, expected, calls, sent, want, quantised = res[0][spec]
        assert quantised >= 3
        for name, want_grad in expected.items():
            # the hook's mean equals the codec applied to each rank's tensor alone, then averaged
            assert torch.allclose(grads[name], want_grad, rtol=1e-6, atol=1e-7), (spec, name)
            assert torch.equal(grads[name], res[1][spec][0][name])  # ranks agree
        if spec.startswith("onebit"):
            w = grads["2.weight"]  # (96, 128): 96 columns of 128 values, each with its own pair per rank
            assert all(len(torch.unique(row)) <= 4 for row in w)
            assert len(torch.unique(w)) > 4 * 10
        # one message per quantised tensor; bytes exactly the per-tensor payloads plus the fp32 riders
        assert calls >= quantised and sent == want, (spec, sent, want)


def _ar_body(rank: int, world: int) -> tuple:
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))
    t = w.clone()
    st = lowbit.comm.CommStats()
    lowbit.all_reduce(t, "onebit:bucket=0", algorithm="scatter_gather", op="mean", stats=st)
    mine = lowbit.get_codec("onebit:bucket=0")
    dec = mine.decode(mine.encode(w), 30, shape=(6, 5))
    both = [torch.empty_like(dec) for _ in range(world)]
    dist.all_gather(both, dec)
    return t, (both[0] + both[1]).view(6, 5) / 2, st.bytes_sent


def test_all_reduce_per_column_uses_the_tensor_shape() -> None:
    (t0, e0, b0), (t1, _, _) = spawn(_ar_body, 2, backend="gloo")
    assert torch.equal(t0, t1) and torch.allclose(t0, e0, rtol=1e-6, atol=1e-7)
    codec = lowbit.get_codec("onebit:bucket=0")
    assert b0 == bytes_sent_per_rank(codec, 30, 2, "scatter_gather", shape=(6, 5))  # per-tensor: allgather
