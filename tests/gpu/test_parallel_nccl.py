"""lowbit.parallel over NCCL on 2 GPUs: the compressed all-gather / reduce-scatter and the hybrid step
(sub-batches in flight on the device) agree with their gloo-tested definitions (run: ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.comm.gather import all_gather, reduce_scatter
from lowbit.launch import spawn
from lowbit.parallel import Hybrid, ParallelComm

from distributed.test_parallel import slice_grad_error  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.gpu

needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                  reason="needs 2 CUDA GPUs")


def _learn(h: Hybrid, rank: int, dev: torch.device, steps: int = 20) -> list[float]:
    """``steps`` SGD steps of the hybrid on a learnable rule (batches of 32 per rank); the losses."""
    opt_f = torch.optim.SGD(h.features.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(h.classifier.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 3, 16, 16, generator=g).to(dev)
        y = (x.mean(dim=(1, 2, 3)) > 0).long()  # a learnable rule
        losses.append(float(h.train_step(x, y, nn.functional.cross_entropy, opt_f, opt_c)))
    return losses


def _body(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    out: dict = {}
    for spec in ["fp32", "dettmers:type=dynamic,bucket=0", "qsgd:bits=8,bucket=512"]:
        parts = [torch.randn(300 + r, 700, generator=torch.Generator().manual_seed(r)).to(dev) for r in range(world)]
        g = all_gather(parts[rank], spec, dim=0, sizes=[300 + r for r in range(world)])
        exact = torch.cat(parts)
        z = torch.randn(600, 50, generator=torch.Generator().manual_seed(9 + rank)).to(dev)
        total = z.clone()
        torch.distributed.all_reduce(total)
        mine = reduce_scatter(z, spec, dim=0)
        lo = 0 if rank == 0 else 300
        out[spec] = (g.cpu(), float((g - exact).norm() / exact.norm()),
                     float((mine - total[lo : lo + 300]).norm() / total[lo : lo + 300].norm()))
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten()).to(dev)
    classifier = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10)).to(dev)
    h = Hybrid(DDP(features, device_ids=[rank]), classifier, ParallelComm(codec="dettmers:type=dynamic,bucket=0"),
               sub_batches=4)
    out["hybrid"] = (_learn(h, rank, dev), [p.detach().cpu() for p in h.features.parameters()])
    return out


@needs_2_gpus
def test_parallel_collectives_and_hybrid_on_nccl() -> None:
    r0, r1 = spawn(_body, 2, backend="nccl")
    for spec in ["fp32", "dettmers:type=dynamic,bucket=0", "qsgd:bits=8,bucket=512"]:
        assert torch.equal(r0[spec][0], r1[spec][0]), spec  # bit-identical gathers
        bound = 1e-6 if spec == "fp32" else 0.05
        for r in (r0, r1):
            assert r[spec][1] <= bound and r[spec][2] <= bound, (spec, r[spec][1:])
    losses0, feats0 = r0["hybrid"]
    losses1, feats1 = r1["hybrid"]
    assert losses0 == losses1  # the global loss, the same on both ranks
    assert all(torch.isfinite(torch.tensor(losses0)))
    assert sum(losses0[-5:]) < sum(losses0[:5])  # it learns
    for a, b in zip(feats0, feats1):
        assert torch.equal(a, b)  # DDP keeps the data-parallel part identical


def _paired_body(rank: int, world: int) -> dict:
    """Column/row pairs on NCCL: the MLP against the single-process model, and a paired 8-bit hybrid."""
    from lowbit.parallel import RowParallelLinear, parallelize

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)

    def mlp() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)).to(dev)

    ref = mlp()
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(5)).to(dev).requires_grad_(True)
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(6)).to(dev)
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_out = ref(x).detach()
    ref_lin = [m for m in ref if isinstance(m, nn.Linear)]
    out: dict = {}
    for spec in ("fp32", "dettmers:type=dynamic,bucket=0"):
        mp = parallelize(mlp(), ParallelComm(codec=spec), pair=True)
        xx = x.detach().clone().requires_grad_(True)
        logits = mp(xx)
        nn.functional.cross_entropy(logits, y).backward()
        out[spec] = (logits.detach().cpu(), float((logits.detach() - ref_out).norm() / ref_out.norm()),
                     float((xx.grad - x.grad).norm() / x.grad.norm()), slice_grad_error(mp, ref_lin),
                     sum(isinstance(m, RowParallelLinear) for m in mp))
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten()).to(dev)
    classifier = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 256), nn.ReLU(),
                               nn.Linear(256, 10)).to(dev)
    h = Hybrid(DDP(features, device_ids=[rank]), classifier, ParallelComm(codec="dettmers:type=dynamic,bucket=0"),
               sub_batches=2, pair=True)
    out["hybrid"] = (_learn(h, rank, dev), [type(m).__name__ for m in h.classifier])
    return out


@needs_2_gpus
def test_column_row_pairs_on_nccl() -> None:
    r0, r1 = spawn(_paired_body, 2, backend="nccl")
    for spec in ("fp32", "dettmers:type=dynamic,bucket=0"):
        logits, out_err, x_err, w_err, rows = r0[spec]
        assert torch.equal(logits, r1[spec][0]), spec  # identical outputs on both ranks
        assert rows == 1, spec
        if spec == "fp32":
            assert out_err < 1e-5 and x_err < 1e-5 and w_err < 1e-5, (out_err, x_err, w_err)
        else:  # the gloo test's bounds for the 8-bit split
            assert out_err < 0.15 and x_err < 0.35 and w_err < 0.35, (out_err, x_err, w_err)
    losses0, layers = r0["hybrid"]
    assert layers == ["ColumnParallelLinear", "SharedDropout", "RowParallelLinear", "ReLU", "ColumnParallelLinear"]
    assert losses0 == r1["hybrid"][0]  # the global loss, the same on both ranks
    assert all(torch.isfinite(torch.tensor(losses0)))
    assert sum(losses0[-5:]) < sum(losses0[:5])  # it learns


def _graph_body(rank: int, world: int) -> dict:
    """Hybrid(graph=True): the classifier's step captured in a CUDA graph (NCCL collectives, Triton codec
    kernels, dropout masks drawn before each replay) against the eager hybrid, step for step."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    out: dict = {}
    for graph in (False, True):
        torch.manual_seed(0)
        features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                                 nn.Flatten()).to(dev)
        classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.5),
                                   nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
        comm = ParallelComm(codec="dettmers:type=dynamic,bucket=0")
        h = Hybrid(DDP(features, device_ids=[rank]), classifier, comm, pair=True, graph=graph)
        opt_f = torch.optim.SGD(h.features.parameters(), lr=0.05, momentum=0.9)
        opt_c = torch.optim.SGD(h.classifier.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        losses, sent = [], []
        for step in range(12):
            b = 32 if step < 8 else 16  # a second shape: a second graph
            x = torch.randn(b, 3, 16, 16, generator=g).to(dev)
            y = (x.mean(dim=(1, 2, 3)) > 0).long()
            before = (comm.stats.bytes_sent, comm.stats.calls)
            losses.append(float(h.train_step(x, y, nn.functional.cross_entropy, opt_f, opt_c)))
            sent.append((comm.stats.bytes_sent - before[0], comm.stats.calls - before[1]))
        out[graph] = (losses, [p.detach().cpu() for p in h.parameters()], sent, len(h._graphs))
    return out


@needs_2_gpus
def test_hybrid_graph_replays_the_eager_step_on_nccl() -> None:
    r0, r1 = spawn(_graph_body, 2, backend="nccl")
    for r in (r0, r1):
        (le, pe, se, ge), (lg, pg, sg, gg) = r[False], r[True]
        assert ge == 0 and gg == 2  # one graph per input shape
        # each replay counts what its collectives send, as an eager step; a capturing step also counts
        # its two eager warm-ups' transfers (sent for real)
        for step in range(12):
            if step in (0, 8):
                assert sg[step][0] == 3 * se[step][0] and sg[step][1] == 3 * se[step][1], (step, se, sg)
            else:
                assert sg[step] == se[step], (step, se, sg)
        for a, b in zip(le, lg):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (le, lg)
        for a, b in zip(pe, pg):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), float((a - b).abs().max())
    assert r0[True][0] == r1[True][0]  # the global loss, the same on both ranks
