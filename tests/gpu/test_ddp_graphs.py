"""lowbit.ddp's CUDA graphs (lowbit.comm.graphs) on one GPU: replays give the eager hook's bits.

As tests/gpu/test_fsdp_graphs.py: one process is rank 0 of a two-rank "mirror" group whose all-to-all
hands every rank its own bytes back and whose all-gather gives every rank my payload, so the exchange
moves real, deterministic bytes. A DDP model is trained with graphs off and on (the hook thread's
messages replayed with LOWBIT_CUDA_GRAPHS=1); parameters and residuals must agree bit for bit after
every step: allgather with fp32 riders, scatter_gather, stochastic rounding, error feedback.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.gpu.test_fsdp_graphs import Mirror, _done

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class SplitMirror(Mirror):
    """Mirror's all-to-all for split lists: what I sent rank j comes back as what j sent me (the bytes of
    my own chunk's slot, truncated or padded with what the buffer held)."""

    def alltoall_base(self, out, x, out_splits, in_splits, opts):
        m = min(out.numel(), x.numel())
        out[:m].copy_(x[:m])
        return _done([out])


@pytest.fixture(scope="module")
def mirror_group():
    os.environ["LOWBIT_CHECK_CALLS"] = "0"
    dist.Backend.register_backend("splitmirror", lambda store, rank, size, timeout: SplitMirror(rank, size),
                                  devices=["cpu", "cuda"])
    dist.init_process_group("splitmirror", store=dist.HashStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _train(options: dict, graphs_on: bool, steps: int = 6):
    import lowbit.ddp

    os.environ["LOWBIT_CUDA_GRAPHS"] = "1" if graphs_on else "0"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 512), nn.ReLU(), nn.Linear(512, 333), nn.ReLU(), nn.Linear(333, 10)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()], bucket_cap_mb=1)
    st = lowbit.ddp.register(ddp, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 96, generator=g).cuda()
        y = torch.randint(0, 10, (32,), generator=g).cuda()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())
    torch.cuda.synchronize()
    return out, st


CASES = {
    "q8_allgather": {"codec": "qsgd:bits=8,bucket=512"},
    "q4_scatter": {"codec": "qsgd:bits=4,bucket=512", "algorithm": "scatter_gather"},
    "onebit_ef_allgather": {"codec": "onebit:bucket=64", "error_feedback": True},
    "onebit_ef_scatter": {"codec": "onebit:bucket=64", "error_feedback": True, "algorithm": "scatter_gather"},
    "dettmers_allgather": {"codec": "dettmers:type=dynamic"},
}


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_ddp_graph_replays_match_the_eager_hook(mirror_group, case):
    eager, st0 = _train(CASES[case], graphs_on=False)
    graphed, st1 = _train(CASES[case], graphs_on=True)
    assert getattr(st0, "_graphs", None) is None or st0._graphs.replays == 0
    assert st1._graphs.replays > 0, "no message was replayed from a graph"
    assert st0.stats.bytes_sent == st1.stats.bytes_sent and st0.stats.calls == st1.stats.calls
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"{case}: step {i}: graph replay differs from the eager hook"
    r0 = {k: v.cpu() for k, v in st0.residuals.items()}
    r1 = {k: v.cpu() for k, v in st1.residuals.items()}
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)


@needs_cuda
@pytest.mark.parametrize("case", ["q8_allgather", "onebit_ef_scatter"])
def test_ddp_inline_side_stream_replays_match_the_hook_thread(mirror_group, case):
    """hook_thread=False on CUDA: the bucket's work runs in the hook, on lowbit's side stream, and its
    messages replay their graphs there too; the bits are the hook thread's (and so the eager hook's)."""
    threaded, st0 = _train({**CASES[case], "hook_thread": True}, graphs_on=True)
    inline, st1 = _train({**CASES[case], "hook_thread": False}, graphs_on=True)
    assert st1._graphs.replays > 0, "no message was replayed from a graph inline"
    _, st2 = _train(CASES[case], graphs_on=True)  # hook_thread="auto": every message replays, so inline
    assert st2._inline, "hook_thread='auto' kept the thread though every message replays a graph"
    assert st0.stats.bytes_sent == st1.stats.bytes_sent and st0.stats.calls == st1.stats.calls
    for i, (a, b) in enumerate(zip(threaded, inline)):
        assert torch.equal(a, b), f"{case}: step {i}: the inline replay differs from the hook thread's"
    r0 = {k: v.cpu() for k, v in st0.residuals.items()}
    r1 = {k: v.cpu() for k, v in st1.residuals.items()}
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
